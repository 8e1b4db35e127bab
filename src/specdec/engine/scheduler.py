"""Continuous batching with chunked prefill and preemption by recompute.

Decides, each step, which requests run and how many query tokens each feeds; owns the waiting and
running queues and the block accounting. Never touches tensors: the model runner turns a
`SchedulerOutput` into a batch. A preempted request drops its KV blocks and later recomputes them;
since every draw is keyed by (seed, position), it then produces exactly the tokens it would have.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specdec.engine.request import Request, RequestStatus
from specdec.runner.kv_cache import BlockAllocator


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """max_num_seqs: requests per step; max_num_batched_tokens: query tokens per step;
    max_model_len: tokens per request (prompt + output); prefill_graph_tokens,
    prefill_graph_width: a prefill of at most prefill_graph_tokens tokens still to compute is
    chunked at prefill_graph_width tokens a step (the runner's graphed prefill; 0: never). No
    defaults: the engine's settings (`EngineConfig`) are the only place they are chosen."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_graph_tokens: int
    prefill_graph_width: int


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step (built for every running request at every step, so it is a
    plain slotted class: a frozen dataclass costs several times as much to construct).

    Attributes:
        request: the request.
        num_query_tokens: tokens fed this step, starting at position request.num_computed_tokens
            (their K/V are written); for a decode step: the last token plus `num_draft` drafts.
        num_draft: drafts to propose and verify (0 for a prefill chunk).
        emits: whether this step emits tokens for the request (the chunk reaches its last token).
    """

    request: Request
    num_query_tokens: int
    num_draft: int
    emits: bool

    def cap_drafts(self, cap: int) -> None:
        """At most `cap` drafts this step (the slots allocated for the others are released
        when the step commits)."""
        if self.num_draft > cap:
            self.num_query_tokens -= self.num_draft - cap
            self.num_draft = cap


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_query_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)


class Scheduler:
    """FIFO admission, running requests first; the newest running request is preempted when
    blocks run out."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        """Queues a new request. Raises ValueError if its prompt cannot fit."""
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_prompt_tokens} tokens "
                f"leaves no room to generate within max_model_len={self.config.max_model_len}"
            )
        max_slots = self.allocator.num_blocks * self.allocator.block_size
        if request.num_prompt_tokens + 1 > max_slots:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_prompt_tokens} tokens "
                f"exceeds the whole KV cache ({max_slots} slots)"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests. Mutates: queues, request.status, request.block_ids."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        index = 0
        block_size = self.allocator.block_size
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            share = self._share(request, budget)
            if share is None:
                break
            needed = request.num_computed_tokens + share.num_query_tokens
            if needed <= len(request.block_ids) * block_size:  # most decode steps: no new block
                scheduled.append(share)
                budget -= share.num_query_tokens
                index += 1
                continue
            while not self.allocator.can_grow(request, needed):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self.allocator.grow(request, needed)
                scheduled.append(share)
                budget -= share.num_query_tokens
                index += 1
                continue
            break
        return SchedulerOutput(scheduled + self._admit(budget), preempted)

    def _admit(
        self, budget: int, accept: Callable[[Request], bool] | None = None
    ) -> list[ScheduledRequest]:
        """Waiting requests, first come first served, while the token budget, max_num_seqs and
        the free blocks allow (never preempting), stopping at the first that `accept` (when
        given) refuses. Mutates: queues, request.status, request.block_ids."""
        admitted: list[ScheduledRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if accept is not None and not accept(request):
                break
            share = self._share(request, budget)
            if share is None:
                break
            needed = request.num_computed_tokens + share.num_query_tokens
            if not self.allocator.can_grow(request, needed):
                break
            self.waiting.popleft()
            self.allocator.grow(request, needed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(share)
            budget -= share.num_query_tokens
        return admitted

    def schedule_ahead(self, hold: set[int], admit: bool = True) -> list[ScheduledRequest] | None:
        """`schedule` for a step launched before the previous one is read (asynchronous
        scheduling): the running requests whose id() is in `hold` (their last token, still on
        the device, ends them) get no share, and nothing is preempted: None, with nothing
        changed, when a running request's share does not fit the free blocks (the caller reads
        the step in flight first and schedules as usual). Waiting requests are admitted as
        `schedule` admits them (`admit`: False admits none). Mutates (when not None): queues,
        request.status, request.block_ids."""
        budget = self.config.max_num_batched_tokens
        allocator = self.allocator
        shares: list[ScheduledRequest] = []
        needed_blocks = 0
        for request in self.running:
            if budget <= 0:
                break
            if id(request) in hold:
                continue
            share = self._share(request, budget)
            if share is None:
                break
            needed = request.num_computed_tokens + share.num_query_tokens
            needed_blocks += max(allocator.blocks_needed(needed) - len(request.block_ids), 0)
            shares.append(share)
            budget -= share.num_query_tokens
        if needed_blocks > allocator.num_free_blocks:
            return None
        for share in shares:
            request = share.request
            allocator.grow(request, request.num_computed_tokens + share.num_query_tokens)
        return shares + self._admit(budget) if admit else shares

    def schedule_joining(
        self,
        joining: list[Request],
        budget: int,
        accept: Callable[[Request], bool],
        decoding: list[Request] = (),
    ) -> list[ScheduledRequest]:
        """A step beside running device rounds (which schedule their own decode rows): one
        plain decode token for each of `decoding` (requests that decode beside the rounds,
        not drafting), the next prefill chunk of each of `joining` still in prefill, then
        waiting requests as `_admit` takes them while `accept` does. Never preempts: a share
        that does not fit the free blocks waits. Mutates: queues, request.status,
        request.block_ids."""
        shares: list[ScheduledRequest] = []
        for request in decoding:
            if budget <= 0:
                break
            if request.status.finished or request.in_prefill or request.num_pending:
                continue
            needed = request.num_computed_tokens + 1
            if not self.allocator.can_grow(request, needed):
                break
            self.allocator.grow(request, needed)
            shares.append(ScheduledRequest(request, 1, 0, True))
            budget -= 1
        for request in joining:
            if budget <= 0:
                break
            if request.status.finished or not request.in_prefill:
                continue
            share = self._share(request, budget)
            needed = request.num_computed_tokens + share.num_query_tokens
            if not self.allocator.can_grow(request, needed):
                break
            self.allocator.grow(request, needed)
            shares.append(share)
            budget -= share.num_query_tokens
        return shares + self._admit(budget, accept)

    def _share(self, request: Request, budget: int) -> ScheduledRequest | None:
        """The request's share of this step, or None when a decode round does not fit `budget`.

        A request's rounds (their anchors and draft counts) depend on the request alone, never on
        the batch: a decode round always proposes its full K (bounded by the request's own
        limits) or waits. A preempted request recomputes its K/V up to (not including) its last
        token without emitting, then resumes the very round it would have run.
        """
        num_tokens = request.num_tokens
        if request.num_computed_tokens < num_tokens - 1:  # request.in_prefill
            end = num_tokens if not request.output_token_ids else num_tokens - 1
            remaining = end - request.num_computed_tokens
            chunk = min(remaining, budget)
            if remaining <= self.config.prefill_graph_tokens:
                chunk = min(chunk, self.config.prefill_graph_width)
            emits = chunk == remaining and not request.output_token_ids
            return ScheduledRequest(request, chunk, 0, emits)
        if request.spec is None:
            return ScheduledRequest(request, 1, 0, True)  # budget > 0 always fits one token
        room = self.config.max_model_len - num_tokens - 1
        max_tokens = request.params.max_tokens
        left = room + 1 if max_tokens is None else max_tokens - len(request.output_token_ids)
        num_draft = max(0, min(request.spec.num_speculative_tokens, room, left - 1))
        if 1 + num_draft > budget:
            return None
        return ScheduledRequest(request, 1 + num_draft, num_draft, True)

    def _preempt(self, request: Request) -> None:
        self.allocator.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def commit(self, request: Request, num_computed_tokens: int) -> None:
        """Records that the first `num_computed_tokens` tokens of `request` now have valid K/V
        (after a step: the prefill chunk, or the input token plus the accepted drafts) and
        releases the blocks of rejected draft slots beyond them.
        Mutates: request.num_computed_tokens, request.block_ids."""
        request.num_computed_tokens = num_computed_tokens
        if (len(request.block_ids) - 1) * self.allocator.block_size >= num_computed_tokens:
            self.allocator.rollback(request, num_computed_tokens)  # a block past the last needed

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Removes a request from the queues and frees its blocks. Mutates: queues, request."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request)
        request.status = status
