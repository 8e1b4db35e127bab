"""The engine's overlapped plain loop (asynchronous scheduling): while a plain decode step runs on
the device, the next one is scheduled and launched, fed the sampled tokens on the device, and the
earlier step's tokens are read meanwhile. A mixin of `LLMEngine`, whose state (scheduler,
runner, the step in flight) it uses.
"""

from __future__ import annotations

from specdec.engine.device_round import mark
from specdec.engine.emitter import Emission
from specdec.engine.inflight import Inflight
from specdec.engine.outputs import RequestOutput
from specdec.engine.proposals import step_inputs
from specdec.engine.scheduler import ScheduledRequest
from specdec.transfer import Readback


class OverlappedLoop:
    """`LLMEngine`'s overlapped plain decode loop (methods only)."""

    def _step_async(self, only_finished: bool) -> list[RequestOutput]:
        """One call of the overlapped loop. With a step in flight: launch the next one when the
        batch is certain to be the same requests (its input tokens are the in-flight step's
        samples, still on the device), then read and commit the in-flight step's tokens while
        the new one runs; otherwise read the in-flight step first. With none in flight: run the
        scheduled step as usual, or launch it without reading when it can be overlapped."""
        inflight = self._inflight
        if inflight is not None:
            self._inflight = None
            if self._can_overlap(inflight):
                self._inflight = self._launch(self._schedule(), inflight)
            return self._resolve(inflight, only_finished)
        scheduled = self._schedule()
        if not scheduled:
            return []
        if all(self._overlappable(share) for share in scheduled):
            self._inflight = self._launch(scheduled, None)
            return []
        return self._run_step(scheduled, only_finished)

    def _overlappable(self, share: ScheduledRequest) -> bool:
        """A plain decode share whose output needs nothing but the sampled token."""
        request = share.request
        return (
            share.emits
            and share.num_query_tokens == 1
            and request.spec is None
            and request.num_computed_tokens == request.num_tokens - 1
            and request.params.logprobs is None
            and not request.host_processed  # processed with the output so far, on the host
        )

    def _admission_pending(self) -> bool:
        """Whether a waiting request could join the batch now (the overlapped loop and the rounds
        then drain). A full batch (max_num_seqs running) admits nobody until one finishes, so a
        queue behind it does not stop them."""
        scheduler = self.scheduler
        return bool(scheduler.waiting) and len(scheduler.running) < self.config.max_num_seqs

    def _can_overlap(self, inflight: Inflight) -> bool:
        """Whether the next schedule is certainly the in-flight requests again, each decoding
        one more token: no waiting request could join (the batch is full or nothing waits),
        nothing finished or was aborted, every request may still emit after its pending token,
        and the cache has a slot for each without preempting."""
        scheduler = self.scheduler
        running = scheduler.running
        if self._admission_pending() or len(running) != len(inflight.requests):
            return False
        if len(running) > scheduler.config.max_num_batched_tokens:
            return False
        block_size = scheduler.allocator.block_size
        new_blocks = 0
        for request, expected in zip(running, inflight.requests, strict=True):
            if request is not expected or request.status.finished:
                return False
            limit = self.outputs.output_limit(request)
            if len(request.output_token_ids) + request.num_pending >= limit:
                return False
            if request.num_computed_tokens + 1 > len(request.block_ids) * block_size:
                new_blocks += 1
        return new_blocks <= scheduler.allocator.num_free_blocks

    def _launch(
        self,
        scheduled: list[ScheduledRequest],
        previous: Inflight | None,
        plain_arm: bool = False,
    ) -> Inflight:
        """Runs and samples a plain decode step without reading its tokens. With `previous`,
        each request's input token is that step's sample (same requests, same order).
        `plain_arm`: a step of the speculation policy's plain arm (speculative requests: it
        keeps the target features their drafter reads, and is measured)."""
        requests = [share.request for share in scheduled]
        first_tokens = None
        if previous is not None:
            if requests != previous.requests:
                raise RuntimeError("asynchronous scheduling: the batch changed unexpectedly")
            first_tokens = previous.token_ids
        inputs = step_inputs(scheduled, None)
        started = mark(self.device) if plain_arm else None
        layers = self.drafter.feature_layers if plain_arm else ()
        rows, features = self.runner.run_rows_with_features(
            inputs, layers, first_tokens, min_rows=self._plain_rows if plain_arm else 0
        )
        if features is not None:
            features = features.clone()  # a static buffer's view: the next step overwrites it
        token_ids, unusable = self.emitter.sample_rows(requests, rows)
        ended = mark(self.device) if plain_arm else None
        for request, step_input in zip(requests, inputs, strict=True):
            self.scheduler.commit(request, step_input.start + 1)
            request.num_pending += 1
        self.loop_stats.num_overlapped_steps += 1
        self.loop_stats.observe_rows(plain=len(inputs))
        # A row without a distribution still yields a valid id (the next step may take it as
        # its input); its flag comes back in the same copy and `_resolve` drops the token.
        readback = Readback({"tokens": token_ids, "unusable": unusable}, {})
        starts = [s.start for s in inputs]
        if not plain_arm:
            return Inflight(requests, token_ids, readback, starts=starts)
        self.loop_stats.observe_plain_arm()
        return Inflight(requests, token_ids, readback, True, starts, features, started, ended)

    def _resolve(self, inflight: Inflight, only_finished: bool) -> list[RequestOutput]:
        """Reads a launched step's tokens and commits them as a synchronous step would have
        (requests that finished meanwhile drop theirs; the cache was committed at launch). A
        request whose row had no distribution ends with an error instead."""
        values = inflight.readback.values()
        tokens, unusable = values["tokens"].tolist(), values["unusable"].tolist()
        if inflight.plain_arm:
            self._observe_plain(inflight)
        commits = []
        for request, token, bad, start in zip(
            inflight.requests, tokens, unusable, inflight.starts, strict=True
        ):
            request.num_pending -= 1
            if request.status.finished:
                continue
            if bad:  # the row of the token at start + 1
                emission = Emission([], 0, 0, None, unusable_position=start + 1)
            else:
                emission = Emission([token], 0, 0, None)
            commits.append((request, None, emission))
        return self._commit(commits, only_finished)
