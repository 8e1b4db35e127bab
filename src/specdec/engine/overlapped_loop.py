"""The engine's overlapped loop (asynchronous scheduling): while a step runs on the device, the
next one is scheduled and launched, fed the sampled tokens on the device, and the earlier step's
tokens are read meanwhile. It serves every request that drafts nothing in its step (plain
requests, prefill chunks, and speculative requests outside the device rounds: `_step_overlapped`
says when a batch leaves it for the rounds). Requests join and leave without draining it: a step
launched ahead holds the in-flight requests' decode rows beside the prefill chunks of requests
that arrive (or continue their prompt), and a request whose last token is still on the device
is held back from it. A mixin of `LLMEngine`, whose state (scheduler, runner, the step in
flight, the feature log) it uses.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from specdec.engine.device_round import mark
from specdec.engine.emitter import Emission
from specdec.engine.inflight import Inflight
from specdec.engine.outputs import RequestOutput
from specdec.engine.proposals import step_inputs
from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledRequest
from specdec.engine.spec_policy import PLAIN
from specdec.runner import StepInput
from specdec.sampling import Logprobs, compute_logprobs
from specdec.transfer import Readback, to_device

# The speculative paths admit waiting requests once one can be admitted per this many running,
# or admission has been possible for MAX_ADMISSION_WAIT_S (`OverlappedLoop._admission_due`).
ADMISSION_BATCH_SHARE = 8
MAX_ADMISSION_WAIT_S = 0.05


@dataclass(slots=True)
class _Forward:
    """A launched step whose rows are not sampled yet (`OverlappedLoop._launch_forward`): the
    emitting requests, their logits rows ([E, V] on the device; None: none emits), the logits
    rules' prefix of tokens still on the device, the positions of their last input tokens,
    whether the step is a measured one of the plain arm (with its start mark), and the target
    features kept for the feature log (a decode step's [E, F], or a mixed step's chunks)."""

    emitters: list[Request]
    rows: torch.Tensor | None
    prefix: torch.Tensor | None
    starts: list[int]
    measured: bool
    features: torch.Tensor | None
    chunks: list | None
    started: torch.cuda.Event | float | None
    # prompt logprobs computed on the device: (request, start, wanted rows, their tokens,
    # number of top ids, `compute_logprobs`' result) per chunk that asked for them
    prompt: list[tuple[Request, int, list[int], list[int], int, Logprobs]]


class OverlappedLoop:
    """`LLMEngine`'s overlapped plain loop (methods only)."""

    def _step_overlapped(self, only_finished: bool) -> list[RequestOutput]:
        """One call of the overlapped loop, which serves every request that drafts nothing in
        its step: plain requests, prefill chunks (arrivals, resumed requests), and speculative
        requests while they are outside the device rounds. With a step in flight, schedule and
        launch the next one ahead of reading it (`_schedule_ahead`: its decode rows take the
        in-flight step's samples on the device; arriving requests' prefill chunks join it),
        then read and commit the in-flight step's tokens while the new one runs
        (`_launch_and_resolve`); where the next step cannot be scheduled ahead without
        preempting, read the in-flight step first. With none in flight: schedule as usual
        (preempting where the cache must) and launch without reading.

        On an engine with device rounds, the batch leaves this loop for the rounds once every
        running request can take them and the policy picks a K for it (`_round_choice`); while
        the policy picks its plain arm the loop goes on, arrivals and all, as an engine without
        a drafter runs, its decode steps measured as the arm's cost. The target features of
        the speculative requests' tokens wait in the feature log until the drafter reads them.
        On an engine without device rounds, a request that speculates sends the batch to the
        synchronous step (the step in flight is read first).

        What a request asks for stays on this path: its logprobs and prompt logprobs are
        computed on the device and read with the tokens; its logits rules (penalties, biases,
        bans, min_tokens) count the token still on the device as output (`Emitter.sample_rows`'
        prefix); a step holding a constrained request is sampled once the step before it is
        read (its grammar runs on the host). With the default verifier, whether a request
        drafts in a step never changes its tokens."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            scheduled = self._schedule()
            if scheduled:
                for share in scheduled:
                    share.cap_drafts(0)
                self._inflight = self._launch(scheduled, None)
            return []
        if not self._overlaps():
            return self._resolve(inflight, only_finished)
        choice = self._round_choice()
        if choice is not None and choice != PLAIN:
            outputs = self._resolve(inflight, only_finished)
            self._enter_rounds(choice)
            return outputs
        # Arrivals are gathered (`_admission_due`) only for a batch bound for the rounds: one
        # that speculates, its policy not on the plain arm; plain batches admit at once.
        gather = (
            self.device_rounds
            and not self._plain_chosen
            and any(r.spec is not None for r in self.scheduler.running)
        )
        scheduled = self._schedule_ahead(admit=self._admission_due() if gather else True)
        measured = (
            choice == PLAIN
            and scheduled is not None
            and len(scheduled) == len(self.scheduler.running)
            and all(not share.request.in_prefill for share in scheduled)
        )
        return self._launch_and_resolve(scheduled, inflight, only_finished, measured)

    def _overlaps(self) -> bool:
        """Whether the next step is the overlapped loop's: asynchronous scheduling, and no
        request speculates unless the engine has device rounds under the adaptive policy (they
        leave the loop for the rounds; a pinned K drafts in every step, synchronously)."""
        if not self.async_scheduling:
            return False
        if self.drafter is None or (self.device_rounds and self.policy.adaptive):
            return True
        scheduler = self.scheduler
        return not any(
            r.spec is not None for r in itertools.chain(scheduler.running, scheduler.waiting)
        )

    def _schedule_ahead(self, admit: bool = True) -> list[ScheduledRequest] | None:
        """The next step's shares while a step is in flight (None: read that step first):
        requests whose token in flight reaches their output limit are held back (that token
        ends them); nothing is preempted (`Scheduler.schedule_ahead`); speculative requests
        draft nothing. `admit`: False takes no waiting request in."""
        scheduler = self.scheduler
        limit = self.outputs.output_limit
        hold = {
            id(r)
            for r in scheduler.running
            if r.num_pending and len(r.output_token_ids) + r.num_pending >= limit(r)
        }
        scheduled = scheduler.schedule_ahead(hold, admit)
        for share in scheduled or ():
            share.cap_drafts(0)
        return scheduled

    def _admission_pending(self) -> bool:
        """Whether a waiting request could join the batch now (the device rounds and the plain
        arm then drain; the overlapped loop takes it in). A full batch
        (max_num_seqs running) admits nobody until one finishes, so a queue behind it does not
        stop them."""
        scheduler = self.scheduler
        return bool(scheduler.waiting) and len(scheduler.running) < self.config.max_num_seqs

    def _admission_due(self) -> bool:
        """Whether the speculative paths take waiting requests in now: `_admission_pending`, and
        either one request can be admitted per `ADMISSION_BATCH_SHARE` running (the lesser of
        those waiting and the free places under max_num_seqs) or admission has been possible for
        `MAX_ADMISSION_WAIT_S` (what a gathered arrival's TTFT may pay). Each admission costs
        the rounds a price whatever its size: a drain into the overlapped loop (every running
        row undrafted through the arrivals' prefill steps, then the drafter's catch-up on
        entering the rounds again) or, for a burst, prefill steps between rounds and a catch-up
        over the joiners' prompts when they take their slots (an eager head pass, one for all
        seated together). Paid for each arrival at steady load (one about every round at c = 64;
        a place freed about every round behind a queue), it kept the batch in visits or in
        catch-ups (s32, H100, py-spy: the catch-up alone 14-19% of the engine process behind a
        queue). Counting free places rather than waiting requests gathers behind a queue too,
        and the clock starts when a place and a request first meet (a queued request's own wait
        says nothing). An idle engine or a small batch (fewer running than
        `ADMISSION_BATCH_SHARE`) admits at once. Tokens do not depend on when a request joins.
        Measured (s32, one H100 lease, 768 requests a level, spec / `--no- spec`): with the
        clock from each request's arrival and waiting requests counted, 0.93x / 1.02x / 0.72x at
        c = 16 / 64 / 256; this rule, 0.96x / 1.01x / 0.82x."""
        if not self._admission_pending():
            self._admissible_since = None
            return False
        now = time.monotonic()
        if self._admissible_since is None:
            self._admissible_since = now
        scheduler = self.scheduler
        running = len(scheduler.running)
        admissible = min(len(scheduler.waiting), self.config.max_num_seqs - running)
        if admissible * ADMISSION_BATCH_SHARE >= running:
            return True
        return now - self._admissible_since >= MAX_ADMISSION_WAIT_S

    def _launch(
        self, scheduled: list[ScheduledRequest], previous: Inflight | None, measured: bool = False
    ) -> Inflight:
        """Runs a step and samples its emitting rows without reading the tokens: decode rows
        (a request's input token is `previous`'s sample where `previous` holds the request)
        and prefill chunks (their tokens from the host; the last chunk of a prompt samples its
        first output token). `measured`: a step of the speculation policy's plain arm (decode
        rows of every running request), its device time measured for the policy. The target
        features of the speculative requests' inputs are kept for the feature log."""
        forward = self._launch_forward(scheduled, previous, measured)
        return self._launch_sample(forward)

    def _launch_and_resolve(
        self,
        scheduled: list[ScheduledRequest] | None,
        inflight: Inflight,
        only_finished: bool,
        measured: bool = False,
    ) -> list[RequestOutput]:
        """Launches `scheduled` (None or empty: nothing) ahead of reading `inflight`, then reads
        it; sets `_inflight` to the launched step. A step with a constrained request (its
        grammar runs on the host) runs its forward first and samples after `inflight` is read,
        so that the grammar's mask follows the token in flight."""
        if not scheduled:
            self._inflight = None
            return self._resolve(inflight, only_finished)
        forward = self._launch_forward(scheduled, inflight, measured)
        if any(r.grammar is not None for r in forward.emitters):
            outputs = self._resolve(inflight, only_finished)
            self._inflight = self._launch_sample(forward, host_current=True)
            return outputs
        self._inflight = self._launch_sample(forward)
        return self._resolve(inflight, only_finished)

    def _launch_forward(
        self,
        scheduled: list[ScheduledRequest],
        previous: Inflight | None,
        measured: bool = False,
    ) -> _Forward:
        """`_launch`'s first half: the target's forward over the step (its K/V committed), its
        emitting rows' logits kept for `_launch_sample`."""
        requests = [share.request for share in scheduled]
        inputs = step_inputs(scheduled, None, self.outputs.wants_prompt_logprobs)
        first_tokens = self._first_tokens(requests, inputs, previous)
        started = mark(self.device) if measured else None
        decode_only = all(
            len(s.token_ids) == 1 and s.num_logit_rows == 1 and share.emits
            for s, share in zip(inputs, scheduled, strict=True)
        )
        decodes = [not share.request.in_prefill for share in scheduled]  # before the commit
        features = chunks = None
        prompt = []
        # An engine with a drafter runs every step with the drafter's feature layers (the
        # graphs its warm-up captured), keeping the features only where a drafter reads them:
        # the speculative requests' (the feature log holds them until the drafter drafts).
        layers = () if self.drafter is None else self.drafter.feature_layers
        kept = bool(layers) and any(r.spec is not None for r in requests)
        if decode_only:
            # the decode graph, its features stacked [B, F]: one copy a step, not one a row
            rows, features = self.runner.run_rows_with_features(
                inputs, layers, first_tokens, min_rows=self._plain_rows if measured else 0
            )
            if features is not None:
                # a static buffer's view: the next step overwrites it
                features = features[: len(inputs)].clone() if kept else None
        elif measured:
            raise RuntimeError("the plain arm's steps are decode rows only")
        else:
            graphed = self.runner.num_graphed_prefill_steps
            logits, per_input = self.runner.run_with_features(inputs, layers, first_tokens)
            graphed = self.runner.num_graphed_prefill_steps - graphed
            self.loop_stats.num_graphed_prefill_steps += graphed
            if per_input and kept:  # views of static buffers: the next step overwrites them
                kept_rows = [
                    (share.request, step_input.start, rows)
                    for share, step_input, rows in zip(scheduled, inputs, per_input, strict=True)
                    if share.request.spec is not None
                ]
                if kept_rows:  # one copy for the step, not one a request (s32: 10% of its host)
                    copies = torch.cat([rows for *_, rows in kept_rows]).split(
                        [rows.shape[0] for *_, rows in kept_rows]
                    )
                    chunks = [
                        (request, start, copy)
                        for (request, start, _), copy in zip(kept_rows, copies, strict=True)
                    ]
            for share, step_input, rows, decode in zip(
                scheduled, inputs, logits, decodes, strict=True
            ):
                if not decode and step_input.num_logit_rows > int(share.emits):
                    prompt += self._prompt_logprobs_ahead(share.request, step_input.start, rows)
            # the emitting shares' rows: a chunk's last one (its others: prompt logprobs)
            picked = [rows[-1:] for rows, s in zip(logits, scheduled, strict=True) if s.emits]
            rows = torch.cat(picked) if picked else None
        plain = sum(not share.request.in_prefill for share in scheduled)
        for share, step_input in zip(scheduled, inputs, strict=True):
            self.scheduler.commit(share.request, step_input.start + len(step_input.token_ids))
        self.loop_stats.num_overlapped_steps += 1
        prefill = sum(len(s.token_ids) for s in inputs) - plain
        self.loop_stats.observe_rows(prefill=prefill, plain=plain)
        self.loop_stats.num_overlapped_prefill_steps += int(prefill > 0)
        if prefill:
            self._plain_rows = 0  # the batch grew: the rounds' rows no longer pad its steps
        emitters = [share.request for share in scheduled if share.emits]
        prefix = self._pending_prefix(scheduled, emitters, first_tokens, previous)
        # per emitting request, the position of its last input token (its token comes next)
        starts = [
            s.start + len(s.token_ids) - 1
            for share, s in zip(scheduled, inputs, strict=True)
            if share.emits
        ]
        return _Forward(emitters, rows, prefix, starts, measured, features, chunks, started, prompt)

    def _prompt_logprobs_ahead(self, request: Request, start: int, rows: torch.Tensor) -> list:
        """The logprobs of the prompt tokens that a chunk's logit rows ([n, V] from position
        `start`) predict and that still lack them, computed on the device now (the rows are a
        static buffer's views): [] or one `_Forward.prompt` entry."""
        wanted, tokens = self.outputs.prompt_logprobs_wanted(request, start, rows.shape[0])
        if not wanted:
            return []
        packed = to_device(wanted + tokens, torch.int64, rows.device)
        index, token_ids = packed.split([len(wanted), len(tokens)])
        num_top = request.params.prompt_logprobs
        result = compute_logprobs(rows.index_select(0, index), token_ids, num_top)
        return [(request, start, wanted, tokens, num_top, result)]

    def _launch_sample(self, forward: _Forward, host_current: bool = False) -> Inflight:
        """`_launch`'s second half: samples the emitting rows (`host_current`: the host has
        read every token of the emitting requests since the forward, so their logits rules
        need no prefix) and starts reading the tokens (and logprobs) back."""
        emitters, rows = forward.emitters, forward.rows
        if rows is not None:
            prefix = None if host_current else forward.prefix
            token_ids, unusable = self.emitter.sample_rows(emitters, rows, prefix)
        else:  # prefill chunks only, none of them the last of its prompt
            token_ids = torch.empty(0, dtype=torch.int64, device=self.device)
            unusable = torch.empty(0, dtype=torch.bool, device=self.device)
        ended = mark(self.device) if forward.measured else None
        for request in emitters:
            request.num_pending += 1
        # A row without a distribution still yields a valid id (the next step may take it as
        # its input); its flag comes back in the same copy and `_resolve` drops the token.
        ints, floats = {"tokens": token_ids, "unusable": unusable}, {}
        groups = self._logprobs_ahead(emitters, rows, token_ids, ints, floats)
        for k, (*_, result) in enumerate(forward.prompt):
            ints[f"prompt_top_ids{k}"] = result.top_ids
            ints[f"prompt_ranks{k}"] = result.token_ranks
            floats[f"prompt_top_logprobs{k}"] = result.top_logprobs
            floats[f"prompt_logprobs{k}"] = result.token_logprobs
        readback = Readback(ints, floats)
        if forward.measured:
            self.loop_stats.observe_plain_arm()
        return Inflight(
            emitters,
            token_ids,
            readback,
            forward.measured,
            forward.starts,
            forward.features,
            forward.started,
            ended,
            forward.chunks,
            logprob_groups=groups,
            prompt_logprobs=[entry[:5] for entry in forward.prompt] or None,
        )

    @staticmethod
    def _pending_prefix(
        scheduled: list[ScheduledRequest],
        emitters: list[Request],
        first_tokens: torch.Tensor | None,
        previous: Inflight | None,
    ) -> torch.Tensor | None:
        """[len(emitters), 1] int64 on the device: for an emitting request whose last token is
        `previous`'s sample (its input token now, not read by the host), that token; -1 for
        the others. None when no emitter has logits rules or none has such a token."""
        if first_tokens is None or not any(r.rules is not None for r in emitters):
            return None
        held = {id(r) for r in previous.requests}
        pending = [id(s.request) in held for s in scheduled if s.emits]
        if not any(pending):
            return None
        rows = [i for i, share in enumerate(scheduled) if share.emits]
        device = first_tokens.device
        packed = to_device(rows + [int(p) for p in pending], torch.int64, device)
        index, flags = packed.split([len(rows), len(rows)])
        return torch.where(flags.bool(), first_tokens[index], -1)[:, None]

    @staticmethod
    def _logprobs_ahead(
        requests: list[Request],
        rows: torch.Tensor | None,
        token_ids: torch.Tensor,
        ints: dict[str, torch.Tensor],
        floats: dict[str, torch.Tensor],
    ) -> list[tuple[int, list[int]]] | None:
        """The logprobs of the sampled tokens of the `requests` that ask for them, computed on
        the device now (the rows are a static buffer's views that the next step overwrites)
        and added to the step's read-back (`ints`, `floats`: "top_ids{g}", "ranks{g}",
        "top_logprobs{g}", "logprobs{g}" per group g of one number of top alternatives).
        Returns the groups (that number, indices into `requests`), or None."""
        groups: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
            if request.params.logprobs is not None:
                groups.setdefault(request.params.logprobs, []).append(index)
        if not groups:
            return None
        for g, (num_top, members) in enumerate(groups.items()):
            picked = to_device(members, torch.int64, token_ids.device)
            lp = compute_logprobs(rows.index_select(0, picked), token_ids[picked], num_top)
            ints[f"top_ids{g}"], ints[f"ranks{g}"] = lp.top_ids, lp.token_ranks
            floats[f"top_logprobs{g}"], floats[f"logprobs{g}"] = lp.top_logprobs, lp.token_logprobs
        return list(groups.items())

    def _logprob_entries_read(
        self, inflight: Inflight, values: dict[str, torch.Tensor], tokens: list[int]
    ) -> dict[int, dict]:
        """Index into `inflight.requests` -> the logprob entry of its token, from the values
        `_logprobs_ahead` added to the read-back."""
        entries: dict[int, dict] = {}
        for g, (num_top, members) in enumerate(inflight.logprob_groups or ()):
            top_ids = values[f"top_ids{g}"].view(len(members), num_top).tolist()
            top_values = values[f"top_logprobs{g}"].view(len(members), num_top).tolist()
            built = self.outputs.logprob_entries_from(
                [tokens[i] for i in members],
                top_ids,
                top_values,
                values[f"logprobs{g}"].tolist(),
                values[f"ranks{g}"].tolist(),
            )
            entries.update(zip(members, built, strict=True))
        return entries

    @staticmethod
    def _first_tokens(
        requests: list[Request], inputs: list[StepInput], previous: Inflight | None
    ) -> torch.Tensor | None:
        """[len(inputs)] int64 on the device: each input's first token, `previous`'s sample
        for the requests it holds (their token is still on the device), else the input's own
        (None when no input takes a sample)."""
        if previous is None:
            return None
        if requests == previous.requests:
            return previous.token_ids
        index = {id(r): i for i, r in enumerate(previous.requests)}
        picks = [(i, index[id(r)]) for i, r in enumerate(requests) if id(r) in index]
        if not picks:
            return None
        own = [s.token_ids[0] for s in inputs]
        device = previous.token_ids.device
        packed = to_device(own + [j for _, j in picks] + [i for i, _ in picks], torch.int64, device)
        firsts, taken, at = packed.split([len(own), len(picks), len(picks)])
        firsts[at] = previous.token_ids[taken]
        return firsts

    def _resolve(self, inflight: Inflight, only_finished: bool) -> list[RequestOutput]:
        """Reads a launched step's tokens and commits them as a synchronous step would have
        (requests that finished meanwhile drop theirs; the cache was committed at launch). A
        request whose row had no distribution ends with an error instead."""
        return self._commit(self._read_commits(inflight), only_finished)

    def _read_commits(self, inflight: Inflight) -> list[tuple[Request, None, Emission]]:
        """`_resolve`'s first half: reads the step (its features to the drafter, its logprobs
        and prompt logprobs to the outputs) and returns its commits for `_commit`."""
        values = inflight.readback.values()
        tokens, unusable = values["tokens"].tolist(), values["unusable"].tolist()
        if inflight.measured:
            self._observe_plain(inflight)
        if inflight.features is not None:  # a decode step's, row b that of requests[b]
            self._feature_log.add_rows(inflight.requests, inflight.starts, inflight.features)
        if inflight.chunks:
            self._feature_log.add_chunks(inflight.chunks)
        entries = self._logprob_entries_read(inflight, values, tokens)
        for k, (request, start, wanted, prompt_tokens, num_top) in enumerate(
            inflight.prompt_logprobs or ()
        ):
            if request.status.finished:
                continue
            shape = (len(wanted), num_top)
            built = self.outputs.logprob_entries_from(
                prompt_tokens,
                values[f"prompt_top_ids{k}"].view(shape).tolist(),
                values[f"prompt_top_logprobs{k}"].view(shape).tolist(),
                values[f"prompt_logprobs{k}"].tolist(),
                values[f"prompt_ranks{k}"].tolist(),
            )
            self.outputs.fill_prompt_logprobs(request, start, wanted, built)
        commits = []
        for index, (request, token, bad, start) in enumerate(
            zip(inflight.requests, tokens, unusable, inflight.starts, strict=True)
        ):
            request.num_pending -= 1
            if request.status.finished:
                continue
            if bad:  # the row of the token at start + 1
                emission = Emission([], 0, 0, None, unusable_position=start + 1)
            else:
                entry = entries.get(index)
                emission = Emission([token], 0, 0, None, logprobs=entry and [entry])
            commits.append((request, None, emission))
        return commits
