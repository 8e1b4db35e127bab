"""When the speculative paths admit waiting requests (`OverlappedLoop._admission_due`): once one
can be admitted per ADMISSION_BATCH_SHARE running, counting free places under max_num_seqs (a
queue behind a full batch gathers too), or once admission has been possible for
MAX_ADMISSION_WAIT_S, timed from when a place and a request first met."""

from __future__ import annotations

import types
from collections import deque

from specdec.engine import overlapped_loop
from specdec.engine.overlapped_loop import (
    ADMISSION_BATCH_SHARE,
    MAX_ADMISSION_WAIT_S,
    OverlappedLoop,
)


def loop_state(running: int, waiting: int, max_num_seqs: int = 64):
    """A stand-in for the engine: what `_admission_due` reads."""
    state = types.SimpleNamespace(
        scheduler=types.SimpleNamespace(running=[object()] * running, waiting=deque([0] * waiting)),
        config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
        _admissible_since=None,
    )
    state._admission_pending = types.MethodType(OverlappedLoop._admission_pending, state)
    return state


def due(state) -> bool:
    return OverlappedLoop._admission_due(state)


def test_a_batchs_worth_of_free_places_or_the_wait_makes_admission_due(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(overlapped_loop.time, "monotonic", lambda: clock[0])
    assert ADMISSION_BATCH_SHARE == 8  # the cases below are written for it
    assert due(loop_state(running=0, waiting=1))  # an idle engine admits at once
    assert due(loop_state(running=7, waiting=1))  # a small batch too
    assert due(loop_state(running=56, waiting=7))  # 7 x 8 >= 56
    # a queue behind a full batch: nothing can be admitted; with one place free, one request
    # can (1 x 8 < 63): not due until the wait; with 8 places free (8 x 8 >= 56), due
    assert not due(loop_state(running=64, waiting=200))
    queue = loop_state(running=63, waiting=200)
    assert not due(queue) and queue._admissible_since == 100.0
    clock[0] += MAX_ADMISSION_WAIT_S / 2
    assert not due(queue)
    clock[0] += MAX_ADMISSION_WAIT_S / 2
    assert due(queue)  # the clock ran from the first call that found a place
    assert due(loop_state(running=56, waiting=200))
    # once nothing can be admitted the clock stops; the next place starts it again
    queue.scheduler.running = [object()] * 64
    assert not due(queue) and queue._admissible_since is None
    queue.scheduler.running = [object()] * 63
    assert not due(queue) and queue._admissible_since == clock[0]


def test_counting_waiting_requests_alone_would_not_gather_behind_a_queue():
    """The control: with the places ignored (a rule of waiting requests per running), a queue
    of 200 behind 63 running would be due with a single place free; the rule is not."""
    state = loop_state(running=63, waiting=200)
    waiting_rule = len(state.scheduler.waiting) * ADMISSION_BATCH_SHARE >= 63
    assert waiting_rule and not due(state)
