"""Tree attention in the verify pass: each tree node attends to the cached prefix and to its
ancestors only. The tree-masked step's logits equal those of running each root-to-leaf path as a
chain (the eager step, on the CPU bit for bit: its rows are decode rows; the decode twin within
1e-5), and after the accepted path's K/V are compacted
into consecutive slots the next step equals the chain's."""

from __future__ import annotations

import pytest
import torch

from models_fixtures import seeded_model
from specdec.draft_tree import (
    node_depths,
    path_slots_to_compact,
    verify_step_mask,
    verify_step_positions,
)
from specdec.models.attention import AttentionMetadata, DecodeMetadata, cache_slots, move_kv

BLOCK = 4
PARENTS = [-1, -1, 0, 0, 1, 2, 2, 5]
TABLE = [9, 3, 12, 0, 7, 5]  # scattered blocks: room for 24 tokens


@pytest.fixture(scope="module")
def model():
    return seeded_model("llama", "cpu")


def run(model, kv, tokens, positions, cache_positions, context_len, tree_mask=None, decode=False):
    """One step of a single sequence: tokens at RoPE `positions`, K/V into the cache slots of
    `cache_positions`, attending to the first `context_len` cache positions."""
    q_len = len(tokens)
    slots = torch.from_numpy(cache_slots(TABLE, cache_positions, BLOCK))
    if decode:
        attn = DecodeMetadata(
            block_tables=torch.tensor([TABLE]),
            context_lens=torch.tensor([context_len]),
            query_lens=torch.tensor([q_len]),
            slot_mapping=slots,
            query_per_seq=q_len,
            tree_mask=tree_mask,
        )
    else:
        attn = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, q_len]),
            context_lens=torch.tensor([context_len]),
            block_tables=torch.tensor([TABLE]),
            slot_mapping=slots,
            max_seqlen_q=q_len,
            max_context_len=context_len,
            tree_mask=tree_mask,
        )
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.tensor(positions), attn, kv)
        return model.compute_logits(hidden)


def leaf_paths(parents):
    children = {p for p in parents if p >= 0}
    paths = []
    for leaf in range(len(parents)):
        if leaf in children:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


@pytest.mark.parametrize("decode", [False, True], ids=["eager", "decode-twin"])
def test_tree_verify_logits_equal_each_path_as_a_chain(model, decode):
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (7,), generator=generator).tolist()
    nodes = torch.randint(0, vocab, (len(PARENTS),), generator=generator).tolist()
    parents = torch.tensor([PARENTS])
    length = len(prompt)  # the last prompt token is the round's input token
    anchor = torch.tensor([length])

    kv = model.allocate_kv_cache(len(TABLE) + 10, BLOCK)
    prefix = prompt[:-1]
    run(model, kv, prefix, range(len(prefix)), range(len(prefix)), len(prefix))
    step_tokens = [prompt[-1], *nodes]
    positions = verify_step_positions(parents, anchor)[0].tolist()
    cache_positions = range(length - 1, length - 1 + len(step_tokens))
    mask = verify_step_mask(parents)
    tree_logits = run(
        model, kv, step_tokens, positions, cache_positions, length + len(nodes), mask, decode
    )

    for path in leaf_paths(PARENTS):
        chain_kv = model.allocate_kv_cache(len(TABLE) + 10, BLOCK)
        chain = prompt + [nodes[n] for n in path]
        chain_logits = run(model, chain_kv, chain, range(len(chain)), range(len(chain)), len(chain))
        # The eager step on the CPU is a row plan (`DecodePlanCPU`): the chain's very bits.
        tolerance = 1e-5 if decode else 0.0
        torch.testing.assert_close(
            tree_logits[0], chain_logits[length - 1], rtol=tolerance, atol=tolerance
        )
        for i, node in enumerate(path):
            torch.testing.assert_close(
                tree_logits[1 + node], chain_logits[length + i], rtol=tolerance, atol=tolerance
            )
    # Without the mask the same step is plain causal attention over node order: it differs.
    causal = run(
        model, model.allocate_kv_cache(len(TABLE) + 10, BLOCK), prompt + nodes,
        range(len(prompt + nodes)), range(len(prompt + nodes)), len(prompt + nodes),
    )  # fmt: skip
    assert not torch.allclose(causal[length + 1], tree_logits[2], atol=1e-3)


def test_compacted_path_continues_as_the_chain(model):
    generator = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (6,), generator=generator).tolist()
    nodes = torch.randint(0, vocab, (len(PARENTS),), generator=generator).tolist()
    parents = torch.tensor([PARENTS])
    length = len(prompt)
    kv = model.allocate_kv_cache(len(TABLE) + 10, BLOCK)
    run(model, kv, prompt[:-1], range(length - 1), range(length - 1), length - 1)
    step_tokens = [prompt[-1], *nodes]
    positions = verify_step_positions(parents, torch.tensor([length]))[0].tolist()
    run(
        model, kv, step_tokens, positions, range(length - 1, length + len(nodes)),
        length + len(nodes), verify_step_mask(parents),
    )  # fmt: skip
    path = [1, 4]  # accepted nodes, root side first (depths 0 and 1)
    assert node_depths(parents)[0, path].tolist() == [0, 1]
    source, target = path_slots_to_compact(torch.tensor([path + [-1] * 6]), torch.tensor([2]))
    base = length - 1  # cache position of the input token (verify-step index 0)
    source_slots = cache_slots(TABLE, base + source[0, :2].numpy(), BLOCK)
    target_slots = cache_slots(TABLE, base + target[0, :2].numpy(), BLOCK)
    move_kv(kv, torch.from_numpy(source_slots), torch.from_numpy(target_slots))
    # The next step: the token after the path (the recovered/bonus token), attending causally
    # to the compacted context only.
    after = int(torch.randint(0, vocab, (1,), generator=generator))
    at = length + len(path)
    next_logits = run(model, kv, [after], [at], [at], at + 1)
    chain = prompt + [nodes[n] for n in path] + [after]
    chain_kv = model.allocate_kv_cache(len(TABLE) + 10, BLOCK)
    chain_logits = run(model, chain_kv, chain, range(len(chain)), range(len(chain)), len(chain))
    torch.testing.assert_close(next_logits[0], chain_logits[-1], rtol=1e-5, atol=1e-5)


def test_a_tree_step_beside_a_prefill_chunk_keeps_both_rules(model):
    """One eager step with a tree verify input and a longer prefill chunk of another sequence:
    the tree's rows equal their chains, the chunk's rows equal the chunk run alone."""
    from specdec.runner.model_runner import PagedModelRunner, StepInput

    generator = torch.Generator().manual_seed(8)
    vocab = model.config.vocab_size
    runner = PagedModelRunner(model, 32, BLOCK, max_num_seqs=4)
    prompt = torch.randint(0, vocab, (6,), generator=generator).tolist()
    chunk = torch.randint(0, vocab, (13,), generator=generator).tolist()
    nodes = torch.randint(0, vocab, (len(PARENTS),), generator=generator).tolist()
    blocks_a, blocks_b = [3, 9, 1, 7], [0, 2, 4, 5, 6]
    runner.run([StepInput(prompt[:-1], 0, blocks_a, 1)])
    both = runner.run(
        [
            StepInput([prompt[-1], *nodes], 5, blocks_a, len(nodes) + 1, list(PARENTS)),
            StepInput(chunk, 0, blocks_b, len(chunk)),
        ]
    )
    alone = PagedModelRunner(model, 32, BLOCK, max_num_seqs=4).run(
        [StepInput(chunk, 0, blocks_b, len(chunk))]
    )
    torch.testing.assert_close(both[1], alone[0], rtol=1e-5, atol=1e-5)
    for path in leaf_paths(PARENTS):
        chain = prompt + [nodes[n] for n in path]
        solo = PagedModelRunner(model, 32, BLOCK, max_num_seqs=4)
        logits = solo.run([StepInput(chain, 0, blocks_a, len(chain))])[0]
        for i, node in enumerate(path):
            torch.testing.assert_close(both[0][1 + node], logits[6 + i], rtol=1e-5, atol=1e-5)
