"""Incremental detokenization against decoding the whole output, on a byte-level toy decoder
whose tokens split multi-byte characters, and the byte path on the built-in vocabulary against
`tokenizers`' own decode (Rust's lossy UTF-8 against Python's)."""

from __future__ import annotations

import pytest
import tokenizers
import torch
from tokenizers import decoders, models

from specdec.engine.detokenize import IncrementalText
from specdec.models.tokenizer import Tokenizer
from tokenizer_fixtures import load_builtin_tokenizer, needs_default_model

TEXT = "héllo 🤗 日本語のテキスト, café"


@pytest.fixture(scope="module")
def builtin_tokenizer() -> Tokenizer:
    return load_builtin_tokenizer()


class ByteDecoder:
    """Token i < 256 is byte i; decoding replaces incomplete UTF-8 with U+FFFD, as byte-level BPE
    tokenizers do. Token 256 is a special token."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if t < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens:
            text += "<s>" * sum(t == 256 for t in token_ids)
        return text


def test_incremental_text_follows_the_whole_decode() -> None:
    text = "plain ascii, café, 日本語 and 🎉🎉 mixed"
    tokens = [*text.encode(), 256]
    decoder = ByteDecoder()
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # appended 1-4 tokens at a time, as verify rounds do
        state, done = IncrementalText(), 0
        while done < len(tokens):
            done = min(len(tokens), done + int(torch.randint(1, 5, (1,), generator=generator)))
            whole = decoder.decode(tokens[:done])
            got = state.update(decoder, tokens[:done], True)
            assert whole.startswith(got)
            if not whole.endswith("\ufffd"):
                assert got == whole
        assert state.text == text


def test_byte_path_follows_the_whole_decode_through_invalid_bytes() -> None:
    """The byte path (`update_bytes`) on the toy decoder: random bytes, most of them invalid
    UTF-8, appended 1-4 at a time; the streamed text is always a prefix of the whole decode and
    equals it once no character is left unfinished."""
    pieces = [bytes([b]) for b in range(256)] + [b""]  # token 256: special, skipped
    decoder = ByteDecoder()
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens = torch.randint(0, 257, (40,), generator=generator).tolist()
        state, done = IncrementalText(), 0
        while done < len(tokens):
            done = min(len(tokens), done + int(torch.randint(1, 5, (1,), generator=generator)))
            whole = decoder.decode(tokens[:done])
            got = state.update_bytes(pieces, tokens[:done])
            assert whole.startswith(got)
            assert got + state.pending.decode("utf-8", "replace") == whole
            assert len(state.pending) <= 3


@needs_default_model
@pytest.mark.parametrize("skip", [True, False])
def test_byte_path_equals_the_tokenizers_decode(builtin_tokenizer, skip: bool) -> None:
    """On the built-in byte-level BPE vocabulary: random ids (split characters, invalid bytes,
    special tokens) and a text that splits characters over tokens, streamed 1-5 ids at a time;
    at every step the text is a prefix of `tokenizers`' own decode of the ids so far, and with
    the unfinished character it is that decode."""
    tok = builtin_tokenizer
    pieces = tok.byte_pieces(skip)
    assert pieces is not None and len(pieces) >= tok.vocab_size
    generator = torch.Generator().manual_seed(2)
    texts = [tok.encode(TEXT + "<|im_end|>", add_special_tokens=False)]
    texts += [torch.randint(0, tok.vocab_size, (64,), generator=generator).tolist()]
    texts += [torch.randint(0, 300, (64,), generator=generator).tolist() for _ in range(30)]
    for tokens in texts:
        state, done = IncrementalText(), 0
        while done < len(tokens):
            done = min(len(tokens), done + int(torch.randint(1, 6, (1,), generator=generator)))
            whole = tok.decode(tokens[:done], skip_special_tokens=skip)
            got = state.update_bytes(pieces, tokens[:done])
            assert whole.startswith(got)
            assert got + state.pending.decode("utf-8", "replace") == whole


@needs_default_model
def test_byte_path_negative_control_special_tokens_kept(builtin_tokenizer) -> None:
    """Negative control: the table that keeps special tokens, streamed against a decode that
    skips them, must fail the check above."""
    tok = builtin_tokenizer
    tokens = tok.encode(TEXT + "<|im_end|>", add_special_tokens=False)
    state = IncrementalText()
    got = state.update_bytes(tok.byte_pieces(False), tokens)
    assert got != tok.decode(tokens, skip_special_tokens=True)


def test_other_decoders_keep_the_window_path() -> None:
    """A SentencePiece-style decoder (Metaspace) strips the first space: no byte pieces."""
    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    assert tok.decode([1, 2]) == "hello world"
    assert tok.byte_pieces(True) is None
