"""Incremental detokenization: the text of a growing output, decoding only a few tokens per step.

Decoding the whole output again at every step costs O(length) per request per step, which a
streaming server pays for every running request. Here each update decodes the window from the
last stable point: the text grows by the difference between the decoded window and the decoded
part already counted. A window whose text ends inside a multi-byte character (U+FFFD) is not
taken yet; the next token completes it. Never touches token ids or randomness.
"""

from __future__ import annotations

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
