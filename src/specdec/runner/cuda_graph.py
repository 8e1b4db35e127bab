"""The CUDA-graph helper every graphed step uses (the target's decode/verify step and each
drafter's steps): padded batch sizes, static int64 inputs sent from a pinned host twin with one
copy per step, and graphs captured on first use per key in one shared memory pool.

A step is written once, as a function of static buffers; `GraphCache.run` either calls it (the
CPU, `enforce_eager`) or replays its graph, so both modes compute the same shapes and the same
numbers. Never samples or draws randomness.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8, up to max_num_seqs."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


def bucket_for(buckets: list[int], num_seqs: int) -> int:
    """The smallest bucket holding `num_seqs` sequences."""
    return next(size for size in buckets if size >= num_seqs)


class StaticInputs:
    """Named int64 inputs of a graphed step: one device buffer, laid out field by field in the
    order given, with pinned host twins (pageable on the CPU) that the host fills in turn and
    sends with one asynchronous copy per step.

    A step calls `begin()` (takes the next twin, waiting until its last copy has left it),
    writes the host views (`host(name)`, numpy), then `send(last, count)`: one copy of every
    field up to the first `count` entries of `last` (the fields after it are not sent). What a
    step leaves unwritten keeps the values of the twin's last step: with one twin (the default)
    the previous step's; with two, the one before it, and a host queues two steps back to back
    (a runner step of two graphs) without waiting for the device to reach the first one's copy.
    """

    def __init__(self, sizes: dict[str, int], device: torch.device, twins: int = 1) -> None:
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = total
            total += size
        self.sizes = dict(sizes)
        on_cuda = device.type == "cuda"
        self.buffer = torch.zeros(total, dtype=torch.int64, device=device)
        self._twins = [
            torch.zeros(total, dtype=torch.int64, pin_memory=on_cuda) for _ in range(twins)
        ]
        self._views = [twin.numpy() for twin in self._twins]
        self._copied = [torch.cuda.Event() for _ in range(twins)] if on_cuda else None
        self._turn = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        """The device view of field `name` (its whole size)."""
        start = self.offsets[name]
        return self.buffer[start : start + self.sizes[name]]

    def host(self, name: str, count: int | None = None) -> np.ndarray:
        """The host view of the first `count` entries of field `name` (all when None)."""
        start = self.offsets[name]
        view = self._views[self._turn]
        return view[start : start + (self.sizes[name] if count is None else count)]

    def begin(self) -> None:
        """Takes the next host twin, once its last `send` has read it (it may be rewritten
        then)."""
        self._turn = (self._turn + 1) % len(self._twins)
        if self._copied is not None:
            self._copied[self._turn].synchronize()

    def send(self, last: str, count: int) -> None:
        """Copies the current host twin to the device, from the first field through the first
        `count` entries of field `last` (asynchronous: the host does not wait for it)."""
        end = self.offsets[last] + count
        self.buffer[:end].copy_(self._twins[self._turn][:end], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()


class GraphCache:
    """CUDA graphs of a step, one per key, captured on first use; all share one memory pool.

    Without `use_graphs` (the CPU, `enforce_eager`) `run` calls the step itself. `graphs` maps each
    key to (graph, the outputs the captured step returned). `keys` holds every key `run` was
    called with, with graphs or without (a set insert per step): the keys a CUDA engine would
    have captured, observable on the CPU (the engine's warm-up is checked against it).
    """

    def __init__(self, use_graphs: bool) -> None:
        self.use_graphs = use_graphs
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.keys: set[Hashable] = set()
        self._pool = None

    def run(
        self,
        key: Hashable,
        step: Callable[[], T],
        state: Callable[[], list[torch.Tensor]] | None = None,
    ) -> T:
        """Runs `step` (a function of static buffers returning tensors in static memory): calls it,
        or replays the graph captured for `key`. Returns what `step` returns (in graph mode, the
        tensors the captured step returned, rewritten by every replay).

        A first use captures the graph after a warm-up run of `step` (which compiles its
        kernels). A step that updates buffers it also reads (a speculative round advancing its
        own state) names them in `state`: they are saved before the warm-up and put back after
        it, so that the step still runs once. Steps that only write what they compute from their
        inputs (a decode step: the same K/V to the same slots) need none."""
        self.keys.add(key)
        if not self.use_graphs:
            return step()
        if key not in self.graphs:
            self.graphs[key] = self._capture(step, state)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture(self, step: Callable[[], T], state) -> tuple[torch.cuda.CUDAGraph, T]:
        saved = [(t, t.clone()) for t in state()] if state is not None else []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        for tensor, copy in saved:
            tensor.copy_(copy)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = step()
        self._pool = graph.pool()
        return graph, outputs
