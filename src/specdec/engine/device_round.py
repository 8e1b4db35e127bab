"""The speculative round on the device, overlapped with the host.

While every running request decodes with speculation, each request keeps a slot (a row of
persistent device buffers: the round anchor, the input token, seed and sampling parameters) and a
whole round runs as one step over static buffers, with no host synchronisation inside: the
drafter's K steps (`DeviceDrafting.propose`), the target's forward over [input token + K drafts],
the verifier, and the acceptance bookkeeping (next anchor, next input token, what the drafter
needs next: `DeviceDrafting.observe`). On CUDA the step is replayed from a CUDA graph per
(batch bucket, K); elsewhere it runs op by op on the same buffers.

The host launches round N + 1 before it reads round N's tokens (through pinned memory), so it
applies stops one round late: a request that finished in round N is inert from round N + 2 on,
and whatever round N + 1 emitted for it is dropped, never reported. A request whose round read a
target row without a distribution (`first_unusable_read_row`, computed in the round and read
back with its tokens) is ended the same way, with an error, emitting nothing from that round.
A request that asks for logprobs rides the rounds: after a round, its rows' logprobs are
computed on the device from the raw target logits the round left (`compute_logprobs`, as the
overlapped plain loop computes them) and read back with its tokens.
A request with logits rules (penalties, bias, allowed tokens, single-token bad words,
min_tokens) holds them in its slot (`SlotRules`): the round processes its verify rows with them,
the drafts before each row counted as output, and adds its emitted tokens to the slot's output
counts, all inside the round (a batch holding such a request runs its own graph per key).
Blocks are allocated ahead for the rounds in flight. A new request joins without a drain
(`admit`: its prefill ran beside the rounds; it takes a free slot for the next launch). A
request the rounds cannot take (a grammar, a multi-token bad word) holds no slot: the engine
decodes it beside them, between two rounds (s43). A preemption or a request near its length
limit drains the rounds in flight and hands the batch back to the overlapped loop.

Never draws randomness itself: drafts come from the drafter, emitted tokens from `verify`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from specdec.drafters import Drafter
from specdec.drafters.device import DeviceDrafting, DeviceSlot, RoundView
from specdec.engine.emitter import Emission
from specdec.engine.request import Request
from specdec.engine.round_bookkeeping import finish_round, round_inputs
from specdec.engine.round_buffers import RoundInputs, RoundResults, RoundSlots
from specdec.engine.round_logprobs import LogprobEntries, ReadLogprobs, RoundLogprobs
from specdec.runner import PagedModelRunner
from specdec.runner.cuda_graph import GraphCache, StaticInputs, batch_buckets, bucket_for
from specdec.sampling import SamplingTensors, compute_logprobs
from specdec.sampling.slot_rules import SlotRules
from specdec.transfer import to_device
from specdec.verify import check_verify_inputs, first_unusable_read_row, verify_checked


def mark(device: torch.device) -> torch.cuda.Event | float:
    """A point in time of the device's work: a recorded CUDA event, or the host clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    """Seconds from one `mark` to a later one (events: both completed)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


Span = tuple[torch.cuda.Event | float, torch.cuda.Event | float]  # two `mark`s: start, end


def round_cost(
    previous: torch.cuda.Event | float | None,
    ended: torch.cuda.Event | float,
    interruptions: list[Span | None],
) -> float | None:
    """A round's cost in steady state: from the previous round's end to its own, less the
    spans of other device work launched between them (on one stream, so inside the interval);
    None with no previous round or after work of no span."""
    if previous is None or None in interruptions:
        return None
    other = sum(seconds_between(*span) for span in interruptions)
    return seconds_between(previous, ended) - other


@dataclass(slots=True, eq=False)
class _Slot:
    """A request's row in the rounds, as the host knows it: `anchor` is the anchor of the oldest
    round not read yet (the host knows it exactly)."""

    request: Request
    anchor: int
    live: bool = True


@dataclass(slots=True)
class _Launched:
    """A round in flight: its K, which slots were live, where its results land on the host, and
    the events (CUDA) or times (CPU) that measure it."""

    k: int
    live: list[bool]
    ring: int
    done: torch.cuda.Event | None
    started: torch.cuda.Event | float | None
    ended: torch.cuda.Event | float | None
    # other device work (a joining request's prefill step, a side step, an admission) ran
    # between the previous round and this one: the spans it took (None: not measured), taken
    # out of the interval to give this round's cost
    interruptions: list[Span | None] | None = None
    logprobs: RoundLogprobs | None = None  # the rows of the slots that asked for them


class DeviceRounds:
    """Speculative rounds of a fixed set of requests on persistent device buffers.

    Args:
        runner: the target's runner (its decode path: `runner.graphs`).
        drafter: the drafter; `drafting` its device steps.
        max_k: the most drafts a round may propose (the buffers' width is max_k + 1).
        max_num_seqs: the most slots.
        max_model_len: the longest request (positions past it are never written).
        use_graphs: replay rounds from CUDA graphs.
        logprob_entries: builds the logprob entries of a request that asks for them from the
            values read back (needed once such a request takes a slot).
    """

    def __init__(
        self,
        runner: PagedModelRunner,
        drafter: Drafter,
        drafting: DeviceDrafting,
        *,
        max_k: int,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool,
        logprob_entries: LogprobEntries | None = None,
    ) -> None:
        graphs = runner.graphs
        if graphs is None or graphs.max_query_len != max_k + 1:
            raise ValueError("device rounds need the runner's decode path at width K + 1")
        self.runner, self.drafter, self.drafting = runner, drafter, drafting
        self.logprob_entries = logprob_entries
        self.max_k, self.width = max_k, max_k + 1
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        self.block_size = runner.block_size
        self.max_blocks = graphs.block_tables.shape[1]
        device = self.device = runner.device
        size = max_num_seqs
        self.anchors = torch.zeros(size, dtype=torch.int64, device=device)
        self.last_tokens = torch.zeros(size, dtype=torch.int64, device=device)
        self.seeds = torch.zeros(size, dtype=torch.int64, device=device)
        self.max_draft = torch.zeros(size, dtype=torch.int64, device=device)
        # The anchor from which a request may draft nothing more: as the scheduler's rule, a
        # round at anchor A drafts at most min(K, max_model_len - 1 - A, P + max_tokens - 1 - A)
        # (P the prompt length), so that no draft lands past the request's last token.
        self.draft_limit = torch.zeros(size, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(size, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(size, dtype=torch.int64, device=device)
        self.top_p = torch.ones(size, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(size, dtype=torch.float32, device=device)
        # Outputs of the latest round: emitted tokens, accepted and verified drafts per slot,
        # and the first target row the round read without a distribution (-1: none).
        self.out = torch.zeros(size * (self.width + 3), dtype=torch.int64, device=device)
        self.inputs = StaticInputs({"live": size, "tables": size * self.max_blocks}, device)
        # The round's own copies of what its view reads (`round_inputs` writes them first; the
        # slots' anchors and input tokens move on at the round's end).
        self.round_anchors = torch.zeros(size, dtype=torch.int64, device=device)
        self.round_last_tokens = torch.zeros(size, dtype=torch.int64, device=device)
        self.round_live = torch.zeros(size, dtype=torch.bool, device=device)
        self.round_temperature = torch.zeros(size, dtype=torch.float32, device=device)
        self.graph_cache = GraphCache(use_graphs)
        on_cuda = device.type == "cuda"
        self._ring = [
            torch.zeros(self.out.shape[0], dtype=torch.int64, pin_memory=on_cuda) for _ in (0, 1)
        ]
        self.slots: list[_Slot] = []
        self.num_rows = 0
        self.method = "standard"
        self._filters: tuple[bool, bool, bool] = (False, False, False)
        # The slots' logits rules (penalties, biases, bans), allocated for the first request
        # that has some; `_ruled`: a slot taken since `begin` has rules (the rounds apply them).
        self.rules: SlotRules | None = None
        self._ruled = False
        self.inflight: deque[_Launched] = deque()
        self._last_end: torch.cuda.Event | float | None = None
        self._left: set[str] = set()  # the request ids of the rounds last left
        self._interruptions: list[Span | None] = []  # device work since the last launch
        self.num_rounds = 0  # rounds launched (all replayed from graphs when use_graphs)
        self.num_overlapped_reads = 0  # rounds read while the next one was already launched
        self.round_seconds: deque[float] = deque(maxlen=4096)  # each read round's cost

    # ------------------------------------------------------------------ set-up
    def begin(self, requests: list[Request]) -> None:
        """Takes over `requests` (each decoding, with speculation, one verify method for all):
        fills their slots and the drafter's device state."""
        previous = {s.request.request_id for s in self.slots} | self._left
        self.slots = [_Slot(r, r.num_tokens) for r in requests]
        rows = bucket_for(self.buckets, len(requests))
        if all(r.request_id in previous for r in requests):
            # The batch the rounds left, less requests that finished: its rows (and graphs)
            # stay, as they would have had the rounds never been left.
            rows = max(rows, self.num_rows)
        self.num_rows = rows
        self._left = set()
        self.method = requests[0].spec.method
        self._filters = self._filters_of(requests)
        self._ruled = False
        self._write_rules(list(range(len(requests))), requests)
        pad = rows - len(requests)
        off = {self.temperature: 0.0, self.top_k: 0, self.top_p: 1.0, self.min_p: 0.0}
        for tensor, values in self._columns(requests).items():
            values = values + [off.get(tensor, 0)] * pad  # padding rows: inert, greedy
            tensor[:rows].copy_(torch.tensor(values, dtype=tensor.dtype))
        self.drafting.begin(self._device_slots(), rows)
        self._last_end = None
        self._interruptions = []

    def _columns(self, requests: list[Request]) -> dict[torch.Tensor, list]:
        """Per-slot buffer -> the values of `requests` (in order)."""
        params = [r.params for r in requests]
        return {
            self.anchors: [r.num_tokens for r in requests],
            self.last_tokens: [r.last_token_id for r in requests],
            self.seeds: [r.seed for r in requests],
            self.max_draft: [r.spec.num_speculative_tokens for r in requests],
            self.draft_limit: [self._draft_limit(r) for r in requests],
            self.temperature: [p.temperature for p in params],
            self.top_k: [p.top_k for p in params],
            self.top_p: [p.top_p for p in params],
            self.min_p: [p.min_p for p in params],
        }

    @staticmethod
    def _filters_of(requests: list[Request]) -> tuple[bool, bool, bool]:
        """Which sampling filters (top-k, top-p, min-p) some request of `requests` uses."""
        params = [r.params for r in requests]
        return (
            any(p.top_k > 0 for p in params),
            any(p.top_p < 1 for p in params),
            any(p.min_p > 0 for p in params),
        )

    def admit(self, requests: list[Request]) -> list[Request]:
        """Takes `requests` (each decoding with speculation by this batch's verify method, the
        drafter holding its target features) into the rounds while they run, without draining
        them: each into a free slot (one whose request finished and that no round in flight
        holds live, else a new one). Returns those taken (the others wait for a slot); their
        first round is the next launch. The slots' buffers are written after the rounds in
        flight (the same stream), so whatever those rounds write to these rows (inert in them)
        lands first."""
        busy = {b for launched in self.inflight for b, live in enumerate(launched.live) if live}
        for slot in self.slots:
            if slot.live and slot.request.status.finished:
                slot.live = False
        free = [b for b, slot in enumerate(self.slots) if not slot.live and b not in busy]
        free += range(len(self.slots), self.anchors.shape[0])
        taken = requests[: len(free)]
        if not taken:
            return []
        started = mark(self.device)
        placed = free[: len(taken)]
        for request, b in zip(taken, placed, strict=True):
            slot = _Slot(request, request.num_tokens)
            if b < len(self.slots):
                self.slots[b] = slot
            else:
                self.slots.append(slot)
        self.num_rows = max(self.num_rows, bucket_for(self.buckets, len(self.slots)))
        self._filters = tuple(
            a or b for a, b in zip(self._filters, self._filters_of(taken), strict=True)
        )
        self._write_rules(placed, taken)
        index = to_device(placed, torch.int64, self.device)
        for tensor, values in self._columns(taken).items():
            tensor.index_copy_(0, index, to_device(values, tensor.dtype, self.device))
        pairs = zip(placed, taken, strict=True)
        slots = [DeviceSlot(b, r.request_id, r.all_token_ids) for b, r in pairs]
        self.drafting.admit(slots, self.num_rows)
        self.interrupt((started, mark(self.device)))
        return taken

    def _write_rules(self, slots: list[int], requests: list[Request]) -> None:
        """The requests' logits rules and outputs so far into their slots (neutral values for
        those without rules, once any request has had some)."""
        if any(r.rules is not None for r in requests):
            self._ruled = True
            self._rule_buffers()
        if self.rules is not None:
            self.rules.write(
                slots,
                [r.rules for r in requests],
                [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
            )

    def _rule_buffers(self) -> SlotRules:
        """The slots' rules, allocated on first use ([S, V] buffers: a ruled round's graph
        reads them where they are)."""
        if self.rules is None:
            vocab = self.runner.graphs.logits.shape[-1]
            self.rules = SlotRules(self.anchors.shape[0], vocab, self.device)
        return self.rules

    def interrupt(self, span: Span | None = None) -> None:
        """Other device work is launched between two rounds (a joining request's prefill step, a
        side step): `span`, two `mark`s around it, is taken out of the next round's interval
        (None: not measured, the interval is no cost)."""
        self._interruptions.append(span)

    def _draft_limit(self, request: Request) -> int:
        limit = self.max_model_len - 1
        if request.params.max_tokens is not None:
            limit = min(limit, request.num_prompt_tokens + request.params.max_tokens - 1)
        return limit

    def end(self) -> None:
        """Hands the live requests back to the host (no round may be in flight)."""
        if self.inflight:
            raise RuntimeError("device rounds still in flight")
        self.drafting.end(self._device_slots())
        self._left = {s.request.request_id for s in self.slots}
        self.slots = []

    def _device_slots(self) -> list[DeviceSlot]:
        return [
            DeviceSlot(b, s.request.request_id, s.request.all_token_ids)
            for b, s in enumerate(self.slots)
            if s.live and not s.request.status.finished
        ]

    @property
    def live_requests(self) -> list[Request]:
        return [s.request for s in self.slots if s.live]

    # ------------------------------------------------------------------ host loop
    def launch_room(self, k: int) -> list[int] | None:
        """The last position each live slot's next round (of k drafts) may write, or None when
        a slot would pass max_model_len (the synchronous step then takes over)."""
        for slot in self.slots:
            if slot.live and slot.request.status.finished:
                slot.live = False  # finished or aborted: inert from the next round on
        last = []
        for b, slot in enumerate(self.slots):
            if slot.live:
                # the rounds in flight that hold it (one admitted since holds fewer)
                ahead = sum(
                    launched.k + 1
                    for launched in self.inflight
                    if b < len(launched.live) and launched.live[b]
                )
                position = slot.anchor - 1 + ahead + k
                if position > self.max_model_len - 2:
                    return None
                last.append(position)
        return last

    def launch(self, k: int, last_positions: list[int]) -> None:
        """Prepares and launches one round of k drafts (`last_positions` from `launch_room`,
        the target's blocks grown to cover them by the caller)."""
        self.drafting.prepare(self._device_slots(), last_positions)
        inputs = self.inputs
        inputs.begin()
        live = inputs.host("live", self.num_rows)
        tables = inputs.host("tables", self.num_rows * self.max_blocks).reshape(
            self.num_rows, self.max_blocks
        )
        live.fill(0)
        tables.fill(0)
        for b, slot in enumerate(self.slots):
            if slot.live:
                live[b] = 1
                blocks = slot.request.block_ids
                tables[b, : len(blocks)] = blocks
        inputs.send("tables", self.num_rows * self.max_blocks)
        started = mark(self.device)
        self._run_round(k)
        logprobs = self._launch_logprobs(k)
        ended = mark(self.device)
        ring = self.num_rounds % 2
        self._ring[ring].copy_(self.out, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        live_flags = [s.live for s in self.slots]
        interruptions, self._interruptions = self._interruptions or None, []
        self.inflight.append(
            _Launched(k, live_flags, ring, done, started, ended, interruptions, logprobs)
        )
        self.num_rounds += 1

    def _launch_logprobs(self, k: int) -> RoundLogprobs | None:
        """After the round of k drafts (on the device, no host sync): the logprobs of every row
        (k + 1 a slot) of the live slots whose requests ask for them, under the raw target
        logits the round left in the runner's buffer, at the tokens the round emitted there
        (rows past a slot's emitted tokens hold no token: never read), copied towards the
        host. None when no live slot asks."""
        wanted = [
            (b, slot.request.params.logprobs)
            for b, slot in enumerate(self.slots)
            if slot.live and slot.request.params.logprobs is not None
        ]
        if not wanted:
            return None
        if self.logprob_entries is None:
            raise RuntimeError("a request asks for logprobs but the rounds cannot build them")
        query, size = k + 1, self.anchors.shape[0]
        rows = [b * query + j for b, _ in wanted for j in range(query)]
        index = to_device(rows, torch.int64, self.device)
        logits = self.runner.graphs.logits[: self.num_rows * query]
        emitted = self.out[: size * self.width].view(size, self.width)[: self.num_rows, :query]
        tokens = emitted.reshape(-1).index_select(0, index).clamp(0, logits.shape[-1] - 1)
        num_top = max(n for _, n in wanted)
        result = compute_logprobs(logits.index_select(0, index), tokens, num_top)
        on_cuda = self.device.type == "cuda"

        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_cuda)
            return host.copy_(tensor, non_blocking=on_cuda)

        return RoundLogprobs(
            [b for b, _ in wanted],
            to_host(result.token_logprobs),
            to_host(result.token_ranks),
            to_host(result.top_ids),
            to_host(result.top_logprobs),
        )

    def _run_round(self, k: int) -> None:
        """Runs (or replays) the round of k drafts over the static buffers as they are."""
        key = (self.num_rows, k, self.method, self._filters, self._ruled)
        # Under tensor parallelism the workers run the round's target step beside it: twice
        # when this launch captures the round's graph (its warm-up and the first replay both
        # run the step's collectives; the capture itself runs none).
        captures = self.graph_cache.use_graphs and key not in self.graph_cache.graphs
        self.runner.announce_device_forward(
            self.num_rows, k + 1, self.drafter.feature_layers, 2 if captures else 1
        )
        with self.runner.device_step():
            self.graph_cache.run(key, lambda: self._round(k), self._state)

    def warm_up(self, num_rows: int, k: int, method: str, *, ruled: bool = False) -> None:
        """Runs one round of k drafts over `num_rows` inert slots (none live: no cache slot
        written, no token emitted), so that its graph is captured now (the engine's warm-up),
        keyed as a launch of requests of `method` without top-k / top-p / min-p would key it,
        with the slots' logits rules (`ruled`: some request has penalties, biases or bans) or
        without. Only while no request holds the rounds (`begin` rewrites every slot it uses)."""
        if self.slots or self.inflight:
            raise RuntimeError("device rounds warm up only while they hold no request")
        self.num_rows, self.method, self._filters = num_rows, method, (False, False, False)
        self._ruled = ruled
        if ruled:
            self._rule_buffers()
        self.drafting.begin([], num_rows)
        inputs = self.inputs
        inputs.begin()
        inputs.host("live", num_rows).fill(0)
        inputs.host("tables", num_rows * self.max_blocks).fill(0)
        inputs.send("tables", num_rows * self.max_blocks)
        self._run_round(k)
        self.num_rows, self.method, self._ruled = 0, "standard", False

    def read(self) -> tuple[list[tuple[Request, Emission]], int, float | None, bool]:
        """Reads the oldest round in flight: (per live request still running, its emission;
        the round's K; its cost in seconds: from the previous round's end to its own on the
        device, less the spans of other device work launched between them (None for the first
        round since `begin`, which has no previous one, and after work of no span; on the CPU
        its own duration); whether other device work came before it since the previous round
        (`interrupt`, `admit`)). Advances
        the host's anchors and each request's computed tokens (the input token and the
        accepted drafts have K/V)."""
        launched = self.inflight.popleft()
        self.num_overlapped_reads += bool(self.inflight)  # a newer round runs meanwhile
        if launched.done is not None:
            launched.done.synchronize()
        values = self._ring[launched.ring].tolist()
        seconds = self._seconds(launched)
        self.round_seconds.append(seconds)
        rows, width = len(self.slots), self.width
        size = self.out.shape[0] // (width + 3)
        logprobs = self._logprobs_read(launched)
        emissions = []
        for b, slot in enumerate(self.slots[:rows]):
            if b >= len(launched.live) or not launched.live[b]:
                continue  # not in that round (inert, or admitted after its launch)
            accepted = values[size * width + b]
            num_draft = values[size * (width + 1) + b]
            bad_row = values[size * (width + 2) + b]
            tokens = values[b * width : b * width + accepted + 1]
            request = slot.request
            if not request.status.finished:
                if bad_row >= 0:  # the row of the token at anchor + bad_row: nothing emitted
                    position = slot.anchor + bad_row
                    emission = Emission([], num_draft, 0, None, unusable_position=position)
                else:
                    entries = logprobs(b, tokens) if b in logprobs.rows else None
                    emission = Emission(tokens, num_draft, accepted, None, logprobs=entries)
                emissions.append((request, emission))
            request.num_computed_tokens = slot.anchor + accepted
            slot.anchor += accepted + 1
        return emissions, launched.k, seconds, launched.interruptions is not None

    def _logprobs_read(self, launched: _Launched) -> ReadLogprobs:
        """The launched round's logprobs on the host (its `done` event has completed)."""
        lp = launched.logprobs
        if lp is None:
            return ReadLogprobs({}, [], [], [], [], self.logprob_entries, {})
        query = launched.k + 1
        return ReadLogprobs(
            {b: i * query for i, b in enumerate(lp.slots)},
            lp.values.tolist(),
            lp.ranks.tolist(),
            lp.top_ids.tolist(),
            lp.top_values.tolist(),
            self.logprob_entries,
            {b: self.slots[b].request.params.logprobs for b in lp.slots},
        )

    def _state(self) -> list[torch.Tensor]:
        """The buffers a round both reads and updates (its own and the drafter's)."""
        rules = self.rules.state() if self._ruled else []
        return [self.anchors, self.last_tokens, *self.drafting.state(), *rules]

    def _seconds(self, launched: _Launched) -> float | None:
        previous, self._last_end = self._last_end, launched.ended
        if self.device.type != "cuda":
            return seconds_between(launched.started, launched.ended)
        return round_cost(previous, launched.ended, launched.interruptions or [])

    # ------------------------------------------------------------------ the round
    def _view(self, k: int) -> RoundView:
        """The round's view of the slots (the copies `round_inputs` wrote)."""
        rows = self.num_rows
        top_k, top_p, min_p = self._filters
        params = SamplingTensors(
            temperature=self.round_temperature[:rows],  # inert rows: 0, greedy
            top_k=self.top_k[:rows] if top_k else None,
            top_p=self.top_p[:rows] if top_p else None,
            min_p=self.min_p[:rows] if min_p else None,
        )
        return RoundView(
            num_rows=rows,
            k=k,
            method=self.method,
            anchors=self.round_anchors[:rows],
            last_tokens=self.round_last_tokens[:rows],
            live=self.round_live[:rows],
            seeds=self.seeds[:rows],
            params=params,
            max_draft=self.max_draft[:rows],
        )

    def _round(self, k: int) -> None:
        """One round over the static buffers (device work only; see the module docstring)."""
        rows, width, size = self.num_rows, self.width, self.anchors.shape[0]
        query = k + 1
        flat = rows * query
        graphs, out = self.runner.graphs, self.out
        # 1. The round's inputs, the target step's included, in one kernel on CUDA: the target
        # runs over [input token, drafts] in the decode step's layout, Q = k + 1 rows a slot
        # (the round's K, not the widest: a round of few drafts in a large batch costs the
        # target's pass over its own rows only; one graph per K either way).
        num_draft = out[size * (width + 1) : size * (width + 1) + rows]  # read by the host too
        round_inputs(
            RoundSlots(
                anchors=self.anchors[:rows],
                last_tokens=self.last_tokens[:rows],
                live=self.inputs["live"][:rows],
                draft_limit=self.draft_limit[:rows],
                max_draft=self.max_draft[:rows],
                temperature=self.temperature[:rows],
                tables=self.inputs["tables"][: rows * self.max_blocks].view(rows, self.max_blocks),
            ),
            RoundInputs(
                anchors=self.round_anchors[:rows],
                last_tokens=self.round_last_tokens[:rows],
                live=self.round_live[:rows],
                temperature=self.round_temperature[:rows],
                num_draft=num_draft,
                input_ids=graphs.input_ids[:flat],
                positions=graphs.positions[:flat],
                slot_mapping=graphs.slot_mapping[:flat],
                context_lens=graphs.context_lens[:rows],
                query_lens=graphs.query_lens[:rows],
                block_tables=graphs.block_tables[:rows],
            ),
            k,
            self.block_size,
        )
        view = self._view(k)
        # 2. Drafts (written after the input token; a drafter that drafts fewer than k for a
        # slot says so in `drafted`).
        draft_ids, draft_logits, draft_lse, drafted = self.drafting.propose(view)
        if k:
            torch.clamp(draft_ids, min=0, out=graphs.input_ids[:flat].view(rows, query)[:, 1:])
        if drafted is not None:
            torch.minimum(num_draft, drafted, out=num_draft)
        # 3. The target.
        features = graphs.forward(rows, query, self.drafter.feature_layers, broadcast_inputs=True)
        logits = graphs.logits[: rows * query].view(rows, query, -1)
        # 4. Verification (inert slots: greedy, nothing drafted).
        inputs = check_verify_inputs(
            logits,
            draft_ids,
            draft_logits,
            view.seeds,
            view.anchors,
            temperature=view.params.temperature,
            top_k=view.params.top_k,
            top_p=view.params.top_p,
            min_p=view.params.min_p,
            num_draft=num_draft,
            method=self.method,
            draft_logsumexp=draft_lse,
            check_values=False,
            context=self.rules.view(rows) if self._ruled else None,
        )
        result = verify_checked(inputs)
        # The first row each slot's outcome read without a distribution (`out`'s fourth
        # section): the host ends such a request (inert slots read nothing it looks at).
        bad_row = first_unusable_read_row(inputs.target_logits, num_draft, result.num_accepted)
        out[size * (width + 2) : size * (width + 2) + rows].copy_(bad_row)
        # 5. The results the host reads (`out`'s first two sections), then the drafter's
        # bookkeeping, then the slots' next anchors and input tokens.
        results = RoundResults(
            emitted=out[: size * width].view(size, width)[:rows],
            accepted=out[size * width : size * width + rows],
        )
        finish_round(
            result.token_ids,
            result.num_accepted,
            view.live,
            results,
            self.anchors[:rows],
            self.last_tokens[:rows],
        )
        if self._ruled:  # the emitted tokens join the slots' output counts
            self.rules.observe(results.emitted, results.accepted, view.live)
        self.drafting.observe(view, features, results.emitted, results.accepted)
