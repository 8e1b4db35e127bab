"""The committed drafter prompt sets: held-out topics and templates never occur in a training
set, so held-out acceptance figures measure generalisation."""

from __future__ import annotations

import json
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
DRAFTER = BENCHMARKS / "drafter"  # make_prompts.py
DATA = BENCHMARKS / "data"  # the prompt files it writes


def _prompts(name: str) -> list[str]:
    lines = (DATA / name).read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def test_held_out_topics_never_occur_in_training_prompts():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_prompts", DRAFTER / "make_prompts.py")
    make_prompts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_prompts)
    held_topics = [t.lower() for t in make_prompts.HELD_OUT_TOPICS]
    assert len(_prompts("heldout_prompts.jsonl")) == len(held_topics)
    for name in ("train_prompts.jsonl", "train_prompts_wide.jsonl"):
        prompts = _prompts(name)
        assert len(prompts) == len(set(prompts)) > 1000
        for prompt in prompts:
            lowered = prompt.lower()
            assert not any(topic in lowered for topic in held_topics), (name, prompt)
        for template in make_prompts.HELD_OUT_TEMPLATES:
            before, after = template.split("{t}")
            pattern = re.compile(re.escape(before) + ".+" + re.escape(after) + "$")
            assert not any(pattern.match(prompt) for prompt in prompts), (name, template)
