"""`Tokenizer.bytes_of`: the bytes a token stands for (OpenAI's logprob `bytes`), on the
built-in byte-level BPE vocabulary, a SentencePiece byte-fallback vocabulary and a character one.

The negative control is the old answer, the UTF-8 of each token decoded alone: it loses a
character split over tokens (each piece decodes to U+FFFD), so the same check must reject it.
"""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers

from specdec.models.tokenizer import Tokenizer
from tokenizer_fixtures import load_builtin_tokenizer, needs_default_model

REPLACEMENT = "\ufffd".encode()
# An emoji, CJK text and an accented letter: byte-level BPE splits the first two inside characters.
TEXT = "héllo 🤗 日本語のテキスト"


@pytest.fixture(scope="module")
def builtin_tokenizer() -> Tokenizer:
    return load_builtin_tokenizer()


def decoded_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The old `bytes`: the token decoded alone, encoded back."""
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


@needs_default_model
def test_byte_level_tokens_join_into_the_texts_utf8(builtin_tokenizer):
    tok = builtin_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    split = [t for t in ids if tok.decode([t]) == "\ufffd"]
    assert split, "the text must split a character over tokens, or this test checks nothing"
    assert b"".join(tok.bytes_of(t) for t in ids) == TEXT.encode()
    for token_id in split:
        piece = tok.bytes_of(token_id)
        assert piece and piece != REPLACEMENT
        with pytest.raises(UnicodeDecodeError):
            piece.decode()  # part of a character, not a whole one


@needs_default_model
def test_decoding_each_token_alone_loses_split_characters(builtin_tokenizer):
    """Negative control: the old `bytes` fail the check above."""
    tok = builtin_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    old = b"".join(decoded_bytes(tok, t) for t in ids)
    assert old != TEXT.encode() and REPLACEMENT in old


@needs_default_model
def test_special_tokens_are_their_texts_utf8(builtin_tokenizer):
    tok = builtin_tokenizer
    assert tok.bytes_of(tok.eos_token_id) == tok.eos_token.encode()
    (im_start,) = tok.encode("<|im_start|>", add_special_tokens=False)
    assert tok.bytes_of(im_start) == b"<|im_start|>"
    assert tok.bytes_of(tok.vocab_size + 5) == b""  # a padded vocabulary's id


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style vocabulary: "\u2581" marks a word start, `<0xNN>` tokens carry bytes."""
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("\u2581", "hello")]
    pieces = ["<unk>", "\u2581", "h", "e", "l", "o", *("".join(m) for m in merges)]
    pieces += ["<0xE4>", "<0xB8>", "<0x96>"]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return Tokenizer(backend)


def test_sentencepiece_byte_tokens_are_their_byte_and_the_word_mark_a_space():
    tok = sentencepiece_tokenizer()
    ids = tok.encode("hello 世", add_special_tokens=False)
    assert tok.decode(ids) == "hello 世"  # the vocabulary does split 世 into byte tokens
    assert [tok.bytes_of(t) for t in ids] == [b" hello", b" ", b"\xe4", b"\xb8", b"\x96"]
    # The old answer: the word mark stripped, each byte token a U+FFFD.
    assert decoded_bytes(tok, ids[0]) == b"hello"
    assert decoded_bytes(tok, ids[2]) == REPLACEMENT


def test_other_vocabularies_give_the_decoded_text():
    vocab = {"<unk>": 0, "a": 1, "é": 2}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tok = Tokenizer(backend)
    assert [tok.bytes_of(t) for t in (1, 2)] == [b"a", "é".encode()]
