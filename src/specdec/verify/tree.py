"""`verify_tree`: exact verification of a draft tree in PyTorch (standard recursive rejection,
coupled, and greedy at temperature 0), walking one root-to-node path per request. Block
verification is chain-only and refused here. Never creates noise itself (all of it comes from
`specdec.rng`), and never reads a draw twice in a round.

Streams, for the children of the node visited at depth d of a round anchored at A
(their tokens sit at Q = A + d):
- ACCEPT (Q, step=A), lane = the child's sibling rank: its acceptance uniform (standard). Only
  one node per depth is visited, so each (Q, A, lane) is read at most once per round, and a chain
  (one child per node) reads exactly the chain verifier's uniforms;
- RESIDUAL (Q): the recovered token when every child of the visited node is rejected;
- TARGET (Q): the bonus token at a leaf, and every coupled decision.
"""

from __future__ import annotations

import torch

from specdec.draft_tree import check_parents
from specdec.rng import Stream, uniform
from specdec.sampling.processing import RowParam
from specdec.sampling.sampler import gumbel_argmax_ref
from specdec.verify.inputs import check_verify_inputs
from specdec.verify.tree_inputs import PreparedTree, TreeVerifyResult, prepare_tree
from specdec.verify.verifier import residual_log_weights

TREE_METHODS = ("standard", "coupled")


def verify_tree(
    target_logits: torch.Tensor,
    parents: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_logits: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    temperature: RowParam,
    top_k: RowParam = None,
    top_p: RowParam = None,
    min_p: RowParam = None,
    num_nodes: torch.Tensor | None = None,
    method: str = "standard",
    check_values: bool = True,
) -> TreeVerifyResult:
    """Verifies one draft tree per request and emits the accepted path plus one token.

    At the visited node (first the root, the round's input token) the children are tried in node
    order. `standard` (SpecInfer's multi-step speculative sampling, Miao et al. 2024, Alg. 2;
    SpecTr, Sun et al. 2023): child i is accepted with probability min(1, r(x_i) / draft_i(x_i))
    against the residual r left by the children rejected before it (r starts as the target at
    the node; after a rejected child r <- norm(max(r - draft_i, 0))); the walk moves into an
    accepted child, and when every child is rejected the recovered token is drawn from the final
    r. The law of the emitted tokens is the target's whatever the tree, provided each child was
    drawn from its recorded draft_i independently of this round's acceptance uniforms (draft_i
    may depend on the siblings before it: sampling without replacement is exact).
    `coupled` (Daliri et al. 2024) accepts the child equal to the target's own Gumbel-max sample
    at that position, so the output is token-identical to plain sampling. Rows with temperature
    0 accept the child equal to the argmax. A leaf (or a node without live children) emits the
    bonus token.

    Args:
        target_logits: [B, N+1, V] raw target logits: row 0 is the distribution after the
            round's input token (of the token at positions[b]), row n+1 the one after node n.
        parents: [B, N] int64 parent of each node (-1 = the input token; else an earlier node).
        draft_token_ids: [B, N] int64 node tokens (node n's token at positions[b] + depth[n]).
        draft_logits: [B, N, V] processed logits node n's token was sampled from (target
            vocabulary, -inf where it cannot go), or None for deterministic (one-hot) drafts.
        seeds: [B] int64 request seeds.
        positions: [B] int64 position of the root's children; also the round anchor.
        temperature, top_k, top_p, min_p: scalars or [B]; processed exactly as `sample` does.
        num_nodes: [B] int64 in [0, N] live nodes per row (None = N); nodes beyond are ignored.
        method: "standard" or "coupled" ("block" is chain-only: refused).
        check_values: False skips the value checks and their host round trip, for callers whose
            inputs are valid by construction (the engine). With them, every live row (0..N)
            must have a distribution (a finite logit and no +inf), whichever path is walked.

    Returns:
        TreeVerifyResult(token_ids [B, N+1], num_accepted [B], accepted_nodes [B, N]).

    RNG: per visited depth d (Q = positions[b] + d): ACCEPT at (Q, anchor) with one lane per
    child tried (standard); RESIDUAL at Q when every child is rejected; TARGET at Q for the bonus
    and every coupled decision. Greedy rows draw nothing.
    """
    if method == "block":
        raise ValueError(
            "block verification is chain-only: verify a tree with 'standard' or 'coupled'"
        )
    if method not in TREE_METHODS:
        raise ValueError(f"tree method must be one of {TREE_METHODS}, got {method!r}")
    inputs = check_verify_inputs(
        target_logits,
        draft_token_ids,
        draft_logits,
        seeds,
        positions,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        num_draft=num_nodes,
        method=method,
        check_values=check_values,
    )
    if parents.shape != draft_token_ids.shape:
        raise ValueError(
            f"parents must have the shape of draft_token_ids {list(draft_token_ids.shape)}, "
            f"got {list(parents.shape)}"
        )
    check_parents(parents, inputs.num_draft)
    prepared = prepare_tree(inputs, parents.to(target_logits.device))
    if target_logits.is_cuda:
        from specdec.verify.tree_triton import verify_tree_triton

        return verify_tree_triton(prepared)
    return verify_tree_ref(prepared)


def verify_tree_ref(prepared: PreparedTree) -> TreeVerifyResult:
    """The PyTorch twin of the tree walk, vectorised over requests: one step per depth (the
    parity reference of `tree_triton.verify_tree_triton`)."""
    target, target_logp = prepared.target, prepared.target_logp
    batch, num_rows, _ = target.shape
    n = num_rows - 1
    device = target.device
    seeds, anchors, method = prepared.seeds, prepared.anchors, prepared.method
    greedy, children, tokens = prepared.greedy, prepared.children, prepared.tokens
    width = children.shape[2]
    draft_logp = None
    if prepared.draft_logits is not None:
        draft_logp = prepared.draft_logits - prepared.draft_lse[..., None]  # [B, N, V]
    max_depth = prepared.max_depth

    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.int64, device=device)  # row of the node: 0 = root
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    out_tokens = torch.full((batch, n + 1), -1, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, max(n, 0)), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    for depth in range(max_depth + 1):
        q_pos = anchors + depth  # [B] Q of this depth's children (and of a final token here)
        node_logp = target_logp[rows, current]  # [B, V] target at the visited node
        kids = children[rows, current]  # [B, C]
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        next_row = current.clone()
        if method == "coupled":
            choice = gumbel_argmax_ref(target[rows, current], greedy, seeds, q_pos, Stream.TARGET)
        else:
            choice = node_logp.argmax(dim=-1)  # greedy rows' target; overwritten below
        # The residual r as unnormalised log-weights plus its log-normaliser (0 at the start,
        # so a chain reads exactly the chain verifier's arithmetic).
        residual = node_logp.clone()
        log_norm = torch.zeros(batch, dtype=torch.float32, device=device)
        rejected_any = torch.zeros(batch, dtype=torch.bool, device=device)
        sampled = walking & ~greedy & (kids[:, 0] >= 0)
        accept_u = None
        if method == "standard" and bool(sampled.any()):
            accept_u = uniform(seeds, q_pos, Stream.ACCEPT, width, step=anchors)  # [B, C]
        for rank in range(width):
            child = kids[:, rank]  # [B]
            trying = walking & ~moved & (child >= 0)
            if not bool(trying.any()):
                break
            safe = child.clamp_min(0)
            token = tokens[rows, safe]
            if method == "coupled":
                accept = trying & (token == choice)
            else:
                accept_greedy = token == choice
                if accept_u is None:
                    accept = trying & greedy & accept_greedy
                else:
                    target_at = residual.gather(1, token[:, None]).squeeze(1) - log_norm
                    if draft_logp is None:
                        draft_at = torch.zeros_like(target_at)
                        child_logp = None
                    else:
                        child_logp = draft_logp[rows, safe]  # [B, V]
                        draft_at = child_logp.gather(1, token[:, None]).squeeze(1)
                    accept_sampled = accept_u[:, rank].log() + draft_at < target_at
                    accept = trying & torch.where(greedy, accept_greedy, accept_sampled)
                    reject = trying & ~accept & ~greedy
                    if bool(reject.any()):
                        if child_logp is None:
                            child_logp = torch.full_like(residual, float("-inf"))
                            child_logp.scatter_(1, token[:, None], 0.0)
                        picked = reject.nonzero().squeeze(1)
                        updated = residual_log_weights(
                            residual[picked], child_logp[picked], -log_norm[picked]
                        )
                        residual[picked] = updated
                        log_norm[picked] = updated.logsumexp(dim=-1)
                        rejected_any |= reject
            moved |= accept
            next_row = torch.where(accept, child + 1, next_row)
        # Rows that stop at this depth emit one token at Q.
        stopping = walking & ~moved
        final = choice.clone()  # coupled: the target's sample; greedy rows: the argmax
        if method == "standard":
            recover = (stopping & rejected_any).nonzero().squeeze(1)
            if recover.numel():
                final[recover] = gumbel_argmax_ref(
                    residual[recover],
                    torch.zeros_like(recover, dtype=torch.bool),
                    seeds[recover],
                    q_pos[recover],
                    Stream.RESIDUAL,
                )
            bonus = (stopping & ~rejected_any & ~greedy).nonzero().squeeze(1)
            if bonus.numel():
                final[bonus] = gumbel_argmax_ref(
                    target[bonus, current[bonus]],
                    torch.zeros_like(bonus, dtype=torch.bool),
                    seeds[bonus],
                    q_pos[bonus],
                    Stream.TARGET,
                )
        out_tokens[rows, num_accepted] = torch.where(
            stopping, final, out_tokens[rows, num_accepted]
        )
        advancing = walking & moved
        if bool(advancing.any()):
            step_node = next_row - 1
            at = advancing.nonzero().squeeze(1)
            column = num_accepted[at]
            out_tokens[at, column] = tokens[at, step_node[at]]
            accepted_nodes[at, column] = step_node[at]
            num_accepted[at] += 1
        current = torch.where(advancing, next_row, current)
        walking = advancing
        if not bool(walking.any()):
            break
    return TreeVerifyResult(out_tokens, num_accepted, accepted_nodes)
