"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Gemma):
a tiny BPE model trained here by `sentencepiece`, written into a GGUF as llama.cpp's converter
writes it (pieces, scores, token types), encodes to sentencepiece's ids and decodes to its text.

Text holding special tokens follows llama.cpp: the special and user-defined tokens split the
text, and each text piece is encoded as sentencepiece encodes it alone (its own space prefix).
(`transformers`' Metaspace-based LlamaTokenizer differs from both on text that starts with a
space, "  two leading spaces" here, and after a special token.)
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import sentencepiece

from specdec.models.gguf_file import GGUFFile
from specdec.models.tokenizer import Tokenizer

SYLLABLES = ("an", "ber", "con", "de", "er", "fi", "gor", "hu", "in", "ja", "ke", "lo", "men")
SYLLABLES += ("nor", "os", "per", "qu", "ra", "sta", "ter", "un", "ver", "wi", "xo")


def _made_up_lines(seed: int, num_lines: int) -> list[str]:
    """Lines of words made of random syllables: a vocabulary whose pieces overlap, so that the
    order of merges decides how a word is cut."""
    rng = random.Random(seed)
    return [
        " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(12))
        for _ in range(num_lines)
    ]


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A naïve café owner met a señor in Zürich; déjà vu, résumé.",
    "Numbers: 123 4567 89, 2026-12-05 and 3.14159.",
    "東京は日本の首都です。北京是中国的首都。",
    "    indented code block",
    "\tdef f(x): return x * 2",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "hello hello hello world world wonderful wander wonder",
    *_made_up_lines(seed=0, num_lines=200),
]
HELD_OUT = _made_up_lines(seed=1, num_lines=20)
CONTROL = ["<start_of_turn>", "<end_of_turn>"]  # special: typed control (3) in the GGUF
USER_DEFINED = ["<think>", "</think>"]  # matched whole, typed user-defined (4)
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, WORLD! Capitals fall back to bytes",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple    inner   spaces",
    "line one\nline two\n\n\tindented\r\n",
    "digits 1234567890 and 3.14159",
    "naïve café señor Zürich déjà vu Ünïcödé",
    "東京は日本の首都です。 北京",
    "emoji 😀🎉 and a llama 🦙",
    "",
    " ",
    "\n",
]
SPECIAL_TEXTS = [
    "<s>hello</s>",
    "x<s>y",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "a <think>plan it</think> b",
    "<unk> stays whole",
    "  <end_of_turn>  ",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# llama.cpp token types.
NORMAL, UNKNOWN, CONTROL_TYPE, USER_DEFINED_TYPE, BYTE = 1, 2, 3, 4, 6


def _train(add_dummy_prefix: bool) -> sentencepiece.SentencePieceProcessor:
    """A BPE model of 600 pieces (256 of them bytes) with Llama's trainer settings."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        add_dummy_prefix=add_dummy_prefix,
        control_symbols=CONTROL,
        user_defined_symbols=USER_DEFINED,
        character_coverage=1.0,
        minloglevel=2,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def _vocabulary(
    sp: sentencepiece.SentencePieceProcessor,
) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) as llama.cpp's converter writes them."""
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        pieces.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL_TYPE)
        elif sp.is_byte(i):
            types.append(BYTE)
        elif pieces[-1] in USER_DEFINED:
            types.append(USER_DEFINED_TYPE)
        else:
            types.append(NORMAL)
    return pieces, scores, types


def _write_gguf(
    path: Path,
    pieces: list[str],
    scores: list[float],
    types: list[int],
    *,
    model: str = "llama",
    flags: dict[str, bool] | None = None,
) -> Path:
    """A GGUF holding only the vocabulary (and one small tensor). `flags`: add_bos_token,
    add_eos_token, add_space_prefix, each written only if given."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(pieces.index("<unk>"))
    writer.add_bos_token_id(pieces.index("<s>"))
    writer.add_eos_token_id(pieces.index("</s>"))
    for name, value in (flags or {}).items():
        getattr(writer, f"add_{name}")(value)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(pieces), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path: Path) -> Tokenizer:
    tokenizer = GGUFFile(path).tokenizer()
    assert tokenizer is not None
    return tokenizer


def _reference(sp: sentencepiece.SentencePieceProcessor, text: str) -> list[int]:
    """llama.cpp's ids for `text`: special and user-defined tokens taken whole (leftmost,
    longest first), each text piece between them encoded by sentencepiece alone."""
    whole = sorted(["<s>", "</s>", "<unk>", *CONTROL, *USER_DEFINED], key=len, reverse=True)
    ids: list[int] = []
    start = position = 0
    while position < len(text):
        token = next((t for t in whole if text.startswith(t, position)), None)
        if token is None:
            position += 1
            continue
        if start < position:
            ids += sp.encode(text[start:position])
        ids.append(sp.piece_to_id(token))
        start = position = position + len(token)
    if start < len(text):
        ids += sp.encode(text[start:])
    return ids


class Case(NamedTuple):
    sp: sentencepiece.SentencePieceProcessor
    tokenizer: Tokenizer  # ours, from the GGUF of sp's vocabulary
    space_prefix: bool  # Llama's dummy space prefix, or Gemma's none


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_space_prefix"])
def case(request, tmp_path_factory) -> Case:
    sp = _train(add_dummy_prefix=request.param)
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    flags = {"add_bos_token": True, "add_space_prefix": request.param}
    return Case(sp, _load(_write_gguf(path, *_vocabulary(sp), flags=flags)), request.param)


def test_encodes_as_sentencepiece(case: Case) -> None:
    sp, tokenizer, _ = case
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tokenizer.encode(text) == [sp.bos_id(), *ids]
    assert any(sp.is_byte(i) for i in tokenizer.encode("🦙", add_special_tokens=False))


def test_special_tokens_are_matched_whole_and_split_the_text(case: Case) -> None:
    sp, tokenizer, space_prefix = case
    for text in SPECIAL_TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == _reference(sp, text), text
    ids = tokenizer.encode("x<s>y", add_special_tokens=False)
    assert ids.count(sp.bos_id()) == 1
    # The text after a special token has its own space prefix, which decoding keeps.
    expected = "x<s> y" if space_prefix else "x<s>y"
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected


def test_decodes_as_sentencepiece_and_round_trips(case: Case) -> None:
    """Decoding drops special tokens and the first piece's space prefix; a token's bytes, joined,
    are the text's UTF-8 (after that prefix): byte tokens are single bytes."""
    sp, tokenizer, space_prefix = case
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == sp.decode(ids) == text, text
        prefix = " " if space_prefix and text else ""
        assert b"".join(tokenizer.bytes_of(i) for i in ids[1:]) == (prefix + text).encode()
    for text in SPECIAL_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        # sentencepiece writes the unknown token as " ⁇ "; it is special here, and skipped.
        assert tokenizer.decode(ids) == sp.decode([i for i in ids if i != sp.unk_id()]), text


def test_the_chat_template_renders_and_encodes_special_tokens_whole(case: Case) -> None:
    sp, tokenizer, _ = case
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == "<s><start_of_turn>user\nhello world<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.encode_chat(messages) == _reference(sp, rendered)


def test_merges_follow_scores_not_vocabulary_order(tmp_path: Path) -> None:
    """The normal pieces shuffled in the file, each keeping its score: the same pieces come out.
    Negative control: the same shuffled file with each score replaced by its position (merging
    in vocabulary order, ignoring scores) cuts at least a quarter of the made-up lines otherwise
    (deterministic: seeded training and shuffle)."""
    sp = _train(add_dummy_prefix=True)
    pieces, scores, types = _vocabulary(sp)
    normal = [i for i, kind in enumerate(types) if kind == NORMAL]
    shuffled = normal.copy()
    random.Random(0).shuffle(shuffled)
    order = list(range(len(pieces)))
    for slot, source in zip(normal, shuffled, strict=True):
        order[slot] = source
    pieces = [pieces[i] for i in order]
    scores = [scores[i] for i in order]
    by_position = [-float(i) if types[i] == NORMAL else 0.0 for i in range(len(pieces))]

    def pieces_of(tokenizer: Tokenizer, text: str) -> list[str]:
        return [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(text, False)]

    kept = _load(_write_gguf(tmp_path / "kept.gguf", pieces, scores, types))
    ignored = _load(_write_gguf(tmp_path / "ignored.gguf", pieces, by_position, types))
    texts = TEXTS + HELD_OUT
    expected = {text: sp.encode(text, out_type=str) for text in texts}
    assert {text: pieces_of(kept, text) for text in texts} == expected
    differ = [text for text in HELD_OUT if pieces_of(ignored, text) != expected[text]]
    assert len(differ) >= len(HELD_OUT) // 4, differ  # measured: 9 of the 20 lines


def test_flags_absent_and_eos(tmp_path: Path) -> None:
    """Without add_bos_token BOS is added (llama.cpp's default for SentencePiece);
    add_eos_token appends EOS."""
    sp = _train(add_dummy_prefix=True)
    vocabulary = _vocabulary(sp)
    plain = _load(_write_gguf(tmp_path / "plain.gguf", *vocabulary))
    assert plain.encode("hello") == [sp.bos_id(), *sp.encode("hello")]
    flags = {"add_bos_token": False, "add_eos_token": True}
    eos = _load(_write_gguf(tmp_path / "eos.gguf", *vocabulary, flags=flags))
    assert eos.encode("hello") == [*sp.encode("hello"), sp.eos_id()]


@pytest.mark.parametrize("model", ["bert", "t5", ""])
def test_another_tokenizer_model_is_refused_by_name(tmp_path: Path, model: str) -> None:
    sp = _train(add_dummy_prefix=True)
    path = _write_gguf(tmp_path / "other.gguf", *_vocabulary(sp), model=model)
    with pytest.raises(ValueError, match=rf"model {model!r} is not supported.*'gpt2'.*'llama'"):
        GGUFFile(path).tokenizer()


def test_a_sentencepiece_vocabulary_without_scores_is_refused(tmp_path: Path) -> None:
    sp = _train(add_dummy_prefix=True)
    pieces, _, types = _vocabulary(sp)
    with pytest.raises(ValueError, match="0 scores for 600 tokens"):
        Tokenizer.from_gguf_vocab(
            model="llama",
            pre=None,
            tokens=pieces,
            token_types=types,
            merges=[],
            bos_token_id=1,
            eos_token_id=2,
        )
