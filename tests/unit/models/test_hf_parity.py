"""Our forward pass against `transformers` on tiny random-weight checkpoints of each architecture.

Checkpoints are written with `save_pretrained` (safetensors) and read back with `load_model`; logits
must agree within 1e-4 (fp32), whole-prompt and through the paged cache step by step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from models_fixtures import (
    TINY_CONFIGS,
    PagedRunner,
    hf_logits,
    make_hf_model,
    prompt_tokens,
    save_hf_model,
)
from specdec.models import AttentionMetadata, load_model, prompt_logits

pytest.importorskip("transformers", reason="transformers (test extra) is the forward reference")

ATOL = 1e-4


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(name, HF model, our loaded model, config) for each tiny architecture."""
    name = request.param
    hf_model = make_hf_model(name)
    path = save_hf_model(hf_model, tmp_path_factory.mktemp(name))
    model, config, tokenizer = load_model(path)
    assert tokenizer is None  # no tokenizer files were written
    return name, hf_model, model, config


def test_prompt_logits_match(checkpoint: Any) -> None:
    _, hf_model, model, config = checkpoint
    prompts = prompt_tokens(config.vocab_size, [1, 6, 29])
    ours = prompt_logits(model, prompts, block_size=4)
    for logits, prompt in zip(ours, prompts, strict=True):
        reference = hf_logits(hf_model, prompt)
        assert logits.shape == (len(prompt), config.vocab_size)
        assert (logits - reference).abs().max().item() <= ATOL


def test_paged_steps_match_full_sequence(checkpoint: Any) -> None:
    """Chunked prefill, decode and multi-token (verify-like) steps, three sequences per batch."""
    _, hf_model, model, config = checkpoint
    sequences = prompt_tokens(config.vocab_size, [19, 9, 24], seed=3)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    runner = PagedRunner(model, num_blocks=24, block_size=4)
    # New tokens per sequence per step: prefill chunks, then decode 1 / verify 3 mixes.
    schedule = [[11, 4, 13], [5, 1, 8], [1, 1, 1], [1, 3, 1], [1, 0, 1]]
    done = [0, 0, 0]
    worst = 0.0
    for step in schedule:
        new = {b: sequences[b][done[b] : done[b] + n] for b, n in enumerate(step) if n > 0}
        for b, logits in runner.step(new).items():
            expected = references[b][done[b] : done[b] + step[b]]
            worst = max(worst, (logits - expected).abs().max().item())
        done = [d + n for d, n in zip(done, step, strict=True)]
    assert done == [19, 9, 24]
    assert worst <= ATOL


def test_layer_outputs_match_hidden_states(checkpoint: Any) -> None:
    _, hf_model, model, config = checkpoint
    prompt = prompt_tokens(config.vocab_size, [13], seed=5)[0]
    with torch.no_grad():
        hf_hidden = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    kv_cache = model.allocate_kv_cache(4, 4)
    attn = AttentionMetadata.build([13], [13], [[2, 0, 3, 1]], 4)
    with torch.inference_mode():
        final, layers = model.forward_with_layers(
            torch.tensor(prompt), torch.arange(13), attn, kv_cache, return_layers=(1, 0)
        )
    torch.testing.assert_close(layers[0], hf_hidden[2][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(layers[1], hf_hidden[1][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(final, hf_hidden[-1][0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="out of range"):
        model.forward_with_layers(
            torch.tensor(prompt), torch.arange(13), attn, kv_cache, (config.num_hidden_layers,)
        )


def test_tied_embeddings_have_no_lm_head(checkpoint: Any) -> None:
    name, _, model, config = checkpoint
    names = {param_name for param_name, _ in model.named_parameters()}
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    assert config.tie_word_embeddings == (name == "smollm2_tied")


def test_sharded_checkpoint_loads_the_same(tmp_path: Path) -> None:
    hf_model = make_hf_model("qwen2_bias")
    save_hf_model(hf_model, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _, _ = load_model(tmp_path)
    prompt = prompt_tokens(97, [9])[0]
    logits = prompt_logits(model, [prompt])[0]
    assert (logits - hf_logits(hf_model, prompt)).abs().max().item() <= ATOL


def test_bfloat16_load_runs(tmp_path: Path) -> None:
    hf_model = make_hf_model("llama")
    model, _, _ = load_model(save_hf_model(hf_model, tmp_path), dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    prompt = prompt_tokens(97, [12])[0]
    logits = prompt_logits(model, [prompt])[0]
    assert logits.dtype == torch.float32
    # bf16 has ~3 significant digits; the logits (std ~1.2) stay close to fp32's.
    assert (logits - hf_logits(hf_model, prompt)).abs().max().item() < 0.25
