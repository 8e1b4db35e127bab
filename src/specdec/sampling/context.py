"""Context-dependent logits processing, shared by the target and the drafts: vLLM's
allowed_token_ids, bad_words, min_tokens and logit_bias, then the repetition, frequency and
presence penalties, in that order (vLLM's), on raw logits before temperature and the filters.

A row's processing is a function of its request's rules (`LogitsRules`) and of its context: the
prompt and the tokens generated before the token the row is for. Under speculation a verify row or
a draft row passes the drafts before it as part of that context (`LogitsContext.apply`'s
`prefix`), so it is processed exactly as plain decoding processes that position once those drafts
are accepted. A request's grammar (`GrammarMatcher`, structured outputs) is the last rule: its
bitmask after the output and the prefix is applied to its rows only. Nothing here draws randomness.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.sampling.bitmask import apply_bitmask, unpack_bitmask
from specdec.sampling.params import SamplingParams
from specdec.transfer import to_device

if TYPE_CHECKING:
    from specdec.sampling.grammar import GrammarMatcher

NEG_INF = float("-inf")
_WILDCARD = -2  # a left-padding entry of a bad word's prefix: matches any context token
_NEVER = -3  # an entry of a padding word: matches no context token


@dataclass(frozen=True, slots=True)
class LogitsRules:
    """One request's context-dependent processing, resolved to token ids.

    Attributes:
        repetition_penalty: > 0; tokens of the prompt or the output have positive logits divided
            by it and negative ones multiplied by it (1 = off).
        presence_penalty: subtracted from the logit of every token present in the output.
        frequency_penalty: times the token's count in the output, subtracted from its logit.
        logit_bias: (token id, bias) pairs added to the logits.
        allowed_token_ids: only these may be sampled (None: any).
        bad_words_token_ids: token sequences that must not be generated: a sequence's last token
            is banned whenever the output ends with the rest of it (always, for one token).
        min_tokens: while the output has fewer tokens, `min_tokens_banned` are banned.
        min_tokens_banned: the stop token ids, and EOS unless ignored.
    """

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    min_tokens_banned: tuple[int, ...] = ()

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @staticmethod
    def build(
        *,
        vocab_size: int,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: Sequence[str] | None = None,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        encode: Callable[[str], list[int]] | None = None,
    ) -> LogitsRules | None:
        """The rules of one request (None when it has none, so it costs nothing).

        Args:
            vocab_size: V; every token id named must lie in [0, V).
            bad_words: strings, tokenized as vLLM does: the word as given (leading spaces
                stripped), and with one leading space when that tokenizes to a different first
                token and the same number of tokens.
            stop_token_ids: banned while the output is shorter than `min_tokens` (pass EOS
                among them unless it is ignored).
            encode: text -> token ids without special tokens (needed for `bad_words`).

        Raises:
            ValueError: a token id outside the vocabulary (naming the field), or bad_words
                without a tokenizer.
        """
        for name, ids in (
            ("logit_bias", list(logit_bias or ())),
            ("allowed_token_ids", list(allowed_token_ids or ())),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
                )
        words: list[tuple[int, ...]] = []
        if bad_words:
            if encode is None:
                raise ValueError("bad_words needs a tokenizer; this model has none")
            words = bad_words_token_ids(bad_words, encode)
            bad = [t for word in words for t in word if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"bad_words tokenize to ids {bad[:5]} outside the vocabulary")
        banned = tuple(sorted(set(stop_token_ids))) if min_tokens > 0 else ()
        rules = LogitsRules(
            repetition_penalty=float(repetition_penalty),
            presence_penalty=float(presence_penalty),
            frequency_penalty=float(frequency_penalty),
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
            allowed_token_ids=None
            if allowed_token_ids is None
            else tuple(sorted(set(allowed_token_ids))),
            bad_words_token_ids=tuple(words),
            min_tokens=min_tokens if banned else 0,
            min_tokens_banned=banned,
        )
        return None if rules == LogitsRules() else rules

    @staticmethod
    def from_params(
        params: SamplingParams,
        *,
        vocab_size: int,
        eos_token_id: int | None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> LogitsRules | None:
        """The rules of a request's SamplingParams (None when it has none). min_tokens bans the
        stop token ids, and EOS unless `ignore_eos`."""
        stops = set(params.stop_token_ids or ())
        if eos_token_id is not None and not params.ignore_eos:
            stops.add(eos_token_id)
        return LogitsRules.build(
            vocab_size=vocab_size,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=params.logit_bias,
            allowed_token_ids=params.allowed_token_ids,
            bad_words=params.bad_words,
            min_tokens=params.min_tokens,
            stop_token_ids=sorted(t for t in stops if 0 <= t < vocab_size),
            encode=encode,
        )


def bad_words_token_ids(
    bad_words: Sequence[str], encode: Callable[[str], list[int]]
) -> list[tuple[int, ...]]:
    """vLLM's tokenization of bad words: each word without leading spaces, and with one leading
    space when that gives a new first token and as many tokens (a word in mid-text)."""
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        bare = tuple(encode(word.lstrip()))
        if bare:
            out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


@dataclass(frozen=True, slots=True)
class RuleTensors:
    """Rules and contexts on one device, a row per request (a `LogitsContext`'s) or per slot
    (`SlotRules`') ([B] / [B, V] per request; None where no request uses it)."""

    bias: torch.Tensor | None  # [B, V] float32: logit_bias, -inf outside allowed / single bad words
    prompt_seen: torch.Tensor | None  # [B, V] bool: tokens of the prompt (repetition penalty)
    output_counts: torch.Tensor | None  # [B, V] float32: counts of the output's tokens
    repetition: torch.Tensor | None  # [B] float32
    presence: torch.Tensor | None  # [B] float32
    frequency: torch.Tensor | None  # [B] float32
    num_output: torch.Tensor | None  # [B] int64 output tokens so far
    min_tokens: torch.Tensor | None  # [B] int64
    min_banned: torch.Tensor | None  # [B, V] bool
    bad_prefix: torch.Tensor | None  # [B, W, M] int64 multi-token bad words but their last token
    bad_last: torch.Tensor | None  # [B, W] int64 the token each bans
    output_tail: torch.Tensor | None  # [B, M] int64 the last M output tokens (-1 before)


class LogitsContext:
    """The rules and contexts of B requests, turned into tensors on first use on each device.

    Rows of requests without rules or grammar are returned unchanged (as float32), bit for bit.
    """

    def __init__(
        self,
        rules: Sequence[LogitsRules | None],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        grammars: Sequence[GrammarMatcher | None] | None = None,
    ) -> None:
        """Args:
        rules: per request, its rules (None: none).
        prompts, outputs: per request, its prompt and the tokens it has generated so far.
        grammars: per request, its grammar matcher, following `outputs` (None: none).
        """
        if not len(rules) == len(prompts) == len(outputs):
            raise ValueError("rules, prompts and outputs must have one entry per request")
        if grammars is not None and len(grammars) != len(rules):
            raise ValueError("grammars must have one entry per request")
        self.rules = list(rules)
        self.prompts = prompts
        self.outputs = outputs
        self.grammars = None
        if grammars is not None and any(g is not None for g in grammars):
            self.grammars = list(grammars)
        self._on: dict[tuple[torch.device, int], RuleTensors] = {}

    @staticmethod
    def build(
        rules: Sequence[LogitsRules | None],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        grammars: Sequence[GrammarMatcher | None] | None = None,
    ) -> LogitsContext | None:
        """A context, or None when no request has rules or a grammar."""
        if all(r is None for r in rules) and (grammars is None or all(g is None for g in grammars)):
            return None
        return LogitsContext(rules, prompts, outputs, grammars)

    @property
    def num_rows(self) -> int:
        return len(self.rules)

    def select(self, rows: Sequence[int]) -> LogitsContext | None:
        """The context of a subset of the requests, in the given order (None: no rules)."""
        return LogitsContext.build(
            [self.rules[r] for r in rows],
            [self.prompts[r] for r in rows],
            [self.outputs[r] for r in rows],
            None if self.grammars is None else [self.grammars[r] for r in rows],
        )

    def apply(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Processes raw logits by each row's rules and context.

        Args:
            logits: [N, V] raw logits, any float dtype.
            rows: [N] int64 request (in [0, B)) of each row, on the logits' device; None: row n
                is request n (N = B).
            prefix: [N, J] int64 tokens that precede row n's token after its request's output
                (drafts before it), -1 from the first absent one on; None: no tokens.

        Returns:
            [N, V] float32, a new tensor. A row that its rules would leave without any token
            (a ban of every allowed token) is returned unprocessed rather than empty; a grammar
            always applies (a row it empties keeps the grammar's tokens, at their raw logits, or
            uniformly where those are all -inf).
        """
        num_rows, vocab = logits.shape
        device = logits.device
        host_rows = list(range(num_rows)) if rows is None else None
        if rows is None:
            if num_rows != self.num_rows:
                raise ValueError(f"logits have {num_rows} rows for {self.num_rows} requests")
            rows = torch.arange(num_rows, device=device)
        raw = logits.to(torch.float32)
        if self.grammars is not None and all(r is None for r in self.rules):  # grammars only
            out = raw.clone()
            self._apply_grammars(out, raw, rows, host_rows, prefix)
            return out
        out = process_rules(raw, self.tensors(device, vocab), rows, prefix)
        if self.grammars is not None:
            self._apply_grammars(out, raw, rows, host_rows, prefix)
        return out

    def _apply_grammars(self, out, raw, rows, host_rows, prefix) -> None:
        """Masks the rows of requests with a grammar by its bitmask after each row's prefix
        (read on the host: the grammar runs there). Mutates: out."""
        if host_rows is None:
            host_rows = rows.tolist()
        picked = [n for n, r in enumerate(host_rows) if self.grammars[r] is not None]
        if not picked:
            return
        prefixes = prefix.tolist() if prefix is not None else None
        masks = []
        for n in picked:
            tokens: tuple[int, ...] = ()
            if prefixes is not None:
                row = prefixes[n]
                length = next((i for i, t in enumerate(row) if t < 0), len(row))
                tokens = tuple(row[:length])
            masks.append(self.grammars[host_rows[n]].mask(tokens))
        device = out.device
        bitmask = torch.stack(masks)  # [M, W] int32
        if device.type == "cuda":
            bitmask = to_device(bitmask.view(-1), torch.int32, device).view(bitmask.shape)
        index = to_device(picked, torch.int64, device)
        part = out[index]  # [M, V], a copy
        apply_bitmask(part, bitmask, torch.arange(len(picked), device=device))
        empty = torch.isneginf(part).all(dim=1)
        if bool(empty.any()):  # rare: the rules or the draft vocabulary left nothing allowed
            allowed = unpack_bitmask(bitmask, out.shape[1])
            fallback = raw[index].masked_fill(~allowed, NEG_INF)
            uniform = torch.zeros_like(fallback).masked_fill(~allowed, NEG_INF)
            fallback = torch.where(torch.isneginf(fallback).all(1, keepdim=True), uniform, fallback)
            part = torch.where(empty[:, None], fallback, part)
        out[index] = part

    def tensors(self, device: torch.device, vocab: int) -> RuleTensors:
        """The rules and contexts as tensors on `device` (built on first use, then kept)."""
        key = (device, vocab)
        if key not in self._on:
            self._on[key] = self._build_tensors(device, vocab)
        return self._on[key]

    def _build_tensors(self, device: torch.device, vocab: int) -> RuleTensors:
        rules = self.rules
        batch = len(rules)
        present = [r for r in rules if r is not None]

        def scatter(entries: list[tuple[int, int]], value: float, dtype, fill: float):
            """[B, V] of `fill` with `value` at each (row, token) entry."""
            out = torch.full((batch, vocab), fill, dtype=dtype, device=device)
            if entries:
                flat = to_device([b * vocab + t for b, t in entries], torch.int64, device)
                out.view(-1)[flat] = value
            return out

        def column(values: list[float], dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        bias = None
        if any(r.logit_bias or r.allowed_token_ids is not None or _single(r) for r in present):
            bias = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
            biased = [(b * vocab + t, v) for b, r in enumerate(rules) if r for t, v in r.logit_bias]
            if biased:
                flat = to_device([i for i, _ in biased], torch.int64, device)
                bias.view(-1)[flat] = column([v for _, v in biased], torch.float32)
            allowed = [(b, r.allowed_token_ids) for b, r in enumerate(rules) if r is not None]
            allowed = [(b, ids) for b, ids in allowed if ids is not None]
            if allowed:
                mask = scatter([(b, t) for b, ids in allowed for t in ids], True, torch.bool, False)
                limited = column([b for b, _ in allowed], torch.int64)
                outside = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
                outside[limited] = ~mask[limited]
                bias.masked_fill_(outside, NEG_INF)
            single = [
                (b, word[0])
                for b, r in enumerate(rules)
                if r is not None
                for word in r.bad_words_token_ids
                if len(word) == 1
            ]
            if single:
                bias.masked_fill_(scatter(single, True, torch.bool, False), NEG_INF)

        penalised = [r is not None and r.penalised for r in rules]
        prompt_seen = output_counts = repetition = presence = frequency = None
        if any(penalised):
            output_counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
            ids = [t for b, out in enumerate(self.outputs) if penalised[b] for t in out]
            owners = [b for b, out in enumerate(self.outputs) if penalised[b] for _ in out]
            if ids:
                cells = [b * vocab + t for b, t in zip(owners, ids, strict=True)]
                flat = to_device(cells, torch.int64, device)
                output_counts.view(-1).index_add_(
                    0, flat, torch.ones(len(ids), dtype=torch.float32, device=device)
                )

            def param(name: str, off: float) -> torch.Tensor | None:
                values = [off if r is None else getattr(r, name) for r in rules]
                return None if all(v == off for v in values) else column(values, torch.float32)

            repetition = param("repetition_penalty", 1.0)
            presence = param("presence_penalty", 0.0)
            frequency = param("frequency_penalty", 0.0)
            if repetition is not None:
                prompt_seen = scatter(
                    [
                        (b, t)
                        for b, prompt in enumerate(self.prompts)
                        if penalised[b] and rules[b].repetition_penalty != 1.0
                        for t in set(prompt)
                    ],
                    True,
                    torch.bool,
                    False,
                )

        num_output = min_tokens = min_banned = None
        if any(r.min_tokens for r in present):
            num_output = column([len(out) for out in self.outputs], torch.int64)
            min_tokens = column([0 if r is None else r.min_tokens for r in rules], torch.int64)
            min_banned = scatter(
                [(b, t) for b, r in enumerate(rules) if r is not None for t in r.min_tokens_banned],
                True,
                torch.bool,
                False,
            )

        bad_prefix = bad_last = output_tail = None
        multi = [
            [w for w in r.bad_words_token_ids if len(w) > 1] if r is not None else [] for r in rules
        ]
        num_words = max(len(words) for words in multi)
        if num_words:
            width = max(len(w) for words in multi for w in words) - 1
            # Per request, its words padded to num_words by a word that never matches (-3).
            prefixes, lasts = [], []
            for words in multi:
                for w in words:
                    prefixes += [_WILDCARD] * (width + 1 - len(w)) + list(w[:-1])
                    lasts.append(w[-1])
                prefixes += [_NEVER] * (width * (num_words - len(words)))
                lasts += [0] * (num_words - len(words))
            bad_prefix = to_device(prefixes, torch.int64, device).view(batch, num_words, width)
            bad_last = to_device(lasts, torch.int64, device).view(batch, num_words)
            tails = [
                t
                for out in self.outputs
                for t in [-1] * max(0, width - len(out)) + list(out[-width:])
            ]
            output_tail = to_device(tails, torch.int64, device).view(batch, width)

        return RuleTensors(
            bias,
            prompt_seen,
            output_counts,
            repetition,
            presence,
            frequency,
            num_output,
            min_tokens,
            min_banned,
            bad_prefix,
            bad_last,
            output_tail,
        )


def _single(rules: LogitsRules) -> bool:
    return any(len(word) == 1 for word in rules.bad_words_token_ids)


def process_rules(
    raw: torch.Tensor, t: RuleTensors, rows: torch.Tensor, prefix: torch.Tensor | None
) -> torch.Tensor:
    """[N, V] float32 rows `raw` processed by the rules in `t` of each row's request (`rows`),
    with `prefix` counted as output after it (`LogitsContext.apply`). Device work only (no host
    sync): a CUDA graph may capture it. A row that its rules would leave without any token is
    returned as it came."""
    vocab = raw.shape[1]
    x = raw.clone()
    if prefix is not None and prefix.shape[1] == 0:
        prefix = None
    valid = None if prefix is None else prefix >= 0  # [N, J]
    num_prefix = None if valid is None else valid.sum(dim=1)  # [N]
    if t.bias is not None:
        x += t.bias[rows]
    if t.min_tokens is not None:
        produced = t.num_output[rows] + (0 if num_prefix is None else num_prefix)
        early = produced < t.min_tokens[rows]
        x.masked_fill_(t.min_banned[rows] & early[:, None], NEG_INF)
    if t.bad_prefix is not None:
        x.masked_fill_(_bad_word_bans(t, rows, prefix, num_prefix, vocab), NEG_INF)
    if t.output_counts is not None:
        counts = t.output_counts[rows]
        if prefix is not None:
            counts = counts.scatter_add(1, prefix.clamp_min(0), valid.to(torch.float32))
        present = counts > 0
        if t.repetition is not None:
            seen = present | t.prompt_seen[rows]
            penalty = torch.where(seen, t.repetition[rows][:, None], 1.0)
            x *= torch.where(x > 0, 1.0 / penalty, penalty)
        if t.frequency is not None:
            x -= t.frequency[rows][:, None] * counts
        if t.presence is not None:
            x -= t.presence[rows][:, None] * present
    empty = torch.isneginf(x).all(dim=1, keepdim=True)
    return torch.where(empty, raw, x)


def _bad_word_bans(t: RuleTensors, rows, prefix, num_prefix, vocab: int) -> torch.Tensor:
    """[N, V] bool: the last token of every multi-token bad word whose other tokens end the
    row's output (its request's output, then its prefix)."""
    width = t.bad_prefix.shape[2]
    tail = t.output_tail[rows]  # [N, M]
    if prefix is not None:
        joined = torch.cat([tail, prefix], dim=1)  # the last M valid tokens start at num_prefix
        index = num_prefix[:, None] + torch.arange(width, device=tail.device)
        tail = joined.gather(1, index)
    words = t.bad_prefix[rows]  # [N, W, M]
    match = ((tail[:, None, :] == words) | (words == _WILDCARD)).all(dim=-1)  # [N, W]
    bans = torch.zeros(rows.shape[0], vocab, dtype=torch.int8, device=tail.device)
    return bans.scatter_reduce_(1, t.bad_last[rows], match.to(torch.int8), "amax") > 0
