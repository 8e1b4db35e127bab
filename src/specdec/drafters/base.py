"""The Drafter interface; the base class owns draft sampling (the single call site of draft noise).

Subclasses compute draft logits and pass them to `draw` (or `sample_draft`) with the position Q
of the token they propose. `sample_draft` picks the stream from the request's verify method, maps
a reduced draft vocabulary to target ids (-inf elsewhere), applies the target's processing (the
request's penalties and bans too, with the drafts before Q as context), and returns exactly the
logits it sampled from. Subclasses never call the sampler or `specdec.rng`
themselves. Every drafter is built the same way, `from_config(spec, target, setup)`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.drafters.config import SpeculativeConfig
from specdec.rng import Stream, tree_draft_stream
from specdec.sampling import LogitsContext, SampleOutput, SamplingTensors, sample
from specdec.transfer import to_device

if TYPE_CHECKING:
    from specdec.drafters.device import DeviceDrafting, RoundView
    from specdec.models import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class DrafterSetup:
    """What the engine lends a drafter besides its config and the target.

    Attributes:
        num_blocks, block_size: the geometry of the drafter's own KV cache (as many blocks as the
            target's: a draft never holds more slots than the target for the same request).
        max_num_seqs: most requests in one round (sizes static buffers and graph buckets).
        max_model_len: longest request, in tokens.
        enforce_eager: never capture CUDA graphs.
        device_rounds: the engine may run rounds on the device (`device_drafting`): build the
            static buffers they need (on the CPU too, where they run op by op).
    """

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool = False
    device_rounds: bool = False


@dataclass(frozen=True, slots=True)
class DraftBatch:
    """What a drafter sees for one verification round of B requests.

    Attributes:
        token_ids: per request, every token so far (prompt + output); the last one is this
            round's input token, at position anchors[b] - 1.
        seeds: [B] int64 request seeds.
        anchors: [B] int64 position of each request's first draft token (the round anchor).
        num_draft: [B] int64 drafts wanted per request (0 = none).
        methods: per request, its verify method ("standard", "block" or "coupled").
        params: per-request sampling tensors ([B] each), the target's.
        request_ids: per request, its id (drafters with per-request state key it by this).
        context: the requests' penalties, biases, bans and grammars with their contexts
            (prompt and output so far), or None when no request has any; `draw` applies it.
    """

    token_ids: list[list[int]]
    seeds: torch.Tensor
    anchors: torch.Tensor
    num_draft: torch.Tensor
    methods: list[str]
    params: SamplingTensors
    request_ids: list[str] | None = None
    context: LogitsContext | None = None

    @property
    def batch_size(self) -> int:
        return len(self.token_ids)

    @property
    def max_draft(self) -> int:
        return int(self.num_draft.max()) if self.batch_size else 0


@dataclass(frozen=True, slots=True)
class Proposal:
    """Attributes:
    draft_token_ids: [B, K] int64 drafts (-1 beyond num_draft[b]).
    draft_logits: [B, K, V_target] float32 processed logits each draft was sampled from, or None
        for deterministic (one-hot) drafts.
    draft_logsumexp: [B, K] float32 log-normalisers of draft_logits, or None.
    num_draft: [B] int64 drafts per request.
    tree_parents: [B, K] int64 on the host for a draft tree (column n is node n, its parent
        -1 for the round's input token, else an earlier node: `specdec.draft_tree`), or None
        for chains.
    """

    draft_token_ids: torch.Tensor
    draft_logits: torch.Tensor | None
    draft_logsumexp: torch.Tensor | None
    num_draft: torch.Tensor
    tree_parents: torch.Tensor | None = None


class ProposalBuffer:
    """The tensors of a proposal being drafted, in target vocabulary, on `device`: [B, K] draft ids
    (-1 where nothing is drafted) and, for sampled drafts, [B, K, V] processed draft logits (-inf
    where nothing is drafted) with their [B, K] log-normalisers. `Drafter.draw` writes into it."""

    __slots__ = ("draft_logits", "draft_logsumexp", "draft_token_ids", "target_logits")

    def __init__(
        self,
        batch_size: int,
        k: int,
        vocab_size: int,
        device: torch.device,
        greedy: bool,
        reduced_vocab: bool = False,
    ) -> None:
        self.draft_token_ids = torch.full((batch_size, k), -1, dtype=torch.int64, device=device)
        # A drafter over a reduced vocabulary: [B, V] -inf outside its ids, kept between draws
        # (`Drafter.to_target_vocab` writes only the ids it drafts over).
        self.target_logits = None
        if reduced_vocab:
            self.target_logits = torch.full((batch_size, vocab_size), float("-inf"), device=device)
        self.draft_logits = None
        self.draft_logsumexp = None
        if not greedy:
            self.draft_logits = torch.full(
                (batch_size, k, vocab_size), float("-inf"), device=device
            )
            self.draft_logsumexp = torch.zeros(batch_size, k, device=device)

    def proposal(
        self, num_draft: torch.Tensor, tree_parents: torch.Tensor | None = None
    ) -> Proposal:
        return Proposal(
            self.draft_token_ids, self.draft_logits, self.draft_logsumexp, num_draft, tree_parents
        )


@dataclass(frozen=True, slots=True)
class TargetFeatures:
    """Target hidden features of newly committed tokens, one entry per request (drafters that
    read the target receive these through `Drafter.observe` after every engine step).

    Only tokens that are now part of the sequence are covered: a prefill chunk's tokens, or a
    decode round's input token plus its accepted drafts (features computed for rejected drafts
    are discarded). The token emitted by the step (sampled, recovered or bonus) has no feature
    yet: it is fed to the target, and its feature delivered, in the request's next step.

    Attributes:
        request_ids: per request, its id.
        starts: per request, the position of the first token covered (row 0 of its features).
        features: per request, [n_b, F] features of the tokens at positions starts[b] ..
            starts[b] + n_b - 1 (n_b >= 1), F = len(feature_layers) * hidden size, in the
            target's dtype and device: the outputs of `feature_layers` concatenated in that order.
    """

    request_ids: list[str]
    starts: list[int]
    features: list[torch.Tensor]


def draft_stream(method: str) -> Stream:
    """Coupled verification needs drafts drawn with the target's own noise; the ratio tests need
    noise of their own, keyed per round."""
    return Stream.TARGET if method == "coupled" else Stream.DRAFT


def draft_row_streams(
    methods: list[str],
    rows: torch.Tensor,
    tree_nodes: torch.Tensor | None,
    tree_ranks: torch.Tensor | None,
) -> list[int]:
    """The stream word of each draft row (host ints): `draft_stream` of its request's method
    for a chain; for a tree node, `Stream.TREE_DRAFT` with the node index (keyed per node, so
    siblings and cousins never share noise), except that a coupled request's first children take
    `Stream.TARGET` (the target's own noise, as its chain drafts do). Block is chain-only.

    Args:
        methods: per request, its verify method.
        rows: [N] int64 request index of each row (host).
        tree_nodes, tree_ranks: [N] int64 node index and sibling rank of each row, or None.
    """
    row_methods = [methods[r] for r in rows.tolist()]
    if tree_nodes is None:
        return [int(draft_stream(method)) for method in row_methods]
    if tree_ranks is None or not tree_nodes.shape == tree_ranks.shape == rows.shape:
        raise ValueError("tree_nodes and tree_ranks must both be given, one entry per row")
    if "block" in row_methods:
        raise ValueError(
            "block verification is chain-only: tree drafts need 'standard' or 'coupled'"
        )
    words = tree_draft_stream(tree_nodes.to("cpu", torch.int64)).tolist()
    ranks = tree_ranks.to("cpu").tolist()
    return [
        int(Stream.TARGET) if method == "coupled" and rank == 0 else word
        for method, word, rank in zip(row_methods, words, ranks, strict=True)
    ]


class Drafter(abc.ABC):
    """Proposes drafts for a batch of requests. Subclasses implement `propose`.

    Drafters that read the target set `feature_layers` (0-based target decoder layers, whose
    outputs before the final norm make a token's feature) and receive the features of committed
    tokens through `observe`, called after every engine step that ran the target on a request
    with speculation on, and before the request's next `propose`.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        target_vocab_size: int,
        draft_to_target: torch.Tensor | None = None,
        greedy: bool = False,
    ):
        """Args:
        target_vocab_size: V of the target.
        draft_to_target: [V_draft] int64 target id of each draft id, when the drafter works
            over a reduced vocabulary (None: the vocabularies are the same).
        greedy: propose the draft's argmax (one-hot drafts, no noise) instead of sampling.
        """
        self.target_vocab_size = target_vocab_size
        self.draft_to_target = draft_to_target
        self.greedy = greedy

    @classmethod
    def from_config(
        cls, spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup
    ) -> Drafter:
        """Builds the drafter of `spec` for `target` (the one signature of every drafter)."""
        raise NotImplementedError(f"{cls.__name__} has no from_config")

    @abc.abstractmethod
    def propose(self, batch: DraftBatch) -> Proposal:
        """Returns drafts for every request of `batch` (num_draft[b] of them)."""

    @staticmethod
    def num_draft_with_features(batch: DraftBatch) -> torch.Tensor:
        """[B] int64 drafts a drafter that reads target features can propose: none for a round
        anchored at A < 2 (a one-token prompt in its first round has no feature yet for the
        token before the anchor), else what the batch asks for. On the host."""
        anchors = batch.anchors.to("cpu")
        return torch.where(anchors < 2, 0, batch.num_draft.to("cpu"))

    def draw(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        batch: DraftBatch,
        out: ProposalBuffer,
        at: tuple,
    ) -> torch.Tensor:
        """Proposes one draft per row (the shared per-draft step of every model drafter): the
        argmax when `greedy`, else a sample through `sample_draft`; writes each row's draft id,
        processed logits and log-normaliser into `out` at the [B, K] index `at`.

        With a `batch.context`, row n's logits are processed with the drafts already in `out`
        before it (columns 0..j-1 of its request, j = Q - anchor) as context; rows of several
        draft indices in one call are then drawn index by index, so that draft j sees drafts
        0..j-1 (the keys, and so the draws, are the same).

        Args:
            logits: [N, V_draft] raw draft logits.
            rows: [N] int64 request index (into `batch`) of each row, on the host.
            positions: [N] int64 position Q of the token each row proposes.
            batch: the round's batch.
            out: the proposal being filled; column j of request b holds its draft at
                Q = anchors[b] + j.
            at: an index of `out.draft_token_ids` ([B, K]) selecting the N entries, in row order.

        Returns: [N] int64 drafts (target ids) on the logits' device.

        RNG: as `sample_draft` (none when greedy).
        """
        if batch.context is None:
            return self._draw_rows(logits, rows, positions, batch, out, at, None)
        rows = rows.to(device="cpu", dtype=torch.int64)
        index = positions.to("cpu", torch.int64) - batch.anchors.to("cpu")[rows]  # [N] j
        columns = sorted(set(index.tolist()))
        if len(columns) == 1:
            return self._draw_rows(logits, rows, positions, batch, out, at, columns[0])
        tokens = torch.empty(rows.shape[0], dtype=torch.int64, device=logits.device)
        for j in columns:
            picked = (index == j).nonzero().squeeze(1)
            on = picked.to(logits.device)
            part = rows[picked]
            cell = (part.to(out.draft_token_ids.device), j)
            tokens[on] = self._draw_rows(
                logits[on], part, positions[picked.to(positions.device)], batch, out, cell, j
            )
        return tokens

    def _draw_rows(self, logits, rows, positions, batch, out, at, column) -> torch.Tensor:
        """`draw` for rows whose drafts before them are the first `column` entries of their
        requests in `out` (None: no context)."""
        prefix = None
        if column is not None:
            index = rows.to(device=out.draft_token_ids.device, dtype=torch.int64)
            prefix = out.draft_token_ids[index, :column]
        if self.greedy:
            full = self.to_target_vocab(logits)
            if batch.context is not None:
                full = batch.context.apply(full, *self._context_rows(rows, prefix, full.device))
            tokens = full.argmax(dim=-1)
        else:
            # The keyword only when there is a context: subclasses' overrides keep the plain form.
            extra = {} if prefix is None else {"prefix": prefix}
            sampled = self.sample_draft(logits, rows, positions, batch, **extra)
            tokens = sampled.token_ids
            out.draft_logits[at] = sampled.processed_logits.to(out.draft_logits.device)
            out.draft_logsumexp[at] = sampled.logsumexp.to(out.draft_logsumexp.device)
        out.draft_token_ids[at] = tokens.to(out.draft_token_ids.device)
        return tokens

    @staticmethod
    def _context_rows(
        rows: torch.Tensor, prefix: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, prefix) of `LogitsContext.apply` on `device`."""
        index = to_device(rows.to("cpu", torch.int64), torch.int64, device)
        return index, None if prefix is None else prefix.to(device)

    def release(self, request_id: str) -> None:  # noqa: B027 - stateless drafters keep nothing
        """Forgets any state kept for a request that finished or was preempted."""

    def observe(self, features: TargetFeatures) -> None:  # noqa: B027 - most read no features
        """Receives the target features of newly committed tokens (only when `feature_layers`
        is non-empty). For a request, successive calls cover consecutive positions, except
        that after `release` (preemption) they restart from position 0."""

    def num_graphs(self) -> int:
        """The CUDA graphs this drafter holds of its own (0: none, or none on this device)."""
        return 0

    def warm_up(self) -> int:
        """Runs each of this drafter's graphed steps once per padded batch size on inert inputs
        (no cache slot written, no request state kept, no draw), so that their CUDA graphs are
        captured at start-up rather than under traffic (`engine.warm_up`). Returns the graphs
        captured (0: none of its own, or nothing captures them on this device)."""
        return 0

    def device_drafting(
        self, num_slots: int, width: int, max_model_len: int, device: torch.device
    ) -> DeviceDrafting | None:
        """This drafter's steps for device rounds on `device` over `num_slots` slots, each
        committing at most `width` tokens per round and holding at most `max_model_len`, or None
        when it drafts on the host only (then the engine runs its rounds synchronously)."""
        return None

    def draw_on_device(
        self,
        logits: torch.Tensor,
        positions: torch.Tensor,
        view: RoundView,
        out: ProposalBuffer,
        column: int,
    ) -> torch.Tensor:
        """`draw` for a device round: one draft per slot of `view` (all S rows, in slot order),
        written into column `column` of `out`. Device work only (no host reads), so a round that
        calls it can be replayed from a CUDA graph.

        Args:
            logits: [S, V_draft] raw draft logits.
            positions: [S] int64 position Q of the token each slot proposes.
            view: the round (seeds, anchors, sampling parameters, verify method).
            out: the round's proposal buffers ([S_max, K, ...]).
            column: the draft index i.

        Returns: [S] int64 drafts (target ids) on the logits' device.

        RNG: as `sample_draft`: `Stream.DRAFT` at (Q, anchor) for "standard"/"block", or
        `Stream.TARGET` at (Q) for "coupled"; V lanes per slot. Inert slots have temperature 0
        and take the argmax: their keys decide nothing.
        """
        num_rows = view.num_rows
        scratch = out.target_logits
        full = self.to_target_vocab(logits, None if scratch is None else scratch[:num_rows])
        if self.greedy:
            tokens = full.argmax(dim=-1)
            out.draft_token_ids[:num_rows, column] = tokens
            return tokens
        stream = draft_stream(view.method)
        params = view.params
        sampled = sample(
            full,
            view.seeds,
            positions,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            stream=stream,
            step=view.anchors if stream == Stream.DRAFT else 0,
            check_values=False,  # the engine's parameters, valid by construction
            out=SampleOutput(  # straight into column `column` of the proposal
                out.draft_token_ids[:num_rows, column],
                out.draft_logits[:num_rows, column],
                out.draft_logsumexp[:num_rows, column],
            ),
        )
        return sampled.token_ids

    def _draft_to_target_on(self, device: torch.device) -> torch.Tensor:
        """`draft_to_target` on `device`, copied there once (not at every draft step)."""
        source, cached = getattr(self, "_draft_to_target_cache", (None, None))
        if source is not self.draft_to_target or cached.device != device:
            cached = self.draft_to_target.to(device)
            self._draft_to_target_cache = (self.draft_to_target, cached)
        return cached

    def to_target_vocab(
        self, logits: torch.Tensor, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N, V_draft] -> [N, V_target] float32, -inf where the draft cannot go. `into`: an
        [N, V_target] float32 tensor that is already -inf outside the draft vocabulary's ids
        (a buffer kept between draws), written and returned instead of a new one."""
        if self.draft_to_target is None:
            if logits.shape[-1] != self.target_vocab_size:
                raise ValueError(
                    f"draft logits have {logits.shape[-1]} ids but the target has "
                    f"{self.target_vocab_size}; give draft_to_target for a reduced vocabulary"
                )
            return logits.to(torch.float32)
        if into is None:
            into = torch.full(
                (logits.shape[0], self.target_vocab_size), float("-inf"), device=logits.device
            )
        into.index_copy_(1, self._draft_to_target_on(logits.device), logits.to(torch.float32))
        return into

    def sample_draft(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        batch: DraftBatch,
        prefix: torch.Tensor | None = None,
        tree_nodes: torch.Tensor | None = None,
        tree_ranks: torch.Tensor | None = None,
        exclude: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Samples one draft per row: the only place draft noise is drawn.

        Args:
            logits: [N, V_draft] raw draft logits.
            rows: [N] int64 request index (into `batch`) of each row.
            positions: [N] int64 position Q of the token each row proposes.
            batch: the round's batch (seeds, anchors, methods, sampling parameters, context).
            prefix: [N, J] int64 drafts of the row's request before Q (-1 from the first
                absent one), the context `batch.context` processes the row with besides the
                request's output; None: none.
            tree_nodes: [N] int64 draft-tree node index of each row's token, or None for a
                chain (a tree's rows of one request each have their own node index).
            tree_ranks: [N] int64 each tree node's rank among its siblings (with tree_nodes).
            exclude: [N, J] int64 target ids a row may not take (-1 = none), set to -inf before
                processing: a tree node's earlier siblings, so that siblings are drawn without
                replacement (the returned logits are what was sampled from, exclusions included).

        Returns:
            SampleOutput in target vocabulary: token_ids [N] (target ids), processed_logits
            [N, V_target] (exactly what was sampled from), logsumexp [N].

        RNG: per row, `Stream.DRAFT` at (Q, anchor) for "standard"/"block" requests, or
        `Stream.TARGET` at (Q) for "coupled" requests; V lanes per sampled row. Tree rows:
        `Stream.TREE_DRAFT` at (Q, anchor, node) (`tree_draft_stream`), except a coupled
        request's first children, which take `Stream.TARGET` at (Q) as a chain's drafts do.
        """
        rows = rows.to(device="cpu", dtype=torch.int64)  # indices into the host batch
        full = self.to_target_vocab(logits)
        device = full.device
        if batch.context is not None:
            full = batch.context.apply(full, *self._context_rows(rows, prefix, device))
        if exclude is not None and exclude.shape[1]:
            exclude = exclude.to(device)
            banned = torch.where(exclude >= 0, exclude, full.shape[1])  # -1 -> a spare column
            spare = full.new_zeros(full.shape[0], 1)
            full = torch.cat([full, spare], dim=1).scatter(1, banned, float("-inf"))[:, :-1]
        n = full.shape[0]
        positions = positions.to(torch.int64)
        if positions.device != device:
            positions = to_device(positions, torch.int64, device)
        streams = draft_row_streams(batch.methods, rows, tree_nodes, tree_ranks)
        outputs = []
        for stream in (Stream.TARGET, Stream.DRAFT):
            # TARGET rows are position-keyed; every other row is keyed by its round's anchor.
            keyed = [s == Stream.TARGET for s in streams]
            picked = [i for i, k in enumerate(keyed) if k == (stream == Stream.TARGET)]
            if not picked:
                continue
            whole = len(picked) == n  # every row draws from this stream: no gather, no scatter
            req = rows if whole else rows[picked]
            # The batch's per-request tensors live on the host: one pinned copy per dtype.
            params = batch.params
            int_columns = [batch.seeds[req]]
            if stream == Stream.DRAFT:
                int_columns.append(batch.anchors[req])
            if params.top_k is not None:
                int_columns.append(params.top_k[req])
            float_columns = [params.temperature[req]]
            float_columns += [t[req] for t in (params.top_p, params.min_p) if t is not None]
            sent = to_device(torch.cat(int_columns), torch.int64, device)
            ints = iter(sent.split(len(picked)))  # in the order appended above
            sent = to_device(torch.cat(float_columns), torch.float32, device)
            floats = iter(sent.split(len(picked)))
            seeds = next(ints)
            step = next(ints) if stream == Stream.DRAFT else 0
            index = None if whole else to_device(picked, torch.int64, device)
            if stream == Stream.DRAFT and tree_nodes is not None:
                stream = to_device([streams[i] for i in picked], torch.int64, device)
            out = sample(
                full if whole else full[index],
                seeds,
                positions if whole else positions[index],
                temperature=next(floats),
                top_k=None if params.top_k is None else next(ints),
                top_p=None if params.top_p is None else next(floats),
                min_p=None if params.min_p is None else next(floats),
                stream=stream,
                step=step,
                check_values=False,  # the engine's parameters, valid by construction
            )
            if whole:
                return out
            outputs.append((index, out))
        token_ids = torch.empty(n, dtype=torch.int64, device=device)
        processed = torch.empty_like(full)
        logsumexp = torch.empty(n, dtype=torch.float32, device=device)
        for index, out in outputs:
            token_ids[index] = out.token_ids
            processed[index] = out.processed_logits
            logsumexp[index] = out.logsumexp
        return SampleOutput(token_ids, processed, logsumexp)
