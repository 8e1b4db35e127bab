"""Tensor-parallel execution: rank 0 (the driver) runs the engine; ranks 1..N-1 are workers that
each hold one shard of the target and replay every forward step the driver runs.

The driver spawns the workers (`torch.multiprocessing`, spawn) or joins ranks started by
`torchrun` (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), and before each target step
broadcasts the step's inputs (`StepInput`s) over a gloo control group; every rank then runs the
same step on its shard, whose all-reduces and logits gather (NCCL on CUDA, gloo on the CPU) keep
the hidden states identical on every rank. Scheduling, sampling, verification and drafting
happen on the driver only. A worker that dies fails the driver's next step with an error naming
its rank. Never samples or draws randomness.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.models import LlamaForCausalLM, LoadedModel, ModelConfig, load_model
from specdec.models.loader import read_model_config
from specdec.models.tensor_parallel import Collectives, ShardLayout, shard_layout
from specdec.runner.model_runner import PagedModelRunner, StepInput

# How long one collective of a forward step may wait for the other ranks before it fails
# (a peer that died normally fails it at once: its sockets close).
COLLECTIVE_TIMEOUT_S = 120.0
# How long a worker may wait for the driver's next command (an idle engine waits for requests).
IDLE_TIMEOUT_S = 365 * 24 * 3600.0
# How long the driver waits for workers to report a death it suspects.
DEATH_GRACE_S = 2.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel step failed: the ranks are out of step and the engine cannot go on."""


class WorkerDiedError(TensorParallelError):
    """A tensor-parallel worker died (killed, out of memory, or failed and exited)."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to load its shard and build its runner (sent at spawn)."""

    model: str
    dtype: torch.dtype
    device: str
    quantization: str | None
    world_size: int
    backend: str
    init_method: str
    threads: int = 1


@dataclass(slots=True)
class TensorParallelGroup:
    """The driver's or a worker's membership: its layout, collectives and control group."""

    layout: ShardLayout
    collectives: Collectives
    control: Any  # the gloo group commands travel on
    processes: list[Any] = field(default_factory=list)  # the driver's spawned workers


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def external_launch() -> tuple[int, int] | None:
    """(rank, world size) when `torchrun` (or a user) set RANK and WORLD_SIZE, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now (the spawned group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_groups(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    layout: ShardLayout,
    processes: list[Any] | None = None,
) -> TensorParallelGroup:
    """Joins the process group (device collectives, COLLECTIVE_TIMEOUT_S) and a gloo control
    group (commands, IDLE_TIMEOUT_S). For spawned workers (`tcp://` init) the rendezvous
    store is the driver's, which fails at once, naming the rank, if a worker dies first."""
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if init_method.startswith("tcp://"):
        host, port = init_method[len("tcp://") :].rsplit(":", 1)
        store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        if rank == 0:
            _wait_for_workers(store, processes or [])
        else:
            store.set(f"specdec-joined-{rank}", "1")
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return TensorParallelGroup(layout, Collectives(layout), control)


def _wait_for_workers(store: Any, processes: list[Any]) -> None:
    """Waits until every spawned worker joined the store; raises WorkerDiedError naming a
    worker that exits first, or that has not joined in COLLECTIVE_TIMEOUT_S."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    for rank, process in enumerate(processes, start=1):
        while not store.check([f"specdec-joined-{rank}"]):
            if process.exitcode is not None:
                raise WorkerDiedError(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) died while "
                    f"starting: {_describe_exit(process.exitcode)} (a script that starts "
                    'tensor-parallel engines needs an `if __name__ == "__main__":` guard)'
                )
            if time.monotonic() > deadline:
                raise WorkerDiedError(
                    f"tensor-parallel worker rank {rank} did not start in {COLLECTIVE_TIMEOUT_S} s"
                )
            time.sleep(0.05)


def _device_of(device: str, rank: int) -> torch.device:
    """A rank's device: `cuda:LOCAL_RANK` under a launcher that sets it, else `cuda:rank`."""
    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return torch.device(device)


def start_driver(spec: WorkerSpec, config: ModelConfig) -> TensorParallelGroup:
    """Rank 0's set-up: spawns ranks 1..N-1 (unless an external launcher started them) and
    joins the group. `config`: the target's ModelConfig (for the layout)."""
    launched = external_launch()
    processes = []
    if launched is None:
        context = mp.get_context("spawn")
        for rank in range(1, spec.world_size):
            process = context.Process(
                target=worker_main, args=(rank, spec), name=f"specdec-tp-{rank}", daemon=True
            )
            process.start()
            processes.append(process)
    elif launched != (0, spec.world_size):
        raise ValueError(
            f"this process is rank {launched[0]} of {launched[1]}; the driver must be rank 0 "
            f"of tensor_parallel_size={spec.world_size}"
        )
    layout = shard_layout(config, 0, spec.world_size)
    try:
        group = _init_groups(0, spec.world_size, spec.backend, spec.init_method, layout, processes)
    except Exception:
        for process in processes:
            process.kill()
        raise
    group.processes = processes
    return group


def default_init_method() -> str:
    """`env://` under an external launcher (MASTER_ADDR / MASTER_PORT), else a free local port."""
    if external_launch() is not None:
        return "env://"
    return f"tcp://127.0.0.1:{free_local_port()}"


def worker_main(rank: int, spec: WorkerSpec) -> None:
    """A worker's life: load its shard, build its runner when the driver says how, then replay
    the driver's steps until told to stop (or the driver goes away)."""
    torch.set_num_threads(spec.threads)
    device = _device_of(spec.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = read_model_config(spec.model)
    layout = shard_layout(config, rank, spec.world_size)
    group = _init_groups(rank, spec.world_size, spec.backend, spec.init_method, layout)
    try:
        model = load_model(
            spec.model,
            dtype=spec.dtype,
            device=device,
            quantization=spec.quantization,
            shard=layout,
        ).model
        model.attach_collectives(group.collectives)
        runner = None
        while True:
            try:
                command, args = _receive(group)
            except RuntimeError:  # the driver went away between steps: nothing is lost
                print(
                    f"tensor-parallel worker rank {rank}: the driver is gone; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(0)
            if command == "stop":
                break
            if command == "build":
                runner = PagedModelRunner(model, **args)
                share_device_inputs(runner)
                continue
            assert runner is not None
            if command == "device_forward":  # a step the driver filled on its device
                num_seqs, query_per_seq, layers, times = args
                for _ in range(times):
                    runner.graphs.forward(num_seqs, query_per_seq, layers, broadcast_inputs=True)
                continue
            inputs, layers, has_first, options = args
            first_tokens = None
            if has_first:
                first_tokens = torch.empty(len(inputs), dtype=torch.int64, device=device)
                dist.broadcast(first_tokens, src=0)
            getattr(runner, command)(inputs, layers, first_tokens, **options)
    except Exception:  # report, then exit: the driver's next collective fails and names us
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


def share_device_inputs(runner: PagedModelRunner) -> None:
    """Lets the runner's decode path take a step's inputs from rank 0 (steps the driver fills
    on its device: the speculative rounds), over the default process group (NCCL on CUDA, gloo
    on the CPU)."""
    if runner.graphs is not None:
        runner.graphs.broadcast = lambda tensor: dist.broadcast(tensor, src=0)


def _receive(group: TensorParallelGroup) -> tuple[str, Any]:
    message: list[Any] = [None]
    dist.broadcast_object_list(message, src=0, group=group.control)
    return message[0]


class TensorParallelRunner:
    """The driver's runner: every step is sent to the workers, then run on rank 0's shard.

    Exposes the `PagedModelRunner` methods the engine calls (`run`, `run_rows`,
    `run_with_features`, `run_rows_with_features`) and its attributes (read through).
    """

    def __init__(
        self, model: LlamaForCausalLM, group: TensorParallelGroup, runner_args: dict[str, Any]
    ) -> None:
        """Builds every rank's `PagedModelRunner(model, **runner_args)` (the workers' first, so
        that any step the set-up runs finds them ready)."""
        self._group = group
        self._closed = False
        self._failure: TensorParallelError | None = None  # once set, every step raises it
        self._send("build", runner_args)
        self._runner = PagedModelRunner(model, **runner_args)
        share_device_inputs(self._runner)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._runner, name)

    def _send(self, command: str, args: Any) -> None:
        self.check_workers()
        dist.broadcast_object_list([(command, args)], src=0, group=self._group.control)

    def check_workers(self) -> None:
        """Raises WorkerDiedError naming every spawned worker that has exited."""
        dead = [
            (rank, process)
            for rank, process in enumerate(self._group.processes, start=1)
            if process.exitcode is not None
        ]
        if dead:
            raise WorkerDiedError(
                "; ".join(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) died: "
                    + _describe_exit(process.exitcode)
                    for rank, process in dead
                )
            )

    def _step(
        self,
        command: str,
        inputs: list[StepInput],
        layers: Sequence[int],
        first_tokens: torch.Tensor | None,
        options: dict[str, Any],
    ) -> Any:
        """Sends the step to the workers, then runs it here; `options`: the runner method's
        keyword arguments, passed on to every rank."""
        if self._failure is not None:
            raise self._failure
        try:
            self._send(command, (inputs, tuple(layers), first_tokens is not None, options))
            if first_tokens is not None:
                dist.broadcast(first_tokens.contiguous(), src=0)
            return getattr(self._runner, command)(inputs, layers, first_tokens, **options)
        except Exception as err:  # the ranks are out of step now: name why, then stay failed
            self._failure = self._explain(err)
            raise self._failure from err

    def announce_device_forward(
        self, num_seqs: int, query_per_seq: int, feature_layers: Sequence[int], times: int = 1
    ) -> None:
        """Tells the workers to run the decode path's step `times` times, its inputs filled on
        the driver's device and broadcast each time the driver runs it (`DecodeGraphs.forward`
        with `broadcast_inputs`: a speculative round's target step; twice when the driver
        captures the round's graph). Sent before the round is launched (its host part: a
        captured round replays only its device work). The workers run it eagerly."""
        if self._failure is not None:
            raise self._failure
        try:
            args = (num_seqs, query_per_seq, tuple(feature_layers), times)
            self._send("device_forward", args)
        except Exception as err:
            self._failure = self._explain(err)
            raise self._failure from err

    @contextlib.contextmanager
    def device_step(self):
        """Around a speculative round (its target step runs on every rank outside `_step`): a
        failure leaves the engine failed with the error `_step` would give (a dead worker
        named)."""
        if self._failure is not None:
            raise self._failure
        try:
            yield
        except Exception as err:
            self._failure = self._explain(err)
            raise self._failure from err

    def _explain(self, err: Exception) -> TensorParallelError:
        """The error a failed step leaves: a dead worker named (waiting DEATH_GRACE_S for one
        whose death failed the collective to be reaped), else the driver's own failure."""
        if isinstance(err, TensorParallelError):
            return err
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            try:
                self.check_workers()
            except WorkerDiedError as died:
                return died
            if time.monotonic() > deadline or not self._group.processes:
                break
            time.sleep(0.05)
        return TensorParallelError(
            f"a tensor-parallel step failed on rank 0 ({type(err).__name__}: {err}); the "
            "workers are out of step and the engine cannot continue"
        )

    def run_with_features(
        self,
        inputs: list[StepInput],
        feature_layers: Sequence[int],
        first_tokens: torch.Tensor | None = None,
        **options: Any,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`PagedModelRunner.run_with_features` on every rank; rank 0's results."""
        return self._step("run_with_features", inputs, feature_layers, first_tokens, options)

    def run_rows_with_features(
        self,
        inputs: list[StepInput],
        feature_layers: Sequence[int],
        first_tokens: torch.Tensor | None = None,
        **options: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`PagedModelRunner.run_rows_with_features` on every rank; rank 0's results."""
        return self._step("run_rows_with_features", inputs, feature_layers, first_tokens, options)

    def run(
        self, inputs: list[StepInput], first_tokens: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        return self.run_with_features(inputs, (), first_tokens)[0]

    def run_rows(
        self, inputs: list[StepInput], first_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.run_rows_with_features(inputs, (), first_tokens)[0]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the workers and leaves the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a worker already gone: the rest stop below
            self._send("stop", None)
        for process in self._group.processes:
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()
        # NCCL's teardown may wait on a peer that died; a failed engine's process should exit.
        if self._failure is None or dist.get_backend() == "gloo":
            with contextlib.suppress(Exception):  # a group a dead peer left broken
                dist.destroy_process_group()


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def start_target(
    path: str, dtype: torch.dtype, device: torch.device, quantization: str | None, world_size: int
) -> tuple[LoadedModel, TensorParallelGroup]:
    """Starts a tensor-parallel target on the driver: the workers, the group, and rank 0's shard
    (with its collectives attached). Returns (LoadedModel of rank 0's shard, its group).

    Under a launcher (`torchrun`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) every rank
    calls this with the same arguments: rank 0 becomes the driver and returns; any other rank
    runs the worker loop here and exits the process (SystemExit(0)) when the driver stops.

    Raises: ValueError: a model whose heads `world_size` ranks cannot split (before any
    process starts)."""
    config = read_model_config(path)
    shard_layout(config, 0, world_size)  # checks the split before anything starts
    spec = WorkerSpec(
        model=path,
        dtype=dtype,
        device=device.type,
        quantization=quantization,
        world_size=world_size,
        backend=backend_for(device),
        init_method=default_init_method(),
    )
    launched = external_launch()
    if launched is not None and launched[0] != 0:  # a launcher's worker rank: serve, then exit
        worker_main(launched[0], spec)
        raise SystemExit(0)
    if dist.is_initialized():
        raise ValueError(
            "a tensor-parallel engine already runs in this process: close it first (LLM.close())"
        )
    group = start_driver(spec, config)
    loaded = load_model(
        path,
        dtype=dtype,
        device=_device_of(device.type, 0),
        quantization=quantization,
        shard=group.layout,
    )
    loaded.model.attach_collectives(group.collectives)
    return loaded, group
