"""Grammar constraints through llguidance: compiling a request's `StructuredOutputsParams` once
(cached by the constraint), and a per-request `GrammarMatcher` that gives the allowed-token
bitmask after the output plus any draft prefix, and follows the output as it is committed.

Why llguidance (not xgrammar): no dependencies (a 3 MB abi3 wheel; xgrammar pulls Triton,
transformers and tvm-ffi), rollback built in, and both compute a SmolLM2 JSON-schema mask in
about 0.02 ms on this project's CPU, far below a decode step. Never draws randomness.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from specdec.sampling.bitmask import unpack_bitmask
from specdec.sampling.structured import StructuredOutputsParams

# Compiled grammars kept per compiler (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256
# One host thread computes the next step's masks while the device (or the CPU's torch ops, which
# release the GIL like llguidance does) runs the current step.
_PREFETCH: ThreadPoolExecutor | None = None
_PREFETCH_LOCK = threading.Lock()


def _prefetcher() -> ThreadPoolExecutor:
    global _PREFETCH
    with _PREFETCH_LOCK:
        if _PREFETCH is None:
            _PREFETCH = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-grammar")
        return _PREFETCH


def _llguidance():
    try:
        import llguidance
    except ImportError as err:  # a dependency in pyproject.toml; say so if it is missing
        raise ValueError(
            "structured outputs need the llguidance package: pip install llguidance"
        ) from err
    return llguidance


def bitmask_words(vocab_size: int) -> int:
    """W: int32 words of one row's bitmask (bit t % 32 of word t // 32 is token t)."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A validated llguidance grammar for one tokenizer (shared by every request using it)."""

    key: tuple[str, str]
    text: str  # llguidance's grammar definition
    compiler: GrammarCompiler


class _TokenBytes:
    """The `TokenizerWrapper` shape llguidance takes for a vocabulary given as token bytes."""

    def __init__(self, tokens: Sequence[bytes], eos_token_id: int, special: Sequence[int]):
        self.tokens = list(tokens)
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.special_token_ids = list(special)
        self.is_tokenizer_wrapper = True
        self._by_bytes = {t: i for i, t in enumerate(self.tokens) if t and i not in special}
        self._longest = max((len(t) for t in self._by_bytes), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """Greedy longest-match encoding (llguidance uses it for forced text only)."""
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._by_bytes.get(data[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]} has no token")
        return out


class GrammarCompiler:
    """Compiles constraints for one tokenizer and one logits width, caching by the constraint."""

    def __init__(self, ll_tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self._tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._prototypes: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def from_tokenizer_json(text: str, vocab_size: int, eos_token_id: int) -> GrammarCompiler:
        """From a Hugging Face `tokenizer.json` text (`tokenizers.Tokenizer.to_str()`)."""
        llg = _llguidance()
        return GrammarCompiler(
            llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_id),
            vocab_size,
            eos_token_id,
        )

    @staticmethod
    def from_backend(backend, vocab_size: int, eos_token_id: int) -> GrammarCompiler:
        """From a `tokenizers.Tokenizer`: its JSON when llguidance reads that tokenizer kind
        (byte-level BPE, SentencePiece-style), else the text of each token decoded alone
        (right for vocabularies whose tokens are whole characters).

        Raises:
            ValueError: neither works (naming llguidance's objection).
        """
        try:
            return GrammarCompiler.from_tokenizer_json(backend.to_str(), vocab_size, eos_token_id)
        except ValueError as err:
            reason = _first_line(str(err))
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        tokens = [
            b"" if i in special else backend.decode([i], skip_special_tokens=False).encode()
            for i in range(vocab_size)
        ]
        if any("\ufffd" in t.decode(errors="replace") for t in tokens):
            raise ValueError(f"structured outputs cannot read this tokenizer: {reason}")
        return GrammarCompiler.from_token_bytes(tokens, eos_token_id, sorted(special))

    @staticmethod
    def from_token_bytes(
        tokens: Sequence[bytes], eos_token_id: int, special_token_ids: Sequence[int] = ()
    ) -> GrammarCompiler:
        """From the bytes of every token id (toy vocabularies; EOS among the special ids)."""
        llg = _llguidance()
        special = sorted({*special_token_ids, eos_token_id})
        wrapper = llg.TokenizerWrapper(_TokenBytes(tokens, eos_token_id, special))
        return GrammarCompiler(
            llg.LLTokenizer(wrapper, n_vocab=len(tokens), eos_token=eos_token_id),
            len(tokens),
            eos_token_id,
        )

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint as a validated grammar (cached by `params.key`).

        Raises:
            ValueError: an invalid schema, regex or grammar (the library's message, first line).
        """
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        text = self._grammar_text(params)
        error = _llguidance().LLMatcher.validate_grammar(text, self._tokenizer)
        if error:
            kind = key[0] if key[0] != "json_object" else "json"
            raise ValueError(f"invalid structured_outputs.{kind}: {readable_error(error, kind)}")
        compiled = CompiledGrammar(key, text, self)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        try:
            return grammar_text(params)
        except ValueError as err:
            kind = params.key[0]
            reason = readable_error(str(err), kind)
            raise ValueError(f"invalid structured_outputs.{kind}: {reason}") from err

    def matcher(self, grammar: CompiledGrammar, *, prefetch: bool = True) -> GrammarMatcher:
        """A fresh matcher at the start of the output (a copy of one checked prototype);
        `prefetch`: compute each next mask on the host thread after a commit.

        Raises:
            ValueError: the constraint allows no non-empty output with this tokenizer.
        """
        with self._lock:
            prototype = self._prototypes.get(grammar.key)
        if prototype is None:
            prototype = _llguidance().LLMatcher(self._tokenizer, grammar.text, log_level=0)
            if prototype.is_error():
                kind = grammar.key[0]
                reason = readable_error(prototype.get_error(), kind)
                raise ValueError(f"invalid structured_outputs.{kind}: {reason}")
            first = GrammarMatcher(prototype.deep_copy(), self.vocab_size, self.eos_token_id)
            allowed = unpack_bitmask(first.mask(())[None], self.vocab_size)[0]
            allowed[self.eos_token_id] = False
            if not bool(allowed.any()):
                raise ValueError(
                    f"structured_outputs.{grammar.key[0]} allows no output with this model's "
                    "tokenizer (no token can start it)"
                )
            with self._lock:
                self._prototypes[grammar.key] = prototype
                while len(self._prototypes) > GRAMMAR_CACHE_SIZE:
                    self._prototypes.popitem(last=False)
        return GrammarMatcher(
            prototype.deep_copy(), self.vocab_size, self.eos_token_id, prefetch=prefetch
        )


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar definition of a constraint (no tokenizer involved).

    Raises:
        ValueError: llguidance's (multi-line) message, e.g. a GBNF grammar it cannot convert.
    """
    llg = _llguidance()
    kind, _ = params.key
    overrides = {"whitespace_flexible": False} if params.disable_any_whitespace else None
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(params.json, overrides=overrides)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=overrides)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", params.choice)
    return llg.grammar_from("grammar", params.grammar)


def constraint_error(params: StructuredOutputsParams) -> str | None:
    """Why llguidance refuses a constraint whatever the tokenizer, in one line a person reads
    once (None: it does not): the check `GrammarCompiler.compile` makes, run before a model is
    loaded. A constraint it passes may still allow no output with a given vocabulary
    (`GrammarCompiler.matcher` says so then)."""
    kind = params.key[0]
    try:
        text = grammar_text(params)
    except ValueError as err:
        return readable_error(str(err), kind)
    error = _llguidance().LLMatcher.validate_grammar(text, None)
    return readable_error(error, kind) if error else None


def readable_error(message: str, kind: str) -> str:
    """llguidance's message as one line: a regex's own reason ("unclosed character class")
    without the regex echoed back or the position in the grammar wrapped around it; a grammar's
    first line with its position as "(line L, column C)"."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected by the grammar compiler"
    reasons = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    at = re.match(r"^at (\d+)\((\d+)\): (.*)$", lines[0])
    if kind == "regex":
        if reasons:
            return reasons[0]
        return at.group(3) if at else _first_line(message)
    reason = at.group(3) if at else lines[0]
    if reasons and reason.endswith("regex parse error:"):  # a regex inside the grammar
        reason = re.sub(r" \(in \w+\)$", "", reason.removesuffix(" regex parse error:").rstrip(":"))
        reason = f"{reason}: {reasons[0]}"
    return reason + (f" (line {at.group(1)}, column {at.group(2)})" if at else "")


class GrammarMatcher:
    """One request's grammar state: the output committed so far, plus speculative tokens.

    `mask(prefix)` advances the matcher over `prefix` (drafts after the output), stopping at the
    first token the grammar rejects (later rows keep the mask reached before it, so the target
    gives that draft probability 0 and verification rejects it exactly), and rolls back what
    does not match the next prefix asked for; `commit(output)` rolls back to the accepted prefix
    and consumes the rest of the output. Masks are cached per prefix until the next commit, so the
    drafter's rows and the verifier's rows of a round compute each mask once.
    """

    def __init__(
        self, ll_matcher, vocab_size: int, eos_token_id: int, *, prefetch: bool = False
    ) -> None:
        self._matcher = ll_matcher
        self.prefetch = prefetch
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.num_committed = 0  # output tokens consumed
        self._speculative: list[int] = []  # tokens consumed past the output
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._pending: Future | None = None
        self._lock = threading.Lock()
        # Set when a committed token is one the grammar rejects (a caller that did not apply
        # the masks): only EOS is allowed from then on, ending the request.
        self.failure: str | None = None

    def mask(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """[W] int32 bitmask of the tokens allowed after the output and `prefix` (never empty:
        EOS when the grammar allows nothing, so a dead end ends the request)."""
        self._wait()
        return self._mask(prefix)

    def _mask(self, prefix: tuple[int, ...]) -> torch.Tensor:
        cached = self._masks.get(prefix)
        if cached is not None:
            return cached
        out = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        if self.failure is None:
            with self._lock:
                self._advance(prefix)
                self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if not bool(out.any()):
            bit = self.eos_token_id % 32
            out[self.eos_token_id // 32] = (1 << bit) - (2**32 if bit == 31 else 0)
        self._masks[prefix] = out
        return out

    def _advance(self, prefix: tuple[int, ...]) -> None:
        """Brings the matcher to the longest grammatical start of `prefix` after the output."""
        spec = self._speculative
        common = 0
        while common < len(spec) and common < len(prefix) and spec[common] == prefix[common]:
            common += 1
        if common < len(spec):
            self._matcher.rollback(len(spec) - common)
            del spec[common:]
        if len(spec) < len(prefix):
            rest = list(prefix[len(spec) :])
            # Stops before the first rejected token, leaving the matcher usable.
            consumed = self._matcher.try_consume_tokens(rest)
            spec.extend(rest[:consumed])

    def commit(self, output: Sequence[int]) -> None:
        """Follows the request's output (every token of it allowed by the masks given), then
        starts computing the next step's mask on the host thread."""
        self._wait()
        new = list(output[self.num_committed :])
        if not new:
            return
        with self._lock:
            self._masks = {}
            self.num_committed += len(new)
            if self.failure is not None:
                return
            self._advance(tuple(new))
            if self._speculative != new:
                self.failure = (
                    f"the grammar rejected committed tokens {new[len(self._speculative) :]}"
                )
                return
            self._speculative = []
        if self.prefetch and not self._matcher.is_stopped():
            self._pending = _prefetcher().submit(self._mask, ())

    def _wait(self) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            pending.result()

    @property
    def stopped(self) -> bool:
        """The committed output completes the grammar and nothing may follow but EOS."""
        self._wait()
        return not self._speculative and self._matcher.is_stopped()


def _first_line(message: str, limit: int = 300) -> str:
    """The library's (multi-line) message as one line, without its source excerpt."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    lines = [line for line in lines if not re.match(r"^(\^|\||\d+ \|)", line)]
    text = "; ".join(lines) or "rejected by the grammar compiler"
    return text if len(text) <= limit else text[: limit - 3] + "..."
