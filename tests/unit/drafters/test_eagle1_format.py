"""EAGLE-1/2 checkpoints (SafeAILab's format, vLLM's "eagle") load into the EAGLE head, wired as
EAGLE's cnets1.py / ea_model.py define it: the draft logits equal those of a reference forward
written here from the published equations (to 5e-5 of their scale in float32), and references
with the wiring changed (concat order, pre-norm feature, layer 0's input norm, no fc bias, the
wrong table) do not; speculation through `LLM` emits plain decoding's tokens; bad checkpoints
are refused by name.
"""

from __future__ import annotations

import re

import pytest
import torch

from drafter_format_fixtures import (
    draft_batch,
    finals_sync_then_async,
    observe_prefixes,
    plain_and_speculative_tokens,
    target_hidden,
)
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from public_drafter_fixtures import EAGLE1_CONFIG, eagle1_tensors, write_checkpoint
from specdec.drafters import DrafterSetup
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.registry import build_drafter
from specdec.engine.llm import LLM
from specdec.models import load_model
from specdec.models.weights import CheckpointError
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB = 97
TOKENS = prompt_tokens(VOCAB, [30, 30, 30], seed=12)
ANCHORS = [6, 11, 25]  # 4, 9 and 23 entries: the fused decode path and the general one


@pytest.fixture(scope="module")
def target_hf():
    return make_hf_model("llama")


@pytest.fixture(scope="module")
def target_dir(target_hf, tmp_path_factory):
    return save_hf_model(target_hf, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def eagle1_weights(target_hf):
    """EAGLE-1 tensors with fc.bias and a copy of the target's embedding (as EAGLE saves it)."""
    return eagle1_tensors(embedding=target_hf.model.embed_tokens.weight)


@pytest.fixture(scope="module")
def eagle1_dir(eagle1_weights, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("eagle1"), EAGLE1_CONFIG, eagle1_weights)


# --- The reference: EAGLE-1's head from its equations (nothing from specdec) -------------------


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    """[T, H, d] rotated by RoPE at `positions` (HF Llama's rotate-half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.cat([positions[:, None].float() * inv_freq[None]] * 2, -1)[:, None]
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def _decoder_layer(w, x, positions, input_norm=False):
    """One Llama decoder layer over the whole causal sequence x [T, D]; EAGLE's layer 0 has no
    input_layernorm (`input_norm=True` is a deliberately wrong variant: RMSNorm, unit weight)."""
    cfg = EAGLE1_CONFIG
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // heads
    h = _rms(x, 1.0, cfg["rms_norm_eps"]) if input_norm else x
    q = (h @ w["layers.0.self_attn.q_proj.weight"].T).view(-1, heads, d)
    k = (h @ w["layers.0.self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
    v = (h @ w["layers.0.self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
    q, k = _rope(q, positions, cfg["rope_theta"]), _rope(k, positions, cfg["rope_theta"])
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    n = x.shape[0]
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, heads * d)
    x = x + attn @ w["layers.0.self_attn.o_proj.weight"].T
    h = _rms(x, w["layers.0.post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    gate = h @ w["layers.0.mlp.gate_proj.weight"].T
    up = h @ w["layers.0.mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T


def reference_draft_logits(
    weights,
    target_hf,
    tokens,
    anchor,
    drafts,
    *,
    embed_first=True,
    post_norm=True,
    input_norm=False,
    use_bias=True,
    table=None,
):
    """[len(drafts), V] EAGLE-1 draft logits of a round anchored at `anchor` that proposed
    `drafts`: entries t = 0 .. anchor - 2 join the target's hidden state at t with the token at
    t + 1 (EAGLE positions entry t at t); draft i > 0 comes from an entry of the head's previous
    output (unnormed) and draft i - 1; every output goes to the target's LM head as it is."""
    table = target_hf.model.embed_tokens.weight if table is None else table
    lm_head = target_hf.lm_head.weight
    hidden = list(target_hidden(target_hf, tokens[: anchor - 1], post_norm))
    inputs = list(tokens[1:anchor])
    logits = []
    with torch.no_grad():
        for draft in drafts:
            embeds = table[torch.tensor(inputs)]
            states = torch.stack(hidden)
            joined = (embeds, states) if embed_first else (states, embeds)
            x = torch.cat(joined, -1) @ weights["fc.weight"].T
            if use_bias and "fc.bias" in weights:
                x = x + weights["fc.bias"]
            out = _decoder_layer(weights, x, torch.arange(len(inputs)), input_norm)
            logits.append(out[-1] @ lm_head.T)
            hidden.append(out[-1])
            inputs.append(int(draft))
    return torch.stack(logits)


# --- Our drafter ------------------------------------------------------------------------------


def propose(target_dir, head_dir, k=3, plain_path=False):
    """The EAGLE drafter of `head_dir` (built through the registry), fed the target's features,
    proposes k sampled drafts (temperature 1: processed logits are the raw ones) for TOKENS at
    ANCHORS."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="eagle", model=str(head_dir), num_speculative_tokens=k)
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    if plain_path:
        drafter._graphs = None  # the general paged path, not the graphs' static buffers
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    batch = draft_batch(TOKENS, ANCHORS, ids, k, ["standard", "coupled", "block"])
    return drafter, drafter.propose(batch)


# float32 against float32 through other operation orders: 1.0e-5 was seen on a clean CI machine
# for the third chained draft (logits ~30); the controls below differ by more than 1e-3.
REFERENCE_RTOL = 5e-5


def relative_error(got, want):
    """[K] max |got - want| of each draft's logits over their largest |want| (the random head's
    unnormed outputs grow along a chain, to logits of ~30: float32 rounding is relative)."""
    return (got - want).abs().amax(-1) / want.abs().amax(-1)


def assert_matches_reference(proposal, weights, target_hf, **variant):
    for b, (tokens, anchor) in enumerate(zip(TOKENS, ANCHORS, strict=True)):
        drafts = proposal.draft_token_ids[b].tolist()
        want = reference_draft_logits(weights, target_hf, tokens, anchor, drafts, **variant)
        assert relative_error(proposal.draft_logits[b], want).max() < REFERENCE_RTOL


@pytest.mark.parametrize("plain_path", [False, True])
def test_draft_logits_match_the_reference(
    target_dir, target_hf, eagle1_dir, eagle1_weights, plain_path
):
    drafter, proposal = propose(target_dir, eagle1_dir, plain_path=plain_path)
    layout = drafter.head.config.layout
    assert not (layout.feature_fc or layout.layer_input_norm or layout.output_norm)
    assert layout.in_proj_bias and not layout.own_embedding  # the stored table is the target's
    assert drafter.embed is not drafter.head.embed_tokens
    assert_matches_reference(proposal, eagle1_weights, target_hf)


@pytest.mark.parametrize(
    "variant",
    [
        {"embed_first": False},  # concat(hidden, embedding)
        {"post_norm": False},  # the last layer's output before the target's final norm
        {"input_norm": True},  # layer 0 with an input_layernorm
        {"use_bias": False},  # fc without its stored bias
    ],
)
def test_a_reference_wired_otherwise_does_not_match(
    target_dir, target_hf, eagle1_dir, eagle1_weights, variant
):
    """Negative controls: the comparison has the power to see each wiring choice."""
    _, proposal = propose(target_dir, eagle1_dir)
    drafts = proposal.draft_token_ids[2].tolist()
    want = reference_draft_logits(
        eagle1_weights, target_hf, TOKENS[2], ANCHORS[2], drafts, **variant
    )
    assert relative_error(proposal.draft_logits[2], want).max() > 1e-3


def test_without_bias_or_table_sharded(target_dir, target_hf, tmp_path):
    """No fc.bias and no embed_tokens (the target's table), in two safetensors shards."""
    weights = eagle1_tensors(seed=6, bias=False)
    head_dir = write_checkpoint(tmp_path / "eagle1", EAGLE1_CONFIG, weights, shards=2)
    drafter, proposal = propose(target_dir, head_dir)
    assert not drafter.head.config.layout.in_proj_bias and drafter.head.in_proj.bias is None
    assert_matches_reference(proposal, weights, target_hf)


def test_a_table_of_its_own_is_used(target_dir, target_hf, tmp_path):
    """A stored embedding that is not the target's is the head's own (EAGLE loads it)."""
    table = 0.15 * torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(4))
    weights = eagle1_tensors(seed=7, embedding=table)
    head_dir = write_checkpoint(tmp_path / "eagle1", EAGLE1_CONFIG, weights)
    drafter, proposal = propose(target_dir, head_dir)
    assert drafter.head.config.layout.own_embedding and drafter.embed is drafter.head.embed_tokens
    assert_matches_reference(proposal, weights, target_hf, table=table)
    drafts = proposal.draft_token_ids[0].tolist()
    shared = reference_draft_logits(weights, target_hf, TOKENS[0], ANCHORS[0], drafts)
    assert relative_error(proposal.draft_logits[0], shared).max() > 1e-3  # (the control)


def _spec(head_dir, **extra):
    return {
        "method": "eagle",
        "model": str(head_dir),
        "num_speculative_tokens": 3,
        "adaptive": False,  # every step drafts (the policy may choose K = 0 on the CPU)
        **extra,
    }


COMMON = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16}


@pytest.mark.parametrize("tree", [None, {"nodes": 4, "depth": 2, "topk": 2}])
def test_greedy_speculation_equals_greedy_plain(target_dir, eagle1_dir, tree):
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, drafted, llm = plain_and_speculative_tokens(
        target_dir, _spec(eagle1_dir, tree=tree), prompts, params, **COMMON
    )
    assert drafted == plain
    assert llm.get_metrics()["num_drafts"] > 0


def test_sampled_speculation_equals_plain_sampling(target_dir, eagle1_dir):
    """The default verifier (coupled) emits plain sampling's tokens for the same seeds."""
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=5)
    params = [
        SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)
    ]
    plain = LLM(str(target_dir), **COMMON).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target_dir), speculative_config=_spec(eagle1_dir), **COMMON)
    assert llm.engine.speculative_config.rejection_sample_method == "coupled"
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0


def _load(target_dir, head_dir):
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="eagle", model=str(head_dir))
    setup = DrafterSetup(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=32)
    return build_drafter(spec, target, setup)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("drop layers.0.mlp.up_proj.weight", "'layers.0.mlp.up_proj.weight'"),
        ("reshape fc.weight", "'fc.weight' has shape"),
        ("reshape fc.bias", "'fc.bias' has shape"),
        ("add norm.weight", "does not define: 'norm.weight'"),
        ("add lm_head.weight", "does not define: 'lm_head.weight'"),
    ],
)
def test_bad_tensors_are_refused_by_name(target_dir, eagle1_weights, tmp_path, change, named):
    action, name = change.split()
    weights = dict(eagle1_weights)
    if action == "drop":
        del weights[name]
    elif action == "reshape":
        weights[name] = weights[name][..., :-1]
    else:
        weights[name] = torch.ones(64) if name == "norm.weight" else torch.ones(VOCAB, 64)
    head_dir = write_checkpoint(tmp_path / "bad", EAGLE1_CONFIG, weights)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        _load(target_dir, head_dir)


def test_other_heads_are_refused_naming_the_format(target_dir, eagle1_weights, tmp_path):
    eagle3 = {**eagle1_weights, "midlayer.hidden_norm.weight": torch.ones(64)}
    write_checkpoint(tmp_path / "eagle3", EAGLE1_CONFIG, eagle3)
    with pytest.raises(CheckpointError, match="EAGLE-3"):
        _load(target_dir, tmp_path / "eagle3")
    write_checkpoint(tmp_path / "other", EAGLE1_CONFIG, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="not an EAGLE head"):
        _load(target_dir, tmp_path / "other")
    wide = {**EAGLE1_CONFIG, "hidden_size": 32}
    write_checkpoint(tmp_path / "wide", wide, eagle1_weights)
    with pytest.raises(ValueError, match="hidden_size 32"):
        _load(target_dir, tmp_path / "wide")
    deep = {**EAGLE1_CONFIG, "num_hidden_layers": 2}
    write_checkpoint(tmp_path / "deep", deep, eagle1_weights)
    with pytest.raises(ValueError, match="2 layers"):
        _load(target_dir, tmp_path / "deep")
    dynamic = {**EAGLE1_CONFIG, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    write_checkpoint(tmp_path / "dynamic", dynamic, eagle1_weights)
    with pytest.raises(ValueError, match="dynamic NTK"):
        _load(target_dir, tmp_path / "dynamic")


@pytest.mark.parametrize(("method", "temperature"), [("standard", 1.0), ("coupled", 0.0)])
def test_device_rounds_emit_what_the_synchronous_step_emits(
    target_dir, eagle1_dir, method, temperature
):
    """The EAGLE-1 head through device rounds (`async_scheduling`; op by op on the CPU, over
    the buffers CUDA graphs replay) emits what the synchronous step emits, K pinned."""
    spec = SpeculativeConfig.from_dict(_spec(eagle1_dir, rejection_sample_method=method))
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=8)
    finals, engine = finals_sync_then_async(
        target_dir,
        spec,
        prompts,
        lambda i: SamplingParams(
            temperature=temperature, max_tokens=20, ignore_eos=True, seed=30 + i
        ),
    )
    assert finals[0] == finals[1]
    assert engine.loop_stats.num_device_rounds > 0
