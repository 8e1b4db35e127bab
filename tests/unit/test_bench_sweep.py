"""Unit tests of the sweep's plain-decoding bracket (`specdec.bench`): speed-ups against the mean
of the plain rates timed before and after the drafters, and a note when that rate drifted."""

from __future__ import annotations

from specdec.bench import SweepPoint, plain_drift, sweep_table


def point(temperature: float, before: float, after: float) -> SweepPoint:
    plain = (before + after) / 2
    return SweepPoint(
        drafter="eagle",
        k=4,
        temperature=temperature,
        mean_acceptance_length=2.0,
        acceptance_per_position=[0.5, 0.3, 0.1, 0.1],
        tokens_per_s=120.0,
        plain_tokens_per_s=plain,
        speedup=120.0 / plain,
        plain_before_after=(before, after),
    )


def test_a_steady_plain_rate_adds_no_note():
    points = [point(0.0, 100.0, 105.0), point(1.0, 90.0, 85.0)]
    assert plain_drift(points) is None
    assert "Note" not in sweep_table(points)


def test_a_drifting_plain_rate_is_named_in_the_table():
    """The control: s13's sweep would have shown its plain rate moving (685 then 816)."""
    points = [point(0.0, 685.0, 816.0), point(1.0, 704.0, 720.0)]
    note = plain_drift(points)
    assert note is not None and "T = 0: 685.0 then 816.0" in note and "T = 1" not in note
    assert note in sweep_table(points)
    assert abs(points[0].speedup - 120.0 / 750.5) < 1e-12
