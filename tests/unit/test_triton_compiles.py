"""The Triton compile counter (`specdec.triton_compiles`) against a stand-in `triton.knobs`: it
counts each post-compile call by kernel, chains the hook that was set before, and reports
nothing where Triton has no hook."""

from __future__ import annotations

import sys
import types
from collections import Counter

import pytest

from specdec import triton_compiles


@pytest.fixture
def fresh(monkeypatch):
    """The counter as in a new process (not installed, nothing counted)."""
    monkeypatch.setattr(triton_compiles, "_installed", None)
    monkeypatch.setattr(triton_compiles, "_by_kernel", Counter())


def fake_triton(monkeypatch, previous=None, with_hook=True):
    runtime = types.SimpleNamespace()
    if with_hook:
        runtime.jit_post_compile_hook = previous
    knobs = types.SimpleNamespace(runtime=runtime)
    module = types.ModuleType("triton")
    module.knobs = knobs
    monkeypatch.setitem(sys.modules, "triton", module)
    return runtime


def compile_event(runtime, name):
    """What Triton does after compiling a variant of kernel `name`."""
    info = types.SimpleNamespace(module="specdec.x", name=name, jit_function=None)
    hook = runtime.jit_post_compile_hook
    return hook(key="k", repr="r", fn=info, compile={}, is_manual_warmup=False)


def test_counts_by_kernel_and_since_a_baseline(fresh, monkeypatch):
    runtime = fake_triton(monkeypatch)
    assert triton_compiles.install()
    assert triton_compiles.install()  # idempotent: one counter, not two
    compile_event(runtime, "a")
    baseline = triton_compiles.by_kernel()
    compile_event(runtime, "a")
    compile_event(runtime, "b")
    assert triton_compiles.total() == 3
    assert triton_compiles.by_kernel() == {"a": 2, "b": 1}
    assert triton_compiles.since(baseline) == {"a": 1, "b": 1}
    assert triton_compiles.since(triton_compiles.by_kernel()) == {}


def test_chains_the_hook_set_before(fresh, monkeypatch):
    seen = []

    def previous(**kwargs):
        seen.append(kwargs["fn"].name)
        return "theirs"

    runtime = fake_triton(monkeypatch, previous)
    triton_compiles.install()
    assert compile_event(runtime, "c") == "theirs"
    assert seen == ["c"]
    assert triton_compiles.by_kernel() == {"c": 1}


@pytest.mark.parametrize("with_hook", [False, None])
def test_nothing_counted_without_the_hook(fresh, monkeypatch, with_hook):
    if with_hook is None:
        monkeypatch.setitem(sys.modules, "triton", None)  # no Triton: import fails
    else:
        fake_triton(monkeypatch, with_hook=False)
    assert not triton_compiles.install()
    assert not triton_compiles.available()
    assert triton_compiles.total() == 0


def test_engine_reports_none_where_not_counted(fresh, monkeypatch):
    """The CPU engine reports the compiles as not counted (None), and /metrics leaves the
    family out; with a counter in place, compiles after the warm-up show by kernel."""
    from specdec.core.snapshot import EngineSnapshot
    from specdec.server.prometheus import _EngineCollector

    def families(snap):
        return {family.name for family in _EngineCollector(lambda: snap, "m").collect()}

    assert "specdec:triton_compiles_after_warm_up" not in families(EngineSnapshot())
    snap = EngineSnapshot(triton_compiles_after_warm_up=(("kernel_a", 2),))
    collected = {f.name: f for f in _EngineCollector(lambda: snap, "m").collect()}
    family = collected["specdec:triton_compiles_after_warm_up"]
    samples = [(s.labels["kernel"], s.value) for s in family.samples if s.name.endswith("_total")]
    assert samples == [("kernel_a", 2)]
