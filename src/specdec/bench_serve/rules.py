"""The rules a mixed load's requests ask for (`--rules`): issue 34's mixed traffic,
a third of the requests with log-probabilities, a third with penalties, a third with a JSON
schema; `--rules no-json`: log-probabilities and penalties in turn (what the device rounds
take); `--rules penalties`: every request with penalties; `--rules json-heavy`: seven in eight
with a JSON schema, the eighth without rules (a few requests the device rounds take beside many
they cannot: what the speculation policy must not lose on). `--rules none` sends the same
requests without them (the comparison that says what the rules cost)."""

from __future__ import annotations

# A JSON schema whose one string field can hold any answer: the text stays free, the grammar runs.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}

RULES: dict[str, dict] = {
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1},
    "json": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
        }
    },
}
# Each mix: the rules its requests ask for in turn ("none": no rules).
MIX_RULES: dict[str, tuple[str, ...]] = {
    "none": ("none",),
    "mixed": tuple(RULES),
    "no-json": ("logprobs", "penalties"),
    "penalties": ("penalties",),
    "json-heavy": ("json",) * 7 + ("none",),
}
MIXES = tuple(MIX_RULES)


def rule_of(index: int, mix: str) -> str:
    """The rule of request `index` under `mix`: its rules in turn (so a level of 3n requests
    under "mixed" has n of each)."""
    names = MIX_RULES[mix]
    return names[index % len(names)]


def may_end_early(rule: str) -> bool:
    """Whether a request of `rule` may end before max_tokens though EOS is ignored (a JSON
    schema's object can close: then the grammar allows nothing but the end)."""
    return rule == "json"
