"""GPU parity of tree-masked paged decode attention: the Triton kernel (TREE) against its twin
`fused.paged_decode_attention_ref` on the same cases as the interpreter test (chains, wide,
deep and random trees from `draft_tree`; contexts across block and 64-key chunk boundaries and
shorter than the region; inert rows; chain shares beside trees; GQA; Q up to 16; float32 and
bfloat16, at test_decode_gpu's tolerances for the non-tree kernel), with negative controls (the
mask ignored, one wrong ancestor); the split-KV kernels under the same masks; and the engine's
tree rounds on CUDA through the decode path
and its CUDA graphs (greedy tree == greedy plain; graphs == enforce_eager)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdec.models import fused
from tree_attention_fixtures import live_rows, standard_cases, to_device, tree_case, wrong_ancestor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
CASES = standard_cases(torch.Generator().manual_seed(19))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4, 64), (8, 1, 128)], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_tree_kernel_matches_the_twin(name, heads, dtype):
    num_kv_heads, group, head_dim = heads
    shares, q, width = CASES[name]
    query, k_cache, v_cache, meta = tree_case(
        shares, query_per_seq=q, width=width, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, dtype=dtype, seed=7,
    )  # fmt: skip
    scale = head_dim**-0.5
    want = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta, scale)
    args = (query.cuda(), k_cache.cuda(), v_cache.cuda())
    cuda_meta = to_device(meta, "cuda")
    got = fused.paged_decode_attention(*args, cuda_meta, scale).cpu()
    rows = live_rows(meta)
    torch.testing.assert_close(got[rows], want[rows], **TOL[dtype])
    inert = (meta.context_lens == 0).repeat_interleave(q).cpu()
    assert (got[inert] == 0).all()
    as_int64 = replace(cuda_meta, tree_mask=cuda_meta.tree_mask.to(torch.int64))
    assert torch.equal(fused.paged_decode_attention(*args, as_int64, scale).cpu(), got)
    # Negative controls: the mask ignored, or one wrong ancestor, must break the equality.
    causal = fused.paged_decode_attention(*args, replace(cuda_meta, tree_mask=None), scale)
    wrong = fused.paged_decode_attention(*args, to_device(wrong_ancestor(meta), "cuda"), scale)
    assert not torch.allclose(causal.cpu()[rows].float(), want[rows].float(), **TOL[dtype])
    assert not torch.allclose(wrong.cpu()[rows].float(), want[rows].float(), **TOL[dtype])


def test_tree_kernel_in_a_cuda_graph():
    """The mask is read from device memory only: a captured step replays a new mask."""
    shares, q, width = CASES["mixed"]
    query, k_cache, v_cache, meta = tree_case(shares, query_per_seq=q, width=width, seed=2)
    other = wrong_ancestor(meta)
    cuda_meta = to_device(meta, "cuda")
    args = (query.cuda(), k_cache.cuda(), v_cache.cuda())
    fused.paged_decode_attention(*args, cuda_meta, 0.125)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.paged_decode_attention(*args, cuda_meta, 0.125)
    cuda_meta.tree_mask.copy_(other.tree_mask)
    graph.replay()
    want = fused.paged_decode_attention_ref(query, k_cache, v_cache, other, 0.125)
    rows = live_rows(meta)
    torch.testing.assert_close(out.cpu()[rows], want[rows], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4, 64), (8, 1, 128)], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_split_kv_tree_kernels_match_the_twins(name, heads, dtype, monkeypatch):
    """The split-KV kernels under a tree mask (64-key partitions: the cases span up to four)
    against the exact tree-masked softmax, with the negative controls; a context of one
    partition gives the single-pass tree kernel's bits."""
    from specdec.models import attention_tiles

    monkeypatch.setattr(attention_tiles, "SPLIT_KV_PARTITION", 64)
    num_kv_heads, group, head_dim = heads
    shares, q, width = CASES[name]
    query, k_cache, v_cache, meta = tree_case(
        shares, query_per_seq=q, width=width, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, dtype=dtype, seed=7,
    )  # fmt: skip
    scale = head_dim**-0.5
    want = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta, scale)
    args = (query.cuda(), k_cache.cuda(), v_cache.cuda())
    cuda_meta = replace(to_device(meta, "cuda"), num_partitions=4)
    got = fused.paged_decode_attention(*args, cuda_meta, scale).cpu()
    rows = live_rows(meta)
    torch.testing.assert_close(got[rows], want[rows], **TOL[dtype])
    single = fused.paged_decode_attention(*args, replace(cuda_meta, num_partitions=0), scale)
    for b, share in enumerate(shares):
        if 0 < share.context_len <= 64:
            block = slice(b * q, b * q + share.num_tokens)
            assert torch.equal(got[block], single.cpu()[block]), f"sequence {b} ({share})"
    causal = fused.paged_decode_attention(*args, replace(cuda_meta, tree_mask=None), scale)
    wrong_meta = replace(to_device(wrong_ancestor(meta), "cuda"), num_partitions=4)
    wrong = fused.paged_decode_attention(*args, wrong_meta, scale)
    assert not torch.allclose(causal.cpu()[rows].float(), want[rows].float(), **TOL[dtype])
    assert not torch.allclose(wrong.cpu()[rows].float(), want[rows].float(), **TOL[dtype])


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from eagle_fixtures import trained_head
    from models_fixtures import make_hf_model, save_hf_model

    target_dir = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))
    return target_dir, trained_head(target_dir, tmp_path_factory.mktemp("eagle"))


def test_engine_tree_rounds_through_the_decode_graphs(tiny_dirs):
    """Tree verify steps take the decode path (graphs captured with a tree mask): greedy tree ==
    greedy plain, and sampled tree rounds under graphs == with enforce_eager."""
    from models_fixtures import prompt_tokens
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    target_dir, head_dir = tiny_dirs
    common = {
        "max_model_len": 96, "block_size": 4, "max_num_batched_tokens": 64, "device": "cuda",
        "dtype": "float32", "async_scheduling": False, "gpu_memory_utilization": 0.2,
    }  # fmt: skip
    spec = {
        "method": "eagle", "model": str(head_dir), "rejection_sample_method": "standard",
        "tree": {"nodes": 8, "depth": 4, "topk": 2},
    }  # fmt: skip
    prompts = prompt_tokens(97, [5, 9, 14, 30], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, max_tokens=24, seed=5, ignore_eos=True)

    def tokens(llm, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(target_dir), **common)
    plain = tokens(llm, greedy)
    del llm
    llm = LLM(str(target_dir), speculative_config=spec, **common)
    assert tokens(llm, greedy) == plain
    assert llm.get_metrics()["num_drafts"] > 0
    tree_keys = [key for key in llm.engine.runner.graphs.graphs if key[3]]  # (.., tree, split)
    assert tree_keys, "no tree verify graph was captured"
    graphed = tokens(llm, sampled)
    del llm
    llm = LLM(str(target_dir), speculative_config=spec, enforce_eager=True, **common)
    assert tokens(llm, sampled) == graphed
    del llm
