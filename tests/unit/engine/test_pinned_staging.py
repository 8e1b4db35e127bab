"""Reused pinned staging buffers of host-to-device copies (`transfer._PinnedStaging`, CUDA
only in use): a buffer is reused only after the event recorded behind its copy has completed,
and every copy carries its own values. Run on the CPU with a fake event and pinning switched off."""

from __future__ import annotations

import pytest
import torch

from specdec import transfer


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.records = 0

    def record(self) -> None:
        self.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def staging(monkeypatch):
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch, "empty", empty)
    return transfer._PinnedStaging()


def test_a_buffer_is_reused_only_after_its_copy_completed(staging) -> None:
    cpu = torch.device("cpu")
    first = staging.to_device([1, 2, 3], torch.int64, cpu)
    second = staging.to_device([4, 5, 6], torch.int64, cpu)  # the first copy is still pending
    (host_a, event_a), (host_b, _) = staging.buffers[(torch.int64, 64)]
    assert host_a is not host_b
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5, 6]
    event_a.done = True
    third = staging.to_device([7, 8, 9], torch.int64, cpu)
    hosts = [host for host, _ in staging.buffers[(torch.int64, 64)]]
    assert len(hosts) == 2 and hosts[-1] is host_a  # reused, and queued again behind its copy
    assert third.tolist() == [7, 8, 9]
    assert event_a.records == 2


def test_sizes_and_dtypes_have_their_own_buffers_and_the_pool_is_bounded(staging) -> None:
    cpu = torch.device("cpu")
    values = staging.to_device([0.5, 1.5], torch.float32, cpu)
    assert values.dtype == torch.float32 and values.tolist() == [0.5, 1.5]
    for i in range(3 * staging.MAX_PER_SIZE):
        assert staging.to_device([i], torch.int64, cpu).tolist() == [i]
    assert len(staging.buffers[(torch.int64, 64)]) == staging.MAX_PER_SIZE
    assert len(staging.buffers[(torch.float32, 64)]) == 1
    # Lengths share power-of-two capacities: 65 .. 128 values use one size of buffer.
    for length in (65, 100, 128):
        out = staging.to_device(list(range(length)), torch.int64, cpu)
        assert out.tolist() == list(range(length))
    assert set(staging.buffers) == {(torch.int64, 64), (torch.float32, 64), (torch.int64, 128)}


def test_tensor_values_are_copied_like_lists(staging) -> None:
    cpu = torch.device("cpu")
    source = torch.tensor([3, 1, 2])
    out = staging.to_device(source, torch.int64, cpu)
    source[0] = 9  # the copy is the caller's values at call time
    assert out.tolist() == [3, 1, 2]
    assert transfer.to_device(torch.tensor([1.5]), torch.float32, cpu).tolist() == [1.5]
