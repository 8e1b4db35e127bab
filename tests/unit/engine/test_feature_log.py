"""The feature log (`engine.feature_log`): what it hands the drafter is, per request, every row
it was given, in position order, in one call; batches that change between steps, chunks beside
decode rows, finished, released and non-speculative requests, and the flush every MAX_STEPS
steps. Negative control: a log that stacks a run of steps along the wrong axis hands a request
the wrong rows, and the same comparison catches it."""

from __future__ import annotations

import torch

from specdec.engine import feature_log
from specdec.engine.feature_log import FeatureLog
from specdec.engine.request import RequestStatus, SpecSettings
from specdec.sampling import SamplingParams

F = 3


class Recorder:
    def __init__(self):
        self.calls = []

    def observe(self, features):
        self.calls.append(features)


def make_request(request_id, spec=True):
    from specdec.engine.request import Request

    return Request(
        request_id, [1, 2, 3], SamplingParams(), 0, SpecSettings(2, "coupled") if spec else None
    )


def feature(request_index, position):
    return torch.full((F,), request_index * 1000.0 + position)


def decode_rows(requests, positions):
    return torch.stack(
        [feature(int(r.request_id), p) for r, p in zip(requests, positions, strict=True)]
    )


def delivered(recorder):
    """request id -> (first position, [n, F]) over every call, each request's calls joined."""
    out = {}
    for call in recorder.calls:
        for request_id, start, rows in zip(
            call.request_ids, call.starts, call.features, strict=True
        ):
            if request_id in out:
                first, held = out[request_id]
                assert start == first + held.shape[0], (request_id, start)
                out[request_id] = (first, torch.cat([held, rows]))
            else:
                out[request_id] = (start, rows)
    return out


def expected_rows(index, first, count):
    return torch.stack([feature(index, first + i) for i in range(count)])


def test_rows_reach_the_drafter_per_request_in_position_order():
    recorder = Recorder()
    log = FeatureLog(recorder)
    a, b, c = (make_request(str(i)) for i in range(3))
    log.add_chunks([(c, 0, expected_rows(2, 0, 5))])  # c's prompt chunk
    log.add_rows([a, b], [10, 20], decode_rows([a, b], [10, 20]))
    log.add_rows([a, b], [11, 21], decode_rows([a, b], [11, 21]))
    log.add_chunks([(c, 5, expected_rows(2, 5, 2))])  # c's last chunk beside...
    log.add_rows([a, b, c], [12, 22, 7], decode_rows([a, b, c], [12, 22, 7]))
    log.add_rows([b, c], [23, 8], decode_rows([b, c], [23, 8]))  # a finished: b and c go on
    assert len(log) == 6 and not recorder.calls
    log.flush()
    assert len(recorder.calls) == 1 and len(log) == 0
    got = delivered(recorder)
    assert set(got) == {"0", "1", "2"}
    for index, first, count in ((0, 10, 3), (1, 20, 4), (2, 0, 9)):
        start, rows = got[str(index)]
        assert start == first
        assert torch.equal(rows, expected_rows(index, first, count))


def test_finished_released_and_plain_requests_are_skipped():
    recorder = Recorder()
    log = FeatureLog(recorder)
    a, b, c, plain = (
        make_request("0"),
        make_request("1"),
        make_request("2"),
        make_request("3", False),
    )
    batch = [a, b, c, plain]
    log.add_rows(batch, [1, 1, 1, 1], decode_rows(batch, [1, 1, 1, 1]))
    a.status = RequestStatus.FINISHED_ABORTED
    log.drop(b)  # preempted: its drafter state was released
    log.flush()
    assert list(delivered(recorder)) == ["2"]
    log.add_rows([b], [0], decode_rows([b], [0]))  # b after its recompute: delivered again
    log.flush()
    assert delivered(recorder)["1"][0] == 0


def test_a_request_released_and_resumed_before_a_flush_keeps_its_new_rows():
    """A request preempted (`drop`) and resumed between two flushes: the rows it logged before
    are forgotten, its recomputed prefix and the rows after it reach the drafter (s43: the drop
    mark lasted until the flush and dropped those too, so the request entered device rounds
    with no features). Its neighbours' rows, in the same entries, are untouched."""
    recorder = Recorder()
    log = FeatureLog(recorder)
    a, b = make_request("0"), make_request("1")
    log.add_chunks([(a, 0, expected_rows(0, 0, 4)), (b, 0, expected_rows(1, 0, 3))])
    log.add_rows([a, b], [4, 3], decode_rows([a, b], [4, 3]))
    log.drop(b)  # preempted: every row above is stale
    log.add_rows([a], [5], decode_rows([a], [5]))
    log.add_chunks([(b, 0, expected_rows(1, 0, 5))])  # b's prompt and output recomputed
    log.add_rows([a, b], [6, 5], decode_rows([a, b], [6, 5]))
    log.flush()
    got = delivered(recorder)
    assert got["0"][0] == 0 and torch.equal(got["0"][1], expected_rows(0, 0, 7))
    assert got["1"][0] == 0 and torch.equal(got["1"][1], expected_rows(1, 0, 6))


def test_the_log_hands_over_every_max_steps(monkeypatch):
    monkeypatch.setattr(feature_log, "MAX_STEPS", 4)
    recorder = Recorder()
    log = FeatureLog(recorder)
    a = make_request("0")
    for position in range(9):
        log.add_rows([a], [position], decode_rows([a], [position]))
    assert len(recorder.calls) == 2 and len(log) == 1
    log.flush()
    start, rows = delivered(recorder)["0"]
    assert start == 0 and torch.equal(rows, expected_rows(0, 0, 9))


def test_negative_control_stacked_along_the_wrong_axis_fails(monkeypatch):
    """A log that stacks a run of decode steps along the batch axis (row b then holds step b's
    rows, not request b's) hands a request the wrong features: the first test's comparison
    must catch it."""

    class WrongAxis:
        cat = staticmethod(torch.cat)

        @staticmethod
        def stack(tensors, dim=0):
            return torch.stack(tensors, dim=0)  # [steps, B, F]: row b is step b

    recorder = Recorder()
    log = FeatureLog(recorder)
    monkeypatch.setattr(feature_log, "torch", WrongAxis)
    a, b = make_request("0"), make_request("1")
    for p in range(2):
        log.add_rows([a, b], [p, 20 + p], decode_rows([a, b], [p, 20 + p]))
    log.flush()
    start, rows = delivered(recorder)["0"]
    assert start == 0 and not torch.equal(rows, expected_rows(0, 0, 2))
