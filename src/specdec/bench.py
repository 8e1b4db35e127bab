"""Speculative vs plain decoding on one workload: tokens/s, TPOT, TTFT, acceptance figures.

Runs the same prompts and seeds through an engine without drafts and through one with the chosen
speculative_config, writes the figures as JSON and a PNG plot. Measures only what it runs.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.engine.llm import LLM
from specdec.engine.outputs import RequestOutput
from specdec.sampling import SamplingParams

# A repetitive workload (code and structured text): n-gram and small drafters do well on it.
DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 1..10.",
    "List the days of the week, one per line, each followed by its number in the week.",
    "Write a JSON object describing three books with title, author and year fields.",
    "Explain what a hash map is, then give an example in Python.",
    "Write the multiplication table of 7 from 7 x 1 to 7 x 12.",
    "Write a bash script that prints the numbers from 1 to 20 and says whether each is even.",
    "Repeat the sentence 'The quick brown fox jumps over the lazy dog.' five times.",
    "Write a SQL query that selects the ten most recent orders with their customer names.",
)


@dataclass(frozen=True, slots=True)
class RunFigures:
    """Figures of one engine on the workload."""

    name: str
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    mean_ttft_s: float
    mean_tpot_s: float
    mean_acceptance_length: float
    acceptance_rate: float
    acceptance_per_position: list[float]


def run_workload(
    llm: LLM,
    name: str,
    prompts: list[list[int]],
    params: SamplingParams,
    progress: bool = True,
) -> tuple[RunFigures, list[RequestOutput]]:
    """Generates for every prompt; times first tokens and completions per request."""
    first_token_at: dict[str, float] = {}
    done_at: dict[str, float] = {}
    finished = [0]
    start = time.perf_counter()

    def on_tokens(output: RequestOutput) -> None:
        now = time.perf_counter()
        first_token_at.setdefault(output.request_id, now)
        if output.finished:
            done_at[output.request_id] = now
            finished[0] += 1
            if progress:
                _draw(name, finished[0], len(prompts))

    before = llm.get_metrics()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, on_tokens=on_tokens
    )
    wall = time.perf_counter() - start
    if progress:
        sys.stderr.write("\n")
    after = llm.get_metrics()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts, tpots = [], []
    for out in outputs:
        n = len(out.outputs[0].token_ids)
        ttft = first_token_at[out.request_id] - start
        ttfts.append(ttft)
        if n > 1:
            tpots.append((done_at[out.request_id] - first_token_at[out.request_id]) / (n - 1))
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    per_position = (
        [
            (
                a
                - (
                    before["accepted_per_position"][i]
                    if i < len(before["accepted_per_position"])
                    else 0
                )
            )
            / drafts
            for i, a in enumerate(after["accepted_per_position"])
        ]
        if drafts
        else []
    )
    figures = RunFigures(
        name=name,
        wall_s=wall,
        output_tokens=tokens,
        tokens_per_s=tokens / wall,
        mean_ttft_s=sum(ttfts) / len(ttfts),
        mean_tpot_s=sum(tpots) / len(tpots) if tpots else float("nan"),
        mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
        acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
        acceptance_per_position=per_position,
    )
    return figures, outputs


def _draw(name: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{name:>12} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    sys.stderr.flush()


def machine_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (CPU)"


def write_results(path: Path, runs: list[RunFigures], meta: dict) -> Path:
    """Writes the JSON figures and a PNG plot beside them; returns the PNG path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=2))
    png = path.with_suffix(".png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r.name for r in runs]
    left.bar(names, [r.tokens_per_s for r in runs], color="tab:blue")
    left.set_ylabel("output tokens / s")
    left.set_title("throughput")
    for run in runs:
        if run.acceptance_per_position:
            positions = range(1, len(run.acceptance_per_position) + 1)
            right.plot(positions, run.acceptance_per_position, marker="o", label=run.name)
    right.set_xlabel("draft position")
    right.set_ylabel("P(accepted length >= position)")
    right.set_ylim(0, 1)
    right.set_title("acceptance per position")
    if right.lines:
        right.legend()
    fig.suptitle(meta.get("title", "specdec bench"))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
