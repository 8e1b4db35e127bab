"""Output processing: a prompt's request group, appending emitted tokens with the stop rules
(stop tokens, stop strings, `max_tokens`, `max_model_len`), requests the engine ends with an
error, logprobs, detokenization, and the `RequestOutput`s callers are given. Host work only: it
never runs a model or draws randomness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestDelta,
    RequestOutput,
    SampleDelta,
    SampleLogprobs,
)
from specdec.engine.request import Request, RequestStatus
from specdec.metrics import SpecDecodeStats
from specdec.models import Tokenizer
from specdec.sampling import compute_logprobs


@dataclass(slots=True, eq=False)
class RequestGroup:
    """The n samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seed: int
    samples: list[Request]
    stop_token_ids: frozenset[int] = frozenset()  # stop_token_ids, and EOS unless ignored
    texts: list[str | None] = field(default_factory=list)  # a stop-truncated text, else None
    stop_reasons: list[str | int | None] = field(default_factory=list)
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # filled as prefill chunks run
    errors: list[str | None] = field(default_factory=list)  # why a sample ended in error
    # What the deltas sent so far hold (`OutputProcessor.delta`), per sample: the text, the
    # number of token ids and of logprob entries, the sum of those entries' log-probabilities.
    sent_texts: list[str] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    sent_logprobs: list[int] = field(default_factory=list)
    sent_cumulative: list[float] = field(default_factory=list)
    prompt_logprobs_sent: bool = False


def unusable_logits_message(position: int) -> str:
    """The error of a request whose logits row for the token at `position` has no
    distribution (`specdec.sampling.processing.unusable_rows`)."""
    return (
        f"the model produced no usable logits for the token at position {position} (NaN or "
        "-inf everywhere, or a +inf): the request was stopped"
    )


class OutputProcessor:
    """The request groups in flight and how their outputs are built.

    `finish(request, status)` is called when a stop rule ends a request (the engine frees its
    blocks and its drafter state there).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        finish: Callable[[Request, RequestStatus], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = None if tokenizer is None else tokenizer.eos_token_id
        if tokenizer is not None:
            tokenizer.byte_pieces()  # built now (tens of ms), not inside the first request's step
        self.max_model_len = max_model_len
        self.finish = finish
        self.groups: dict[str, RequestGroup] = {}
        self._group_of: dict[int, RequestGroup] = {}

    def add(self, group: RequestGroup) -> None:
        """Registers a new group. Mutates: group.texts, stop_reasons, errors, logprobs (one per
        sample)."""
        n = len(group.samples)
        group.texts = [None] * n
        group.stop_reasons = [None] * n
        group.errors = [None] * n
        group.sent_texts = [""] * n
        group.sent_tokens = [0] * n
        group.sent_logprobs = [0] * n
        group.sent_cumulative = [0.0] * n
        params = group.samples[0].params
        wants_logprobs = params.logprobs is not None
        group.logprobs = [[] if wants_logprobs else None for _ in range(n)]
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(group.prompt_token_ids)
        self.groups[group.request_id] = group
        for request in group.samples:
            self._group_of[id(request)] = group

    def group_of(self, request: Request) -> RequestGroup:
        return self._group_of[id(request)]

    def forget(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for request in group.samples:
            self._group_of.pop(id(request), None)

    @property
    def empty(self) -> bool:
        return not self.groups and not self._group_of

    def append(
        self,
        request: Request,
        tokens: list[int],
        rows: torch.Tensor | None,
        entries: list[dict[int, Logprob]] | None = None,
    ) -> bool:
        """Appends emitted tokens one by one, stopping at the first stop condition (the tokens
        after it are dropped). `rows` ([len(tokens), V] raw logits) give the logprobs, unless
        their `entries` were read already (`logprob_entries_from`). Returns whether the request
        finished."""
        group = self._group_of[id(request)]
        params = request.params
        output = request.output_token_ids
        check_text = bool(params.stop) and self.tokenizer is not None
        limit = self.output_limit(request)
        if params.logprobs is not None and entries is None:
            entries = self.logprob_entries(rows[: len(tokens)], tokens, params.logprobs)
        for j, token in enumerate(tokens):
            output.append(token)
            if entries is not None:
                group.logprobs[group.samples.index(request)].append(entries[j])
            num_out = len(output)
            if num_out >= params.min_tokens:
                if token in group.stop_token_ids:
                    reason = None if token == self.eos_token_id else token
                    group.stop_reasons[group.samples.index(request)] = reason
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
                    return True
                if check_text:
                    text = self.text(request)
                    hit = _find_stop(text, params.stop)
                    if hit is not None:
                        position, stop = hit
                        keep = position + (len(stop) if params.include_stop_str_in_output else 0)
                        index = group.samples.index(request)
                        group.texts[index] = text[:keep]
                        group.stop_reasons[index] = stop
                        self.finish(request, RequestStatus.FINISHED_STOPPED)
                        return True
            if num_out >= limit:
                self.finish(request, RequestStatus.FINISHED_LENGTH)
                return True
        return False

    def fail(self, request: Request, message: str) -> None:
        """Ends a running request with finish_reason "error" and `message` (its tokens so far
        stay emitted). Mutates: the group's errors; the request's status (through `finish`)."""
        group = self._group_of[id(request)]
        group.errors[group.samples.index(request)] = message
        self.finish(request, RequestStatus.FINISHED_ERROR)

    def logprob_entries(
        self, rows: torch.Tensor, token_ids: list[int], num_top: int
    ) -> list[dict[int, Logprob]]:
        """vLLM's logprob dicts of tokens under [N, V] raw logit rows: the top `num_top` ids in
        rank order, then the token itself if it is not among them."""
        lp = compute_logprobs(rows, torch.tensor(token_ids, device=rows.device), num_top)
        return self.logprob_entries_from(
            token_ids,
            lp.top_ids.tolist(),
            lp.top_logprobs.tolist(),
            lp.token_logprobs.tolist(),
            lp.token_ranks.tolist(),
        )

    def logprob_entries_from(
        self,
        token_ids: list[int],
        top_ids: list[list[int]],
        top_values: list[list[float]],
        values: list[float],
        ranks: list[int],
    ) -> list[dict[int, Logprob]]:
        """`logprob_entries` from `compute_logprobs`' results read to the host (per token: its
        top ids and their log-probabilities, its own log-probability and rank)."""
        entries = []
        for j, token in enumerate(token_ids):
            entry = {
                t: Logprob(v, rank, self.token_text(t))
                for rank, (t, v) in enumerate(zip(top_ids[j], top_values[j], strict=True), 1)
            }
            if token not in entry:
                entry[token] = Logprob(values[j], ranks[j], self.token_text(token))
            entries.append(entry)
        return entries

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def wants_prompt_logprobs(self, request: Request, start: int) -> bool:
        """Whether a prefill chunk of `request` from position `start` has prompt tokens whose
        logprobs are still missing (so it asks for the logits of all its tokens)."""
        group = self._group_of.get(id(request))
        if group is None or group.prompt_logprobs is None:
            return False
        filled = group.prompt_logprobs
        return any(filled[p] is None for p in range(max(start + 1, 1), len(filled)))

    def add_prompt_logprobs(self, request: Request, start: int, rows: torch.Tensor) -> None:
        """Records the logprobs of the prompt tokens that raw logit rows [n, V] of positions
        start .. start+n-1 predict (row i: the token at start+i+1), where still missing.
        Mutates: the group's prompt_logprobs."""
        wanted, tokens = self.prompt_logprobs_wanted(request, start, rows.shape[0])
        if not wanted:
            return
        index = torch.tensor(wanted, device=rows.device)
        num_top = request.params.prompt_logprobs
        entries = self.logprob_entries(rows[index], tokens, num_top)
        self.fill_prompt_logprobs(request, start, wanted, entries)

    def prompt_logprobs_wanted(
        self, request: Request, start: int, num_rows: int
    ) -> tuple[list[int], list[int]]:
        """Of `num_rows` logit rows from position `start`, the rows whose prompt token (at
        start + i + 1) still lacks its logprobs, and those tokens."""
        group = self._group_of[id(request)]
        filled, prompt = group.prompt_logprobs, group.prompt_token_ids
        wanted = [
            i
            for i in range(num_rows)
            if start + i + 1 < len(prompt) and filled[start + i + 1] is None
        ]
        return wanted, [prompt[start + i + 1] for i in wanted]

    def fill_prompt_logprobs(
        self, request: Request, start: int, wanted: list[int], entries: list[dict]
    ) -> None:
        """Records `entries`, the logprobs of the prompt tokens rows `wanted` (from position
        `start`) predict. Mutates: the group's prompt_logprobs."""
        filled = self._group_of[id(request)].prompt_logprobs
        for i, entry in zip(wanted, entries, strict=True):
            filled[start + i + 1] = entry

    def output_limit(self, request: Request) -> int:
        """Output tokens the request may have: max_tokens, or max_model_len tokens in all."""
        limit = self.max_model_len - len(request.prompt_token_ids)
        max_tokens = request.params.max_tokens
        return limit if max_tokens is None else min(limit, max_tokens)

    def text(self, request: Request) -> str:
        """The output text: decoded incrementally while the request runs (it may lag by an
        incomplete character), decoded whole once it has finished."""
        if self.tokenizer is None:
            return ""
        skip = request.params.skip_special_tokens
        if request.status.finished:
            return self.tokenizer.decode(request.output_token_ids, skip_special_tokens=skip)
        pieces = self.tokenizer.byte_pieces(skip)
        if pieces is not None:
            return request.detokenized.update_bytes(pieces, request.output_token_ids)
        return request.detokenized.update(self.tokenizer, request.output_token_ids, skip)

    def outputs(
        self, reported: dict[str, RequestGroup], only_finished: bool, deltas: bool = False
    ) -> list[RequestOutput] | list[RequestDelta]:
        """The outputs of the reported groups (only the finished ones with `only_finished`;
        `deltas`: each as the change since its previous delta); finished groups are
        forgotten."""
        if deltas:
            return [self.delta(group) for group in reported.values()]
        if only_finished:
            return [
                self.output(group)
                for group in reported.values()
                if all(r.status.finished for r in group.samples)
            ]
        return [self.output(group) for group in reported.values()]

    def output(self, group: RequestGroup) -> RequestOutput:
        outputs = []
        finished = True
        for index, request in enumerate(group.samples):
            status = request.status
            done = status.finished
            finished = finished and done
            logprobs = group.logprobs[index]
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=self.text(request) if group.texts[index] is None else group.texts[index],
                    token_ids=list(request.output_token_ids),
                    finish_reason=status.value if done else None,
                    stop_reason=group.stop_reasons[index],
                    error=group.errors[index],
                    logprobs=None if logprobs is None else list(logprobs),
                    cumulative_logprob=None
                    if logprobs is None
                    else sum(
                        entry[token].logprob
                        for entry, token in zip(logprobs, request.output_token_ids, strict=False)
                    ),
                )
            )
        stats = self._stats(group)
        if finished:
            self.forget(group)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            seed=group.seed,
            spec_decode_stats=stats,
            prompt_logprobs=None if group.prompt_logprobs is None else list(group.prompt_logprobs),
        )

    def delta(self, group: RequestGroup) -> RequestDelta:
        """The group's output as a change since its previous delta (`output`'s fields without
        rebuilding what was sent: a streaming server's engine process sends these); the group
        is forgotten once finished."""
        samples = []
        finished = True
        for index, request in enumerate(group.samples):
            status = request.status
            done = status.finished
            finished = finished and done
            text = group.texts[index]
            if text is None:
                text = self.text(request)
            before = group.sent_texts[index]
            keep = len(before) if text.startswith(before) else 0
            tokens = request.output_token_ids
            logprobs = group.logprobs[index]
            new_logprobs = cumulative = None
            if logprobs is not None:
                sent = group.sent_logprobs[index]
                new_logprobs = logprobs[sent:]
                cumulative = group.sent_cumulative[index] + sum(
                    entry[token].logprob
                    for entry, token in zip(new_logprobs, tokens[sent:], strict=False)
                )
                group.sent_cumulative[index] = cumulative
                group.sent_logprobs[index] = len(logprobs)
            samples.append(
                SampleDelta(
                    index,
                    keep,
                    text[keep:],
                    tokens[group.sent_tokens[index] :],
                    new_logprobs,
                    status.value if done else None,
                    group.stop_reasons[index],
                    cumulative,
                    group.errors[index],
                )
            )
            group.sent_texts[index] = text
            group.sent_tokens[index] = len(tokens)
        prompt_logprobs = None
        if group.prompt_logprobs is not None and not group.prompt_logprobs_sent:
            prompt_logprobs = list(group.prompt_logprobs)
            group.prompt_logprobs_sent = True
        stats = None
        if finished:
            stats = self._stats(group)
            self.forget(group)
        return RequestDelta(
            group.request_id, group.prompt, finished, group.seed, stats, prompt_logprobs, samples
        )

    @staticmethod
    def _stats(group: RequestGroup) -> dict:
        """The group's spec-decode counters, summed over its samples, as a dict."""
        if len(group.samples) == 1:
            return group.samples[0].stats.as_dict()
        stats = SpecDecodeStats()
        for request in group.samples:
            stats.merge(request.stats)
        return stats.as_dict()


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(hits) if hits else None
