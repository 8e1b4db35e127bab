"""Device-held rules of plain steps (`engine/request_rules.py`): requests with penalties, a
bias, allowed tokens, bans and min_tokens emit, through plain steps that read their rules from
rows kept on the device, exactly the tokens of steps that rebuild a `LogitsContext` each step
(overlapped and synchronous loops, arrivals, preemption, more ruled requests than rows). A
negative control (committed tokens never counted) must change the tokens."""

from __future__ import annotations

import pytest

from models_fixtures import make_hf_model, save_hf_model
from request_rules_fixtures import ENGINE_CASES, run
from specdec.engine.request_rules import RequestRules


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-request-rules"))


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_kept_rules_emit_what_rebuilt_rules_emit(model_dir, async_scheduling, case):
    """ "few rows": 4 rows for the ruled requests of 12 (three kept at once, row 0 neutral),
    so requests give rows back and later ones are written afresh."""
    args, preempts = ENGINE_CASES[case], case == "preempting"
    expected = run(model_dir, async_scheduling, kept=False, preempts=preempts, **args)
    assert len(expected) == 12
    assert run(model_dir, async_scheduling, kept=True, preempts=preempts, **args) == expected


def test_negative_control_uncounted_tokens_change_the_output(model_dir, monkeypatch):
    expected = run(model_dir, True, kept=False)
    monkeypatch.setattr(RequestRules, "committed", lambda self, request, tokens: None)
    assert run(model_dir, True, kept=True) != expected
