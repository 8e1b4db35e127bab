"""The EAGLE drafter: draft noise only through `sample_draft` at Q, on the method's stream and
round anchor; greedy speculation emits exactly what greedy plain decoding emits; a head directory
loads back with its reduced vocabulary."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from drafter_format_fixtures import cpu_draft_batch, observe_prefixes
from eagle_fixtures import tiny_target_and_head_fixtures, trained_head
from models_fixtures import prompt_tokens
from specdec.drafters import DrafterSetup
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.engine.config import SpeculativeConfig
from specdec.engine.llm import LLM
from specdec.models import load_model
from specdec.models.attention_tiles import decode_query_bucket
from specdec.rng import Stream
from specdec.sampling import SamplingParams, SamplingTensors
from specdec.sampling import sampler as sampler_module

VOCAB = 97

target_dir, head_dir = tiny_target_and_head_fixtures()


@pytest.fixture(scope="module")
def reduced_head_dir(target_dir, tmp_path_factory):
    return trained_head(target_dir, tmp_path_factory.mktemp("eagle-reduced"), 40, steps=5)


def fed_drafter(target_dir, head_dir, token_lists, anchors, greedy=False):
    """A drafter that has observed the target features of positions 0 .. anchor - 2."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(
        method="eagle",
        model=str(head_dir),
        draft_sample_method="greedy" if greedy else "probabilistic",
    )
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = EagleDrafter.from_config(spec, target, setup)
    drafter._graphs = None  # the plain path (tests that want the head buffers set their own)
    ids = observe_prefixes(drafter, target, token_lists, anchors)
    return drafter, ids


RAGGED_TOKENS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
RAGGED_ANCHORS = [6, 3, 8]


def ragged_batch(ids, num_draft):
    """The DraftBatch of RAGGED_TOKENS: one request per verify method, temperature 0.9."""
    methods = ["standard", "block", "coupled"]
    return cpu_draft_batch(
        RAGGED_TOKENS, RAGGED_ANCHORS, [11, -22, 33], num_draft, methods, 0.9, ids
    )


@pytest.fixture
def noise_calls(monkeypatch):
    calls = []
    real = sampler_module.gumbel

    def spy(seeds, positions, stream, num_lanes, *, step=0):
        callers = [frame.function for frame in inspect.stack()[1:8]]
        steps = step.tolist() if isinstance(step, torch.Tensor) else [step] * len(seeds)
        calls.append((seeds.tolist(), positions.tolist(), Stream(stream), steps, callers))
        return real(seeds, positions, stream, num_lanes, step=step)

    monkeypatch.setattr(sampler_module, "gumbel", spy)
    return calls


@pytest.mark.parametrize("reduced", [False, True])
def test_eagle_draws_only_through_sample_draft_at_q(
    target_dir, head_dir, reduced_head_dir, noise_calls, reduced
):
    anchors = RAGGED_ANCHORS
    drafter, ids = fed_drafter(
        target_dir, reduced_head_dir if reduced else head_dir, RAGGED_TOKENS, anchors
    )
    batch = ragged_batch(ids, [3, 2, 3])
    proposal = drafter.propose(batch)
    seen: dict[int, list[int]] = {}
    for call_seeds, positions, stream, steps, callers in noise_calls:
        assert "sample_draft" in callers
        for seed, position, step in zip(call_seeds, positions, steps, strict=True):
            row = batch.seeds.tolist().index(seed)
            coupled = batch.methods[row] == "coupled"
            assert stream == (Stream.TARGET if coupled else Stream.DRAFT)
            assert step == (0 if coupled else anchors[row])
            seen.setdefault(row, []).append(position)
    for b in range(3):
        n = int(batch.num_draft[b])
        assert sorted(seen[b]) == list(range(anchors[b], anchors[b] + n))  # draft i at Q = A + i
        for i in range(n):
            token = int(proposal.draft_token_ids[b, i])
            assert torch.isfinite(proposal.draft_logits[b, i, token])
            if reduced:  # -inf outside the draft vocabulary, which has 40 ids
                assert int(torch.isfinite(proposal.draft_logits[b, i]).sum()) <= 40


def test_greedy_eagle_draws_no_noise(target_dir, head_dir, noise_calls):
    from specdec.drafters import DraftBatch

    drafter, ids = fed_drafter(target_dir, head_dir, [[5, 6, 7, 8]], [4], greedy=True)
    batch = DraftBatch(
        token_ids=[[5, 6, 7, 8]],
        seeds=torch.tensor([1]),
        anchors=torch.tensor([4]),
        num_draft=torch.tensor([4]),
        methods=["standard"],
        params=SamplingTensors.build(1, torch.device("cpu"), 1.0),
        request_ids=ids,
    )
    proposal = drafter.propose(batch)
    assert proposal.draft_logits is None and (proposal.draft_token_ids >= 0).all()
    assert noise_calls == []


def test_head_directory_round_trip(head_dir, reduced_head_dir):
    config = json.loads((reduced_head_dir / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["feature_layers"] == [2]
    assert json.loads((head_dir / "config.json").read_text())["draft_vocab_size"] is None


@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_greedy_eagle_equals_greedy_plain(target_dir, head_dir, method):
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16}
    plain = LLM(str(target_dir), **common).generate(prompts, params, use_tqdm=False)
    spec = {
        "method": "eagle" if method != "block" else "mtp",
        "model": str(head_dir),
        "num_speculative_tokens": 3,
        "rejection_sample_method": method,
        "adaptive": False,  # every step drafts (the policy may choose K = 0 on the CPU)
    }
    llm = LLM(str(target_dir), speculative_config=spec, **common)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0


def test_training_unroll_matches_paged_inference(target_dir, head_dir):
    """The training-time-test unroll (dense, all entries at once) computes, for entry t and step
    j, exactly the head output the drafter computes on its paged cache when it drafts from entry
    t with the tokens x_{t+2} .. x_{t+j} fed back: the masks and positions agree."""
    from specdec.train.dense import causal_layer, chain_layer

    tokens = prompt_tokens(VOCAB, [12], seed=8)[0]
    anchor = 8  # the drafter has features of positions 0 .. 6, entry t = 6 drafts Q = 8
    drafter, ids = fed_drafter(target_dir, head_dir, [tokens], [anchor])
    head, state = drafter.head, drafter._states[ids[0]]
    drafter.allocator.grow(state, anchor + 2)
    feats = torch.cat(state.pending)
    with torch.inference_mode():
        out = drafter._step(
            head.project_features(feats),
            tokens[1:anchor],
            list(range(1, anchor)),
            [anchor - 1],
            [anchor - 1],
            [state],
        )
        paged = [out[-1]]
        for j in (2, 3):
            entry = anchor - 3 + j  # the entry drafting step j from base entry anchor - 2
            paged.append(
                drafter._step(
                    paged[-1][None], [tokens[entry + 1]], [entry + 1], [1], [entry + 1], [state]
                )[0]
            )
        # Dense unroll over the same entries 0 .. anchor - 2 (true tokens at every step).
        entries = anchor - 1
        embeds = drafter.embed(torch.tensor(tokens))[None]
        positions = torch.arange(entries)
        hidden = head.project_features(feats)[None]
        prefix, chain, dense = None, [], []
        for j in (1, 2, 3):
            emb = embeds[:, j : j + entries]
            cos, sin = head.rotary_emb(positions + j)
            x = head.layer_input(hidden, emb)
            if prefix is None:
                hidden, prefix = causal_layer(head.layer, x, cos, sin)
            else:
                hidden, kv = chain_layer(head.layer, x, cos, sin, prefix, chain)
                chain.append(kv)
            dense.append(hidden[0, anchor - 2])
    for got, want in zip(paged, dense, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_path_matches_general_path(target_dir, head_dir):
    """The fused decode path (ragged entries padded to a common width, then one entry per
    request) computes the head outputs and cache the general paged path computes."""
    token_lists = prompt_tokens(VOCAB, [14, 14], seed=5)
    anchors = [12, 9]
    drafter, ids = fed_drafter(target_dir, head_dir, token_lists, anchors)
    states = [drafter._states[i] for i in ids]
    feats = [drafter.head.project_features(torch.cat(s.pending)) for s in states]
    for state, anchor in zip(states, anchors, strict=True):
        drafter.allocator.grow(state, anchor + 2)
    done = [6, 7]  # entries fed by the general path first; then 4 and 1 more (ragged)
    new = [anchors[j] - 1 - done[j] for j in range(2)]
    with torch.inference_mode():
        drafter._step(
            torch.cat([f[:n] for f, n in zip(feats, done, strict=True)]),
            [t for toks, n in zip(token_lists, done, strict=True) for t in toks[1 : n + 1]],
            [p for n in done for p in range(1, n + 1)],
            done,
            done,
            states,
        )

        def general(hidden, first, counts):
            tokens = [
                t
                for toks, f, n in zip(token_lists, first, counts, strict=True)
                for t in toks[f : f + n]
            ]
            positions = [p for f, n in zip(first, counts, strict=True) for p in range(f, f + n)]
            context = [f - 1 + n for f, n in zip(first, counts, strict=True)]
            return drafter._step(hidden, tokens, positions, counts, context, states)

        def decode(rows, first, counts, width):
            hidden = torch.zeros(2 * width, rows[0].shape[-1])
            tokens = [0] * (2 * width)
            for j in range(2):
                hidden[j * width : j * width + counts[j]] = rows[j]
                tokens[j * width : j * width + counts[j]] = token_lists[j][
                    first[j] : first[j] + counts[j]
                ]
            out = drafter._decode_step(hidden, tokens, first, counts, states, width)
            return torch.cat([out[j * width : j * width + counts[j]] for j in range(2)])

        rows = [f[n : n + m] for f, n, m in zip(feats, done, new, strict=True)]
        first = [n + 1 for n in done]
        want = general(torch.cat(rows), first, new)
        cache = drafter.kv_cache.k_cache.clone()
        got = decode(rows, first, new, max(new))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(drafter.kv_cache.k_cache, cache, rtol=1e-5, atol=1e-5)
        # One entry per request (a draft step), fed with the previous outputs.
        last = [want[new[0] - 1 : new[0]], want[-1:]]
        first = anchors
        want = general(torch.cat(last), first, [1, 1])
        got = decode(last, first, [1, 1], 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_eager_catch_up_pads_to_the_query_bucket(target_dir, head_dir, monkeypatch) -> None:
    """The eager catch-up (no head graphs, or more new entries than they take: after plain-arm
    steps) pads its data-driven width to `decode_query_bucket`, so that the decode kernel
    (Q_PER_SEQ is a constexpr) compiles one variant per bucket, not per width; the drafts are
    those of the unpadded layout."""
    from specdec.drafters.eagle import drafter as drafter_module
    from specdec.models import decoder_layers

    widths = []
    attend = decoder_layers.paged_decode_attention

    def recording(query, k_cache, v_cache, meta, scale, **options):
        widths.append(meta.query_per_seq)
        return attend(query, k_cache, v_cache, meta, scale, **options)

    monkeypatch.setattr(decoder_layers, "paged_decode_attention", recording)
    proposals = []
    for bucketed in (True, False):
        if not bucketed:
            monkeypatch.setattr(drafter_module, "decode_query_bucket", lambda width, *_: width)
        drafter, ids = fed_drafter(target_dir, head_dir, RAGGED_TOKENS, RAGGED_ANCHORS)
        attn = drafter.head.layer.self_attn
        group = attn.num_heads // attn.num_kv_heads
        widths.clear()
        proposals.append(drafter.propose(ragged_batch(ids, [1, 1, 1])))  # the catch-up only
        entries = max(a - 1 for a in RAGGED_ANCHORS)  # 7 new entries, the widest request
        assert widths == [decode_query_bucket(entries, group, 16) if bucketed else entries]
    assert widths != [decode_query_bucket(entries, group, 16)]  # (the control padded nothing)
    bucketed, unpadded = proposals
    assert torch.equal(bucketed.draft_token_ids, unpadded.draft_token_ids)
    torch.testing.assert_close(bucketed.draft_logits, unpadded.draft_logits, rtol=1e-5, atol=1e-5)


def test_catch_up_variants_are_launched_inert(target_dir, head_dir, monkeypatch) -> None:
    """`compile_catch_up_variants` (run at set-up on CUDA, where it compiles the kernel
    variants): one inert launch per bucket of the catch-up's widths, output 0 and the head's
    cache untouched; here on the CPU through the twin."""
    from specdec.drafters.eagle import drafter as drafter_module

    drafter, _ = fed_drafter(target_dir, head_dir, RAGGED_TOKENS, RAGGED_ANCHORS)
    attn = drafter.head.layer.self_attn
    group = attn.num_heads // attn.num_kv_heads
    attend, widths = drafter_module.paged_decode_attention, []

    def recording(query, k_cache, v_cache, meta, scale):
        widths.append(meta.query_per_seq)
        out = attend(query, k_cache, v_cache, meta, scale)
        assert out.shape == query.shape and not out.any()
        return out

    monkeypatch.setattr(drafter_module, "paged_decode_attention", recording)
    caches = (drafter.kv_cache.k_cache.clone(), drafter.kv_cache.v_cache.clone())
    drafter.compile_catch_up_variants()
    assert widths == sorted({decode_query_bucket(w, group, 16) for w in range(1, 17)})
    assert torch.equal(drafter.kv_cache.k_cache, caches[0])
    assert torch.equal(drafter.kv_cache.v_cache, caches[1])


@pytest.mark.parametrize("width", [5, 8])
def test_draft_step_buffers_give_the_drafts_of_the_plain_path(target_dir, head_dir, width):
    """Head steps through the static input buffers that CUDA graphs replay (run op by op here,
    padded to the graphs' shapes) propose exactly what the plain path proposes, in a ragged
    batch: the chained draft steps, and (width 8 >= the 7 entries a request brings) the
    round's first step too."""
    from specdec.drafters.eagle.head_graphs import HeadGraphs

    proposals = []
    for buffered in (False, True):
        drafter, ids = fed_drafter(target_dir, head_dir, RAGGED_TOKENS, RAGGED_ANCHORS)
        if buffered:
            drafter._graphs = HeadGraphs(drafter, 4, width, 8, use_graphs=False)
        proposals.append(drafter.propose(ragged_batch(ids, [4, 2, 3])))
    plain, buffered = proposals
    assert torch.equal(plain.draft_token_ids, buffered.draft_token_ids)
    # The logits to rounding: on some CPUs (seen on an AMD EPYC) a matrix product's bits depend
    # on its row count, and the buffered path pads the rows to the graphs' shapes. On CUDA the
    # graphs' parity is bit for bit (tests/parity/test_device_rounds_gpu.py).
    torch.testing.assert_close(plain.draft_logits, buffered.draft_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        plain.draft_logsumexp, buffered.draft_logsumexp, rtol=1e-5, atol=1e-5
    )


def test_requests_may_draft_more_than_the_configured_k(target_dir, head_dir):
    """A request asking for more drafts than speculative_config's K (per-request override)
    drafts through the same head buffers, up to max_model_len, and greedy output is unchanged."""
    prompts = prompt_tokens(VOCAB, [5, 17], seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = {"max_model_len": 48, "block_size": 4}
    plain = LLM(str(target_dir), **common).generate(prompts, params, use_tqdm=False)
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 2}
    llm = LLM(str(target_dir), speculative_config=spec, **common)
    drafted = llm.generate(
        prompts, params, use_tqdm=False, speculative={"num_speculative_tokens": 7}
    )
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.drafter._graphs is not None
    assert llm.get_metrics()["num_draft_tokens"] > 2 * llm.get_metrics()["num_drafts"]
