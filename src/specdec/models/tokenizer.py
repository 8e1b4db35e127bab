"""Tokenizer: text <-> token ids and chat templates, from a HF directory or GGUF metadata.

Wraps a `tokenizers.Tokenizer` and renders chat templates with a sandboxed jinja2 environment set up
as `transformers` sets it up. It never touches model weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# llama.cpp token types (`tokenizer.ggml.token_type`).
GGUF_TOKEN_UNKNOWN = 2
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (as llama.cpp applies them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# GPT-2's regex after splitting every digit apart (StarCoder / SmolLM vocabularies).
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")
# A SentencePiece byte-fallback token (`<0xE6>`) and SentencePiece's word-start mark.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model.

    Attributes:
        backend: the `tokenizers.Tokenizer` doing the work.
        chat_template: the jinja2 chat template, or None.
        bos_token: beginning-of-sequence token text, or None.
        eos_token: end-of-sequence token text, or None.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens_map: Mapping[str, str] | None = None,
    ) -> None:
        """Args: backend, chat_template, bos_token, eos_token: as the attributes;
        special_tokens_map: further special tokens the chat template may read ("unk_token", ...).
        """
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._special_tokens_map = dict(special_tokens_map or {})

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS where the tokenizer says so."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for, which may be part of a UTF-8 character (decoding it
        alone would give U+FFFD); the bytes of a text's tokens, joined, are the text's UTF-8.

        Byte-level BPE: the token's characters mapped back through GPT-2's byte table.
        SentencePiece: a byte-fallback token (`<0xE6>`) is its byte, U+2581 a space. Special and
        added tokens: their text's UTF-8. Any other token: the UTF-8 of its text decoded alone.
        An id the tokenizer does not know (a vocabulary padded past it): no bytes.
        """
        added = self._added_tokens.get(token_id)
        if added is not None:
            return added.encode()
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        decoder_types = self._decoder_types
        byte_of_char = _unicode_to_bytes()
        if "ByteLevel" in decoder_types and all(c in byte_of_char for c in token):
            return bytes(byte_of_char[c] for c in token)
        if "ByteFallback" in decoder_types and (match := _BYTE_TOKEN.fullmatch(token)):
            return bytes([int(match.group(1), 16)])
        if decoder_types & {"ByteFallback", "Metaspace"}:
            return token.replace(_SENTENCEPIECE_SPACE, " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def byte_pieces(self, skip_special_tokens: bool = True) -> tuple[bytes, ...] | None:
        """Per token id, the bytes `decode` turns it into, when decoding is exactly "join the
        tokens' bytes, then UTF-8 with U+FFFD for invalid bytes" (a byte-level BPE decoder and
        nothing else: GPT-2, Llama-3, Qwen, SmolLM); None for any other decoder. Special tokens
        are b"" with `skip_special_tokens`; ids the tokenizer does not know are b"". The
        incremental detokenizer appends these instead of decoding windows of ids."""
        return self._byte_pieces[bool(skip_special_tokens)]

    @cached_property
    def _byte_pieces(self) -> dict[bool, tuple[bytes, ...] | None]:
        if self._decoder_types != {"ByteLevel"}:
            return {True: None, False: None}
        byte_of_char = _unicode_to_bytes()
        added = self.backend.get_added_tokens_decoder()
        special = {i for i, t in added.items() if t.special}
        pieces = []
        for token_id in range(max([self.vocab_size - 1, *added]) + 1):
            token = self.backend.id_to_token(token_id)
            if token is None:
                pieces.append(b"")
            elif all(c in byte_of_char for c in token):
                pieces.append(bytes([byte_of_char[c] for c in token]))
            else:  # the decoder passes a token with other characters through as its UTF-8
                pieces.append(token.encode())
        kept = tuple(pieces)
        skipped = tuple(b"" if i in special else piece for i, piece in enumerate(pieces))
        return {True: skipped, False: kept}

    @cached_property
    def _added_tokens(self) -> dict[int, str]:
        """Special and added tokens by id: their text, which no decoder rewrites."""
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    @cached_property
    def _decoder_types(self) -> frozenset[str]:
        """The types of the backend's decoder, or of each decoder in its sequence."""
        if self.backend.decoder is None:
            return frozenset()
        state = json.loads(self.backend.decoder.__getstate__())
        return frozenset(part["type"] for part in state.get("decoders", [state]))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Args:
            messages: the conversation.
            add_generation_prompt: end with the template's opening of an assistant turn.
            continue_final_message: end the text right after the final message's content, so
                that generation continues that message (HF's rule; not with
                add_generation_prompt).
            chat_template: a template to use instead of the tokenizer's own.

        Raises:
            ValueError: no chat template, both add_generation_prompt and
                continue_final_message, or a final message the rendered text does not contain.
            jinja2.TemplateError: the template rejected the messages.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message continues the last message; it cannot be combined "
                "with add_generation_prompt (pass add_generation_prompt=False)"
            )
        if chat_template is None and self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = {
            **self._special_tokens_map,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **template_kwargs,
        }
        template = (
            self._compiled_template
            if chat_template is None
            else _compile_chat_template(chat_template)
        )
        text = template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes any special tokens itself)."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
        )
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _compiled_template(self) -> Any:
        return _compile_chat_template(self.chat_template or "")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Loads tokenizer.json, with tokenizer_config.json and chat_template.jinja if present.

        Raises:
            FileNotFoundError: no tokenizer.json.
            ValueError: a file that cannot be parsed.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:
            raise ValueError(f"cannot read {tokenizer_file}: {err}") from err
        tokenizer_config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise ValueError(f"cannot read {config_file}: {err}") from err
        chat_template = tokenizer_config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {entry.get("name"): entry.get("template") for entry in chat_template}
            chat_template = named.get("default", next(iter(named.values()), None))
        template_file = path / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        special = {
            name: _token_text(tokenizer_config[name])
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if tokenizer_config.get(name) is not None
        }
        return cls(
            backend,
            chat_template=chat_template,
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            special_tokens_map=special,
        )

    @classmethod
    def from_gguf_vocab(
        cls,
        *,
        model: str,
        pre: str | None,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        bos_token_id: int | None,
        eos_token_id: int | None,
        scores: Sequence[float] | None = None,
        unknown_token_id: int | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        add_space_prefix: bool = True,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Rebuilds the tokenizer of GGUF `tokenizer.ggml.*` metadata, as llama.cpp runs it.

        "gpt2": byte-level BPE from the merges, split by the `pre` pattern. "llama": SentencePiece
        BPE (`_sentencepiece_backend`). In both, control tokens (and in SentencePiece the unknown
        token) are special tokens matched whole in the text, user-defined ones added tokens.

        Args:
            model: `tokenizer.ggml.model`: "gpt2" or "llama".
            pre: `tokenizer.ggml.pre`, which picks the byte-level pre-tokenizer split pattern.
            tokens: the vocabulary, id order.
            token_types: llama.cpp token types.
            merges: "left right" merge rules, best first (byte-level BPE).
            bos_token_id: BOS id, or None.
            eos_token_id: EOS id, or None.
            scores: `tokenizer.ggml.scores`, one a token (SentencePiece: the merge priorities).
            unknown_token_id: `tokenizer.ggml.unknown_token_id`, or None (SentencePiece: the
                token typed unknown).
            add_bos_token: prepend BOS when encoding with `add_special_tokens=True`; None:
                llama.cpp's default (SentencePiece yes, byte-level BPE no).
            add_eos_token: append EOS when encoding with `add_special_tokens=True`.
            add_space_prefix: SentencePiece's dummy prefix: a space before the text and after
                each special token (`tokenizer.ggml.add_space_prefix`; Gemma's files say no).
            chat_template: `tokenizer.chat_template`, or None.

        Raises:
            ValueError: a tokenizer model other than "gpt2" and "llama", or a SentencePiece
                vocabulary without one score a token.
        """
        types = list(token_types or [])
        if model == "gpt2":
            backend = _byte_level_backend(pre, tokens, merges)
            alphabet = set(_bytes_to_unicode().values())
            # A token outside the byte alphabet is no token of this vocabulary.
            keep = [set(token) <= alphabet for token in tokens]
            special_types = {GGUF_TOKEN_CONTROL}
        elif model == "llama":
            if scores is None or len(scores) != len(tokens):
                raise ValueError(
                    f"GGUF SentencePiece tokenizer: tokenizer.ggml.scores has "
                    f"{0 if scores is None else len(scores)} scores for {len(tokens)} tokens"
                )
            if unknown_token_id is None and GGUF_TOKEN_UNKNOWN in types:
                unknown_token_id = types.index(GGUF_TOKEN_UNKNOWN)
            unk_token = tokens[unknown_token_id] if unknown_token_id is not None else None
            backend = _sentencepiece_backend(tokens, scores, unk_token, add_space_prefix)
            keep = [True] * len(tokens)
            special_types = {GGUF_TOKEN_CONTROL, GGUF_TOKEN_UNKNOWN}
        else:
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported; supported: "
                "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )
        backend.add_special_tokens(
            [
                AddedToken(tokens[i], normalized=False, special=True)
                for i, kind in enumerate(types)
                if kind in special_types and keep[i]
            ]
        )
        backend.add_tokens(
            [
                AddedToken(tokens[i], normalized=False, special=False)
                for i, kind in enumerate(types)
                if kind == GGUF_TOKEN_USER_DEFINED and keep[i]
            ]
        )

        bos_token = tokens[bos_token_id] if bos_token_id is not None else None
        eos_token = tokens[eos_token_id] if eos_token_id is not None else None
        if add_bos_token is None:
            add_bos_token = model == "llama"
        bos = [bos_token] if add_bos_token and bos_token is not None else []
        eos = [eos_token] if add_eos_token and eos_token is not None else []
        if bos or eos:
            single = [*bos, "$A", *eos]
            backend.post_processor = processors.TemplateProcessing(
                single=single,
                pair=[*single, *bos, "$B", *eos],
                special_tokens=[(bos_token, bos_token_id)] * len(bos)
                + [(eos_token, eos_token_id)] * len(eos),
            )
        return cls(backend, chat_template=chat_template, bos_token=bos_token, eos_token=eos_token)


def _byte_level_backend(
    pre: str | None, tokens: Sequence[str], merges: Sequence[str]
) -> tokenizers.Tokenizer:
    """Byte-level BPE (llama.cpp's "gpt2"): tokens spelled in GPT-2's byte alphabet, the given
    merges, the text split first by the pattern `pre` names."""
    byte_to_char = _bytes_to_unicode()
    alphabet = set(byte_to_char.values())
    vocab = {
        token if set(token) <= alphabet else "".join(byte_to_char[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _SPLIT_BY_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:  # "gpt2", "default" and the rest: GPT-2's own regex
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    tokens: Sequence[str], scores: Sequence[float], unk_token: str | None, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """SentencePiece BPE (llama.cpp's "llama"), as sentencepiece and llama.cpp encode and decode.

    Encode: spaces become U+2581 and, with `add_space_prefix`, one is put before the text and
    after each special or user-defined token (the added tokens split the text first; llama.cpp's
    rule, and sentencepiece's on each piece); then, from the characters up, the adjacent pair
    whose joined text is the token of highest score merges first, as a BPE merge list ranked by
    score (`_merges_by_score`); a character no token covers becomes its UTF-8 byte tokens
    (`<0xNN>`), or the unknown token. Decode: U+2581 back to spaces, byte tokens back to UTF-8,
    and with `add_space_prefix` the text's first space dropped.

    The normalizer rather than `transformers`' Metaspace pre-tokenizer puts the prefix: Metaspace
    adds none before a text that starts with a space, so "  hi" would lose a space that
    sentencepiece and llama.cpp keep ("▁▁▁hi").
    """
    vocab = {token: index for index, token in enumerate(tokens)}  # a repeated text: its last id
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, scores),
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    spaces = normalizers.Replace(" ", _SENTENCEPIECE_SPACE)
    steps = [decoders.Replace(_SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SENTENCEPIECE_SPACE), spaces]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = spaces
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_score(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merge rule as a BPE merge list: every cut of a token into two tokens,
    ranked by the token's score, highest first.

    SentencePiece merges the adjacent pair whose joined text is the token of highest score, so
    ranking each cut by its joined token's score gives the same merges. Equal scores (which
    sentencepiece's trainer never writes) go in vocabulary order, where llama.cpp takes the
    leftmost pair in the text.
    """
    score_of = {token: float(score) for token, score in zip(tokens, scores, strict=True)}
    ranked = [
        (-score, token[:cut], token[cut:])
        for token, score in score_of.items()
        for cut in range(1, len(token))
        if token[:cut] in score_of and token[cut:] in score_of
    ]
    ranked.sort(key=lambda merge: merge[0])
    return [(left, right) for _, left, right in ranked]


def _token_text(entry: str | Mapping[str, Any]) -> str:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    return entry if isinstance(entry, str) else str(entry["content"])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


@cache
def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of `_bytes_to_unicode`: a byte-level BPE character -> the byte it stands for."""
    return {char: byte for byte, char in _bytes_to_unicode().items()}


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`text` up to the end of the final message's content (HF's continue_final_message: the
    last occurrence, retried stripped for templates that strip whitespace)."""
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    final = messages[-1].get("content") or ""
    if isinstance(final, list | tuple):
        final = "".join(p.get("text", "") for p in final if isinstance(p, Mapping))
    for candidate in (final, final.strip()):
        if candidate and candidate in text:
            return text[: text.rindex(candidate) + len(candidate)]
    raise ValueError(
        "continue_final_message: the rendered chat does not contain the final message's content"
    )


def _compile_chat_template(template: str) -> Any:
    """Compiles a chat template in the sandboxed environment `transformers` uses."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
