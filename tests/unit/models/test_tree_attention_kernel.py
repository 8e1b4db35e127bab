"""The tree-masked paged decode attention kernel (`fused_triton._paged_decode_attention_kernel`
with TREE) against its twin `fused.paged_decode_attention_ref` under Triton's CPU interpreter
(tests marked `interpret`: skipped unless TRITON_INTERPRET=1 and Triton is importable; on a GPU
tests/parity/test_tree_attention_gpu.py runs the same cases), and the runner's decode path on a
tree verify step (positions and mask filled by `DecodeGraphs`) against the eager tree step."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from models_fixtures import seeded_model
from specdec.models import fused
from specdec.runner.model_runner import PagedModelRunner, StepInput
from tree_attention_fixtures import live_rows, standard_cases, tree_case, wrong_ancestor

# float32 kernel against the float32 twin: the same sums in another order (test_decode_gpu's
# tolerance for the non-tree kernel).
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
CASES = standard_cases(torch.Generator().manual_seed(19))


def _kernel(query, k_cache, v_cache, meta, scale):
    from specdec.models import fused_triton

    return fused_triton.paged_decode_attention_triton(query, k_cache, v_cache, meta, scale)


@interpret
@pytest.mark.parametrize("name", list(CASES))
def test_tree_kernel_matches_the_twin_interpreted(name):
    shares, q, width = CASES[name]
    query, k_cache, v_cache, meta = tree_case(shares, query_per_seq=q, width=width, seed=3)
    scale = query.shape[-1] ** -0.5
    want = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta, scale)
    got = _kernel(query, k_cache, v_cache, meta, scale)
    rows = live_rows(meta)
    torch.testing.assert_close(got[rows], want[rows], **FP32_TOL)
    from dataclasses import replace

    # The decode graphs' int64 mask reads the same.
    as_int64 = replace(meta, tree_mask=meta.tree_mask.to(torch.int64))
    assert torch.equal(_kernel(query, k_cache, v_cache, as_int64, scale), got)
    # Negative controls: the kernel without the mask, or with one wrong ancestor, differs.

    causal = _kernel(query, k_cache, v_cache, replace(meta, tree_mask=None), scale)
    wrong = _kernel(query, k_cache, v_cache, wrong_ancestor(meta), scale)
    assert not torch.allclose(causal[rows], want[rows], **FP32_TOL)
    assert not torch.allclose(wrong[rows], want[rows], **FP32_TOL)


def test_tree_mask_shape_is_checked():
    shares, q, width = CASES["short"]
    query, k_cache, v_cache, meta = tree_case(shares, query_per_seq=q, width=width)
    from dataclasses import replace

    bad = replace(meta, tree_mask=meta.tree_mask[:, :2])
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="tree_mask must be"):
        _kernel(query, k_cache, v_cache, bad, 1.0)


def test_decode_path_tree_step_equals_the_eager_tree_step():
    """A tree verify step beside a chain share and a decode share through the decode path
    (`DecodeGraphs`: tree positions, the [B, Q, Q] mask over the padded width) gives the eager
    tree step's logits."""
    model = seeded_model("llama", "cpu")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(5)
    block = 4
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 3, 14)]
    trees = [(-1, -1, 0, 0, 1, 2), None, None]
    extra = [6, 2, 0]  # the tree's nodes, a chain share's drafts, a decode share
    drafts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in extra]
    logits = {}
    for decode in (False, True):
        runner = PagedModelRunner(
            model, 40, block, max_num_seqs=4, max_query_len=8, decode_path=decode
        )
        tables = [list(range(i * 10, i * 10 + 10)) for i in range(3)]
        prefill = [StepInput(p[:-1], 0, t, 1) for p, t in zip(prompts, tables, strict=True)]
        runner.run(prefill)
        step = []
        for prompt, table, parents, nodes in zip(prompts, tables, trees, drafts, strict=True):
            tokens = [prompt[-1], *nodes]
            step.append(StepInput(tokens, len(prompt) - 1, table, len(tokens), parents))
        logits[decode] = [x.clone() for x in runner.run(step)]
        assert (runner.graphs is not None) == decode
    for eager, fused_step in zip(logits[False], logits[True], strict=True):
        torch.testing.assert_close(fused_step, eager, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ split-KV under a tree mask
# Partitions of 64 keys (one online-softmax step each): the cases' contexts (up to 200 keys)
# span up to four partitions, the tree region sits inside or across a partition edge.
SMALL_PARTITION = 64


@pytest.fixture()
def small_partitions(monkeypatch):
    from specdec.models import attention_tiles

    monkeypatch.setattr(attention_tiles, "SPLIT_KV_PARTITION", SMALL_PARTITION)
    return SMALL_PARTITION


def _split_meta(meta, partitions: int = 4):
    from dataclasses import replace

    return replace(meta, num_partitions=partitions)


@pytest.mark.parametrize("name", list(CASES))
def test_split_kv_twin_under_a_tree_mask_matches_the_exact_softmax(name, small_partitions):
    """The split-KV twin (`split_kv.split_kv_decode_attention_ref`) with a tree mask equals the
    exact tree-masked softmax of `fused.paged_decode_attention_ref` on every live row; the same
    twin without the mask, or with one wrong ancestor, does not (negative controls)."""
    from dataclasses import replace

    from specdec.models import split_kv

    shares, q, width = CASES[name]
    query, k_cache, v_cache, meta = tree_case(shares, query_per_seq=q, width=width, seed=3)
    scale = query.shape[-1] ** -0.5
    want = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta, scale)
    split = _split_meta(meta)
    got = split_kv.split_kv_decode_attention_ref(query, k_cache, v_cache, split, scale)
    rows = live_rows(meta)
    torch.testing.assert_close(got[rows], want[rows], **FP32_TOL)
    causal = split_kv.split_kv_decode_attention_ref(
        query, k_cache, v_cache, replace(split, tree_mask=None), scale
    )
    wrong = split_kv.split_kv_decode_attention_ref(
        query, k_cache, v_cache, _split_meta(wrong_ancestor(meta)), scale
    )
    assert not torch.allclose(causal[rows], want[rows], **FP32_TOL)
    assert not torch.allclose(wrong[rows], want[rows], **FP32_TOL)


@interpret
@pytest.mark.parametrize("name", list(CASES))
def test_split_kv_kernels_under_a_tree_mask_interpreted(name, small_partitions):
    """The split-KV kernels with a tree mask against their twin, and (the batch-invariance
    argument of `models/split_kv.py`) a context of one partition gives the single-pass tree
    kernel's bits."""
    from specdec.models import split_kv, split_kv_triton

    shares, q, width = CASES[name]
    query, k_cache, v_cache, meta = tree_case(shares, query_per_seq=q, width=width, seed=3)
    scale = query.shape[-1] ** -0.5
    split = _split_meta(meta)
    got = split_kv_triton.split_kv_decode_attention_triton(query, k_cache, v_cache, split, scale)
    twin = split_kv.split_kv_decode_attention_ref(query, k_cache, v_cache, split, scale)
    rows = live_rows(meta)
    torch.testing.assert_close(got[rows], twin[rows], **FP32_TOL)
    single = _kernel(query, k_cache, v_cache, meta, scale)
    for b, share in enumerate(shares):
        if 0 < share.context_len <= SMALL_PARTITION:
            block = slice(b * q, b * q + share.num_tokens)
            assert torch.equal(got[block], single[block]), f"sequence {b} ({share})"
