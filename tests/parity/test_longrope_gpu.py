"""Phi-3's LongRoPE on CUDA's fused decode path: the RoPE + cache-write kernel with a frequency
table per token (short factors before `original_max_position_embeddings`, long ones from it on)
against its PyTorch twin, and the tiny `phi3_longrope` model decoding past the switch on CUDA's
decode path (eager and CUDA-graphed) against `transformers`' token-by-token logits.

Tolerances: float32 kernel outputs within 1e-5 of the twin (the same float32 products; the
hardware sin/cos); model logits within 1e-4 of `transformers` (float32). Negative control: the
kernel given the short table for every token moves off the twin's long-factor rows.
"""

from __future__ import annotations

import pytest
import torch

from models_fixtures import (
    FAMILY_CONFIGS,
    decode_path_error,
    hf_decode_logits,
    llm_greedy,
    make_family_hf_model,
    prompt_tokens,
    rope_per_token_error,
    save_hf_model,
)
from specdec.engine.llm import LLM
from specdec.models import fused, load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATOL = 1e-4
LONG_FROM = FAMILY_CONFIGS["phi3_longrope"]["original_max_position_embeddings"]


def test_rope_kernel_takes_a_table_per_token() -> None:
    error, control = rope_per_token_error(fused.rope_write_kv, "cuda")
    assert error <= 1e-5
    assert control > 1e-2


def test_longrope_decodes_past_the_switch_on_cuda(tmp_path) -> None:
    """The decode path on CUDA (1 to 4 rows a step) within 1e-4 of `transformers` decoding
    token by token, across the switch at position 32; then greedy generation through `LLM`
    (decode graphs) equal to the CPU engine's, whose tokens the CI tests hold to
    `transformers`."""
    hf_model = make_family_hf_model("phi3_longrope")
    path = save_hf_model(hf_model, tmp_path)
    sequences = prompt_tokens(97, [48, 40, 36], seed=10)
    references = [hf_decode_logits(hf_model, seq).cuda() for seq in sequences]
    model = load_model(path, device="cuda").model
    assert model.model.eager_only_reason is None
    assert decode_path_error(model, references, sequences) <= ATOL
    prompt = prompt_tokens(97, [20], seed=8)[0]
    assert len(prompt) + 24 > LONG_FROM + 8
    args = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 256}
    on_cuda = LLM(str(path), speculative_config=None, device="cuda", dtype="float32", **args)
    on_cpu = LLM(str(path), speculative_config=None, **args)
    got = llm_greedy(on_cuda, [prompt])[0].outputs[0].token_ids
    assert list(got) == list(llm_greedy(on_cpu, [prompt])[0].outputs[0].token_ids)
