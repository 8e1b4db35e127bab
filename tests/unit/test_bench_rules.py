"""The rules of `bench_serve --rules` mixes: each mix's requests ask for its rules in turn."""

from __future__ import annotations

import pytest

from specdec.bench_serve.rules import MIXES, RULES, rule_of


@pytest.mark.parametrize(
    ("mix", "expected"),
    [
        ("none", ["none"] * 6),
        ("mixed", ["logprobs", "penalties", "json"] * 2),
        ("no-json", ["logprobs", "penalties"] * 3),
        ("penalties", ["penalties"] * 6),
        ("json-heavy", (["json"] * 7 + ["none"]) * 2),
    ],
)
def test_each_mix_asks_for_its_rules_in_turn(mix, expected):
    assert mix in MIXES
    got = [rule_of(i, mix) for i in range(len(expected))]
    assert got == expected
    assert all(rule == "none" or rule in RULES for rule in got)
