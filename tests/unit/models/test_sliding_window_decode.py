"""Sliding-window attention on the CPU decode path (`DecodePlanCPU`): a query at position p sees
the keys at positions > p - window, per layer.

The plan's attention against the eager path's masked attention (`paged_attention` with
`sliding_window`) over scattered and consecutive blocks; a tiny Mistral with a window of 7
against `transformers` through prefill and decode/verify steps far past the window, on the
decode path (`DecodeMetadata`) and the eager path alike; a tree verify step under the window
(nodes at their depth, not their index) against the chain steps of each node's path. Negative
controls: the same parity tests with the window dropped from the plan, or taken at the tree
nodes' indices, fail. CUDA's decode kernels take the window too, tree steps included
(test_window_softcap_kernels.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from models_fixtures import (
    TINY_CONFIGS,
    PagedRunner,
    decode_path_step,
    hf_logits,
    make_hf_model,
    prompt_tokens,
    save_hf_model,
    seeded_model,
)
from specdec.models import (
    AttentionMetadata,
    AttentionPlan,
    LlamaForCausalLM,
    ModelConfig,
    load_model,
    paged_attention,
)
from specdec.models.attention import DecodeMetadata
from specdec.models.decode_cpu import DecodePlanCPU, decode_attention_cpu
from specdec.runner.model_runner import PagedModelRunner

ATOL = 1e-4
WINDOW = 7  # TINY_CONFIGS["mistral_window"]'s


@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_plan_attention_matches_the_masked_eager_path(window: int) -> None:
    """Three sequences of 1, 4 and 3 live rows (padded to 4) over contexts of 5, 23 and 13
    keys, two of them on scattered blocks (the plan gathers their slots) and one on
    consecutive blocks (the plan takes a view of the cache); GQA 2:1. Each live row equals the
    masked SDPA of the eager path with the same window; without the window the plan differs
    wherever a row has more keys than the window."""
    num_heads, num_kv_heads, head_dim, block_size, per_seq = 4, 2, 8, 4, 4
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(16, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(16, block_size, num_kv_heads, head_dim, generator=generator)
    context_lens, query_lens = [5, 23, 13], [1, 4, 3]
    tables = [[9, 2], [3, 4, 5, 6, 7, 8], [14, 0, 11, 1]]  # the second one consecutive
    query = torch.randn(len(context_lens) * per_seq, num_heads, head_dim, generator=generator)
    meta = DecodeMetadata(
        block_tables=torch.tensor([table + [-1] * (6 - len(table)) for table in tables]),
        context_lens=torch.tensor(context_lens),
        query_lens=torch.tensor(query_lens),
        slot_mapping=torch.full((len(query),), -1),  # nothing written: the caches hold the keys
        query_per_seq=per_seq,
    )
    positions = torch.zeros(len(query), dtype=torch.int64)
    live = torch.cat([torch.arange(b * per_seq, b * per_seq + n) for b, n in enumerate(query_lens)])
    for b, (n, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        positions[b * per_seq : b * per_seq + n] = torch.arange(ctx - n, ctx)
    plan = DecodePlanCPU.build(meta, positions, torch.ones(head_dim // 2), block_size)
    assert isinstance(plan.sequences[1][2], int) and not isinstance(plan.sequences[0][2], int)
    windowed = plan.for_layers(positions, None, window)
    got = decode_attention_cpu(query, k_cache, v_cache, windowed, scale=0.3)
    eager = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    want = paged_attention(query[live], k_cache, v_cache, eager, scale=0.3, sliding_window=window)
    torch.testing.assert_close(got[live], want, atol=1e-5, rtol=1e-5)
    assert got[~torch.isin(torch.arange(len(query)), live)].abs().max() == 0  # padding rows
    full = decode_attention_cpu(query, k_cache, v_cache, plan, scale=0.3)[live]
    sees_more = (positions[live] >= window).nonzero().flatten()
    if window < 40:
        assert (full[sees_more] - want[sees_more]).abs().amax(dim=(1, 2)).min() > 1e-3
    else:
        torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list, list]:
    """(HF model, checkpoint directory, three sequences of 40, 20 and 33 tokens, each one's
    `transformers` logits over the whole sequence under its window of 7)."""
    hf_model = make_hf_model("mistral_window")
    assert hf_model.config.sliding_window == WINDOW
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("mistral_window"))
    sequences = prompt_tokens(97, [40, 20, 33], seed=21)
    return hf_model, path, sequences, [hf_logits(hf_model, seq) for seq in sequences]


def decode_past_the_window(model: Any, sequences: list[list[int]]) -> list[list[torch.Tensor]]:
    """Prefills 3, 5 and 2 tokens (one `AttentionMetadata` step), then decodes the rest on the
    decode path in steps of 1 to 4 query rows (padded to 4); returns per sequence its [V]
    logits rows, position by position."""
    runner = PagedRunner(model, num_blocks=40, block_size=4)
    prefill = {0: sequences[0][:3], 1: sequences[1][:5], 2: sequences[2][:2]}
    rows: list[list[torch.Tensor]] = [list(logits) for logits in runner.step(prefill).values()]
    done = [3, 5, 2]
    step = 0
    while any(d < len(seq) for d, seq in zip(done, sequences, strict=True)):
        new = {}
        for b, seq in enumerate(sequences):
            count = min(1 + (step + b) % 4, len(seq) - done[b])
            if count > 0:
                new[b] = seq[done[b] : done[b] + count]
                done[b] += count
        for b, logits in decode_path_step(runner, new, query_per_seq=4).items():
            rows[b] += list(logits)
        step += 1
    return rows


def errors_by_position(rows: list[list[torch.Tensor]], references: list[torch.Tensor]) -> Any:
    """Per position (over the sequences that reach it), the largest |ours - reference|."""
    longest = max(len(seq_rows) for seq_rows in rows)
    errors = torch.zeros(longest)
    for seq_rows, reference in zip(rows, references, strict=True):
        diff = (torch.stack(seq_rows) - reference).abs().amax(dim=-1)
        errors[: len(diff)] = torch.maximum(errors[: len(diff)], diff)
    return errors


def test_mistral_window_decode_path_matches_transformers(mistral: Any) -> None:
    """Every position of the three sequences (up to 40, more than five windows) within 1e-4 of
    `transformers` on the decode path; the eager path (masked SDPA) gives the same logits."""
    _, path, sequences, references = mistral
    model = load_model(path).model
    assert errors_by_position(decode_past_the_window(model, sequences), references).max() <= ATOL
    eager = load_model(path).model
    eager.model._plans_rows = lambda input_ids: False  # masked SDPA for every step
    runner = PagedRunner(eager, num_blocks=40, block_size=4)
    for b, logits in runner.step(dict(enumerate(sequences))).items():
        assert (logits - references[b]).abs().max().item() <= ATOL


def test_negative_control_window_ignored_on_the_decode_path(mistral: Any, monkeypatch: Any) -> None:
    """The plan built without its window: positions before the window stay exact (they see the
    same keys), every later one is far off, so the parity test above has power."""
    _, path, sequences, references = mistral
    keep_rope = DecodePlanCPU.for_layers

    def without_window(self: DecodePlanCPU, positions: Any, inv_freq: Any, window: Any) -> Any:
        return keep_rope(self, positions, inv_freq, None)

    monkeypatch.setattr(DecodePlanCPU, "for_layers", without_window)
    errors = errors_by_position(
        decode_past_the_window(load_model(path).model, sequences), references
    )
    assert errors[:WINDOW].max() <= ATOL
    assert errors[WINDOW:].min() > 100 * ATOL


def test_decode_path_takes_a_window() -> None:
    """The CPU plan and CUDA's kernels have windows: the decode path names no reason on either
    device (nor for callers that name none), and the CPU runner builds it (a tree step under
    the window on the decode path: test_window_softcap_kernels.py)."""
    config = ModelConfig.from_hf_config(TINY_CONFIGS["mistral_window"])
    assert config.decode_path_reason("cuda") is None
    assert config.eager_only_reason is None
    assert config.decode_path_reason("cpu") is None
    model = seeded_model("mistral_window", "cpu")
    PagedModelRunner(model, 8, 4, max_num_seqs=2, decode_path=True)


PREFIX = prompt_tokens(97, [20], seed=1)[0]  # far past the window of 7
# A verify step's region: the input token (depth 0), two children of it (depth 1), a child of
# the second one (depth 2); rows are the nodes' visible region keys (ancestors and itself).
TREE_TOKENS, TREE_DEPTHS = [5, 9, 11, 30], [0, 1, 1, 2]
TREE_MASK = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]]).bool()
TREE_PATHS = [[0], [0, 1], [0, 2], [0, 2, 3]]  # each node's path from the root


def after_prefix(model: LlamaForCausalLM, tokens: list[int], positions: list[int], tree: Any):
    """[len(tokens), V] logits of one step after PREFIX (prefilled in its own step)."""
    cache = model.allocate_kv_cache(16, 4)
    n, table = len(PREFIX), [list(range(16))]
    with torch.inference_mode():
        model(
            torch.tensor(PREFIX),
            torch.arange(n),
            AttentionMetadata.build([n], [n], table, 4),
            cache,
        )
        attn = AttentionMetadata.build([len(tokens)], [n + len(tokens)], table, 4)
        if tree is not None:
            attn = dataclasses.replace(attn, tree_mask=tree)
        return model.compute_logits(
            model(torch.tensor(tokens), torch.tensor(positions), attn, cache)
        )


def tree_errors(model: LlamaForCausalLM) -> list[float]:
    """Per node, |tree step's logits - the chain step's of its path| (max over the vocabulary)."""
    positions = [len(PREFIX) + depth for depth in TREE_DEPTHS]
    tree = after_prefix(model, TREE_TOKENS, positions, TREE_MASK)
    errors = []
    for node, path in enumerate(TREE_PATHS):
        tokens = [TREE_TOKENS[i] for i in path]
        chain = after_prefix(model, tokens, list(range(len(PREFIX), len(PREFIX) + len(path))), None)
        errors.append((tree[node] - chain[-1]).abs().max().item())
    return errors


def test_tree_verify_under_the_window_equals_each_path(monkeypatch: Any) -> None:
    """A tree verify step gives each node the logits of the chain step of its own path: its
    window is counted from its depth. On the CPU's row plan (`DecodePlanCPU`: each node row
    over the keys before the tree and its path's) the very bits of the chain step; on the
    eager path's masked SDPA (CUDA's eager tree step) within 1e-5. Negative control (the masked
    path): the window taken at the nodes' indices in the step (what a causal step would assume)
    moves the nodes whose index exceeds their depth. A region wider than the window is
    refused there."""
    model = seeded_model("mistral_window", "cpu")
    assert max(tree_errors(model)) == 0.0
    monkeypatch.setattr(model.model, "_plans_rows", lambda input_ids: False)  # the masked path
    assert max(tree_errors(model)) <= 1e-5
    build = AttentionPlan.build.__func__  # type: ignore[attr-defined]

    def at_indices(
        cls: Any, attn: Any, block_size: int, device: Any, window: Any = None, positions: Any = None
    ) -> Any:
        indices = torch.arange(len(PREFIX), len(PREFIX) + len(TREE_TOKENS))
        return build(cls, attn, block_size, device, window, positions=indices)

    monkeypatch.setattr(AttentionPlan, "build", classmethod(at_indices))
    errors = tree_errors(model)
    assert max(errors[:2]) <= 1e-5 and min(errors[2:]) > 100 * ATOL  # index == depth only for 0, 1
    monkeypatch.undo()
    assert max(tree_errors(model)) == 0.0  # the row plan again
    wide = torch.ones(1, 4, 8, dtype=torch.bool)
    attn = dataclasses.replace(
        AttentionMetadata.build([4], [24], [list(range(8))], 4), tree_mask=wide
    )
    with pytest.raises(ValueError, match="region of at most that many keys"):
        AttentionPlan.build(attn, 4, torch.device("cpu"), 7, positions=torch.arange(20, 24))
