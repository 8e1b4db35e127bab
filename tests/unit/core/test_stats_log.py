"""The server's running line (`StatsLog`): written once per interval while the engine has work,
with the interval's token rates, KV use, acceptance length and the K the steps took; silent
when idle."""

from __future__ import annotations

import io
from types import SimpleNamespace

from specdec.core.stats_log import StatsLog


def _engine(running=0, waiting=0, drafts=0, accepted=0, chosen=None, usage=0.0, preemptions=0):
    return SimpleNamespace(
        scheduler=SimpleNamespace(running=[None] * running, waiting=[None] * waiting),
        stats=SimpleNamespace(num_drafts=drafts, num_accepted_tokens=accepted),
        loop_stats=SimpleNamespace(k_chosen=dict(chosen or {})),
        allocator=SimpleNamespace(usage=usage),
        num_preemptions=preemptions,
    )


def test_a_busy_interval_gives_one_line_with_its_rates():
    engine = _engine(drafts=10, accepted=5, chosen={1: 10})
    out = io.StringIO()
    log = StatsLog(engine, interval_s=5.0, out=out)
    start = log._since
    log.admitted(100)
    log.emitted(250)
    engine.scheduler.running = [None] * 3
    engine.stats.num_drafts, engine.stats.num_accepted_tokens = 110, 85  # 100 rounds, 80 accepted
    engine.loop_stats.k_chosen = {1: 60, 0: 50}
    engine.allocator.usage = 0.25
    assert log.tick(start + 1.0) is None  # the interval is not over
    line = log.tick(start + 5.0)
    assert line == (
        "engine: running 3 reqs, waiting 0, prompt 20.0 tok/s, generation 50.0 tok/s, "
        "KV cache 25.0%, acceptance length 1.80, K per step {0: 50, 1: 50}"
    )
    assert out.getvalue() == line + "\n"


def test_an_idle_interval_writes_nothing():
    out = io.StringIO()
    log = StatsLog(_engine(), interval_s=5.0, out=out)
    assert log.tick(log._since + 6.0) is None
    assert out.getvalue() == ""
