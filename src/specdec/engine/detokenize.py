"""Incremental detokenization: the text of a growing output, decoding only a few tokens per step.

Decoding the whole output again at every step costs O(length) per request per step, which a
streaming server pays for every running request. Here each update decodes the window from the
last stable point: the text grows by the difference between the decoded window and the decoded
part already counted. A window whose text ends inside a multi-byte character (U+FFFD) is not
taken yet; the next token completes it.

Tokenizers whose decoding only joins the tokens' bytes (byte-level BPE: `Tokenizer.byte_pieces`)
take a cheaper path: the new tokens' bytes are appended, and the bytes up to the last complete
character are decoded; an unfinished character waits for the next token. Decoding from a
character's first byte starts the UTF-8 decoder afresh (invalid bytes become U+FFFD exactly as in
a whole decode), so the pieces' texts join to the whole decode's text. Never touches token ids or
randomness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHARACTER = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class IncrementalText:
    """Attributes:
    text: the text of output tokens 0 .. read_offset - 1.
    prefix_offset: start of the window decoded at the next update.
    read_offset: tokens already turned into `text`.
    """

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    pending: bytes = b""  # the byte path's unfinished character (at most 3 bytes)

    def update(self, decoder: Decoder, token_ids: list[int], skip_special_tokens: bool) -> str:
        """Takes in the tokens appended since the last update; returns the text so far (it may
        lag by an incomplete character). Mutates: this state."""
        if self.read_offset >= len(token_ids):
            return self.text
        counted = decoder.decode(
            token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=skip_special_tokens,
        )
        window = decoder.decode(
            token_ids[self.prefix_offset :], skip_special_tokens=skip_special_tokens
        )
        if len(window) > len(counted) and not window.endswith(REPLACEMENT_CHARACTER):
            self.text += window[len(counted) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
        return self.text

    def update_bytes(self, pieces: Sequence[bytes], token_ids: list[int]) -> str:
        """`update` for a tokenizer with byte pieces (`Tokenizer.byte_pieces`): returns the text
        so far (it may lag by an unfinished character). Mutates: this state."""
        if self.read_offset >= len(token_ids):
            return self.text
        count = len(pieces)
        data = self.pending + b"".join(
            [pieces[t] if 0 <= t < count else b"" for t in token_ids[self.read_offset :]]
        )
        self.read_offset = len(token_ids)
        cut = complete_prefix(data)
        if cut:
            self.text += data[:cut].decode("utf-8", "replace")
        self.pending = data[cut:]
        return self.text


def complete_prefix(data: bytes) -> int:
    """The length of `data` without a trailing unfinished UTF-8 character: the position of the
    last character's first byte when fewer bytes follow it than its first byte announces."""
    end = len(data)
    for start in range(end - 1, max(end - 4, -1), -1):
        byte = data[start]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if byte >= 0xF0 else 1
        return start if end - start < need else end
    return end
