"""The EAGLE head's C++ CPU step (`drafters.eagle.head_native`) against its Python twin: the same
head outputs and K/V bit for bit (catch-ups of several entries, one-entry chain steps, requests
of different query lengths, inert padding requests, scattered cache blocks), the same drafts and
draft logits through `propose`; a perturbed weight is detected (the comparison has power)."""

from __future__ import annotations

import pytest
import torch

from drafter_format_fixtures import cpu_draft_batch, observe_prefixes
from eagle_fixtures import tiny_target_and_head_fixtures
from models_fixtures import prompt_tokens
from specdec.drafters import DrafterSetup
from specdec.drafters.eagle import head_native
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.drafters.eagle.head import quantize_head_int8
from specdec.drafters.eagle.head_graphs import HeadGraphs
from specdec.engine.config import SpeculativeConfig
from specdec.models import load_model
from specdec.models.attention import DecodeMetadata, cache_slots

VOCAB = 97
BLOCK = 4

pytestmark = pytest.mark.skipif(
    head_native.load_extension() is None, reason="the CPU extension is not built here"
)

target_dir, head_dir = tiny_target_and_head_fixtures()


def int8_drafter(target_dir, head_dir) -> EagleDrafter:
    """The drafter of the tiny target with its head made int8 (as for a quantized target)."""
    target = load_model(target_dir).model
    spec = SpeculativeConfig(method="eagle", model=str(head_dir))
    setup = DrafterSetup(num_blocks=64, block_size=BLOCK, max_num_seqs=4, max_model_len=64)
    drafter = EagleDrafter.from_config(spec, target, setup)
    assert quantize_head_int8(drafter.head)
    drafter._native = head_native.native_head_step(drafter.head, drafter.kv_cache)
    assert drafter._native is not None, head_native.native_reason(drafter.head, drafter.kv_cache)
    return drafter


@pytest.fixture(scope="module")
def drafter(target_dir, head_dir):
    return int8_drafter(target_dir, head_dir)


def step_inputs(drafter, contexts, query_lens, width, tables, seed):
    """A decode-path step over the head's cache: request b's entries are the last
    query_lens[b] of its context (context 0: an inert request), rows b * width ..; random
    features, hidden inputs and tokens; the cache filled with noise."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(contexts) * width
    slots, positions = [], []
    for context, count, blocks in zip(contexts, query_lens, tables, strict=True):
        entries = list(range(context - count, context))
        slots += cache_slots(blocks, entries, BLOCK).tolist() + [-1] * (width - count)
        positions += [t + 1 for t in entries] + [0] * (width - count)
    meta = DecodeMetadata(
        block_tables=torch.tensor(tables),
        context_lens=torch.tensor(contexts),
        query_lens=torch.tensor(query_lens),
        slot_mapping=torch.tensor(slots),
        query_per_seq=width,
    )
    config = drafter.head.config
    features = 3 * torch.randn(rows, config.feature_size, generator=generator)
    hidden = torch.randn(rows, config.hidden_size, generator=generator)
    tokens = torch.randint(0, VOCAB, (rows,), generator=generator)
    for cache in (drafter.kv_cache.k_cache, drafter.kv_cache.v_cache):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    ends = torch.tensor([b * width + max(n, 1) - 1 for b, n in enumerate(query_lens)])
    return features, hidden, tokens, torch.tensor(positions), meta, ends


def both_steps(drafter, step, project, inputs):
    """(Python outputs, K, V), (C++ outputs, K, V) of one step from the same cache."""
    features, hidden, tokens, positions, meta, ends = inputs
    cache = drafter.kv_cache
    start = (cache.k_cache.clone(), cache.v_cache.clone())
    results = []
    with torch.inference_mode():
        embeds = drafter.embed(tokens)
        for native in (False, True):
            cache.k_cache.copy_(start[0])
            cache.v_cache.copy_(start[1])
            if native:
                out = step(features if project else hidden, project, embeds, positions, meta)
            else:
                head = drafter.head
                given = head.project_features(features) if project else hidden
                out = head.forward_decode(given, embeds, positions, meta, cache)
            results.append((out, cache.k_cache.clone(), cache.v_cache.clone()))
    if project:  # the catch-up's selection of each request's last entry, on both paths
        with torch.inference_mode():
            picked = step(features, True, embeds, positions, meta, ends)
        assert torch.equal(picked, results[1][0].index_select(0, ends))
    return results


CASES = {
    # name: (contexts, query_lens, width, block tables (scattered, unsorted))
    "prefill-style catch-up": (
        [7, 12, 3],
        [7, 5, 3],
        8,
        [[9, 2, 40, 0], [5, 31, 8, 17], [60, 0, 0, 0]],
    ),
    "one-entry chain steps": (
        [13, 6, 9],
        [1, 1, 1],
        1,
        [[3, 33, 12, 50], [20, 7, 0, 0], [44, 1, 26, 0]],
    ),
    "ragged with an inert request": (
        [10, 0, 4, 15],
        [2, 0, 1, 3],
        3,
        [[11, 4, 29, 0], [0, 0, 0, 0], [6, 0, 0, 0], [14, 57, 2, 38]],
    ),
    "one request, padded row": ([22], [1], 2, [[8, 19, 3, 47, 25, 61]]),
}


@pytest.mark.parametrize("project", [True, False], ids=["features", "hidden"])
@pytest.mark.parametrize("case", list(CASES))
def test_native_step_is_the_python_step_bit_for_bit(drafter, case, project):
    """Head outputs (padding rows included) and the whole K/V cache after the step are equal."""
    contexts, query_lens, width, tables = CASES[case]
    inputs = step_inputs(drafter, contexts, query_lens, width, tables, seed=len(case))
    (want, want_k, want_v), (got, got_k, got_v) = both_steps(
        drafter, drafter._native, project, inputs
    )
    assert torch.equal(got, want)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_a_perturbed_weight_is_detected(drafter, monkeypatch):
    """Negative control: the C++ step made with one int8 weight of the MLP's down product off
    by one gives other outputs than the Python step (the comparison above has power)."""
    down = drafter.head.layer.mlp.down_proj.quantized
    values = down._tensors["values"]
    perturbed = values.clone()
    perturbed[0, 0] = perturbed[0, 0] + (1 if perturbed[0, 0] < 127 else -1)
    monkeypatch.setitem(down._tensors, "values", perturbed)
    bad = head_native.native_head_step(drafter.head, drafter.kv_cache)
    monkeypatch.setitem(down._tensors, "values", values)
    contexts, query_lens, width, tables = CASES["prefill-style catch-up"]
    inputs = step_inputs(drafter, contexts, query_lens, width, tables, seed=1)
    (want, _, _), (got, _, _) = both_steps(drafter, bad, True, inputs)
    assert not torch.equal(got, want)
    (want, _, _), (got, _, _) = both_steps(drafter, drafter._native, True, inputs)
    assert torch.equal(got, want)  # (and the unperturbed step is still equal)


TOKENS = prompt_tokens(VOCAB, [9, 6, 12], seed=7)
ANCHORS = [9, 4, 11]


def fed(drafter_dirs, native: bool, graphs: bool) -> tuple[EagleDrafter, list[str]]:
    """An int8 drafter (C++ step or not; head buffers or the eager path) that has observed
    the target features of positions 0 .. anchor - 2 of each request."""
    target_dir, head_dir = drafter_dirs
    drafter = int8_drafter(target_dir, head_dir)
    if not native:
        drafter._native = None
    if not graphs:
        drafter._graphs = None
    elif drafter._graphs.width < 10:  # every catch-up through the buffers
        drafter._graphs = HeadGraphs(drafter, 4, 10, 8, use_graphs=False)
    ids = observe_prefixes(drafter, load_model(target_dir).model, TOKENS, ANCHORS)
    return drafter, ids


@pytest.mark.parametrize("graphs", [True, False], ids=["head-buffers", "eager"])
def test_propose_gives_the_python_drafts_bit_for_bit(target_dir, head_dir, graphs):
    """Whole rounds (a ragged catch-up, then chained drafts, K = 4, 2, 3) propose the same
    draft tokens, logits and log-normalisers with the C++ step as with the Python step."""
    methods = ["standard", "block", "coupled"]
    batch = cpu_draft_batch(
        TOKENS, ANCHORS, [5, -6, 7], [4, 2, 3], methods, 0.8, ["r0", "r1", "r2"]
    )
    proposals = []
    for native in (False, True):
        drafter, _ = fed((target_dir, head_dir), native, graphs)
        proposals.append(drafter.propose(batch))
    python, native = proposals
    assert torch.equal(python.draft_token_ids, native.draft_token_ids)
    assert torch.equal(python.draft_logits, native.draft_logits)
    assert torch.equal(python.draft_logsumexp, native.draft_logsumexp)


def test_no_native_step_without_the_extension(drafter, monkeypatch):
    """Without the extension (`SPECDEC_CPU_NATIVE=0`, no compiler) the Python path runs."""
    monkeypatch.setattr(head_native, "load_extension", lambda: None)
    assert head_native.native_head_step(drafter.head, drafter.kv_cache) is None
