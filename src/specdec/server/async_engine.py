"""AsyncEngine: one background thread owns the `LLMEngine` and steps it while work exists.

Requests arrive through a thread-safe command queue; each request's outputs go to its own asyncio
queue through `loop.call_soon_threadsafe`, so the event loop never blocks on a step. An error in
one request's admission is delivered to that request only and never stops the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specdec.core.snapshot import EngineDeadError, snapshot_of
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.outputs import RequestOutput
from specdec.runner.tensor_parallel import TensorParallelError
from specdec.sampling import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread waits for a command before re-checking for shutdown.
IDLE_POLL_S = 0.1


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestStream:
    """The outputs of one admitted request; iterate it, and `abort()` if you stop early.

    Each output holds everything so far (text, tokens, logprobs: cumulative, as vLLM's), so a
    reader that fell behind the engine gets only the newest of the outputs waiting for it: one
    chunk for several steps' tokens rather than one chunk a step, which would keep it behind
    (`coalesced` counts the outputs skipped). An error or the final output is never skipped,
    and the outputs before an error are delivered first."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._outputs = outputs
        self._held: RequestOutput | BaseException | None = None  # taken early, not yet handed
        self.finished = False
        self.coalesced = 0

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            if self._held is not None:
                item, self._held = self._held, None
            else:
                item = await self._outputs.get()
            while not isinstance(item, BaseException) and not item.finished:
                if self._outputs.empty():
                    break
                newer = self._outputs.get_nowait()
                if isinstance(newer, BaseException):
                    self._held = newer  # after the output it follows
                    break
                item = newer
                self.coalesced += 1
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> bool:
        """Asks the engine thread to abort the request and free its KV blocks (idempotent).

        Returns whether the request was still running (False once it has finished).
        """
        if self.finished:
            return False
        self.finished = True
        self.engine.abort(self.request_id)
        return True


class AsyncEngine:
    """Runs `engine.step()` in one thread; `add` and `abort` may be called from any event loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._ready = threading.Event()  # the thread has warmed the engine up
        self.snapshot = snapshot_of(self.engine)

    # ------------------------------------------------------------ event loop side
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float) -> None:
        """Aborts every request in flight (their streams end with EngineDeadError), joins, and
        then closes the engine (stops its tensor-parallel workers)."""
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.close()

    def close(self) -> None:
        """Closes the engine (its tensor-parallel workers stop); idempotent."""
        self.engine.close()

    def drain(self) -> None:
        """Begins a graceful shutdown (from any thread, e.g. a signal handler): nothing more is
        admitted, and every request in flight is aborted with a final output (finish_reason
        "abort"), so that its stream ends with a last chunk instead of being cut."""
        self._draining.set()
        self._commands.put(("drain",))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_ready(self) -> bool:
        """Whether the engine thread has warmed the engine up (`LLMEngine.warm_up`, its first
        work; requests sent meanwhile wait for it)."""
        return self._ready.is_set()

    # The model facts the routes need (as `EngineClient` has them).
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def new_request_seed(self) -> int:
        """The seed of a request that brings none (the engine's derivation)."""
        return self.engine.new_request_seed()

    async def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        speculative: dict | None,
    ) -> RequestStream:
        """Submits a request and waits for its admission.

        Raises:
            ValueError: the engine rejected the request (bad prompt, parameters or speculation).
            EngineDeadError: the engine is shut down.
        """
        if self._draining.is_set():
            raise EngineDeadError("the server is shutting down")
        if self._stopping.is_set() or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        outputs: asyncio.Queue = asyncio.Queue()
        admitted = asyncio.get_running_loop().create_future()
        self._commands.put(("add", request_id, prompt, params, speculative, outputs, admitted))
        await admitted
        return RequestStream(self, request_id, outputs)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---------------------------------------------------------------- engine side
    def _run(self) -> None:
        if self.engine.config.warm_up:
            print(self.engine.warm_up().line(), file=sys.stderr, flush=True)
        self._ready.set()
        while not self._stopping.is_set():
            idle = not self.engine.has_unfinished
            try:
                command = self._commands.get(timeout=IDLE_POLL_S) if idle else None
            except queue.Empty:
                command = None
            if command is not None:
                self._handle(command)
            self._drain()
            if self.engine.has_unfinished and not self._stopping.is_set():
                self._step()
            self.snapshot = snapshot_of(self.engine)
        self._abort_all(EngineDeadError("the server is shutting down"))
        self._drain()
        self.snapshot = snapshot_of(self.engine)

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._handle(command)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, speculative, outputs, admitted = command
            loop = admitted.get_loop()
            if self._stopping.is_set() or self._draining.is_set():
                error: BaseException | None = EngineDeadError("the server is shutting down")
            else:
                try:
                    self.engine.add_request(
                        prompt, params, request_id=request_id, speculative=speculative
                    )
                    error = None
                except ValueError as err:
                    error = err
            if error is None:
                self._streams[request_id] = _Stream(loop, outputs)
            loop.call_soon_threadsafe(_settle, admitted, error)
        elif kind == "abort":
            request_id = command[1]
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)
        elif kind == "drain":
            for request_id, stream in self._streams.items():
                output = self.engine.abort(request_id)
                item = output if output is not None else EngineDeadError("shutting down")
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            self._streams.clear()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except TensorParallelError as err:  # the engine cannot go on: 503 to all, then exit
            logger.error("engine failed: %s; the server exits", err)
            self._abort_all(EngineDeadError(f"the engine failed: {err}"))
            self._stopping.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the server's own graceful exit
            return
        except Exception as err:  # a failed step must not kill the thread: fail the requests
            logger.exception("engine step failed; aborting the requests in flight")
            self._abort_all(EngineDeadError(f"engine step failed: {type(err).__name__}"))
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)

    def _abort_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()
        for request_id in list(self.engine.groups):
            try:
                self.engine.abort(request_id)
            except Exception:  # after a failed step the engine may be inconsistent
                logger.exception("aborting request %s failed", request_id)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
