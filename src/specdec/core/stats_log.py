"""The server's running feedback: one line every few seconds while the engine is busy, as
vLLM's engine logs it (requests running and waiting, prompt and generation tokens/s, KV-cache
use, and what speculation did: acceptance length and the K the steps took).

Reads the engine's counters and the tokens the loop reports; never touches requests.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

# Seconds between two lines (vLLM logs every 5 s too; the environment variable
# SPECDEC_LOG_STATS_INTERVAL sets another, as VLLM_LOG_STATS_INTERVAL does vLLM's).
STATS_INTERVAL_S = 5.0


class StatsLog:
    """Call `admitted` and `emitted` as tokens go by, and `tick` after each loop iteration."""

    def __init__(
        self, engine, interval_s: float = STATS_INTERVAL_S, out: TextIO | None = None
    ) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.out = out
        self._since = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._counters = self._read_counters()

    def admitted(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens += num_prompt_tokens

    def emitted(self, num_tokens: int) -> None:
        self._generation_tokens += num_tokens

    def tick(self, now: float | None = None) -> str | None:
        """Writes (and returns) the line when the interval is over and anything happened in it
        or requests are still in the engine; otherwise None."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return None
        scheduler = self.engine.scheduler
        running, waiting = len(scheduler.running), len(scheduler.waiting)
        counters = self._read_counters()
        busy = running or waiting or self._prompt_tokens or self._generation_tokens
        line = None
        if busy:
            line = self._line(elapsed, running, waiting, counters)
            out = self.out or sys.stderr
            out.write(line + "\n")
            out.flush()
        self._since = now
        self._prompt_tokens = self._generation_tokens = 0
        self._counters = counters
        return line

    def _read_counters(self) -> tuple[int, int, dict[int, int], int]:
        stats, loop = self.engine.stats, self.engine.loop_stats
        return (
            stats.num_drafts,
            stats.num_accepted_tokens,
            dict(loop.k_chosen),
            self.engine.num_preemptions,
        )

    def _line(self, elapsed: float, running: int, waiting: int, counters: tuple) -> str:
        drafts, accepted, chosen, preemptions = counters
        drafts0, accepted0, chosen0, preemptions0 = self._counters
        parts = [
            f"running {running} reqs, waiting {waiting}",
            f"prompt {self._prompt_tokens / elapsed:.1f} tok/s",
            f"generation {self._generation_tokens / elapsed:.1f} tok/s",
            f"KV cache {100.0 * float(self.engine.allocator.usage):.1f}%",
        ]
        rounds = drafts - drafts0
        if rounds > 0:
            parts.append(f"acceptance length {1.0 + (accepted - accepted0) / rounds:.2f}")
        steps = {k: n - chosen0.get(k, 0) for k, n in chosen.items() if n - chosen0.get(k, 0)}
        if steps:
            taken = ", ".join(f"{k}: {n}" for k, n in sorted(steps.items()))
            parts.append(f"K per step {{{taken}}}")
        if preemptions > preemptions0:
            parts.append(f"preempted {preemptions - preemptions0}")
        return "engine: " + ", ".join(parts)
