"""EngineClient: the HTTP process's handle on an engine that runs in its own process.

`specdec serve` starts the engine process (`specdec.core.engine_process`) before it takes
requests and talks to it over two ZMQ sockets (commands out, frames in; `specdec.core.wire`). The
engine process never waits on HTTP work (JSON, SSE framing, sockets), and the HTTP process's
Python never holds the engine's interpreter lock. Same interface as `AsyncEngine` (the in-process
engine thread, which the tests and a `torchrun` launch keep using): `start`, `add`, `abort`,
`drain`, `shutdown`, `is_alive`, `is_ready`, `snapshot` and the model facts the routes need.

`launch` returns once the model is loaded; the engine process then warms up (captures its CUDA
graphs: `LLMEngine.warm_up`) while the port already answers, and `is_ready` turns true with its
first frame, which its loop sends only after the warm-up. Requests sent meanwhile wait for it.

A request without a seed gets one here (`new_request_seed`, the engine's derivation from its
`seed`): every request reaches the engine seeded, so seeds come from one sequence in arrival
order, as with the in-process engine. If the engine process dies, every open stream ends with
EngineDeadError (the routes answer 503) and the server exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable

from specdec.core.engine_process import EngineInfo, run_engine_process
from specdec.core.snapshot import EngineDeadError, EngineSnapshot
from specdec.core.wire import (
    ADMITTED,
    DEAD,
    FAILED,
    OUTPUTS,
    Abort,
    Add,
    Command,
    Drain,
    OutputAssembler,
    Shutdown,
    decode_frame,
    encode_command,
)
from specdec.rng import engine_request_seed, fresh_seed
from specdec.sampling import SamplingParams
from specdec.server.async_engine import RequestStream

logger = logging.getLogger(__name__)

# How often `launch` checks that the loading engine process is still alive (s).
LAUNCH_POLL_S = 0.5
# After `shutdown`'s timeout, how much longer the engine process gets before SIGKILL (s).
KILL_GRACE_S = 5.0


class EngineStartError(RuntimeError):
    """The engine process failed while loading (a bug: its traceback is on stderr)."""


class EngineLoadError(ValueError):
    """The engine could not load what the user asked for (a bad path, checkpoint or setting):
    the engine's own one-line message."""


class EngineClient:
    """The engine process seen from the HTTP process (create it with `launch`)."""

    def __init__(self, process, info: EngineInfo, directory: str) -> None:
        self.process = process
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.snapshot = EngineSnapshot()
        self._directory = directory
        self._inbox_address = f"ipc://{directory}/commands"
        self._outbox_address = f"ipc://{directory}/frames"
        self._unseeded = itertools.count()
        self._streams: dict[str, asyncio.Queue] = {}
        self._admissions: dict[str, asyncio.Future] = {}
        self._assembler = OutputAssembler()
        self._commands = None  # zmq PUSH socket (bound in start)
        self._frames = None  # zmq.asyncio PULL socket
        self._contexts: list = []
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._stopping = False
        self._dead: str | None = None
        self._ready = False  # a frame came: the engine process has warmed up

    @classmethod
    def launch(
        cls,
        engine_config,
        speculative,
        threads: int | None,
        describe: Callable,
        log_stats: bool = True,
    ) -> EngineClient:
        """Starts the engine process and waits until its model is loaded.

        Args:
            engine_config, speculative: what the engine is built from (an `EngineConfig` and a
                `SpeculativeConfig` or None).
            threads: torch CPU threads of the engine process.
            describe: engine -> its start-up description (a module-level function).
            log_stats: the engine process writes a line of figures every few seconds while
                busy (`stats_log.StatsLog`).

        Raises:
            EngineLoadError: the engine refused the model or a setting (its one-line message).
            EngineStartError: the engine process failed otherwise, or died, while loading.
        """
        directory = tempfile.mkdtemp(prefix="specdec-engine-")
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=run_engine_process,
            args=(
                engine_config,
                speculative,
                threads,
                f"ipc://{directory}/commands",
                f"ipc://{directory}/frames",
                send,
                describe,
                log_stats,
            ),
            name="specdec-engine",
        )
        try:
            process.start()
            send.close()
            while not receive.poll(LAUNCH_POLL_S):
                if not process.is_alive():
                    raise EngineStartError(
                        f"the engine process exited with code {process.exitcode} while loading"
                    )
            try:
                kind, value, *user = receive.recv()
            except EOFError:
                process.join(KILL_GRACE_S)
                raise EngineStartError(
                    f"the engine process exited with code {process.exitcode} while loading"
                ) from None
            if kind == "error":
                raise (EngineLoadError if user[0] else EngineStartError)(value)
        except BaseException:
            _stop_process(process, 0.0)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            receive.close()
        return cls(process, value, directory)

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Connects to the engine process and starts reading frames (in the server's loop)."""
        import zmq
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        commands_context = zmq.Context()
        frames_context = zmq.asyncio.Context()
        self._contexts = [commands_context, frames_context]
        # The engine process bound both; a connecting PUSH queues from here on (no send is lost
        # or blocks: no high-water mark).
        self._commands = commands_context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.connect(self._inbox_address)
        self._frames = frames_context.socket(zmq.PULL)
        self._frames.setsockopt(zmq.RCVHWM, 0)
        self._frames.connect(self._outbox_address)
        self._reader = self._loop.create_task(self._read_frames())
        self._loop.add_reader(self.process.sentinel, self._on_process_exit)

    def shutdown(self, timeout_s: float) -> None:
        """Ends the engine process (its open requests end with EngineDeadError) and waits for it
        up to `timeout_s`, then stops it."""
        self._stopping = True
        self._send(Shutdown())
        self.process.join(timeout_s)
        self._close(KILL_GRACE_S)

    def close(self) -> None:
        """Stops the engine process at once if `shutdown` has not (idempotent)."""
        self._stopping = True
        self._close(0.0)

    def _close(self, grace_s: float) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)
        if self._reader is not None:
            self._reader.cancel()
        _stop_process(self.process, grace_s)
        self._fail_all(EngineDeadError("the server is shutting down"))
        for socket in (self._commands, self._frames):
            if socket is not None:
                socket.close(linger=0)
        for context in self._contexts:
            context.term()
        self._commands = self._frames = None
        self._contexts = []
        shutil.rmtree(self._directory, ignore_errors=True)

    def drain(self) -> None:
        """Begins a graceful shutdown (callable from a signal handler): nothing more is
        admitted, and every request in flight ends with a final output (finish_reason
        "abort")."""
        self._draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._send, ("drain",))
        else:
            self._send(Drain())

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._stopping and self.process.is_alive()

    @property
    def is_ready(self) -> bool:
        """Whether the engine process has warmed up (its loop has sent a frame)."""
        return self._ready

    # ---------------------------------------------------------------- requests
    def new_request_seed(self) -> int:
        """The seed of a request that brings none (the engine's derivation)."""
        if self.info.seed is None:
            return fresh_seed()
        return engine_request_seed(self.info.seed, next(self._unseeded))

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
            EngineDeadError: the engine is shut down or gone.
        """
        if self._draining:
            raise EngineDeadError("the server is shutting down")
        if not self.is_alive or self._commands is None:
            raise EngineDeadError(self._dead or "the engine is not running")
        if params.seed is None:
            params = dataclasses.replace(params, seed=self.new_request_seed())
        outputs: asyncio.Queue = asyncio.Queue()
        admitted = asyncio.get_running_loop().create_future()
        self._streams[request_id] = outputs
        self._admissions[request_id] = admitted
        self._assembler.expect(request_id, prompt)
        self._send(Add(request_id, list(prompt), params, speculative))
        try:
            await admitted
        except asyncio.CancelledError:  # the client left while the request was being admitted
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, outputs)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._assembler.forget(request_id)
            self._send(Abort(request_id))

    # ---------------------------------------------------------------- internals
    def _send(self, command: Command) -> None:
        import zmq

        if self._commands is None:
            return
        with contextlib.suppress(zmq.Again):  # never raised: a connected PUSH without a limit
            self._commands.send(encode_command(command), zmq.NOBLOCK)

    async def _read_frames(self) -> None:
        while True:
            data = await self._frames.recv()
            try:
                self._take(data)
            except Exception:  # a bad frame must not stop the reader
                logger.exception("could not read a frame from the engine process")

    def _take(self, data: bytes) -> None:
        self._ready = True
        kind, payload, snapshot = decode_frame(data)
        if snapshot is not None:
            self.snapshot = snapshot
        if kind == OUTPUTS:
            for delta in payload:
                output = self._assembler.assemble(delta)
                if output is None:
                    continue
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                stream.put_nowait(output)
        elif kind == ADMITTED:
            for request_id, error_kind, message in payload:
                future = self._admissions.pop(request_id, None)
                if error_kind is not None:
                    self._streams.pop(request_id, None)
                    self._assembler.forget(request_id)
                    error = ValueError if error_kind == ValueError.__name__ else EngineDeadError
                    _settle(future, error(message))
                else:
                    _settle(future, None)
        elif kind == FAILED:
            for request_id, message in payload:
                self._assembler.forget(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put_nowait(EngineDeadError(message))
        elif kind == DEAD:
            self._engine_gone(payload)

    def _on_process_exit(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.process.sentinel)
        if self._stopping:
            return
        self.process.join(1.0)
        self._engine_gone(f"the engine process exited (code {self.process.exitcode})")

    def _engine_gone(self, message: str) -> None:
        """The engine cannot serve anymore: 503 to everyone, then the server's own exit."""
        if self._dead is not None:
            return
        self._dead = message
        logger.error("%s; the server exits", message)
        self._fail_all(EngineDeadError(message))
        os.kill(os.getpid(), signal.SIGTERM)

    def _fail_all(self, error: BaseException) -> None:
        for future in self._admissions.values():
            _settle(future, error)
        self._admissions.clear()
        for request_id, stream in self._streams.items():
            self._assembler.forget(request_id)
            stream.put_nowait(error)
        self._streams.clear()


def _settle(future: asyncio.Future | None, error: BaseException | None) -> None:
    if future is None or future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _stop_process(process, grace_s: float) -> None:
    """Ends `process` if its own exit did not come (it ignores SIGTERM: SIGKILL)."""
    if process.is_alive():
        process.join(grace_s)
    if process.is_alive():
        process.kill()
        process.join()
