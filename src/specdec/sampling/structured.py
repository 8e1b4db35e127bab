"""StructuredOutputsParams: a request's output constraint, with vLLM's field names.

Exactly one of JSON schema, any JSON object, regex, choice or grammar. Validates its own shape
only; compiling the constraint (and rejecting a bad schema or grammar) is the job of
`specdec.sampling.grammar`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM fields we do not implement: refused by name rather than ignored.
UNSUPPORTED_FIELDS = ("structural_tag", "whitespace_pattern")


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `StructuredOutputsParams`).

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid
            under it.
        regex: the output matches this regular expression (Rust `regex` syntax).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, Lark syntax (or llama.cpp's GBNF / EBNF).
        json_object: the output is any JSON object.
        disable_any_whitespace: JSON without whitespace between tokens (default: any, as
            vLLM allows; a schema's own `"x-guidance": {"whitespace_flexible": false}` does too).

    Under speculation a constrained request still follows the target's constrained law
    norm(target x mask) at every position, whatever the drafter and the verify method.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or "
                f"json_object; got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from err
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what the compiled grammar is cached by."""
        compact = "compact:" if self.disable_any_whitespace else ""
        if self.json is not None:
            return "json", compact + json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", compact
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar

    @staticmethod
    def from_dict(fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object (unknown fields refused by name)."""
        unsupported = sorted(set(fields) & set(UNSUPPORTED_FIELDS))
        if unsupported:
            raise ValueError(f"structured_outputs fields {unsupported} are not supported")
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown structured_outputs fields {unknown}; known: {sorted(known)}")
        return StructuredOutputsParams(**fields)
