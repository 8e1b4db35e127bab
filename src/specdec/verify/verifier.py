"""`verify` (dispatch: the fused Triton kernels on CUDA, the PyTorch twin elsewhere) and
`verify_ref`, the PyTorch twin: token-level, block and coupled verification, written as the
algorithms read. Exact in law for every method; keyed per DESIGN.md so that a row's outcome
depends only on its own inputs and key. Never creates noise itself (all of it comes from
`specdec.rng`).

Streams, for the draft at position Q of a round anchored at A (A = positions[b]):
- ACCEPT (Q, step=A): the acceptance uniform of that draft (standard, block);
- RESIDUAL (Q): the recovered token at the first rejection (standard, block);
- TARGET (Q): the bonus token after a fully accepted chain, and every coupled decision.
"""

from __future__ import annotations

import torch

from specdec.rng import Stream, uniform
from specdec.sampling.context import LogitsContext
from specdec.sampling.processing import RowParam, process_logits
from specdec.sampling.sampler import gumbel_argmax_ref
from specdec.sampling.tensors import SamplingTensors
from specdec.verify.inputs import ValueCheck, VerifyInputs, VerifyResult, check_verify_inputs


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_logits: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    temperature: RowParam,
    top_k: RowParam = None,
    top_p: RowParam = None,
    min_p: RowParam = None,
    num_draft: torch.Tensor | None = None,
    method: str = "standard",
    draft_logsumexp: torch.Tensor | None = None,
    active_rows: int | None = None,
    context: LogitsContext | None = None,
) -> VerifyResult:
    """Verifies one round of drafts per request and emits the accepted prefix plus one token.

    Args:
        target_logits: [B, K+1, V] raw target logits; row i is the distribution of the token at
            positions[b] + i (row num_draft[b] is the bonus row). NaN counts as -inf. A row
            that the round reads (`specdec.verify.inputs.rows_read`: rows 0..num_draft[b]-1
            always, the bonus row when every draft is accepted) without a finite logit, or
            with a +inf, is refused (ValueError naming target_logits[b, row]); a row the
            outcome never reads (such as the bonus row after a rejection) may hold anything.
        draft_token_ids: [B, K] int64 drafts; entries at or beyond num_draft[b] are ignored.
        draft_logits: [B, K, V] processed logits the drafts were sampled from (what `sample`
            returned; -inf where the draft cannot go), or None for deterministic (one-hot) drafts.
        seeds: [B] int64 request seeds.
        positions: [B] int64 position of draft_token_ids[b, 0]; also the round anchor; at most
            2**32 - 1 - K (the round keys positions .. positions + K, on every device).
        temperature, top_k, top_p, min_p: scalars or [B]; processed exactly as `sample` does.
        num_draft: [B] int64 in [0, K] drafts per row (None = K); 0 means one plain sample.
        method: "standard" (Leviathan et al. 2023), "block" (Sun et al. 2024) or "coupled"
            (Daliri et al. 2024: drafts sampled with Stream.TARGET; accept iff equal).
        draft_logsumexp: optional [B, K] float32 log-normaliser of draft_logits (what `sample`
            returned as `logsumexp`); it must be exactly that, and saves a pass over the drafts.
        active_rows: rows >= active_rows are padding: they emit -1, accept nothing and draw no
            noise (None = all rows are live).
        context: the B requests' penalties, biases, bans and grammar masks
            (`specdec.sampling.LogitsContext`):
            row j of request b is processed as if drafts 0..j-1 had been accepted; the drafts
            must have been sampled from logits processed the same way (`Drafter.sample_draft`).

    Returns:
        VerifyResult(token_ids [B, K+1] int64 padded with -1, num_accepted [B] int64).

    RNG: ACCEPT at (Q, anchor) per draft; RESIDUAL at the first rejected Q; TARGET at the bonus
    position (and at every row for "coupled"). Keys never depend on the batch row.
    """
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
        num_draft=num_draft,
        method=method,
        draft_logsumexp=draft_logsumexp,
        active_rows=active_rows,
        check_values=False,
        context=context,
    )
    # The value checks read their values back while the kernels run: the kernels are memory-safe
    # on any values (they clamp ids and counts; a row is read only by its own request's
    # outcome), and nothing is returned before the checks pass. Filtering rows first compute
    # thresholds from the parameters, so those wait for the checks.
    check = _value_check(inputs)
    params = inputs.params
    if not target_logits.is_cuda or any(
        t is not None for t in (params.top_k, params.top_p, params.min_p)
    ):
        check.wait()
    result = verify_checked(inputs)
    check.wait()
    check.wait_read(result.num_accepted)
    return result


def _value_check(inputs: VerifyInputs) -> ValueCheck:
    """The value checks of validated inputs, the target rows included (started, not waited)."""
    return ValueCheck(
        inputs.draft_token_ids,
        inputs.draft_logits,
        inputs.positions,
        inputs.num_draft,
        inputs.params,
        inputs.method,
        inputs.active_rows,
        inputs.target_logits.shape[-1],
        inputs.target_logits,
    )


def verify_checked(inputs: VerifyInputs) -> VerifyResult:
    """`verify` on inputs already built by `check_verify_inputs`: the fused Triton kernels on
    CUDA, the PyTorch twin elsewhere."""
    if inputs.target_logits.is_cuda:
        from specdec.verify.verifier_triton import verify_triton

        return verify_triton(inputs)
    return verify_checked_ref(inputs)


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] int64: the length of the all-True prefix of each row."""
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def residual_log_weights(
    target_logp: torch.Tensor, draft_logp: torch.Tensor, log_weight: torch.Tensor
) -> torch.Tensor:
    """log max(w * target - draft, 0) per row, with w = exp(log_weight) (w = 1 for token-level).

    Computed as a + log1p(-exp(draft - a)) where a = log w + target > draft, -inf elsewhere, so the
    rejected token of a token-level chain drops out by itself. Rows whose residual is empty (only
    possible through rounding) fall back to the target.

    Args:
        target_logp: [N, V] target log-probabilities.
        draft_logp: [N, V] draft log-probabilities (0 / -inf for a one-hot draft).
        log_weight: [N] log w, <= 0.
    """
    lifted = target_logp + log_weight[:, None]
    log_res = torch.where(
        draft_logp < lifted,
        lifted + torch.log1p(-torch.exp(draft_logp - lifted)),
        torch.full_like(lifted, float("-inf")),
    )
    empty = torch.isneginf(log_res).all(dim=-1)
    if bool(empty.any()):
        log_res[empty] = target_logp[empty]
    return log_res


def verify_ref(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_logits: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    temperature: RowParam,
    top_k: RowParam = None,
    top_p: RowParam = None,
    min_p: RowParam = None,
    num_draft: torch.Tensor | None = None,
    method: str = "standard",
    draft_logsumexp: torch.Tensor | None = None,
    active_rows: int | None = None,
    context: LogitsContext | None = None,
) -> VerifyResult:
    """The PyTorch twin of `specdec.verify.verify` (same arguments and results)."""
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
        num_draft=num_draft,
        method=method,
        draft_logsumexp=draft_logsumexp,
        active_rows=active_rows,
        check_values=False,
        context=context,
    )
    check = _value_check(inputs)
    check.wait()
    result = verify_checked_ref(inputs)
    check.wait_read(result.num_accepted)
    return result


def verify_checked_ref(inputs: VerifyInputs) -> VerifyResult:
    """`verify_ref` on already validated inputs. Padded rows (>= active_rows) are not touched:
    they emit -1 and accept nothing, and draw no noise."""
    batch, num_rows, _ = inputs.target_logits.shape
    device = inputs.target_logits.device
    token_ids = torch.full((batch, num_rows), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    active = inputs.active_rows
    if active:
        tokens, accepted = _verify_active_rows(inputs, active)
        token_ids[:active] = tokens
        num_accepted[:active] = accepted
    return VerifyResult(token_ids, num_accepted)


def _verify_active_rows(inputs: VerifyInputs, active: int) -> tuple[torch.Tensor, torch.Tensor]:
    target_logits = inputs.target_logits[:active]
    _, num_rows, vocab = target_logits.shape
    k = num_rows - 1
    device = target_logits.device
    seeds, anchors = inputs.seeds[:active], inputs.positions[:active]
    num_draft = inputs.num_draft[:active]
    params = SamplingTensors(
        *(
            None if t is None else t[:active]
            for t in (
                inputs.params.temperature,
                inputs.params.top_k,
                inputs.params.top_p,
                inputs.params.min_p,
            )
        )
    )
    row_params = params.repeat_interleave(num_rows)
    target = process_logits(
        target_logits.reshape(active * num_rows, vocab),
        row_params.temperature,
        row_params.top_k,
        row_params.top_p,
        row_params.min_p,
    ).view(active, num_rows, vocab)
    greedy = params.temperature == 0  # [B]
    row_positions = anchors[:, None] + torch.arange(num_rows, device=device)  # [B, K+1] Q
    in_chain = torch.arange(k, device=device)[None, :] < num_draft[:, None]  # [B, K]
    drafts = torch.where(in_chain, inputs.draft_token_ids[:active], 0)  # [B, K]
    if device.type == "cpu" and inputs.method == "coupled" and not bool(greedy.all()):
        accepted, final = _coupled_cpu(target, drafts, num_draft, greedy, seeds, row_positions)
        return _emit(drafts, accepted, final), accepted
    target_argmax = target.argmax(dim=-1)  # [B, K+1]
    greedy_accepted = leading_true((drafts == target_argmax[:, :k]) & in_chain)
    if device.type == "cpu" and bool(greedy.all()):
        # Every row greedy (on the CPU, where asking costs no device sync): what each method
        # below emits for a greedy row, without its log-softmaxes and uniforms (a K = 1 round
        # on a 2-core EPYC spent ~1 ms of its 2.2 ms of verification there).
        final = target_argmax.gather(1, greedy_accepted[:, None]).squeeze(1)
        return _emit(drafts, greedy_accepted, final), greedy_accepted

    if inputs.method == "coupled":
        # Daliri et al. 2024: drafts carry the target's own noise; accept iff equal.
        samples = gumbel_argmax_ref(
            target.view(active * num_rows, vocab),
            greedy.repeat_interleave(num_rows),
            seeds.repeat_interleave(num_rows),
            row_positions.flatten(),
            Stream.TARGET,
        ).view(active, num_rows)
        accepted = leading_true((drafts == samples[:, :k]) & in_chain)
        final = samples.gather(1, accepted[:, None]).squeeze(1)
        return _emit(drafts, accepted, final), accepted

    target_logp = target.log_softmax(dim=-1)  # [B, K+1, V]
    target_at_draft = target_logp[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    if inputs.draft_logits is None:
        draft_logp = None
        draft_at_draft = torch.zeros_like(target_at_draft)
    else:
        draft = inputs.draft_logits[:active].to(torch.float32)
        if inputs.draft_logsumexp is not None:
            lse = inputs.draft_logsumexp[:active].to(torch.float32)
        else:
            lse = draft.logsumexp(dim=-1)
        draft_logp = draft - lse[..., None]  # [B, K, V]
        draft_at_draft = draft_logp.gather(-1, drafts[..., None]).squeeze(-1)
    accept_u = uniform(
        seeds.repeat_interleave(k),
        row_positions[:, :k].flatten(),
        Stream.ACCEPT,
        1,
        step=anchors.repeat_interleave(k),
    ).view(active, k)

    if inputs.method == "standard":
        # Leviathan et al. 2023, Alg. 1: accept draft i iff u_i * draft(x_i) < target(x_i).
        accept = (accept_u.log() + draft_at_draft < target_at_draft) & in_chain
        accepted = leading_true(accept)
        log_weight = torch.zeros(active, dtype=torch.float32, device=device)
    else:
        accepted, log_weight = _block_tau(
            target_logp, draft_logp, drafts, target_at_draft, draft_at_draft, accept_u, num_draft
        )
    accepted = torch.where(greedy, greedy_accepted, accepted)

    all_accepted = accepted == num_draft
    final_row = target.gather(1, accepted[:, None, None].expand(-1, 1, vocab)).squeeze(1)
    final = final_row.argmax(dim=-1)  # greedy rows: the target's argmax, no noise
    bonus = (all_accepted & ~greedy).nonzero().squeeze(1)  # rejected rows draw a residual below
    if bonus.numel():
        final[bonus] = gumbel_argmax_ref(
            final_row[bonus],
            torch.zeros_like(bonus, dtype=torch.bool),
            seeds[bonus],
            anchors[bonus] + accepted[bonus],
            Stream.TARGET,
        )
    rejected = (~all_accepted & ~greedy).nonzero().squeeze(1)
    if rejected.numel():
        rows = accepted[rejected]
        rejected_target = target_logp[rejected, rows]  # [R, V]
        if draft_logp is None:
            rejected_draft = torch.full_like(rejected_target, float("-inf"))
            rejected_draft.scatter_(1, drafts[rejected, rows][:, None], 0.0)
        else:
            rejected_draft = draft_logp[rejected, rows]
        log_res = residual_log_weights(rejected_target, rejected_draft, log_weight[rejected])
        final[rejected] = gumbel_argmax_ref(
            log_res,
            torch.zeros_like(rows, dtype=torch.bool),
            seeds[rejected],
            anchors[rejected] + rows,
            Stream.RESIDUAL,
        )
    return _emit(drafts, accepted, final), accepted


def _coupled_cpu(
    target: torch.Tensor,
    drafts: torch.Tensor,
    num_draft: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    row_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled verification on the CPU (accepted [B], final [B]): what the "coupled" branch of
    `_verify_active_rows` computes, row by row, sampling each request's rows only up to its
    first rejection (asking costs no device sync here). The rows past it are never read, so
    their noise is not drawn; the rows sampled are the same rows with the same keys."""
    active, num_rows, _ = target.shape
    accepted = torch.zeros(active, dtype=torch.int64)
    final = torch.zeros(active, dtype=torch.int64)
    live = torch.arange(active)  # requests whose drafts 0..j-1 were all accepted
    for j in range(num_rows):
        samples = gumbel_argmax_ref(
            target[live, j], greedy[live], seeds[live], row_positions[live, j], Stream.TARGET
        )
        if j < num_rows - 1:
            match = (j < num_draft[live]) & (drafts[live, j] == samples)
        else:
            match = torch.zeros_like(live, dtype=torch.bool)
        stop = ~match
        final[live[stop]] = samples[stop]
        accepted[live[stop]] = j
        live = live[match]
        if not live.numel():
            break
    return accepted, final


def _block_tau(
    target_logp: torch.Tensor,
    draft_logp: torch.Tensor | None,
    drafts: torch.Tensor,
    target_at_draft: torch.Tensor,
    draft_at_draft: torch.Tensor,
    accept_u: torch.Tensor,
    num_draft: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative
    Decoding", Alg. 2): returns (tau [B], log p_tau [B]).

    p_0 = 1, p_i = min(p_{i-1} target(X_i) / draft(X_i), 1);
    h_i = S_i / (S_i + 1 - p_i) for i < n, with S_i = sum_x max(p_i target_i(x) - draft_i(x), 0)
    over row i's distributions; h_n = p_n; tau = max{i : eta_i < h_i} (h_0 = 1).
    The uniforms eta_i are read past the accepted prefix, which is why ACCEPT is round-keyed.
    """
    active, k = drafts.shape
    device = drafts.device
    log_p = torch.zeros(active, k + 1, dtype=torch.float32, device=device)  # log p_i, i=0..K
    for i in range(1, k + 1):
        step = target_at_draft[:, i - 1] - draft_at_draft[:, i - 1]
        log_p[:, i] = torch.clamp_max(log_p[:, i - 1] + step, 0.0)
    if k == 0:
        return torch.zeros(active, dtype=torch.int64, device=device), log_p[:, 0]
    target_prob = target_logp[:, :k].exp()  # [B, K, V] rows 0..K-1
    if draft_logp is None:
        draft_prob = torch.zeros_like(target_prob)
        draft_prob.scatter_(-1, drafts[..., None], 1.0)
    else:
        draft_prob = draft_logp.exp()
    p = log_p.exp()  # [B, K+1]
    mass = (p[:, :k, None] * target_prob - draft_prob).clamp_min(0).sum(dim=-1)  # S_i, i<K
    h = torch.where(p[:, :k] >= 1, torch.ones_like(mass), mass / (mass + 1 - p[:, :k]))
    h = torch.cat([h, torch.zeros(active, 1, device=device)], dim=1)  # [B, K+1]
    index = torch.arange(1, k + 1, device=device)[None, :]  # i = 1..K
    h_at = torch.where(index < num_draft[:, None], h[:, 1:], p[:, 1:])
    ok = (accept_u < h_at) & (index <= num_draft[:, None])
    tau = (ok.to(torch.int64) * index).amax(dim=-1)
    return tau, log_p.gather(1, tau[:, None]).squeeze(1)


def _emit(drafts: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: accepted drafts, then `final` at column `accepted`, then -1."""
    k = drafts.shape[1]
    columns = torch.arange(k + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], dim=1)
    out = torch.where(columns < accepted[:, None], padded, torch.full_like(padded, -1))
    return out.scatter(1, accepted[:, None], final[:, None])
