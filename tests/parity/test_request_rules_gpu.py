"""Device-held rules of plain steps on CUDA (`engine/request_rules.py`): requests with penalties,
a bias, allowed tokens, bans and min_tokens emit exactly the tokens of steps that rebuild a
`LogitsContext` every step, under graphed decode steps, overlapped and synchronous, with
arrivals and preemption (the CPU test's cases, `tests/unit/engine/test_request_rules.py`)."""

from __future__ import annotations

import pytest

from models_fixtures import make_hf_model, save_hf_model
from request_rules_fixtures import ENGINE_CASES, run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-rules-gpu"))


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_kept_rules_emit_what_rebuilt_rules_emit_on_cuda(model_dir, async_scheduling, case):
    args = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 512, **ENGINE_CASES[case]}
    preempts = case == "preempting"
    expected = run(model_dir, async_scheduling, kept=False, preempts=preempts, **args)
    assert len(expected) == 12
    assert run(model_dir, async_scheduling, kept=True, preempts=preempts, **args) == expected
