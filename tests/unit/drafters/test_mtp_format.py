"""MTP layers inside a target checkpoint (`method: "mtp"`, `drafters.mtp`): MiMo's naming
(`model.mtp_layers.{k}`) on a Qwen2 target and DeepSeek-V3's (`model.layers.{N + k}`) on a
Llama target. The draft logits equal those of a reference forward written here from the
published equations (MiMo's modeling_mimo.py, vLLM's mimo_mtp.py / deepseek_mtp.py) to 5e-5 of
their scale in float32, and references wired otherwise (concat order swapped, the other hidden
state, the other chained input) do not; speculation through `LLM` with no `model` (the target's
own files) emits plain decoding's tokens; bad checkpoints are refused by name. Checkpoints of
2 and 3 layers draft through the chain (`drafters.mtp_chain`): their logits equal a reference
that runs every layer over the round's whole sequence to 1e-5, while layer 0 alone does not.
"""

from __future__ import annotations

import json
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
from law_fixtures import exact_continuation_law, first_token_counts, save_vocab8_target
from models_fixtures import TINY_CONFIGS, make_hf_model, prompt_tokens, save_hf_model
from public_drafter_fixtures import mtp_prefix as _prefix
from public_drafter_fixtures import mtp_tensors, write_mtp_target
from specdec.audit import chi_square
from specdec.drafters import DrafterSetup, TargetFeatures
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.mtp import mtp_cache_layers
from specdec.drafters.registry import build_drafter
from specdec.engine.llm import LLM
from specdec.models import AttentionMetadata, load_model
from specdec.models.weights import CheckpointError
from specdec.sampling import SampleOutput, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB, HIDDEN = 97, 64
TOKENS = prompt_tokens(VOCAB, [30, 30, 30], seed=12)
ANCHORS = [6, 11, 25]  # 4, 9 and 23 entries: the fused decode path and the general one
# naming -> (tiny target config, layer 0's prefix, its own tensor names beside the decoder layer)
NAMINGS = {
    "mimo": ("qwen2_bias", "model.mtp_layers.0."),
    "deepseek": ("llama", f"model.layers.{TINY_CONFIGS['llama']['num_hidden_layers']}."),
}


@pytest.fixture(scope="module", params=sorted(NAMINGS))
def case(request, tmp_path_factory):
    """(naming, target_hf, its directory with MTP layers, the MTP tensors)."""
    naming = request.param
    target_hf = make_hf_model(NAMINGS[naming][0])
    tensors = mtp_tensors(naming, target_hf)
    path = write_mtp_target(target_hf, tmp_path_factory.mktemp(naming), naming, tensors)
    return naming, target_hf, path, tensors


# --- The reference, from the published equations (nothing from specdec) ---------------------


def _rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    """[T, H, d] rotated by RoPE at `positions` (HF's rotate-half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.cat([positions[:, None].float() * inv_freq[None]] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * angles.cos() + rotated * angles.sin()


def theta_of(cfg):
    """The RoPE base of a transformers config (transformers 5 keeps it in rope_parameters)."""
    parameters = getattr(cfg, "rope_parameters", None) or {}
    return parameters.get("rope_theta") or cfg.rope_theta


def _decoder_layer(w, p, x, cfg):
    """One pre-norm decoder layer (Llama / Qwen2, biases where stored) over the causal x [T, D]."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = x.shape[-1] // heads

    def linear(name, h):
        out = h @ w[f"{p}{name}.weight"].T
        bias = w.get(f"{p}{name}.bias")
        return out if bias is None else out + bias

    h = _rms(x, w[p + "input_layernorm.weight"])
    positions, theta = torch.arange(x.shape[0]), theta_of(cfg)
    q = _rope(linear("self_attn.q_proj", h).view(-1, heads, d), positions, theta)
    k = _rope(linear("self_attn.k_proj", h).view(-1, kv_heads, d), positions, theta)
    v = linear("self_attn.v_proj", h).view(-1, kv_heads, d)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    n = x.shape[0]
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, heads * d)
    x = x + linear("self_attn.o_proj", attn)
    h = _rms(x, w[p + "post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(linear("mlp.gate_proj", h)) * linear("mlp.up_proj", h)
    return x + linear("mlp.down_proj", mlp)


def _mtp_layer(naming, w, k, cfg, hidden, tokens, table, swap=False):
    """MTP layer k over E entries (hidden [E, D], the token each entry reads): (its outputs o
    [E, D], o normed [E, D], the layer's own LM head [V, D] or None)."""
    p, mimo = _prefix(naming, k), naming == "mimo"
    names = (
        ("token_layernorm", "hidden_layernorm", "input_proj")
        if mimo
        else ("enorm", "hnorm", "eh_proj")
    )
    e = _rms(table[torch.tensor(tokens)], w[f"{p}{names[0]}.weight"])
    h = _rms(hidden, w[f"{p}{names[1]}.weight"])
    pair = (h, e) if mimo != swap else (e, h)
    out = _decoder_layer(w, p, torch.cat(pair, -1) @ w[f"{p}{names[2]}.weight"].T, cfg)
    normed = _rms(out, w[p + ("final_layernorm.weight" if mimo else "shared_head.norm.weight")])
    return out, normed, w.get(p + "shared_head.head.weight")  # (MiMo: the target's LM head)


def reference_draft_logits(
    naming,
    w,
    target_hf,
    tokens,
    anchor,
    drafts,
    *,
    num_layers=1,
    swap=False,
    other_hidden=False,
    other_chain=False,
):
    """[len(drafts), V] draft logits of a round anchored at `anchor` that proposed `drafts`,
    from a chain of the first `num_layers` MTP layers, every layer run over the whole round's
    sequence (tokens[:anchor] + drafts) as in training (DeepSeek-V3 section 2.2):

    layer 0, entry i (0..A-2): the target's hidden state at i and the token at i + 1;
    layer k, entry i: layer k - 1's chained output at entry i and the token at i + k + 1;
    draft k < num_layers: layer k's entry A-2; draft k >= num_layers: the last layer's entry
    A-2 + (k - num_layers + 1), fed its own chained output at the entry before.

    MiMo:     o = final_layernorm(layer(input_proj(cat(hidden_layernorm(h), token_layernorm(e)))))
              logits = lm_head(o); the chain reads o.
    DeepSeek: o = layer(eh_proj(cat(enorm(e), hnorm(h)))); logits = shared_head.head(
              shared_head.norm(o)) of the layer; the chain reads o.
    Controls: `swap` the concatenation order, `other_hidden` the target's hidden state on the
    other side of its final norm, `other_chain` the other output (normed / unnormed) fed back.
    """
    cfg, mimo = target_hf.config, naming == "mimo"
    table = target_hf.model.embed_tokens.weight
    sequence = list(tokens[:anchor]) + [int(d) for d in drafts]
    hidden = target_hidden(target_hf, tokens[: anchor - 1], (not mimo) != other_hidden)
    logits = []
    with torch.no_grad():
        for k in range(len(drafts)):
            layer = min(k, num_layers - 1)
            count = hidden.shape[0]  # entries 0 .. count - 1
            reads = sequence[layer + 1 : layer + 1 + count]  # entry i: the token at i + layer + 1
            out, normed, lm_head = _mtp_layer(naming, w, layer, cfg, hidden, reads, table, swap)
            lm_head = target_hf.lm_head.weight if lm_head is None else lm_head
            logits.append(normed[-1] @ lm_head.T)
            chained = normed if mimo != other_chain else out
            # The next layer reads this one at every entry; the last layer feeds itself.
            last = k + 1 >= num_layers
            hidden = torch.cat([hidden, chained[-1:]]) if last else chained
    return torch.stack(logits)


# --- Our drafter ------------------------------------------------------------------------------


def propose(target_dir, model=None, k=3, plain_path=False, mtp_layers="all"):
    """The "mtp" drafter (built through the registry, `model` the target's own directory by
    default), fed the target's features, proposes k sampled drafts (temperature 1) for TOKENS
    at ANCHORS."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(
        method="mtp",
        model=str(model or target_dir),
        num_speculative_tokens=k,
        mtp_layers=mtp_layers,
    )
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    if plain_path:
        drafter._graphs = None  # the general paged path, not the graphs' static buffers
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    batch = draft_batch(TOKENS, ANCHORS, ids, k, ["standard", "coupled", "block"])
    return drafter, drafter.propose(batch)


# float32 against float32 through other operation orders (as the EAGLE-1/2 test); the
# controls below differ by more than 1e-3.
REFERENCE_RTOL = 5e-5
# Chains (2 and 3 layers, K = n + 2) measured at 4e-7 .. 1.1e-6 of the scale in float32; the
# one-layer drafter against the chain's reference (the negative control) differs by > 0.9.
CHAIN_RTOL = 1e-5


def relative_error(got, want):
    """[K] max |got - want| of each draft's logits over their largest |want|."""
    return (got - want).abs().amax(-1) / want.abs().amax(-1)


@pytest.mark.parametrize("plain_path", [False, True])
def test_draft_logits_match_the_reference(case, plain_path):
    naming, target_hf, path, tensors = case
    drafter, proposal = propose(path, plain_path=plain_path)
    layout = drafter.head.config.layout
    assert layout.hidden_first == (naming == "mimo") and drafter.head.lm_head is None
    for b, (tokens, anchor) in enumerate(zip(TOKENS, ANCHORS, strict=True)):
        drafts = proposal.draft_token_ids[b].tolist()
        want = reference_draft_logits(naming, tensors, target_hf, tokens, anchor, drafts)
        assert relative_error(proposal.draft_logits[b], want).max() < REFERENCE_RTOL


@pytest.mark.parametrize("variant", ["swap", "other_hidden", "other_chain"])
def test_a_reference_wired_otherwise_does_not_match(case, variant):
    """Negative controls: the comparison has the power to see each wiring choice (the
    concatenation order, which hidden state, which output the chain reads)."""
    naming, target_hf, path, tensors = case
    _, proposal = propose(path)
    drafts = proposal.draft_token_ids[2].tolist()
    want = reference_draft_logits(
        naming, tensors, target_hf, TOKENS[2], ANCHORS[2], drafts, **{variant: True}
    )
    assert relative_error(proposal.draft_logits[2], want).max() > 1e-3


def test_a_lm_head_of_its_own(tmp_path):
    """DeepSeek-V3 naming with a shared_head.head that is not the target's LM head (the
    layer's own, used)."""
    target_hf = make_hf_model("llama")
    tensors = mtp_tensors("deepseek", target_hf)
    own = 0.15 * torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(8))
    tensors[_prefix("deepseek") + "shared_head.head.weight"] = own
    path = write_mtp_target(target_hf, tmp_path / "t", "deepseek", tensors)
    drafter, proposal = propose(path)
    assert drafter.head.lm_head is not None
    drafts = proposal.draft_token_ids[1].tolist()
    want = reference_draft_logits("deepseek", tensors, target_hf, TOKENS[1], ANCHORS[1], drafts)
    assert relative_error(proposal.draft_logits[1], want).max() < REFERENCE_RTOL


# --- Chains of several MTP layers (`drafters.mtp_chain`) ---------------------------------------


@pytest.fixture(scope="module", params=[(n, k) for n in sorted(NAMINGS) for k in (2, 3)])
def chain_case(request, tmp_path_factory):
    """(naming, target_hf, its directory with `num_layers` MTP layers, the MTP tensors,
    num_layers); DeepSeek-V3's layer 1 with a LM head of its own (its shared_head.head)."""
    naming, num_layers = request.param
    target_hf = make_hf_model(NAMINGS[naming][0])
    tensors = mtp_tensors(naming, target_hf, seed=40, num_layers=num_layers)
    if naming == "deepseek":
        own = 0.15 * torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(9))
        tensors[_prefix(naming, 1) + "shared_head.head.weight"] = own
    directory = tmp_path_factory.mktemp(f"{naming}-{num_layers}")
    path = write_mtp_target(target_hf, directory, naming, tensors, num_layers=num_layers)
    return naming, target_hf, path, tensors, num_layers


def test_chain_draft_logits_match_the_reference(chain_case):
    """Draft k from layer min(k, n - 1), each layer over the round's whole sequence, for
    K = n + 2 > n drafts (the last layer drafting past its position twice)."""
    naming, target_hf, path, tensors, num_layers = chain_case
    k = num_layers + 2
    drafter, proposal = propose(path, k=k)
    assert type(drafter).__name__ == "MtpChainDrafter" and len(drafter.heads) == num_layers
    for b, (tokens, anchor) in enumerate(zip(TOKENS, ANCHORS, strict=True)):
        drafts = proposal.draft_token_ids[b].tolist()
        want = reference_draft_logits(
            naming, tensors, target_hf, tokens, anchor, drafts, num_layers=num_layers
        )
        assert relative_error(proposal.draft_logits[b], want).max() < CHAIN_RTOL


def test_chain_layers_catch_up_after_a_round(chain_case):
    """A second round, 3 tokens later (the first round's drafts not the sequence's tokens):
    each layer's history entries are caught up across rounds and the entries the first
    round's drafts wrote are rewritten, so the logits again equal the reference. Power: a
    drafter that stops catching layers >= 1 up after their first round fails this test (all
    four cases) and passes the one-round test above (checked by hand, not kept)."""
    naming, target_hf, path, tensors, num_layers = chain_case
    k, later = num_layers + 1, [a + 3 for a in ANCHORS]
    target = load_model(path).model
    spec = SpeculativeConfig(method="mtp", model=str(path), num_speculative_tokens=k)
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(spec, target, setup)
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    drafter.propose(draft_batch(TOKENS, ANCHORS, ids, k, ["standard"] * 3))
    rows = [
        target_features(target, drafter, tokens[: end - 1])[start - 1 :]
        for tokens, start, end in zip(TOKENS, ANCHORS, later, strict=True)
    ]
    drafter.observe(TargetFeatures(ids, [a - 1 for a in ANCHORS], rows))
    proposal = drafter.propose(draft_batch(TOKENS, later, ids, k, ["standard"] * 3))
    for b, (tokens, anchor) in enumerate(zip(TOKENS, later, strict=True)):
        drafts = proposal.draft_token_ids[b].tolist()
        want = reference_draft_logits(
            naming, tensors, target_hf, tokens, anchor, drafts, num_layers=num_layers
        )
        assert relative_error(proposal.draft_logits[b], want).max() < CHAIN_RTOL


def target_features(target, drafter, tokens):
    """[len(tokens), F] the target's features of `tokens` (one prefill in a fresh cache)."""
    kv = target.allocate_kv_cache(-(-len(tokens) // 4), 4)
    attn = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(kv.num_blocks))], 4)
    with torch.inference_mode():
        _, layers = target.forward_with_layers(
            torch.tensor(tokens), torch.arange(len(tokens)), attn, kv, drafter.feature_layers
        )
    return torch.cat(layers, dim=-1)


def test_negative_control_layer_0_for_every_position(chain_case):
    """The chain test has power: `mtp_layers: 1` on the same checkpoint (layer 0 drafts every
    position, as before chains) equals the one-layer reference, and differs from the chain's
    reference (by > 1e-3) at every position k >= 1, equal at position 0."""
    naming, target_hf, path, tensors, num_layers = chain_case
    k = num_layers + 1
    drafter, proposal = propose(path, k=k, mtp_layers=1)
    assert type(drafter).__name__ == "EagleDrafter"
    drafts = proposal.draft_token_ids[2].tolist()
    chain = reference_draft_logits(
        naming, tensors, target_hf, TOKENS[2], ANCHORS[2], drafts, num_layers=num_layers
    )
    one = reference_draft_logits(naming, tensors, target_hf, TOKENS[2], ANCHORS[2], drafts)
    assert relative_error(proposal.draft_logits[2], one).max() < REFERENCE_RTOL
    errors = relative_error(proposal.draft_logits[2], chain)
    assert errors[0] < REFERENCE_RTOL and errors[1:].min() > 1e-3, errors


@pytest.mark.parametrize(
    ("naming", "drop", "named"),
    [
        ("mimo", "input_proj.weight", "missing tensor 'model.mtp_layers.1.input_proj.weight'"),
        ("mimo", "mlp.up_proj.weight", "missing tensor 'model.mtp_layers.1.mlp.up_proj.weight'"),
        ("deepseek", "hnorm.weight", "missing tensor 'model.layers.4.hnorm.weight'"),
        ("deepseek", "shared_head.norm.weight", "'model.layers.4.shared_head.norm.weight'"),
    ],
)
def test_a_chained_layer_missing_a_tensor_is_refused_by_name(tmp_path, naming, drop, named):
    target_hf = make_hf_model(NAMINGS[naming][0])
    tensors = mtp_tensors(naming, target_hf, num_layers=2)
    del tensors[_prefix(naming, 1) + drop]
    path = write_mtp_target(target_hf, tmp_path / "bad", naming, tensors, num_layers=2, shards=1)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        propose(path)
    propose(path, mtp_layers=1)  # layer 0 alone is whole


def test_mtp_layers_refused_by_name(tmp_path):
    """`mtp_layers` other than "all" or an int >= 1, on another method, above the layers
    stored, and a tree over several layers: each refused naming the key."""
    for bad in (0, "two", True, 1.0):
        with pytest.raises(ValueError, match=r"speculative_config\.mtp_layers must be"):
            SpeculativeConfig(method="mtp", mtp_layers=bad)
    with pytest.raises(ValueError, match='mtp_layers applies to method "mtp"'):
        SpeculativeConfig(method="eagle", model="x", mtp_layers=1)
    target_hf = make_hf_model("llama")
    tensors = mtp_tensors("deepseek", target_hf, num_layers=2)
    path = write_mtp_target(target_hf, tmp_path / "t", "deepseek", tensors, num_layers=2)
    with pytest.raises(ValueError, match=r"mtp_layers 3: .* has 2 MTP layers"):
        propose(path, mtp_layers=3)
    with pytest.raises(ValueError, match='set "mtp_layers": 1'):
        LLM(str(path), speculative_config=_spec(tree={"nodes": 4, "depth": 2, "topk": 2}), **COMMON)
    LLM(
        str(path),
        speculative_config=_spec(tree={"nodes": 4, "depth": 2, "topk": 2}, mtp_layers=1),
        **COMMON,
    )


def test_layer_count_from_the_tensors_without_a_config_count(tmp_path):
    """Without `num_nextn_predict_layers` the layers stored are counted (MiMo: model.mtp_layers.k;
    DeepSeek-V3: consecutive model.layers.N + k with its MTP tensors), and `mtp_cache_layers`
    (the caches the drafter keeps) says as many."""
    for naming in sorted(NAMINGS):
        target_hf = make_hf_model(NAMINGS[naming][0])
        tensors = mtp_tensors(naming, target_hf, num_layers=3)
        path = write_mtp_target(target_hf, tmp_path / naming, naming, tensors, num_layers=3)
        config = json.loads((path / "config.json").read_text())
        del config["num_nextn_predict_layers"]
        (path / "config.json").write_text(json.dumps(config))
        drafter, _ = propose(path, k=1)
        assert len(drafter.heads) == 3, naming
        assert mtp_cache_layers(str(path)) == 3 and mtp_cache_layers(str(path), 2) == 2
    assert mtp_cache_layers(None) == 1
    assert mtp_cache_layers(str(save_hf_model(make_hf_model("llama"), tmp_path / "plain"))) == 1


COMMON = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16}


def _spec(**extra):
    """ "mtp" with no `model`: the engine reads the MTP layers of the target's own files."""
    return {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False, **extra}


@pytest.mark.parametrize("tree", [None, {"nodes": 4, "depth": 2, "topk": 2}])
def test_greedy_speculation_equals_greedy_plain(case, tree):
    _, _, path, _ = case
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, drafted, llm = plain_and_speculative_tokens(
        path, _spec(tree=tree), prompts, params, **COMMON
    )
    assert drafted == plain
    assert llm.get_metrics()["num_drafts"] > 0


def test_sampled_speculation_equals_plain_sampling(case):
    """The default verifier (coupled) emits plain sampling's tokens for the same seeds."""
    _, _, path, _ = case
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=5)
    params = [
        SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)
    ]
    plain, drafted, llm = plain_and_speculative_tokens(path, _spec(), prompts, params, **COMMON)
    assert drafted == plain
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_device_rounds_emit_what_the_synchronous_step_emits(case):
    """Through device rounds (`async_scheduling`; op by op on the CPU) the MTP drafter emits
    what the synchronous step emits, K pinned (standard verification, sampled)."""
    _, _, path, _ = case
    spec = SpeculativeConfig.from_dict(_spec(rejection_sample_method="standard"))
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=8)
    finals, engine = finals_sync_then_async(
        path,
        spec,
        prompts,
        lambda i: SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=30 + i),
    )
    assert finals[0] == finals[1]
    assert engine.loop_stats.num_device_rounds > 0


def test_chain_greedy_speculation_equals_greedy_plain(chain_case):
    """Through `LLM.generate`, K = 4 > n: greedy speculation emits greedy plain decoding's
    tokens (whatever the chain drafts), and rounds draft."""
    _, _, path, _, _ = chain_case
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = _spec(num_speculative_tokens=4)
    plain, drafted, llm = plain_and_speculative_tokens(path, spec, prompts, params, **COMMON)
    assert drafted == plain
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_chain_sampled_speculation_equals_plain_sampling(chain_case):
    """The default verifier (coupled) through the chain emits plain sampling's tokens."""
    _, _, path, _, _ = chain_case
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=5)
    params = [
        SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)
    ]
    spec = _spec(num_speculative_tokens=4)
    plain, drafted, llm = plain_and_speculative_tokens(path, spec, prompts, params, **COMMON)
    assert drafted == plain
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_chain_with_async_scheduling_runs_synchronous_rounds(chain_case):
    """A chain has no device rounds: with `async_scheduling` the engine runs its rounds
    synchronously and emits what the synchronous step emits (standard, sampled, K pinned)."""
    _, _, path, _, _ = chain_case
    spec = SpeculativeConfig.from_dict(_spec(rejection_sample_method="standard"))
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=8)
    finals, engine = finals_sync_then_async(
        path,
        spec,
        prompts,
        lambda i: SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=30 + i),
    )
    assert finals[0] == finals[1]
    assert engine.loop_stats.num_device_rounds == 0


@pytest.mark.parametrize(
    ("naming", "change", "named"),
    [
        ("mimo", "drop input_proj.weight", "missing tensor 'model.mtp_layers.0.input_proj.weight'"),
        ("mimo", "reshape self_attn.q_proj.bias", "'model.mtp_layers.0.self_attn.q_proj.bias' has"),
        ("mimo", "add mlp.experts.0.w1.weight", "does not define: 'model.mtp_layers.0.mlp.exp"),
        ("deepseek", "drop hnorm.weight", "missing tensor 'model.layers.3.hnorm.weight'"),
        ("deepseek", "reshape eh_proj.weight", "'model.layers.3.eh_proj.weight' has shape"),
        ("deepseek", "drop shared_head.head.weight", "'model.layers.3.shared_head.head.weight'"),
    ],
)
def test_bad_tensors_are_refused_by_name(tmp_path, naming, change, named):
    action, name = change.split()
    target_hf = make_hf_model(NAMINGS[naming][0])
    tensors = mtp_tensors(naming, target_hf)
    name = _prefix(naming) + name
    if action == "drop":
        del tensors[name]
    elif action == "reshape":
        tensors[name] = tensors[name][..., :-1].clone()
    else:
        tensors[name] = torch.ones(4, HIDDEN)
    path = write_mtp_target(target_hf, tmp_path / "bad", naming, tensors, shards=1)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        propose(path)


def test_the_engine_sizes_one_cache_layer_per_chained_layer(chain_case):
    """The KV budget counts the caches the chain allocates: n layers ("all"), m with
    `mtp_layers: m`; one for a head directory."""
    from specdec.drafters.config import SpeculativeConfig
    from specdec.engine.setup import draft_cache_layers

    _, _, path, _, num_layers = chain_case
    spec = SpeculativeConfig.from_dict({**_spec(), "model": str(path)})
    assert draft_cache_layers(spec, None) == num_layers
    one = SpeculativeConfig.from_dict({**_spec(), "model": str(path), "mtp_layers": 1})
    assert draft_cache_layers(one, None) == 1


def test_a_windowed_target_is_refused_by_name(tmp_path):
    """The MTP head attends eagerly with no window: a target with sliding-window attention is
    refused naming it (its decode path, which has the window, would disagree with the head's
    catch-up)."""
    target_hf = make_hf_model("mistral_window")
    tensors = mtp_tensors("deepseek", target_hf)
    path = write_mtp_target(target_hf, tmp_path / "windowed", "deepseek", tensors)
    with pytest.raises(ValueError, match="sliding-window attention") as err:
        LLM(str(path), speculative_config=_spec(), **COMMON)
    assert "\n" not in str(err.value)


def test_a_target_without_mtp_layers_is_refused_in_one_line(tmp_path):
    path = save_hf_model(make_hf_model("llama"), tmp_path / "plain")
    with pytest.raises(ValueError, match="has no MTP layers") as err:
        LLM(str(path), speculative_config=_spec(), **COMMON)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not a file"):
        propose(path, model=path / "model.safetensors")


# --- The engine's law through the MTP drafter (the vocabulary-8 target of the law tests) -------

LAW_TOKENS, LAW_TRIALS, LOG10_ALPHA = 3, 12_000, -6


@pytest.fixture(scope="module")
def law_target(tmp_path_factory):
    """The law tests' 3-layer vocabulary-8 Llama with a random DeepSeek-V3-named MTP layer
    (its drafts differ from the target's, so rounds both accept and reject)."""
    import transformers

    path = save_vocab8_target(tmp_path_factory.mktemp("vocab8-mtp"))
    target_hf = transformers.LlamaForCausalLM.from_pretrained(path)
    tensors = mtp_tensors("deepseek", target_hf, seed=5)
    return write_mtp_target(target_hf, path, "deepseek", tensors, shards=1)


def law_counts(path, method, temperature, k=2):
    spec = {"method": "mtp", "num_speculative_tokens": k, "rejection_sample_method": method}
    counts, metrics = first_token_counts(
        path, spec, temperature, LAW_TOKENS, LAW_TOKENS, LAW_TRIALS
    )
    assert metrics["num_accepted_tokens"] > 0
    return counts


@pytest.mark.stats
@pytest.mark.parametrize(
    "method", [pytest.param("standard", marks=pytest.mark.slow), "block", "coupled"]
)
def test_first_tokens_follow_the_target(law_target, method):
    """H0: with the MTP drafter (sampled drafts), the engine's first 3 emitted tokens have the
    target's exact joint law. Statistic: Pearson chi-square over the 512 cells (cells expecting
    < 5 pooled), N = 12,000 seeded requests at temperature 0.7, K = 2; reject at p < 1e-6, so
    the false-failure rate is <= 1e-6 per case (3 cases; standard runs with the slow tests)."""
    law = exact_continuation_law(law_target, 0.7, LAW_TOKENS)
    result = chi_square(law_counts(law_target, method, 0.7), law)
    assert result.log10_p > LOG10_ALPHA, result.describe()


@pytest.mark.stats
def test_negative_control_verifier_given_the_raw_draft_distribution(law_target, monkeypatch):
    """The same test has power: it rejects (p < 1e-6) an engine whose verifier gets the MTP
    layer's raw logits instead of the temperature-processed ones its drafts were sampled from
    (temperature 1.6, where the two differ most)."""
    from specdec.drafters.base import Drafter

    real = Drafter.sample_draft

    def wrong_distribution(self, logits, rows, positions, batch):
        out = real(self, logits, rows, positions, batch)
        raw = self.to_target_vocab(logits)
        return SampleOutput(out.token_ids, raw, raw.logsumexp(dim=-1))

    monkeypatch.setattr(Drafter, "sample_draft", wrong_distribution)
    law = exact_continuation_law(law_target, 1.6, LAW_TOKENS)
    result = chi_square(law_counts(law_target, "standard", 1.6), law)
    assert result.log10_p < LOG10_ALPHA, result.describe()


@pytest.fixture(scope="module")
def law_chain_target(tmp_path_factory):
    """The law tests' vocabulary-8 Llama with two random DeepSeek-V3-named MTP layers (drafted
    by the chain: layer 0, layer 1, then layer 1 again at K = 3)."""
    import transformers

    path = save_vocab8_target(tmp_path_factory.mktemp("vocab8-mtp-chain"))
    target_hf = transformers.LlamaForCausalLM.from_pretrained(path)
    tensors = mtp_tensors("deepseek", target_hf, seed=6, num_layers=2)
    path = write_mtp_target(target_hf, path, "deepseek", tensors, num_layers=2, shards=1)
    target = load_model(path).model
    spec = SpeculativeConfig(method="mtp", model=str(path))
    setup = DrafterSetup(num_blocks=16, block_size=4, max_num_seqs=4, max_model_len=32)
    assert type(build_drafter(spec, target, setup)).__name__ == "MtpChainDrafter"
    return path


@pytest.mark.stats
@pytest.mark.parametrize("method", [pytest.param("standard", marks=pytest.mark.slow), "coupled"])
def test_chain_first_tokens_follow_the_target(law_chain_target, method):
    """H0: with a chain of 2 MTP layers (sampled drafts, K = 3 > 2), the engine's first 3
    emitted tokens have the target's exact joint law. Statistic: Pearson chi-square over the
    512 cells (cells expecting < 5 pooled), N = 12,000 seeded requests at temperature 0.7;
    reject at p < 1e-6, so the false-failure rate is <= 1e-6 per case (2 cases; standard runs
    with the slow tests)."""
    law = exact_continuation_law(law_chain_target, 0.7, LAW_TOKENS)
    result = chi_square(law_counts(law_chain_target, method, 0.7, k=3), law)
    assert result.log10_p > LOG10_ALPHA, result.describe()


@pytest.mark.stats
def test_negative_control_chain_verifier_given_the_raw_draft_distribution(
    law_chain_target, monkeypatch
):
    """The chain's law test has power: it rejects (p < 1e-6) an engine whose verifier gets
    the layers' raw logits instead of the temperature-processed ones the drafts were sampled
    from (temperature 1.6), K = 3 through the chain."""
    from specdec.drafters.base import Drafter

    real = Drafter.sample_draft

    def wrong_distribution(self, logits, rows, positions, batch):
        out = real(self, logits, rows, positions, batch)
        raw = self.to_target_vocab(logits)
        return SampleOutput(out.token_ids, raw, raw.logsumexp(dim=-1))

    monkeypatch.setattr(Drafter, "sample_draft", wrong_distribution)
    law = exact_continuation_law(law_chain_target, 1.6, LAW_TOKENS)
    result = chi_square(law_counts(law_chain_target, "standard", 1.6, k=3), law)
    assert result.log10_p < LOG10_ALPHA, result.describe()
