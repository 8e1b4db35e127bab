"""z-lab's DFlash checkpoints (`DFlashDraftModel`) load into the block drafter, wired as z-lab's
model.py defines it: the draft logits equal those of a reference forward written here from the
published equations (float32, relative 1e-5), references wired otherwise (feature layers shifted
by one, causal block attention, the anchor row predicting) do not; greedy speculation through
`LLM` emits plain decoding's tokens; variants whose math differs are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from drafter_format_fixtures import (
    draft_batch,
    finals_sync_then_async,
    observe_prefixes,
    plain_and_speculative_tokens,
)
from models_fixtures import prompt_tokens, save_hf_model
from public_drafter_fixtures import (
    DFLASH_BLOCK_SIZE,
    DFLASH_CONFIG,
    DFLASH_LAYER_IDS,
    DFLASH_MASK_TOKEN_ID,
    dflash_target,
    dflash_tensors,
    write_checkpoint,
)
from specdec.drafters import DrafterSetup
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.registry import build_drafter
from specdec.models import load_model
from specdec.models.weights import CheckpointError
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB = 97
TOKENS = prompt_tokens(VOCAB - 1, [30, 30, 30], seed=12)
ANCHORS = [3, 11, 25]
RTOL = 1e-5


@pytest.fixture(scope="module")
def target_hf():
    return dflash_target()


@pytest.fixture(scope="module")
def target_dir(target_hf, tmp_path_factory):
    return save_hf_model(target_hf, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def weights():
    return dflash_tensors()


@pytest.fixture(scope="module")
def dflash_dir(weights, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("zlab"), DFLASH_CONFIG, weights)


# --- The reference: z-lab's DFlashDraftModel from its equations (nothing from specdec) --------


def _rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta=1e6):
    """[T, H, d] rotated by RoPE at `positions` (HF's rotate-half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.cat([positions[:, None].float() * inv_freq[None]] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * angles.cos() + rotated * angles.sin()


def reference_logits(target_hf, w, tokens, anchor, layer_ids=DFLASH_LAYER_IDS, causal=False):
    """[block_size - 1, V] logits of rows 1.. of the block [anchor token, mask, ...] at positions
    anchor-1 ..; the context is tokens[:anchor-1] through the target's hidden_states[i + 1]."""
    cfg = DFLASH_CONFIG
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    context_ids = torch.tensor(tokens[: anchor - 1])[None]
    with torch.no_grad():
        states = target_hf(context_ids, output_hidden_states=True).hidden_states
    feature = torch.cat([states[i + 1][0] for i in layer_ids], -1)  # [S, F]
    context = _rms(feature @ w["fc.weight"].T, w["hidden_norm.weight"])  # [S, D]
    s, r = context.shape[0], DFLASH_BLOCK_SIZE
    embed = target_hf.model.embed_tokens.weight.detach()
    h = embed[torch.tensor([tokens[anchor - 1]] + [DFLASH_MASK_TOKEN_ID] * (r - 1))]  # [R, D]
    positions = torch.arange(s + r)
    visible = torch.ones(r, s + r, dtype=torch.bool)
    if causal:
        visible[:, s:] = torch.ones(r, r).tril().bool()
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"])
        both = torch.cat([context, x])  # [S + R, D]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(r, heads, d)
        k = (both @ w[p + "self_attn.k_proj.weight"].T).view(s + r, kv_heads, d)
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(s + r, kv_heads, d)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], 1e-5), positions[s:])
        k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], 1e-5), positions)
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("rhd,thd->hrt", q, k) * d**-0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hrt,thd->rhd", scores.softmax(-1), v).reshape(r, heads * d)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    h = _rms(h, w["norm.weight"])
    return (h @ target_hf.lm_head.weight.detach().T)[1:]


# --- Our drafter ------------------------------------------------------------------------------


def draft_logits(target_dir, head_dir):
    """[B, block_size - 1, V] logits of our DFlash drafter (built through the registry from the
    z-lab directory) fed the engine's target features, for TOKENS at ANCHORS."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="dflash", model=str(head_dir), num_speculative_tokens=3)
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    batch = draft_batch(TOKENS, ANCHORS, ids, 3, ["standard"] * 3)
    with torch.inference_mode():
        hidden = drafter.block_hidden(batch)  # [B, R, D]
        logits = target.compute_logits(hidden[:, 1:].flatten(0, 1))
    return drafter, logits.view(len(TOKENS), DFLASH_BLOCK_SIZE - 1, -1)


def _close(ours, reference):
    return torch.allclose(ours, reference, rtol=0, atol=RTOL * reference.abs().max())


def test_recognised_and_mapped(target_dir, dflash_dir):
    drafter, _ = draft_logits(target_dir, dflash_dir)
    config = drafter.model.config
    assert config.kind == "dflash" and config.feature_layers == tuple(DFLASH_LAYER_IDS)
    assert config.block_size == DFLASH_BLOCK_SIZE - 1 and config.num_rows == DFLASH_BLOCK_SIZE


def test_draft_logits_match_the_reference(target_dir, target_hf, dflash_dir, weights):
    _, ours = draft_logits(target_dir, dflash_dir)
    for b, (tokens, anchor) in enumerate(zip(TOKENS, ANCHORS, strict=True)):
        reference = reference_logits(target_hf, weights, tokens, anchor)
        assert _close(ours[b], reference), (b, (ours[b] - reference).abs().max())


@pytest.mark.parametrize(
    "wiring",
    [
        {"layer_ids": [i + 1 for i in DFLASH_LAYER_IDS]},
        {"layer_ids": [i - 1 for i in DFLASH_LAYER_IDS]},
        {"layer_ids": DFLASH_LAYER_IDS[::-1]},
        {"causal": True},
    ],
    ids=["layers+1", "layers-1", "reversed", "causal"],
)
def test_a_reference_wired_otherwise_does_not_match(
    target_dir, target_hf, dflash_dir, weights, wiring
):
    _, ours = draft_logits(target_dir, dflash_dir)
    b = 2  # a long context, so that every wiring difference shows
    wrong = reference_logits(target_hf, weights, TOKENS[b], ANCHORS[b], **wiring)
    assert (ours[b] - wrong).abs().max() > 1e-3 * wrong.abs().max()


COMMON = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16}


def _spec(head_dir):
    return {
        "method": "dflash",
        "model": str(head_dir),
        "num_speculative_tokens": 3,
        "adaptive": False,  # every step drafts (the policy may choose K = 0 on the CPU)
    }


def test_greedy_speculation_equals_greedy_plain(target_dir, dflash_dir):
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, drafted, llm = plain_and_speculative_tokens(
        target_dir, _spec(dflash_dir), prompts, params, **COMMON
    )
    assert drafted == plain
    assert llm.get_metrics()["num_drafts"] > 0


def _load(target_dir, head_dir):
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="dflash", model=str(head_dir))
    setup = DrafterSetup(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=32)
    return build_drafter(spec, target, setup)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
        ({"is_causal": True}, "is_causal"),
        ({"input_embedding_scale": 2.0}, "input_embedding_scale"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        (
            {"dflash_config": {"mask_token_id": 96, "target_layer_ids": [1, 4]}},
            "last layer 4",
        ),
        ({"dflash_config": {"mask_token_id": 97, "target_layer_ids": [1, 3]}}, "mask_token_id"),
    ],
)
def test_other_variants_are_refused_by_name(target_dir, weights, tmp_path, change, named):
    head_dir = write_checkpoint(tmp_path / "zlab", {**DFLASH_CONFIG, **change}, weights)
    with pytest.raises(CheckpointError, match=named):
        _load(target_dir, head_dir)


def test_unknown_tensors_and_other_shapes_are_refused(target_dir, weights, tmp_path):
    extra = {**weights, "candidate_selector.hidden_projection.weight": torch.zeros(4, 64)}
    head_dir = write_checkpoint(tmp_path / "extra", DFLASH_CONFIG, extra)
    with pytest.raises(CheckpointError, match=r"candidate_selector\.hidden_projection\.weight"):
        _load(target_dir, head_dir)
    head_dir = write_checkpoint(
        tmp_path / "wide", {**DFLASH_CONFIG, "intermediate_size": 80}, weights
    )
    with pytest.raises(ValueError, match="intermediate_size 80"):
        _load(target_dir, head_dir)
    missing = {k: v for k, v in weights.items() if k != "hidden_norm.weight"}
    head_dir = write_checkpoint(tmp_path / "missing", DFLASH_CONFIG, missing)
    with pytest.raises(CheckpointError, match=r"'hidden_norm\.weight'"):
        _load(target_dir, head_dir)


def test_the_dspark_method_refuses_a_dflash_checkpoint(target_dir, dflash_dir):
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="dspark", model=str(dflash_dir))
    setup = DrafterSetup(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match='holds a "dflash" drafter'):
        build_drafter(spec, target, setup)


def test_device_rounds_emit_what_the_synchronous_step_emits(target_dir, dflash_dir):
    """The z-lab drafter through device rounds (`async_scheduling`; op by op on the CPU, over
    its paged context pools) emits what the synchronous step emits, greedy, K pinned."""
    spec = SpeculativeConfig.from_dict(_spec(dflash_dir))
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=8)
    finals, engine = finals_sync_then_async(
        target_dir,
        spec,
        prompts,
        lambda _: SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    )
    assert finals[0] == finals[1]
    assert engine.loop_stats.num_device_rounds > 0
