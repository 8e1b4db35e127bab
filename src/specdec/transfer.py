"""Moving small per-row values between host and device without stalling the device queue.

`to_device` sends host values through reused pinned buffers with an asynchronous copy (a copy from
pageable memory waits for the work already queued). Pinned buffers are made on the CPU explicitly,
so that they stay host memory under `torch.set_default_device("cuda")`.

`Readback` packs named int64 and float32 tensors into one int64 buffer (floats travel as their
bit patterns), copies it to pinned host memory with one asynchronous copy and records an event.
`values()` waits for that event only: work queued after the copy (the kernels that consume the
same inputs) keeps running while the host checks the values. The argument checks of `sample` and
`verify` use it, so they cost no device-wide synchronisation.
"""

from __future__ import annotations

import threading

import torch


class _Pool(threading.local):
    """Per-thread free pinned buffers and events, by (device, number of int64 words).

    Buffers return here once their values have been read, so a call costs no pinned allocation
    (host work on the critical path of a call that waits for its read-back; not measured on its
    own).
    """

    def __init__(self) -> None:
        self.free: dict[tuple[torch.device, int], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}


_POOL = _Pool()


class Readback:
    """An asynchronous device-to-host copy of a few small named tensors.

    Args:
        ints: name -> integer tensor (read back as flat int64), None entries skipped.
        floats: name -> floating tensor (read back as flat float32), None entries skipped.
    """

    def __init__(
        self, ints: dict[str, torch.Tensor | None], floats: dict[str, torch.Tensor | None]
    ) -> None:
        ints = {name: t for name, t in ints.items() if t is not None}
        floats = {name: t for name, t in floats.items() if t is not None}
        self._int_sizes = {name: t.numel() for name, t in ints.items()}
        self._float_sizes = {name: t.numel() for name, t in floats.items()}
        parts = [t.reshape(-1).to(torch.int64) for t in ints.values()]
        if floats:
            flat = torch.cat([t.reshape(-1).to(torch.float32) for t in floats.values()])
            parts.append(flat.view(torch.int32).to(torch.int64))
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._event = None
        if packed.is_cuda:
            self._key = (packed.device, packed.numel())
            free = _POOL.free.get(self._key)
            if free:
                self._host, self._event = free.pop()
            else:
                self._host = torch.empty(
                    packed.shape, dtype=torch.int64, device="cpu", pin_memory=True
                )
                self._event = torch.cuda.Event()
            self._host.copy_(packed, non_blocking=True)
            self._event.record()
        else:
            self._host = packed

    def values(self) -> dict[str, torch.Tensor]:
        """name -> flat host tensor (int64 or float32); waits for the copy."""
        if self._event is not None:
            self._event.synchronize()
            host, self._host = self._host, self._host.clone()
            _POOL.free.setdefault(self._key, []).append((host, self._event))
            self._event = None
        total_ints = sum(self._int_sizes.values())
        ints = self._host[:total_ints].split(list(self._int_sizes.values()))
        bits = self._host[total_ints:].to(torch.int32)
        floats = bits.view(torch.float32).split(list(self._float_sizes.values()))
        return dict(zip(self._int_sizes, ints, strict=True)) | dict(
            zip(self._float_sizes, floats, strict=True)
        )


class _PinnedStaging(threading.local):
    """Reused pinned host buffers for small host-to-device copies, by (dtype, capacity: the
    length rounded up to a power of two, at least 64); a buffer is reused once the event
    recorded after its copy has completed. Capacities bound the pool for copies of many lengths
    (eager steps: attention metadata of every prefill chunk).

    This saves a pinned allocation per copy (host work every speculative or sampled step; its
    cost on the H200 host was not measured on its own)."""

    MAX_PER_SIZE = 8

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, torch.cuda.Event]]]
        self.buffers = {}

    @staticmethod
    def capacity(length: int) -> int:
        return max(64, 1 << (length - 1).bit_length())

    def to_device(self, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        length = len(values)
        entries = self.buffers.setdefault((dtype, self.capacity(length)), [])
        for index, (_, event) in enumerate(entries):
            if event.query():
                buffer, event = entries.pop(index)
                break
        else:
            buffer = torch.empty(self.capacity(length), dtype=dtype, device="cpu", pin_memory=True)
            event = torch.cuda.Event()
        host = buffer[:length]
        if isinstance(values, torch.Tensor):
            host.copy_(values)
        else:
            host.numpy()[:] = values
        out = host.to(device, non_blocking=True)
        event.record()
        if len(entries) < self.MAX_PER_SIZE:
            entries.append((buffer, event))
        return out


_STAGING = _PinnedStaging()


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[len(values)] tensor of `dtype` on `device` from host values (a list, or a 1-d CPU
    tensor). A CUDA copy goes through reused pinned memory, so it does not wait for the work
    already queued."""
    if device.type != "cuda":
        if isinstance(values, torch.Tensor):
            return values.to(device=device, dtype=dtype, copy=True)  # a copy, as on CUDA
        return torch.tensor(values, dtype=dtype, device=device)
    return _STAGING.to_device(values, dtype, device)
