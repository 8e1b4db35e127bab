"""Sliding windows and soft-capped scores in the CUDA decode path's attention kernels (single-pass
decode/verify, split-KV partials + combine, flash prefill) and their PyTorch twins, and GeGLU's
fused gelu_tanh * up kernel.

The twins are checked on the CPU against a plain dense-mask attention written here (float32
tolerance: the same sums in another order). The Triton kernels run under Triton's CPU interpreter
in the tests marked `interpret` (skipped unless TRITON_INTERPRET=1): each against its twin within
float32 tolerance (the interpreter's `tl.dot` sums in another order than torch's matmul, as in
test_long_attention.py), and bit for bit where the contract says bits (a context of one
partition: split-KV == single pass; a window at least as long as every context == no window).
Windows of 1 key, within a 16-key cache block, across block, 64-key step and 128-key partition
boundaries, and longer than every context; a tree verify step under a window, each node's window
counted from its depth (its position), not its index. Negative controls: a kernel run without the
window (or the cap) that its twin applies differs from it, as does a tree's window counted from
the rows' indices; a model whose layers lose their window or cap moves off `transformers`. GPU
parity: tests/parity/test_window_softcap_gpu.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import pytest
import torch

from models_fixtures import (
    decode_path_error,
    drop_attention_cap,
    eager,
    hf_decode_logits,
    hf_logits,
    make_gemma2_hf_model,
    make_hf_model,
    prompt_tokens,
    save_hf_model,
    seeded_model,
)
from specdec.models import fused, load_model, paged_attention, split_kv
from specdec.models.attention import AttentionMetadata, DecodeMetadata
from specdec.models.prefill_attention import paged_prefill_attention_ref

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")

PARTITION = 128  # split-KV partitions of two 64-key steps, so short contexts span several
SCALE = 0.3
CAP = 2.0  # binds: scores reach ~+-5 at this scale
# Contexts at step and partition boundaries, a long one, and an inert sequence (context 0).
CONTEXTS = [1, 64, 127, 129, 300, 0]
# (window, cap): 1 key; inside a 16-key block; across a block; a 64-key step; across a
# 128-key partition; longer than every context; the cap alone and with a window.
CASES = [(1, None), (5, None), (17, None), (64, None), (130, None), (1000, None)]
CASES += [(None, CAP), (40, CAP)]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _decode_case(q_per_seq: int, group: int, seed: int, padded: bool = True) -> tuple[Any, ...]:
    """Queries, caches on scattered blocks of 16 keys, and `meta(parts, tree_mask)`: CONTEXTS
    with min(q_per_seq, context) live rows each, and (`padded`) fewer for the 300-key one."""
    block_size, head_dim, num_kv_heads = 16, 16, 2
    num_seqs = len(CONTEXTS)
    query_lens = [min(q_per_seq, c) for c in CONTEXTS]
    if padded:
        query_lens[4] = min(2, q_per_seq)
    width = max(-(-c // block_size) for c in CONTEXTS) + 2
    num_blocks = num_seqs * width + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = order[: num_seqs * width].view(num_seqs, width)
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 1)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, seed=seed + 2)
    query = _randn(num_seqs * q_per_seq, num_kv_heads * group, head_dim, seed=seed + 3)

    def meta(parts: int, tree_mask: torch.Tensor | None = None) -> DecodeMetadata:
        return DecodeMetadata(
            block_tables=tables,
            context_lens=torch.tensor(CONTEXTS),
            query_lens=torch.tensor(query_lens),
            slot_mapping=torch.full((num_seqs * q_per_seq,), -1),
            query_per_seq=q_per_seq,
            num_partitions=parts,
            tree_mask=tree_mask,
        )

    return query, k_cache, v_cache, meta


def _dense(query, k_cache, v_cache, meta, window, cap, positions=None) -> torch.Tensor:
    """Plain attention, row by row: row j of sequence b at index position i = context -
    query_len + j sees keys 0 .. i (under `meta.tree_mask` the last W keys through the mask
    instead), and with a window none at or before p - window, p = i or under a tree the live
    row's `positions` entry; scores q.k * SCALE, then cap * tanh(s / cap); rows that see no
    key are 0."""
    q_per_seq = meta.query_per_seq
    group = query.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.zeros_like(query)
    for b, (ctx, q_len) in enumerate(zip(CONTEXTS, meta.query_lens.tolist(), strict=True)):
        if ctx == 0:
            continue
        blocks = meta.block_tables[b, : -(-ctx // block_size)].to(torch.int64)
        keys = k_cache[blocks].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)
        values = v_cache[blocks].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)
        key_pos = torch.arange(ctx)
        for j in range(q_per_seq):
            pos = ctx - q_len + j
            seen = key_pos <= pos
            if meta.tree_mask is not None:
                region = meta.tree_mask[b, j]
                seen = seen.clone()
                for k, bit in enumerate(region.tolist()):
                    if 0 <= ctx - len(region) + k < ctx:
                        seen[ctx - len(region) + k] = bit
                if j < q_len:
                    pos = int(positions[b * q_per_seq + j])
            if window is not None:
                seen &= key_pos > pos - window
            if not seen.any():
                continue
            row = query[b * q_per_seq + j]  # [H_q, D]
            scores = torch.einsum("hd,shd->hs", row, keys[seen]) * SCALE
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            out[b * q_per_seq + j] = torch.einsum("hs,shd->hd", scores.softmax(-1), values[seen])
    return out


@pytest.fixture
def small_partitions(monkeypatch: pytest.MonkeyPatch) -> int:
    """Split-KV partitions of PARTITION keys in the twin and (when imported) the kernels."""
    from specdec.models import attention_tiles

    monkeypatch.setattr(attention_tiles, "SPLIT_KV_PARTITION", PARTITION)
    return PARTITION


def _parts() -> int:
    return -(-max(CONTEXTS) // PARTITION) + 1  # one empty partition past every context


# --------------------------------------------------------------------------- the twins
@pytest.mark.parametrize("window,cap", CASES)
@pytest.mark.parametrize("q_per_seq,group", [(1, 1), (4, 2)])
def test_twins_match_dense_attention(small_partitions, window, cap, q_per_seq, group) -> None:
    query, k_cache, v_cache, meta = _decode_case(q_per_seq, group, 3)
    want = _dense(query, k_cache, v_cache, meta(0), window, cap)
    options = dict(sliding_window=window, softcap=cap)
    single = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta(0), SCALE, **options)
    torch.testing.assert_close(single, want, **FP32_TOL)
    split = split_kv.split_kv_decode_attention_ref(
        query, k_cache, v_cache, meta(_parts()), SCALE, **options
    )
    torch.testing.assert_close(split, want, **FP32_TOL)
    # The dispatch sends split metadata to the split-KV twin, with the window and the cap.
    dispatched = fused.paged_decode_attention(
        query, k_cache, v_cache, meta(_parts()), SCALE, **options
    )
    assert torch.equal(dispatched, split)


def test_twins_negative_control() -> None:
    """The dense reference has power: without the window (or the cap) it moves off the twins
    wherever a row has more keys than the window (every row, for the cap)."""
    query, k_cache, v_cache, meta = _decode_case(4, 2, 3)
    twin = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta(0), SCALE, 17, CAP)
    no_window = _dense(query, k_cache, v_cache, meta(0), None, CAP)
    no_cap = _dense(query, k_cache, v_cache, meta(0), 17, None)
    long_rows = slice(4 * 4, 5 * 4)  # the 300-key sequence's rows
    assert (twin[long_rows] - no_window[long_rows]).abs().max() > 1e-2
    assert (twin - no_cap).abs().max() > 1e-2


# A verify step's tree of 4 nodes: the input token (depth 0), two children of it (depth 1), a
# child of the second (depth 2); each row sees its ancestors and itself.
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]).bool()
TREE_DEPTHS = torch.tensor([0, 1, 1, 2])


def _tree_step() -> tuple[torch.Tensor, torch.Tensor]:
    """([B, 4, 4] tree masks, [B * 4] positions) over CONTEXTS (4 rows each): the tree and its
    nodes at their depths after the region's start where the context holds the region; the
    1-key context sees its key (an all-ones mask, its live row at its index)."""
    masks, positions = [], []
    for context in CONTEXTS:
        full = context >= 4
        masks.append(TREE if full else torch.ones(4, 4, dtype=torch.bool))
        start = context - 4 if full else 0
        positions.append(start + (TREE_DEPTHS if full else torch.arange(4)))
    return torch.stack(masks), torch.cat(positions)


def _index_positions() -> torch.Tensor:
    """[B * 4] the tree step's rows at their indices in the step (what a causal step assumes):
    a negative control's positions."""
    return torch.cat([max(context - 4, 0) + torch.arange(4) for context in CONTEXTS])


@pytest.mark.parametrize("window,cap", [(4, None), (5, None), (17, CAP), (130, None)])
def test_twins_window_a_tree_from_its_depths(small_partitions, window, cap) -> None:
    """A tree step under a window: each node's window counts from its own position (its depth),
    in both twins as in the dense reference; a region wider than the window, or no positions,
    is refused. Negative control: the window counted from the rows' indices moves the deeper
    nodes off."""
    query, k_cache, v_cache, meta = _decode_case(4, 2, 3, padded=False)
    masks, positions = _tree_step()
    step, split_step = meta(0, masks), meta(_parts(), masks)
    want = _dense(query, k_cache, v_cache, step, window, cap, positions)
    options = dict(sliding_window=window, softcap=cap, positions=positions)
    single = fused.paged_decode_attention_ref(query, k_cache, v_cache, step, SCALE, **options)
    torch.testing.assert_close(single, want, **FP32_TOL)
    split = split_kv.split_kv_decode_attention_ref(
        query, k_cache, v_cache, split_step, SCALE, **options
    )
    torch.testing.assert_close(split, want, **FP32_TOL)
    at_indices = _dense(query, k_cache, v_cache, step, window, cap, _index_positions())
    if window < 130:
        assert (at_indices - want).abs().max() > 1e-2
    for bad in (dict(options, positions=None), dict(options, sliding_window=3)):
        with pytest.raises(ValueError, match="needs its rows' positions and a region"):
            fused.paged_decode_attention_ref(query, k_cache, v_cache, step, SCALE, **bad)
        with pytest.raises(ValueError, match="needs its rows' positions and a region"):
            split_kv.split_kv_decode_attention_ref(query, k_cache, v_cache, step, SCALE, **bad)


@pytest.mark.parametrize("window", [None, 20])
def test_prefill_twin_caps_as_the_eager_path(window) -> None:
    """The flash prefill twin with soft-capped scores against the eager masked path
    (`attention.softcap_attention`), prompts over a cached prefix, GQA 2:1."""
    query_lens, context_lens, block_size = [7, 40, 1], [7, 100, 30], 16
    tables = [[0], [1, 2, 3, 4, 5, 6, 7], [8, 9]]
    k_cache, v_cache = _randn(10, block_size, 2, 16, seed=1), _randn(10, block_size, 2, 16, seed=2)
    query = _randn(sum(query_lens), 4, 16, seed=3)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    args = (query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    capped = paged_prefill_attention_ref(*args, scale=SCALE, sliding_window=window, softcap=CAP)
    naive = paged_attention(
        query, k_cache, v_cache, meta, scale=SCALE, sliding_window=window, softcap=CAP
    )
    torch.testing.assert_close(capped, naive, **FP32_TOL)
    uncapped = paged_prefill_attention_ref(*args, scale=SCALE, sliding_window=window)
    assert (uncapped - naive).abs().max() > 1e-2  # negative control


# --------------------------------------------------------------------------- the kernels
@interpret
@pytest.mark.parametrize("window,cap", CASES)
@pytest.mark.parametrize("q_per_seq", [1, 4])
def test_kernels_interpreted_match_twins(small_partitions, window, cap, q_per_seq) -> None:
    from specdec.models import fused_triton, split_kv_triton

    query, k_cache, v_cache, meta = _decode_case(q_per_seq, 2, 5)
    options = dict(sliding_window=window, softcap=cap)
    single = fused_triton.paged_decode_attention_triton(
        query, k_cache, v_cache, meta(0), SCALE, **options
    )
    twin = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta(0), SCALE, **options)
    torch.testing.assert_close(single, twin, **FP32_TOL)
    split = split_kv_triton.split_kv_decode_attention_triton(
        query, k_cache, v_cache, meta(_parts()), SCALE, **options
    )
    split_twin = split_kv.split_kv_decode_attention_ref(
        query, k_cache, v_cache, meta(_parts()), SCALE, **options
    )
    torch.testing.assert_close(split, split_twin, **FP32_TOL)
    # Contexts of one partition (1, 64, 127 keys; the inert one): the single pass's bits.
    for b in (0, 1, 2, 5):
        rows = slice(b * q_per_seq, (b + 1) * q_per_seq)
        assert torch.equal(split[rows], single[rows]), f"sequence {b}"


@interpret
def test_a_window_past_every_context_gives_the_full_bits(small_partitions) -> None:
    """SLIDING with a window no row (padding rows included) reaches past: the same bits as the
    full-attention launch (the masks agree key for key), single pass and split-KV alike."""
    from specdec.models import fused_triton, split_kv_triton

    query, k_cache, v_cache, meta = _decode_case(4, 2, 7)
    for launch, parts in (
        (fused_triton.paged_decode_attention_triton, 0),
        (split_kv_triton.split_kv_decode_attention_triton, _parts()),
    ):
        full = launch(query, k_cache, v_cache, meta(parts), SCALE)
        reach = max(CONTEXTS) + 4  # the last padding row's position + 1
        wide = launch(query, k_cache, v_cache, meta(parts), SCALE, sliding_window=reach)
        assert torch.equal(wide, full)


@interpret
def test_kernels_negative_control(small_partitions) -> None:
    """The kernel without the window (the cap) that its twin applies is far from the twin: the
    comparisons above have power."""
    from specdec.models import fused_triton, split_kv_triton

    query, k_cache, v_cache, meta = _decode_case(4, 2, 5)
    twin = fused.paged_decode_attention_ref(query, k_cache, v_cache, meta(0), SCALE, 17, CAP)
    no_window = fused_triton.paged_decode_attention_triton(
        query, k_cache, v_cache, meta(0), SCALE, softcap=CAP
    )
    no_cap = split_kv_triton.split_kv_decode_attention_triton(
        query, k_cache, v_cache, meta(_parts()), SCALE, sliding_window=17
    )
    long_rows = slice(4 * 4, 5 * 4)  # the 300-key sequence's rows
    assert (no_window[long_rows] - twin[long_rows]).abs().max() > 1e-2
    assert (no_cap - twin).abs().max() > 1e-2


@interpret
@pytest.mark.parametrize("window,cap", [(None, CAP), (4, None), (17, CAP), (130, None)])
def test_tree_step_kernels_window_and_cap(small_partitions, window, cap) -> None:
    """A tree verify step's kernels (single pass and split-KV) with capped scores and a window
    counted from each node's depth match their twins; without the positions the window is
    refused by name. Negative control: the positions at the rows' indices move the kernels
    off the twins."""
    from specdec.models import fused_triton, split_kv_triton

    query, k_cache, v_cache, meta = _decode_case(4, 2, 9, padded=False)
    masks, positions = _tree_step()
    options = dict(sliding_window=window, softcap=cap, positions=positions)
    for launch, twin, parts in (
        (fused_triton.paged_decode_attention_triton, fused.paged_decode_attention_ref, 0),
        (
            split_kv_triton.split_kv_decode_attention_triton,
            split_kv.split_kv_decode_attention_ref,
            _parts(),
        ),
    ):
        step = meta(parts, masks)
        want = twin(query, k_cache, v_cache, step, SCALE, **options)
        torch.testing.assert_close(launch(query, k_cache, v_cache, step, SCALE, **options), want)
        if window is None:
            continue
        with pytest.raises(ValueError, match="needs its rows' positions and a region"):
            launch(query, k_cache, v_cache, step, SCALE, sliding_window=window)
        if window < 130:
            at_indices = dict(options, positions=_index_positions())
            off = launch(query, k_cache, v_cache, step, SCALE, **at_indices)
            assert (off - want).abs().max() > 1e-2


@interpret
@pytest.mark.parametrize("window,cap", [(None, CAP), (20, CAP), (20, None)])
def test_prefill_kernel_interpreted_caps_as_its_twin(window, cap) -> None:
    from specdec.models.prefill_attention_triton import paged_prefill_attention_triton

    query_lens, context_lens, block_size = [7, 70, 1], [7, 100, 30], 16
    tables = [[0], [1, 2, 3, 4, 5, 6, 7], [8, 9]]
    k_cache, v_cache = _randn(10, block_size, 2, 16, seed=4), _randn(10, block_size, 2, 16, seed=5)
    query = _randn(sum(query_lens), 4, 16, seed=6)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    args = (query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
    options = dict(scale=SCALE, sliding_window=window, softcap=cap)
    twin = paged_prefill_attention_ref(*args, **options)
    got = paged_prefill_attention_triton(*args, meta.max_seqlen_q, **options)
    torch.testing.assert_close(got, twin, **FP32_TOL)


@interpret
def test_gelu_tanh_mul_kernel_interpreted_matches_twin() -> None:
    """GeGLU's fused kernel against `fused.gelu_tanh_mul_ref` (float32; large gates saturate,
    never NaN); negative control: SiLU's kernel on the same input is far off."""
    from specdec.models import fused_triton

    gate_up = 3 * _randn(5, 2 * 1500, seed=8)
    gate_up[0, :4] = torch.tensor([60.0, -60.0, 0.0, -5.0])
    got = fused_triton.gelu_tanh_mul_triton(gate_up)
    want = fused.gelu_tanh_mul_ref(gate_up)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (fused_triton.silu_mul_triton(gate_up) - want).abs().max() > 1e-2


# --------------------------------------------------------------------------- the models
@pytest.fixture(scope="module")
def gemma2_capped(tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf_model = make_gemma2_hf_model("gemma2")
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("gemma2_capped"))


def clear_windows(model: Any) -> Any:
    """`model` whose layers' decode kernels take no window (a negative control)."""
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    return model


def test_gemma2_decode_path_through_the_kernel_twins(gemma2_capped: Any) -> None:
    """Gemma 2 (window 8 on alternate layers, capped scores, GeGLU) on the decode path without
    the CPU's row plan: every layer through `fused.py`'s dispatch (on the CPU its twins, what
    CUDA's kernels run against) with its layer's window and cap, within 1e-4 of `transformers`
    decoding, steps of 1 to 4 rows to position 40 (five windows). Negative controls: the
    layers' windows or caps dropped."""
    hf_model, path = gemma2_capped
    sequences = prompt_tokens(97, [40, 26, 33], seed=6)
    references = [hf_decode_logits(hf_model, seq) for seq in sequences]
    model = eager(load_model(path).model)
    assert decode_path_error(model, references, sequences) <= 1e-4
    windowless = clear_windows(eager(load_model(path).model))
    assert decode_path_error(windowless, references, sequences) > 1e-2
    capless = drop_attention_cap(eager(load_model(path).model))
    assert decode_path_error(capless, references, sequences) > 1e-2


def test_mistral_window_decode_path_through_the_kernel_twins(tmp_path: Any) -> None:
    """A Mistral with a window of 7 on the decode path through the twins (no row plan), past
    five windows, within 1e-4 of `transformers`; without its window it moves off."""
    hf_model = make_hf_model("mistral_window")
    path = save_hf_model(hf_model, tmp_path / "mistral_window")
    sequences = prompt_tokens(97, [40, 20, 33], seed=21)
    references = [hf_logits(hf_model, seq) for seq in sequences]
    assert decode_path_error(eager(load_model(path).model), references, sequences) <= 1e-4
    off = clear_windows(eager(load_model(path).model))
    assert decode_path_error(off, references, sequences) > 1e-2


def test_cuda_decode_path_takes_windows_softcaps_and_geglu(
    gemma2_capped: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA refusals lifted: windows, soft-capping and GeGLU name no reason on either
    device; a mixture of experts neither (its grouped kernel, CUDA's default), unless that
    kernel is switched off (SPECDEC_MOE_GROUPED_KERNEL=0)."""
    from models_fixtures import MOE_CONFIGS, TINY_CONFIGS
    from specdec.models import ModelConfig

    config = load_model(gemma2_capped[1]).config
    for device in ("cuda", "cpu"):
        assert config.device_reason(device) is None
        assert config.decode_path_reason(device) is None
    window = ModelConfig.from_hf_config(TINY_CONFIGS["mistral_window"])
    assert window.eager_only_reason is None
    moe = ModelConfig.from_hf_config(MOE_CONFIGS["mixtral"])
    monkeypatch.delenv("SPECDEC_MOE_GROUPED_KERNEL", raising=False)
    assert moe.decode_path_reason("cuda") is None
    monkeypatch.setenv("SPECDEC_MOE_GROUPED_KERNEL", "0")
    assert "mixture-of-experts" in (moe.decode_path_reason("cuda") or "")


def test_tree_verify_under_the_window_on_the_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree verify step of a Mistral with a window of 7, after a 20-token prefix, on the
    decode path (`DecodeMetadata` with the tree mask: on the CPU the kernels' twins, each node's
    window counted from its depth) gives every node the eager tree step's logits (masked
    attention, nodes at their depths). Negative control: the twins' window counted from the
    rows' indices moves the deeper nodes off."""
    from specdec.models import AttentionMetadata as Attn

    model = seeded_model("mistral_window", "cpu")
    prefix = prompt_tokens(97, [20], seed=1)[0]
    tokens, table = torch.tensor([5, 9, 11, 30]), [list(range(16))]
    positions = 20 + TREE_DEPTHS

    def after_prefix(step: Any) -> torch.Tensor:
        cache = model.allocate_kv_cache(16, 4)
        with torch.inference_mode():
            model(torch.tensor(prefix), torch.arange(20), Attn.build([20], [20], table, 4), cache)
            return model.compute_logits(model(tokens, positions, step, cache))

    eager_step = dataclasses.replace(Attn.build([4], [24], table, 4), tree_mask=TREE[None])
    want = after_prefix(eager_step)
    decode_step = DecodeMetadata(
        block_tables=torch.tensor(table),
        context_lens=torch.tensor([24]),
        query_lens=torch.tensor([4]),
        slot_mapping=torch.arange(20, 24),
        query_per_seq=4,
        tree_mask=TREE[None],
    )
    torch.testing.assert_close(after_prefix(decode_step), want, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(
        fused,
        "window_positions_ref",
        lambda meta, b, ctx, q_len, pos: ctx - q_len + torch.arange(4),
    )
    off = (after_prefix(decode_step) - want).abs().amax(dim=-1)
    assert off[0] < 1e-5 and off[1] < 1e-5  # nodes at their index: the same keys
    assert off[2:].min() > 1e-3
