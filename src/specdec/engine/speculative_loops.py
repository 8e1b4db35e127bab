"""The engine's speculative loops beside its synchronous step: the speculation policy's plain
arm (plain overlapped steps of speculative requests) and speculative rounds on the device
(`device_round.DeviceRounds`), with the moves between them and the synchronous step. A mixin of
`LLMEngine`, whose state (scheduler, runner, drafter, policy, the step in flight) it uses.
"""

from __future__ import annotations

import time

from specdec.engine.device_round import DeviceRounds, mark, seconds_between
from specdec.engine.inflight import Inflight
from specdec.engine.outputs import RequestOutput
from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledRequest
from specdec.engine.spec_policy import PLAIN
from specdec.runner.cuda_graph import batch_buckets, bucket_for
from specdec.sampling.slot_rules import SlotRules


def _nobody(request: Request) -> bool:
    return False


def _anybody(request: Request) -> bool:
    return True


class SpeculativeLoops:
    """`LLMEngine`'s plain-arm and device-round loops (methods only)."""

    # ------------------------------------------------------- the synchronous step's K
    def _sync_step_k(self, scheduled: list[ScheduledRequest]) -> tuple[int, int] | None:
        """The speculation policy's K for a synchronous step of an engine without device
        rounds (the CPU): every decode share drafts at most K (a request's own larger K stands
        when the policy picks the engine's). With draft trees the arms are K = 0 (no drafts)
        and the tree (`SpeculationPolicy.tree`: K = its depth; each request keeps its node
        budget). With the default (coupled) verifier K never changes a token. Mutates the
        shares' num_draft / num_query_tokens (the slots allocated for the drafts not proposed
        are released at commit).

        Returns (bucket, K) to `_observe_sync_step` after the step, or None where nothing is to
        be measured: K pinned, device rounds, no speculative decode share, or a prefill chunk
        in the step (its cost says nothing of K: the bucket's last choice holds)."""
        policy = self.policy
        if policy is None or not policy.adaptive:
            return None
        if self.device_rounds:  # (a pinned K reaches the synchronous step only)
            return None
        decodes = [share for share in scheduled if not share.request.in_prefill]
        if not any(share.request.spec is not None for share in decodes):
            return None
        bucket = bucket_for(batch_buckets(self.config.max_num_seqs), len(decodes))
        measured = len(decodes) == len(scheduled)
        if measured:
            horizon = self._horizon([share.request for share in decodes])
            drafting = [s.request.request_id for s in decodes if s.request.spec is not None]
            k = policy.choose(bucket, horizon, in_rounds=True, requests=drafting)
            self._sync_k[bucket] = k
            self.loop_stats.k_chosen[k] = self.loop_stats.k_chosen.get(k, 0) + 1
        else:
            k = self._sync_k.get(bucket, policy.max_k)
            policy.observe_unmeasured(k)
        cap = max(k, 0)  # the plain arm (PLAIN), where offered, is a step of no drafts here
        if cap < policy.max_k:
            for share in decodes:
                share.cap_drafts(cap)
        return (bucket, k) if measured else None

    def _observe_sync_step(self, chosen: tuple[int, int], seconds: float) -> None:
        """A measured synchronous step (`_sync_step_k`): its cost and its rounds' acceptance to
        the policy."""
        bucket, k = chosen
        read = [
            (request_id, (e.num_draft, e.num_accepted))
            for request_id, e in self._sync_emitted
            if e is not None and e.num_draft and e.unusable_position is None
        ]
        ids = [request_id for request_id, _ in read]
        self.policy.observe(bucket, k, seconds, [outcome for _, outcome in read], requests=ids)

    # ------------------------------------------------------- into the rounds, or not
    def _round_choice(self) -> int | None:
        """The policy's choice for the batch of the overlapped loop once the rounds could take
        it: a K (0..max_k) to enter them with, or `PLAIN` (the plain arm: the loop goes on).
        None, asking nothing, where they cannot: no device rounds, an arrival due
        (`_admission_due`), a request in prefill, or none the rounds can take (`_round_able`;
        the others decode beside the rounds, `_round_takers`). Non-anticipating: asked at a
        launch, from what was read and the remaining budgets."""
        if not self.device_rounds or self.drafter is None:
            return None
        running = self.scheduler.running
        if not running or self._admission_due():
            return None
        if any(request.in_prefill for request in running):
            return None
        takers = self._round_takers(running)
        if not takers:
            return None
        bucket = self._plain_bucket(len(takers))
        taken = {id(r) for r in takers}
        beside = self._budgets([r for r in running if id(r) not in taken])
        k = self.policy.choose(
            bucket,
            self._horizon(takers),
            in_rounds=False,
            beside=beside,
            rows=len(takers),
            requests=[r.request_id for r in takers],
        )
        self._plain_chosen = k == PLAIN
        if self._plain_chosen:
            self._plain_rows = bucket  # its measured steps pad to the bucket measured
        return k

    def _round_takers(self, requests: list[Request]) -> list[Request]:
        """Those of `requests` the rounds take (`_round_able`, the first one's verify method);
        the others decode beside the rounds (`_round_side`)."""
        takers = [r for r in requests if self._round_able(r)]
        if not takers:
            return []
        method = takers[0].spec.method
        return [r for r in takers if r.spec.method == method]

    @staticmethod
    def _round_able(request: Request) -> bool:
        """Whether device rounds can take the request: it speculates and needs no logits
        processed on the host. Its logprobs are computed after each round; its penalties,
        logit bias, allowed tokens, single-token bad words and min_tokens are held in its slot
        on the device (`SlotRules`). A grammar (a matcher on the host) or a multi-token bad word
        keeps it out. A batch holding one that cannot decodes in the overlapped loop, drafting
        nothing, instead of synchronous steps with drafts (s27: about 30 ms a step for 16 rows
        of SmolLM2 on an H100, against 2-3 ms for a round)."""
        return (
            request.spec is not None
            and request.grammar is None
            and SlotRules.supports(request.rules)
        )

    # ------------------------------------------------------- the policy's plain arm
    def _plain_bucket(self, num_requests: int) -> int:
        return bucket_for(
            batch_buckets(self.config.max_num_seqs), max(num_requests, self._plain_rows)
        )

    def _observe_plain(self, inflight: Inflight) -> None:
        """A read measured step of the plain arm: its cost to the policy. The cost is the
        step's own device time (from the events around its graph and sampling), not the
        interval since the previous step: the intervals of a short visit, still ramping up
        after the rounds drained, read 1.2-1.5 ms at batch 32-64 (s12-E). Within the step the
        device still waits on the host where the loop is host-bound (1.12-1.42 ms against
        0.98-1.13 ms plain steps, s12-G/H), which it should count. Rounds keep their interval,
        which includes the host's time between them."""
        seconds = seconds_between(inflight.started, inflight.ended)
        bucket = self._plain_bucket(len(inflight.requests))
        self.policy.observe(bucket, PLAIN, seconds, [])

    # ------------------------------------------------------- speculative rounds on the device
    def _enter_rounds(self, k: int | None = None) -> None:
        """Hands the batch to device rounds when every running request decodes (none in
        prefill) and the rounds can take some of them (`_round_takers`), and no waiting request
        could join; else the loop it came from goes on. The others (a grammar, a multi-token
        bad word, another verify method, speculation off) decode beside the rounds in
        overlapped steps launched between two rounds (`_round_side`). `k`: the policy's choice
        for the first round (None: asked when the round launches). The feature log is handed
        to the drafter first (its catch-up on entering reads it)."""
        scheduler = self.scheduler
        requests = list(scheduler.running)
        if not requests or self._admission_due():
            return
        for request in requests:
            if request.num_computed_tokens != request.num_tokens - 1 or request.num_tokens < 2:
                return
        takers = self._round_takers(requests)
        if not takers:
            return
        rounds = self._device_round_runner()
        if rounds is None:
            return
        self._feature_log.flush()
        self._next_k = k
        started, host = mark(self.device), time.perf_counter()
        rounds.begin(takers)
        host = time.perf_counter() - host
        taken = {id(r) for r in takers}
        self._round_side = [r for r in requests if id(r) not in taken]
        self._plain_rows = rounds.num_rows
        # The entry's cost: its host time, or its device work when longer (read with the first
        # round, when the events have completed).
        self._entry_cost = (rounds.num_rows, host, started, mark(self.device))
        self._in_rounds = True

    def _horizon(self, requests: list[Request]) -> list[int] | None:
        """Per request, the tokens it may still emit, when no request waits to join (the batch
        is closed: it ends with its slowest request); None when one waits."""
        if self.scheduler.waiting:
            return None
        return self._budgets(requests) or None

    def _budgets(self, requests: list[Request]) -> list[int]:
        """Per unfinished request of `requests`, the tokens it may still emit (at least 1)."""
        limit = self.outputs.output_limit
        return [
            max(limit(r) - len(r.output_token_ids) - r.num_pending, 1)
            for r in requests
            if not r.status.finished
        ]

    def _device_round_runner(self) -> DeviceRounds | None:
        if self._rounds is None:
            k = self.speculative_config.num_speculative_tokens
            drafting = self.drafter.device_drafting(
                self.config.max_num_seqs, k + 1, self.max_model_len, self.device
            )
            if drafting is None or self.runner.graphs is None:
                self.device_rounds = False  # this drafter drafts on the host only
                return None
            self._rounds = DeviceRounds(
                self.runner,
                self.drafter,
                drafting,
                max_k=k,
                max_num_seqs=self.config.max_num_seqs,
                max_model_len=self.max_model_len,
                use_graphs=self.runner.graphs.use_graphs,
                logprob_entries=self.outputs.logprob_entries_from,
            )
        return self._rounds

    def _step_rounds(self, only_finished: bool) -> list[RequestOutput]:
        """One call of the device-round loop: launch the next round unless the batch must go
        back to the synchronous step (a waiting request that cannot join the rounds, one nears
        its length limit, or the cache cannot hold what the round may write), then read the
        round before it. Requests that can join (`_joins_rounds`) do so without a drain: their
        prefill runs in overlapped steps launched between two rounds, and once read each takes
        a free slot (`DeviceRounds.admit`) for the next round."""
        rounds = self._rounds
        joining = self._joins_rounds()
        self._round_side = [r for r in self._round_side if not r.status.finished]
        launched = False
        k = None
        if (
            not self._plain_chosen
            and (joining or not self._admission_due())
            and rounds.live_requests
        ):
            k = self._next_k
            if k is None:
                live = rounds.live_requests
                k = self.policy.choose(
                    rounds.num_rows,
                    self._horizon(live),
                    in_rounds=True,
                    beside=self._budgets(self._round_side),
                    rows=len(live),
                    requests=[r.request_id for r in live],
                )
            self._next_k = None
            if k == PLAIN:
                self._plain_chosen, k = True, None  # drain the rounds in flight, then go plain
                self._plain_rows = rounds.num_rows
        if k is not None:
            last = rounds.launch_room(k)
            if last is not None and self._grow_ahead(rounds.live_requests, last):
                rounds.launch(k, last)
                self.loop_stats.observe_round(
                    k, rounds.graph_cache.use_graphs, len(rounds.live_requests)
                )
                launched = True
        commits = []
        prefill, self._round_prefill = self._round_prefill, None
        if prefill is not None:  # launched before the round just launched: read meanwhile
            commits += self._read_commits(prefill)
        if rounds.inflight and (len(rounds.inflight) > 1 or not launched):
            emissions, k, seconds, interrupted = rounds.read()
            read = [
                (r.request_id, (e.num_draft, e.num_accepted))
                for r, e in emissions
                if e.unusable_position is None  # a failed round says nothing of acceptance
            ]
            self.policy.observe(
                rounds.num_rows,
                k,
                seconds,
                [outcome for _, outcome in read],
                interrupted=interrupted,
                requests=[request_id for request_id, _ in read],
            )
            if self._entry_cost is not None:
                bucket, host, started, ended = self._entry_cost
                self._entry_cost = None
                device = host if isinstance(started, float) else seconds_between(started, ended)
                self.policy.observe_entry(bucket, max(host, device))
            commits += [(r, None, e) for r, e in emissions]
        outputs = self._commit(commits, only_finished) if commits else []
        if prefill is not None or self._round_joiners:
            self._seat_joiners()
        if (joining or self._round_side) and launched:  # (a drain launches none)
            self._launch_joining_prefill()
        if not launched and not rounds.inflight and self._round_prefill is None:
            self._leave_rounds()  # to the overlapped loop (the plain arm, if it was chosen)
        return outputs

    def _joins_rounds(self) -> bool:
        """Whether requests join the running rounds without draining them: some admitted
        already wait for their prefill or a slot, or admission is due (`_admission_due`:
        arrivals gathered) — unless the policy chose its plain arm or the drafter admits none.
        Every arrival joins: one the rounds can take takes a slot once its prefill is read
        (`_seat_joiners`), the others decode beside the rounds (`_round_side`).

        Until s41 only bursts joined (at least as many waiting as running) and a few arrivals
        drained the rounds into overlapped steps, each drain paying a re-entry (the drafter's
        catch-up over every running request, 6-7 ms at 64 rows). Once joins were gathered too
        (`_launch_joining_prefill`), joining every arrival measured better (s41, H100, the
        built-in model, 768 chats a level, spec server tokens/s with the drain rule / joining
        every arrival in one lease: 11,330 / 13,226-13,356 at c = 16, 32,754 / 35,344-37,404
        at c = 64, 37,058 / 36,972-40,721 at c = 256; s30's contrary figures predate the
        gathering). Until s43 an arrival the rounds could not take drained them."""
        if self._plain_chosen or not self._rounds.drafting.admits:
            return False
        joiners = [r for r in self._round_joiners if not r.status.finished]
        self._round_joiners = joiners
        if joiners:
            return True
        return self._admission_due()

    def _launch_joining_prefill(self) -> None:
        """Launches the step beside the rounds after the round just launched, without reading
        it: one plain token of each request decoding beside them (`_round_side`) and the next
        prefill chunks of the requests joining them (the rounds run their neighbours); its
        target features go to the drafter when it is read. The token budget is the engine's
        less the rounds' rows. Waiting requests are taken in only when admission is due
        (`_admission_due`), as for the first joiners: while joiners wait for their prefill or a
        slot, a place freed by a finished request waits for the next gathering rather than
        starting a prefill step of its own (s41, H100, c = 256: 682 joins took 424 prefill
        steps between rounds, 1.6 a step, and spec / `--no-spec` read 0.78x while the rounds'
        own steps predicted 2x)."""
        rounds = self._rounds
        width = rounds.width
        budget = self.config.max_num_batched_tokens - len(rounds.live_requests) * width
        budget = max(budget, width)
        admits = rounds.drafting.admits and self._admission_due()  # DFlash, DSpark: drain first
        accept = _anybody if admits else _nobody
        shares = self.scheduler.schedule_joining(
            self._round_joiners, budget, accept, decoding=self._round_side
        )
        if not shares:
            return
        side = {id(r) for r in self._round_side}
        joins = False
        for share in shares:
            request = share.request
            if id(request) in side:
                self.loop_stats.num_side_rows += 1
                continue
            joins = True
            if request not in self._round_joiners:
                self._round_joiners.append(request)
        started = mark(self.device)
        self._round_prefill = self._launch(shares, None)
        if joins:  # prefill chunks: their device time is not the next round's cost
            rounds.interrupt((started, mark(self.device)))
        # A step of side rows alone comes with every round while they run: part of its cost.

    def _seat_joiners(self) -> None:
        """The joining requests whose prefill is read (their first token and every target
        feature with the host and the drafter) into free slots of the rounds. Called with no
        joining prefill step in flight (`_step_rounds` reads it first), so a request whose
        last chunk emits nothing (a recomputed prefix) is seated only once its features came."""
        ready = [
            r
            for r in self._round_joiners
            if not r.status.finished
            and not r.num_pending
            and r.num_computed_tokens == r.num_tokens - 1
        ]
        if not ready:
            return
        method = self._rounds.method
        fits = [self._round_able(r) and r.spec.method == method for r in ready]
        seatable = [r for r, fit in zip(ready, fits, strict=True) if fit]
        beside = [r for r, fit in zip(ready, fits, strict=True) if not fit]
        seated = []
        if seatable:
            self._feature_log.flush()  # the joiners' prefill features, read by the catch-up
            seated = self._rounds.admit(seatable)
            self.loop_stats.num_round_joins += len(seated)
        self._round_side += beside  # they decode beside the rounds
        moved = {id(r) for r in seated} | {id(r) for r in beside}
        self._round_joiners = [r for r in self._round_joiners if id(r) not in moved]

    def _grow_ahead(self, requests: list[Request], last_positions: list[int]) -> bool:
        """Blocks for every position a launched round may write (False, growing nothing, when
        the cache cannot hold them all)."""
        allocator = self.allocator
        needed = [
            max(allocator.blocks_needed(last + 1) - len(r.block_ids), 0)
            for r, last in zip(requests, last_positions, strict=True)
        ]
        if sum(needed) > allocator.num_free_blocks:
            return False
        for request, last in zip(requests, last_positions, strict=True):
            allocator.grow(request, last + 1)
        return True

    def _leave_rounds(self) -> None:
        """Back to the synchronous step: the drafter's host state from the device, and the
        blocks grown ahead for rounds that did not run given back. Requests that were joining
        the rounds go on through the scheduler (still in prefill, or decoding)."""
        self._round_joiners, self._round_side = [], []
        rounds = self._rounds
        live = [r for r in rounds.live_requests if not r.status.finished]
        rounds.end()
        for request in live:
            self.scheduler.commit(request, request.num_computed_tokens)
        self._in_rounds = False
