"""Incremental detokenization against decoding the whole output, on a byte-level toy decoder
whose tokens split multi-byte characters."""

from __future__ import annotations

import torch

from specdec.engine.detokenize import IncrementalText


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
