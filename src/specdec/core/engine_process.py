"""The engine process of `specdec serve`: it loads the model, then only takes commands, runs
steps and sends their outputs; the HTTP process (`engine_client.EngineClient`) does everything
else. Once loaded it reports ready and warms up (`LLMEngine.warm_up`) before its loop starts. The
process ends when told to (`shutdown`), when its parent goes away, or after an error
that leaves the engine unusable (a tensor-parallel worker lost), which it reports first.

Detokenization and stop strings stay here, in the step: a stop string ends the request (and
frees its KV blocks) in the step that produced it, as in `LLM.generate`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from specdec.core.snapshot import EngineDeadError, snapshot_of
from specdec.core.stats_log import STATS_INTERVAL_S, StatsLog
from specdec.core.wire import (
    ADMITTED,
    DEAD,
    FAILED,
    OUTPUTS,
    SNAPSHOT,
    Abort,
    Add,
    Drain,
    Shutdown,
    decode_command,
    delta_row,
    encode_frame,
)

logger = logging.getLogger(__name__)

# How long the idle engine process waits for a command before checking on its parent (ms).
IDLE_POLL_MS = 100
# How long a frame waits for the HTTP process to connect before the parent is checked (ms).
SEND_TIMEOUT_MS = 1000
# How often the running requests' outputs are built and sent while STREAM_GATHER_FROM or more
# requests run (s; SPECDEC_STREAM_INTERVAL_MS sets another, 0: every step). Between two sends a
# step builds the outputs of the requests that finished or emitted their first tokens only (a
# stream starts at once), and the next send carries every token since the last (deltas). Built
# every step they were 15% of a host-bound engine process (s36, H100, `--no-spec`, 64 streams:
# 0.43 ms of a 2.8 ms step, where `LLM.generate` takes 1.1 ms for the whole step); every 4 ms the
# server delivered 1.18-1.21x the tokens/s (s37, same lease). A stream's chunks then come at most
# this far apart beyond the step's own time. Fewer requests cost little to report: their outputs
# go every step. A step between sends with nothing to report sends no frame (the metrics'
# snapshot rides on the next one).
STREAM_INTERVAL_S = 0.004
STREAM_GATHER_FROM = 16


class ParentGone(Exception):
    """The HTTP process went away: the engine process ends."""


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP process needs from the loaded engine (sent once, when it is ready)."""

    tokenizer: object
    max_model_len: int
    vocab_size: int
    seed: int | None
    startup: str  # what the engine runs, for `serve`'s start-up line


def run_engine_process(
    engine_config,
    speculative: dict | None,
    threads: int | None,
    inbox_address: str,
    outbox_address: str,
    ready,
    describe,
    log_stats: bool = True,
) -> None:
    """The engine process's main (multiprocessing spawn target).

    Args:
        engine_config, speculative: what `LLMEngine` is built from.
        threads: torch CPU threads for the engine (None: torch's default).
        inbox_address, outbox_address: the ZMQ endpoints to bind (commands in, frames out).
        ready: a multiprocessing Connection: receives ("ready", EngineInfo) or ("error", line,
            whether it is the user's error: a bad path, checkpoint or setting).
        describe: engine -> the start-up description (picklable: a module-level function).
        log_stats: write a line of figures every few seconds while busy (`StatsLog`).
    """
    # Ctrl-C, or a service manager's SIGTERM, reaches the whole group: the HTTP process drains
    # the requests and then ends this one (or this one ends when it finds its parent gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch
    import zmq

    from specdec.engine.llm_engine import LLMEngine

    if threads is not None:
        torch.set_num_threads(threads)
    parent = os.getppid()
    try:
        engine = LLMEngine(engine_config, speculative)
    except BaseException as err:  # the parent reports it (a user's error in one line)
        user = isinstance(err, (ValueError, OSError))  # a bad path, checkpoint or setting
        if not user:
            traceback.print_exc()
        ready.send(("error", str(err) or type(err).__name__, user))
        return
    # This side binds, before it reports ready: the HTTP process connects, and its commands
    # queue from its connect on (a connecting PUSH has its pipe at once), so none is lost.
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.bind(inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    outbox.bind(outbox_address)
    info = EngineInfo(
        engine.tokenizer,
        engine.max_model_len,
        engine.model_config.vocab_size,
        engine.config.seed,
        describe(engine),
    )
    ready.send(("ready", info))
    ready.close()
    try:
        # The HTTP process answers /health with 503 until this loop's first frame (the
        # snapshot it sends before waiting for commands) comes: after the warm-up.
        if engine.config.warm_up:
            print(engine.warm_up().line(), file=sys.stderr, flush=True)
        interval = float(os.environ.get("SPECDEC_LOG_STATS_INTERVAL", STATS_INTERVAL_S))
        stats = StatsLog(engine, interval) if log_stats else None
        EngineCore(engine, inbox, outbox, parent, stats).run()
    except ParentGone:
        pass
    finally:
        engine.close()
        outbox.close(linger=1000)
        inbox.close(linger=0)
        context.term()


class EngineCore:
    """The engine process's loop: commands first, then a step while work exists."""

    def __init__(
        self, engine, inbox, outbox, parent_pid: int, stats: StatsLog | None = None
    ) -> None:
        self.engine = engine
        self.stats = stats
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        engine.emit_deltas = True  # each step's outputs as changes (`delta_row`)
        interval_ms = os.environ.get("SPECDEC_STREAM_INTERVAL_MS")
        self.stream_interval = (
            STREAM_INTERVAL_S if interval_ms is None else float(interval_ms) / 1e3
        )
        self.next_stream = 0.0  # when the running requests' outputs are next due
        self.live: set[str] = set()  # requests admitted and not finished or aborted
        self.draining = False
        self.stopping = False

    def run(self) -> None:
        import zmq

        from specdec.runner.tensor_parallel import TensorParallelError

        while not self.stopping:
            if not self.engine.has_unfinished:
                self._send(SNAPSHOT, None)
                while not self.inbox.poll(IDLE_POLL_MS, zmq.POLLIN):
                    if os.getppid() != self.parent_pid:  # the HTTP process is gone
                        return
                    if self.stats is not None:
                        self.stats.tick()
            elif os.getppid() != self.parent_pid:
                return
            self._read_commands()
            if self.stopping or not self.engine.has_unfinished:
                continue
            now = time.monotonic()
            streaming = len(self.live) < STREAM_GATHER_FROM or now >= self.next_stream
            if streaming:
                self.next_stream = now + self.stream_interval
            try:
                outputs = self.engine.step(only_finished=not streaming)
            except TensorParallelError as err:  # the engine cannot go on: report and end
                logger.error("engine failed: %s", err)
                self._fail_all(f"the engine failed: {err}")
                self._send(DEAD, f"the engine failed: {err}")
                return
            except Exception as err:  # a failed step fails the requests, not the process
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(f"engine step failed: {type(err).__name__}")
                continue
            deltas = []
            for delta in outputs:
                if delta.request_id not in self.live:
                    continue
                if delta.finished:
                    self.live.discard(delta.request_id)
                deltas.append(delta_row(delta))
            if deltas or streaming:  # between sends a step with nothing finished sends nothing
                self._send(OUTPUTS, deltas)
            if self.stats is not None:
                self.stats.emitted(sum(len(sample[3]) for delta in deltas for sample in delta[6]))
                self.stats.tick()
        self._fail_all("the server is shutting down")

    def _send(self, kind: str, payload) -> None:
        """Sends a frame; it is never dropped while the HTTP process lives (none has connected
        yet at the start: the send waits for it)."""
        import zmq

        frame = encode_frame(kind, payload, snapshot_of(self.engine))
        while True:
            try:
                self.outbox.send(frame)
                return
            except zmq.Again:
                if os.getppid() != self.parent_pid:
                    raise ParentGone from None

    def _read_commands(self) -> None:
        import zmq

        admitted = []
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            command = decode_command(data)
            if isinstance(command, Add):
                admitted.append(self._add(command))
            elif isinstance(command, Abort):
                if command.request_id in self.live:
                    self.live.discard(command.request_id)
                    self.engine.abort(command.request_id)
            elif isinstance(command, Drain):
                self.draining = True
                self._abort_with_outputs()
            elif isinstance(command, Shutdown):
                self.stopping = True
        if admitted:
            self._send(ADMITTED, admitted)

    def _add(self, command: Add) -> list:
        request_id = command.request_id
        if self.draining or self.stopping:
            return [request_id, EngineDeadError.__name__, "the server is shutting down"]
        try:
            self.engine.add_request(
                command.prompt,
                command.params,
                request_id=request_id,
                speculative=command.speculative,
            )
        except ValueError as err:
            return [request_id, ValueError.__name__, str(err)]
        self.live.add(request_id)
        if self.stats is not None:
            self.stats.admitted(len(command.prompt))
        return [request_id, None, None]

    def _abort_with_outputs(self) -> None:
        """Every live request aborted with a final output (finish_reason "abort")."""
        deltas, failed = [], []
        for request_id in sorted(self.live):
            delta = self.engine.abort(request_id)
            if delta is None:
                failed.append([request_id, "the server is shutting down"])
            else:
                deltas.append(delta_row(delta))
        self.live.clear()
        if deltas:
            self._send(OUTPUTS, deltas)
        if failed:
            self._send(FAILED, failed)

    def _fail_all(self, message: str) -> None:
        failed = [[request_id, message] for request_id in sorted(self.live)]
        for request_id in list(self.engine.groups):
            try:
                self.engine.abort(request_id)
            except Exception:  # after a failed step the engine may be inconsistent
                logger.exception("aborting request %s failed", request_id)
        self.live.clear()
        if failed:
            self._send(FAILED, failed)
