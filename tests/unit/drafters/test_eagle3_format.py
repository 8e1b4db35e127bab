"""EAGLE-3 checkpoints (SpecForge's / SGLang's `LlamaForCausalLMEagle3`, vLLM's
`Eagle3LlamaForCausalLM`, `speculators`' `Eagle3Speculator`) load into `Eagle3Head` and draft as
vLLM's and SGLang's llama_eagle3.py define it: the draft logits of a first step and of chained
steps equal those of a reference written here from the published equations (to 1e-5 of their
scale in float32); references wired otherwise (capture ids read one layer apart, d2t ignored,
the residual taken from the embedding or the normed hidden, the normed output fed back, the
embedding after the hidden) do not; speculation through `LLM` (methods "eagle3" and "eagle")
emits plain decoding's tokens, greedy and coupled-sampled; bad checkpoints are refused by name.

The target is `models_fixtures`' tiny Llama with 8 layers (`deep_target`): the default capture
points, the inputs of layers (2, N // 2, N - 3), need N >= 7.
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
)
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from public_drafter_fixtures import (
    EAGLE1_CONFIG,
    EAGLE3_DRAFT_VOCAB,
    deep_target,
    draft_vocabulary,
    eagle1_tensors,
    eagle3_config,
    eagle3_tensors,
    write_checkpoint,
)
from specdec.drafters import DrafterSetup
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.formats import EAGLE1, EAGLE3, DrafterCheckpoint, recognise_eagle
from specdec.drafters.registry import build_drafter
from specdec.engine.llm import LLM
from specdec.models import load_model
from specdec.models.weights import CheckpointError
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer")

VOCAB, HIDDEN = 97, 64
TOKENS = prompt_tokens(VOCAB, [30, 30, 30], seed=12)
ANCHORS = [6, 11, 25]  # 4, 9 and 23 entries: the fused decode path and the general one

# (config style, capture ids in the config, target layers whose outputs they name, layer
# tensor prefix, norm_before_residual): SGLang's key read as SGLang does (id k: layer k's
# output); vLLM's key and speculators' read as vLLM does (layer k's input); no ids: the default
# inputs of layers (2, 4, 5).
CHECKPOINTS = {
    "specforge": ("specforge", [1, 3, 6], (1, 3, 6), "midlayer.", False),
    "speculators": ("speculators", [2, 4, 6], (1, 3, 5), "layers.0.", True),
    "vllm-default": ("vllm", None, (1, 3, 4), "midlayer.", False),
}


@pytest.fixture(scope="module")
def target_hf():
    return deep_target()


@pytest.fixture(scope="module")
def target_dir(target_hf, tmp_path_factory):
    return save_hf_model(target_hf, tmp_path_factory.mktemp("deep"))


@pytest.fixture(scope="module")
def heads(target_hf, tmp_path_factory):
    """name -> (directory, tensors, layers, prefix, norm_before_residual) of each CHECKPOINTS
    entry; the speculators head stores a copy of the target's table (as speculators saves
    it), the others none (as EAGLE's and SpecForge's heads ship)."""
    made = {}
    for name, (style, ids, layers, prefix, before) in CHECKPOINTS.items():
        table = target_hf.model.embed_tokens.weight if style == "speculators" else None
        tensors = eagle3_tensors(prefix, seed=11 + len(made), embedding=table)
        extra = {"norm_before_residual": True} if before else {}
        config = eagle3_config(style, ids, **extra)
        path = write_checkpoint(tmp_path_factory.mktemp(name), config, tensors)
        made[name] = (path, tensors, layers, prefix, before)
    return made


# --- The reference: EAGLE-3's head from its equations (nothing from specdec) -------------------

EPS, THETA, HEADS, KV_HEADS, HEAD_DIM = 1e-6, 10000.0, 4, 2, 16


def _rms(x, weight, eps=EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions):
    """[T, H, d] rotated by RoPE at `positions` (HF Llama's rotate-half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.cat([positions[:, None].float() * inv_freq[None]] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * angles.cos() + rotated * angles.sin()


def _midlayer(w, p, embeds, hidden, residual, embed_first):
    """EAGLE-3's decoder layer over the causal sequence: attention over
    [input_layernorm(embeds), hidden_norm(hidden)] with q/k/v 2D wide, the residual `residual`
    ("hidden", as vLLM and SGLang wire it; "normed": norm_before_residual; "embedding": a wrong
    variant), then the MLP block. [T, D] each -> [T, D]."""
    e = _rms(embeds, w[p + "input_layernorm.weight"])
    h = _rms(hidden, w[p + "hidden_norm.weight"])
    u = torch.cat((e, h) if embed_first else (h, e), -1)
    n = u.shape[0]
    positions = torch.arange(n)
    q = _rope((u @ w[p + "self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = _rope((u @ w[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (u @ w[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
    start = {"hidden": hidden, "normed": h, "embedding": embeds}[residual]
    x = start + attn @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(x, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def layer_outputs(target_hf, tokens):
    """[L] of [T, D]: the target's residual stream after each decoder layer (before the final
    norm), read with forward hooks."""
    captured = []
    hooks = [
        layer.register_forward_hook(
            lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out)
        )
        for layer in target_hf.model.layers
    ]
    with torch.no_grad():
        target_hf.model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return [out[0] for out in captured]


def reference_draft_logits(
    weights,
    target_hf,
    tokens,
    anchor,
    drafts,
    layers,
    prefix,
    *,
    residual="hidden",
    use_d2t=True,
    feed_back="prenorm",
    embed_first=True,
    table=None,
    use_bias=True,
):
    """[len(drafts), V] EAGLE-3 draft logits (target vocabulary, -inf off the draft one) of a
    round anchored at `anchor` that proposed `drafts`: entries t = 0 .. anchor - 2 join
    fc(the outputs of target `layers` at t) with the token at t + 1; draft i > 0 comes from an
    entry of the head's previous output (before `norm`; `feed_back="normed"`: after it, a wrong
    variant) and draft i - 1."""
    table = target_hf.model.embed_tokens.weight if table is None else table
    outputs = layer_outputs(target_hf, tokens[: anchor - 1])
    features = torch.cat([outputs[i] for i in layers], -1)
    projected = features @ weights["fc.weight"].T
    if use_bias and "fc.bias" in weights:
        projected = projected + weights["fc.bias"]
    hidden = list(projected)
    inputs = list(tokens[1:anchor])
    draft_ids = torch.arange(EAGLE3_DRAFT_VOCAB)
    if use_d2t:
        draft_ids = draft_ids + weights["d2t"]
    logits = []
    with torch.no_grad():
        for draft in drafts:
            embeds = table[torch.tensor(inputs)]
            out = _midlayer(weights, prefix, embeds, torch.stack(hidden), residual, embed_first)
            normed = _rms(out[-1], weights["norm.weight"])
            row = torch.full((VOCAB,), float("-inf"))
            row[draft_ids] = normed @ weights["lm_head.weight"].T
            logits.append(row)
            hidden.append(out[-1] if feed_back == "prenorm" else normed)
            inputs.append(int(draft))
    return torch.stack(logits)


# --- Our drafter ------------------------------------------------------------------------------


def _setup(max_model_len=64):
    return DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=max_model_len)


def propose(target_dir, head_dir, k=3, plain_path=False, method="eagle3"):
    """The drafter of `head_dir` (built through the registry), fed the target's features,
    proposes k sampled drafts (temperature 1: processed logits are the raw ones) for TOKENS at
    ANCHORS."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method=method, model=str(head_dir), num_speculative_tokens=k)
    drafter = build_drafter(spec, target, _setup())
    if plain_path:
        drafter._graphs = None  # the general paged path, not the graphs' static buffers
    ids = observe_prefixes(drafter, target, TOKENS, ANCHORS)
    batch = draft_batch(TOKENS, ANCHORS, ids, k, ["standard", "coupled", "block"])
    return drafter, drafter.propose(batch)


def relative_error(got, want):
    """[K] max |got - want| of each draft's logits over their largest |want| (finite entries;
    inf where the two disagree on which entries are -inf, i.e. on the draft vocabulary)."""
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return torch.full(want.shape[:-1], float("inf"))
    diff = torch.where(finite, got - want, 0.0).abs().amax(-1)
    return diff / torch.where(finite, want, 0.0).abs().amax(-1)


def assert_matches_reference(proposal, weights, target_hf, layers, prefix, **variant):
    for b, (tokens, anchor) in enumerate(zip(TOKENS, ANCHORS, strict=True)):
        drafts = proposal.draft_token_ids[b].tolist()
        want = reference_draft_logits(
            weights, target_hf, tokens, anchor, drafts, layers, prefix, **variant
        )
        assert relative_error(proposal.draft_logits[b], want).max() < 1e-5


def test_recognised_in_each_style(heads, tmp_path):
    for path, *_ in heads.values():
        assert recognise_eagle(DrafterCheckpoint(path)) == EAGLE3
    eagle1 = write_checkpoint(tmp_path / "eagle1", EAGLE1_CONFIG, eagle1_tensors())
    assert recognise_eagle(DrafterCheckpoint(eagle1)) == EAGLE1  # fc + layers.0.*, no hidden_norm


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("plain_path", [False, True])
def test_draft_logits_match_the_reference(target_dir, target_hf, heads, name, plain_path):
    """First steps (the catch-up's last entry) and two chained steps, per request."""
    path, weights, layers, prefix, before = heads[name]
    drafter, proposal = propose(target_dir, path, plain_path=plain_path)
    assert drafter.feature_layers == layers
    assert drafter.head.config.norm_before_residual == before
    assert drafter.embed is not drafter.head.embed_tokens  # no table, or the target's copy
    assert torch.equal(drafter.draft_to_target, draft_vocabulary())
    residual = "normed" if before else "hidden"
    assert_matches_reference(proposal, weights, target_hf, layers, prefix, residual=residual)


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        ("specforge", {"layers": (0, 2, 5)}),  # SGLang's ids read as vLLM reads (one apart)
        ("speculators", {"layers": (2, 4, 6)}),  # vLLM's ids read as SGLang reads
        ("specforge", {"use_d2t": False}),  # draft id taken as the target id
        ("specforge", {"residual": "embedding"}),  # the residual from the embedding
        ("specforge", {"residual": "normed"}),  # norm_before_residual where it is off
        ("speculators", {"residual": "hidden"}),  # ... and not where it is on
        ("specforge", {"feed_back": "normed"}),  # the normed output fed to the next step
        ("specforge", {"embed_first": False}),  # [hidden_norm(h), input_layernorm(e)]
    ],
)
def test_a_reference_wired_otherwise_does_not_match(target_dir, target_hf, heads, name, variant):
    """Negative controls: the comparison has the power to see each wiring choice (request 2:
    23 entries, three drafts; `feed_back` only shows from the second draft on)."""
    path, weights, layers, prefix, before = heads[name]
    _, proposal = propose(target_dir, path)
    settings = {"layers": layers, "residual": "normed" if before else "hidden", **variant}
    drafts = proposal.draft_token_ids[2].tolist()
    want = reference_draft_logits(
        weights, target_hf, TOKENS[2], ANCHORS[2], drafts, prefix=prefix, **settings
    )
    assert relative_error(proposal.draft_logits[2], want).max() > 1e-3


def test_a_table_of_its_own_and_fc_bias(target_dir, target_hf, tmp_path):
    """A stored embedding that is not the target's is the head's own (vLLM and SGLang load
    it), and a stored fc.bias is added (SGLang's `bias`, older speculators heads)."""
    table = 0.15 * torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(4))
    weights = eagle3_tensors(seed=21, fc_bias=True, embedding=table)
    head_dir = write_checkpoint(tmp_path / "own", eagle3_config("specforge", [1, 3, 6]), weights)
    drafter, proposal = propose(target_dir, head_dir, method="eagle")
    assert drafter.embed is drafter.head.embed_tokens and drafter.head.fc.bias is not None
    layers, prefix = (1, 3, 6), "midlayer."
    assert_matches_reference(proposal, weights, target_hf, layers, prefix, table=table)
    drafts = proposal.draft_token_ids[2].tolist()
    for variant in ({}, {"table": table, "use_bias": False}):  # (the controls)
        want = reference_draft_logits(
            weights, target_hf, TOKENS[2], ANCHORS[2], drafts, layers, prefix, **variant
        )
        assert relative_error(proposal.draft_logits[2], want).max() > 1e-3


# --- Through the engine -----------------------------------------------------------------------


def _spec(head_dir, method="eagle3", **extra):
    return {
        "method": method,
        "model": str(head_dir),
        "num_speculative_tokens": 3,
        "adaptive": False,  # every step drafts (the policy may choose K = 0 on the CPU)
        **extra,
    }


COMMON = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16}


@pytest.mark.parametrize(
    ("name", "method", "tree"),
    [
        ("specforge", "eagle3", None),
        ("speculators", "eagle", None),
        ("specforge", "eagle", {"nodes": 4, "depth": 2, "topk": 2}),
    ],
)
def test_greedy_speculation_equals_greedy_plain(target_dir, heads, name, method, tree):
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = _spec(heads[name][0], method, tree=tree)
    plain, drafted, llm = plain_and_speculative_tokens(target_dir, spec, prompts, params, **COMMON)
    assert drafted == plain
    assert llm.get_metrics()["num_drafts"] > 0


def test_sampled_speculation_equals_plain_sampling(target_dir, heads):
    """The default verifier (coupled) emits plain sampling's tokens for the same seeds."""
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=5)
    params = [
        SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)
    ]
    plain = LLM(str(target_dir), **COMMON).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(target_dir), speculative_config=_spec(heads["speculators"][0]), **COMMON)
    assert llm.engine.speculative_config.rejection_sample_method == "coupled"
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize(("method", "temperature"), [("standard", 1.0), ("coupled", 0.0)])
def test_device_rounds_emit_what_the_synchronous_step_emits(target_dir, heads, method, temperature):
    """The EAGLE-3 head through device rounds (`async_scheduling`; op by op on the CPU, over
    the buffers CUDA graphs replay) emits what the synchronous step emits, K pinned."""
    head_dir = heads["specforge"][0]
    spec = SpeculativeConfig.from_dict(_spec(head_dir, rejection_sample_method=method))
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


def test_int8_target(target_dir, heads):
    """Beside an int8 target the head's linears go int8 too (its own LM head stays float):
    greedy speculation still emits plain decoding's tokens."""
    prompts = prompt_tokens(VOCAB, [5, 9], seed=6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = {**COMMON, "quantization": "int8"}
    plain, drafted, llm = plain_and_speculative_tokens(
        target_dir, _spec(heads["specforge"][0]), prompts, params, **common
    )
    assert drafted == plain
    assert llm.get_metrics()["num_drafts"] > 0


# --- Refusals ---------------------------------------------------------------------------------


def _load(target_dir, head_dir, method="eagle3"):
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method=method, model=str(head_dir))
    return build_drafter(spec, target, _setup(32))


def _bad(weights, change):
    action, name = change.split()
    weights = dict(weights)
    if action == "drop":
        del weights[name]
    elif action == "reshape":
        weights[name] = weights[name][..., :-1]
    elif action == "add":
        weights[name] = torch.ones(HIDDEN)
    elif name == "d2t":  # "break d2t": two draft ids onto one target id
        weights["d2t"] = weights["d2t"].clone()
        weights["d2t"][1] = weights["d2t"][0] - 1
    else:  # "break t2d": a target id marked that no draft id maps to
        weights["t2d"] = weights["t2d"].clone()
        weights["t2d"][(~weights["t2d"]).nonzero()[0]] = True
    return weights


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("drop midlayer.hidden_norm.weight", "'midlayer.hidden_norm.weight'"),
        ("drop lm_head.weight", "'lm_head.weight'"),
        ("drop d2t", "missing tensor 'd2t'"),
        ("reshape fc.weight", "'fc.weight' has shape"),
        ("reshape midlayer.self_attn.q_proj.weight", "'midlayer.self_attn.q_proj.weight'"),
        ("reshape d2t", "'d2t' has shape"),
        ("reshape t2d", "'t2d' has shape"),
        ("break d2t", "'d2t' is not a one-to-one map"),
        ("break t2d", "'t2d' does not mark"),
        ("add midlayer.self_attn.q_norm.weight", "does not define: 'midlayer.self_attn.q_norm"),
        ("add layers.0.hidden_norm.weight", "both midlayer.* and layers.0.*"),
    ],
)
def test_bad_tensors_are_refused_by_name(target_dir, heads, tmp_path, change, named):
    weights = _bad(heads["specforge"][1], change)
    head_dir = write_checkpoint(tmp_path / "bad", eagle3_config("specforge", [1, 3, 6]), weights)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        _load(target_dir, head_dir)


@pytest.mark.parametrize(
    ("style", "ids", "extra", "named"),
    [
        ("vllm", [0, 3, 6], {}, "layer 0's input (the embedding output)"),
        ("specforge", [1, 3, 8], {}, "[8] out of range for a target of 8 layers"),
        ("speculators", [2, 3, 3], {}, "two ids name one layer"),
        ("specforge", [1, 3, 6], {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}, "different"),
        ("speculators", [2, 4, 6], {"norm_before_fc": True}, "['norm_before_fc']"),
        ("specforge", [1, 3, 6], {"num_hidden_layers": 2}, "2 layers"),
        ("specforge", [1, 3, 6], {"hidden_size": 32}, "hidden_size 32"),
        ("specforge", [1, 3, 6], {"tie_word_embeddings": True}, "tie_word_embeddings"),
        ("specforge", [1, 3, 6], {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "NTK"),
    ],
)
def test_configs_not_wired_are_refused(target_dir, heads, tmp_path, style, ids, extra, named):
    prefix = "layers.0." if style == "speculators" else "midlayer."
    weights = eagle3_tensors(prefix)
    head_dir = write_checkpoint(tmp_path / "bad", eagle3_config(style, ids, **extra), weights)
    with pytest.raises(ValueError, match=re.escape(named)):
        _load(target_dir, head_dir)


def test_a_shallow_target_has_no_default_capture_points(tmp_path):
    """The 3-layer tiny target: the default ids (2, 1, 0) name the embedding output."""
    target_dir = save_hf_model(make_hf_model("llama"), tmp_path / "tiny")
    head_dir = write_checkpoint(tmp_path / "head", eagle3_config("vllm"), eagle3_tensors())
    with pytest.raises(ValueError, match=re.escape("the default ids [2, 1, 0] names layer 0")):
        _load(target_dir, head_dir)


def test_method_eagle3_takes_eagle3_heads_only(target_dir, tmp_path):
    eagle1 = write_checkpoint(tmp_path / "eagle1", EAGLE1_CONFIG, eagle1_tensors())
    with pytest.raises(ValueError, match='use "eagle" for this one'):
        _load(target_dir, eagle1)
    with pytest.raises(ValueError, match='"eagle3" needs "model"'):
        SpeculativeConfig(method="eagle3")
