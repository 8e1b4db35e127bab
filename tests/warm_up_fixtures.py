"""Test helpers for the engine's warm-up: the keys an engine's graph caches have run, and a load
that walks every batch bucket (the batch grows one request at a time to max_num_seqs, then
shrinks as they finish), plain or speculative."""

from __future__ import annotations

from models_fixtures import prompt_tokens
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams

JOIN_EVERY = 3  # steps between two arrivals


def graph_caches(engine: LLMEngine) -> dict:
    """The engine's graph caches by name: the target's decode path, device rounds (once built),
    the EAGLE head's steps (an EAGLE drafter's)."""
    caches = {"decode": engine.runner.graphs.graph_cache}
    if engine._rounds is not None:
        caches["rounds"] = engine._rounds.graph_cache
    head = getattr(engine.drafter, "_graphs", None)
    if head is not None:
        caches["head"] = head.graph_cache
    return caches


def graph_keys(engine: LLMEngine) -> set:
    """Every key any of the engine's graph caches has run, as (cache name, key)."""
    return {(name, key) for name, cache in graph_caches(engine).items() for key in cache.keys}


def run_load(
    engine: LLMEngine,
    speculative: bool,
    seed: int = 0,
    vocab_size: int = 97,
    extra: list[list[int]] = (),
    penalty_every: int = 0,
) -> dict[str, list[int]]:
    """Requests join one every JOIN_EVERY steps until max_num_seqs run (between joins the batch
    decodes: device rounds at each size), each asking for more tokens than the one before (so
    they finish one by one: the batch shrinks); half of them at temperature 0; `extra` prompts
    join first; with `penalty_every` = n, every n-th request (the first included) has a
    presence penalty (rounds holding it run with the slots' rules). Returns each request's
    tokens by request id."""
    count = engine.config.max_num_seqs
    prompts = [*extra, *prompt_tokens(vocab_size, [5 + 3 * i for i in range(count)], seed + 1)]
    override = None if speculative else {"enabled": False}
    pending = [
        (
            prompt,
            SamplingParams(
                temperature=0.0 if i % 2 else 1.0,
                max_tokens=8 + 4 * i,
                ignore_eos=True,
                seed=seed * 100 + i,
                presence_penalty=0.5 if penalty_every and i % penalty_every == 0 else 0.0,
            ),
        )
        for i, prompt in enumerate(prompts[:count])
    ]
    tokens: dict[str, list[int]] = {}
    index = steps = 0
    while pending or engine.has_unfinished:
        if pending and steps % JOIN_EVERY == 0:
            prompt, params = pending.pop(0)
            engine.add_request(prompt, params, request_id=f"s{seed}-{index}", speculative=override)
            index += 1
        steps += 1
        for output in engine.step(only_finished=True):
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens
