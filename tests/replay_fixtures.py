"""Replay checks shared by the CPU and GPU tests: a seeded request set, arrival patterns, an engine
driver that adds requests between steps, the reference (each request alone on an idle engine),
the token-for-token comparison, and the negative control (a batch-dependent logits term).

Random choices (prompts, arrival steps, permutations) come from seeded generators here (tests
only).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf_fixtures import write_gguf
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.outputs import CompletionOutput
from specdec.models import LlamaForCausalLM
from specdec.sampling import SamplingParams

VOCAB = 97
MAX_MODEL_LEN = 128
# Prompts made of a repeated half (prompt lookup finds something), 4 to 70 tokens: longer than
# every chunk size the tests use (8, 16, 64) for some of them.
HALF_LENGTHS = (2, 6, 9, 14, 20, 35)
MAX_TOKENS = (24, 40, 28, 32, 36, 26)
TEMPERATURES = (0.8, 0.0, 0.8, 0.8, 0.0, 0.8)
# A CUDA test engine's KV cache (blocks of 16): the default sizing gives one engine 90% of the
# GPU, and a test keeps several alive (the alone reference, the batch, a drafter's).
CUDA_KV_BLOCKS = 4096
ARRIVAL_PATTERNS = ("closed", "permuted", "uniform", "bursts")
DRAFTERS = ("ngram", "draft_model", "eagle", "dflash", "dspark")


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One seeded request (ignore_eos, so that its length is fixed)."""

    prompt: list[int]
    params: SamplingParams


def replay_requests(seed: int = 0) -> list[ReplayRequest]:
    """Six seeded requests: temperature 0.8 with top_p 0.95, or greedy; 24-40 tokens each."""
    halves = prompt_tokens(VOCAB, HALF_LENGTHS, seed=seed + 1)
    requests = []
    for index, (half, max_tokens, temperature) in enumerate(
        zip(halves, MAX_TOKENS, TEMPERATURES, strict=True)
    ):
        top_p = 0.95 if temperature > 0 else 1.0
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            seed=1000 * seed + 17 + index,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        requests.append(ReplayRequest(half + half, params))
    return requests


@dataclass(frozen=True, slots=True)
class Arrivals:
    """When each request joins: (engine step before which it is added, request index), in the
    order they are added."""

    pattern: str
    schedule: tuple[tuple[int, int], ...]


def arrivals(pattern: str, num_requests: int, seed: int = 0) -> Arrivals:
    """An arrival pattern: "closed" (all before the first step, in order), "permuted" (all
    before the first step, in a seeded random order), "uniform" (each at a step drawn
    uniformly from [0, 40)), or "bursts" (2-3 requests at once, then a gap of 8-20 steps)."""
    rng = random.Random(f"{pattern}-{seed}")
    order = list(range(num_requests))
    if pattern == "closed":
        steps = [0] * num_requests
    elif pattern == "permuted":
        rng.shuffle(order)
        steps = [0] * num_requests
    elif pattern == "uniform":
        steps = sorted(rng.randrange(40) for _ in order)
        rng.shuffle(order)
    elif pattern == "bursts":
        rng.shuffle(order)
        steps, step = [], 0
        while len(steps) < num_requests:
            steps += [step] * rng.randint(2, 3)
            step += rng.randint(8, 20)
        steps = steps[:num_requests]
    else:
        raise ValueError(f"unknown arrival pattern {pattern!r}")
    return Arrivals(pattern, tuple(zip(steps, order, strict=True)))


@dataclass(slots=True)
class StepLog:
    """What the scheduler put into the steps of one run (so that a test can check its case
    really happened): steps holding a prefill chunk beside decode rows, chunks shorter than
    their prompt."""

    num_steps: int = 0
    num_mixed_steps: int = 0
    num_split_prompts: int = 0
    chunk_sizes: set[int] = field(default_factory=set)


def spy_schedule(engine: LLMEngine) -> StepLog:
    """Wraps `engine.scheduler.schedule` and `schedule_ahead` (the overlapped loop's steps
    launched before the one in flight is read; this engine only) to fill a StepLog."""
    log = StepLog()
    scheduler = engine.scheduler
    schedule, schedule_ahead = scheduler.schedule, scheduler.schedule_ahead

    def record(scheduled):
        chunks = [s for s in scheduled if s.request.in_prefill]
        decodes = len(scheduled) - len(chunks)
        log.num_steps += 1
        log.num_mixed_steps += int(bool(chunks) and decodes > 0)
        for share in chunks:
            log.chunk_sizes.add(share.num_query_tokens)
            log.num_split_prompts += int(share.num_query_tokens < share.request.num_prompt_tokens)

    def spy():
        out = schedule()
        record(out.scheduled)
        return out

    def spy_ahead(hold, admit=True):
        scheduled = schedule_ahead(hold, admit)
        if scheduled is not None:
            record(scheduled)
        return scheduled

    scheduler.schedule, scheduler.schedule_ahead = spy, spy_ahead
    return log


def drive(
    engine: LLMEngine,
    requests: Sequence[ReplayRequest],
    schedule: Sequence[tuple[int, int]],
    overrides: dict[int, dict] | None = None,
) -> list[CompletionOutput]:
    """Adds each request before the engine step its arrival names (`engine.add_request`
    between `engine.step()` calls; a step of an idle engine does nothing) and steps until every
    request finished. `overrides`: per request index, its `speculative` override. Returns each
    request's final output, by request index."""
    overrides = overrides or {}
    pending = sorted(schedule, key=lambda entry: entry[0])  # stable: keeps the order of a step
    index_of: dict[str, int] = {}
    finals: dict[int, CompletionOutput] = {}
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= step:
            _, index = pending.pop(0)
            request = requests[index]
            request_id = engine.add_request(
                list(request.prompt), request.params, speculative=overrides.get(index)
            )
            index_of[request_id] = index
        for output in engine.step(only_finished=True):
            if output.finished:
                finals[index_of[output.request_id]] = output.outputs[0]
        step += 1
        if step > 10_000:
            raise RuntimeError("the engine did not finish its requests")
    return [finals[index] for index in range(len(requests))]


def run_alone(
    engine: LLMEngine,
    requests: Sequence[ReplayRequest],
    overrides: dict[int, dict] | None = None,
) -> list[CompletionOutput]:
    """Each request alone, one after another, on `engine` (idle between them)."""
    overrides = overrides or {}
    alone = []
    for index, request in enumerate(requests):
        override = {0: overrides[index]} if index in overrides else None
        alone += drive(engine, [request], [(0, 0)], override)
    return alone


def mismatches(
    want: Sequence[CompletionOutput],
    got: Sequence[CompletionOutput],
    requests: Sequence[ReplayRequest],
) -> list[str]:
    """Token-for-token differences, one line per request that differs (empty: replayed). Each
    output must also have its request's max_tokens tokens (ignore_eos). Where the requests
    asked for logprobs, the values too: each emitted token's log-probability, bit for bit (a
    row whose logits depend on its batch by an ulp differs there long before a token does)."""
    lines = []
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        expected = requests[index].params.max_tokens
        name = f"request {index} (T={requests[index].params.temperature})"
        if len(a.token_ids) != expected or len(b.token_ids) != expected:
            lines.append(f"{name}: {len(a.token_ids)} / {len(b.token_ids)} tokens, not {expected}")
        elif a.token_ids != b.token_ids:
            first = next(
                j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y
            )
            lines.append(
                f"{name}: token {first} of {expected} differs: "
                f"{a.token_ids[first : first + 4]} != {b.token_ids[first : first + 4]}"
            )
        elif requests[index].params.logprobs is not None:
            values = [emitted_logprobs(out) for out in (a, b)]
            differ = [j for j, (x, y) in enumerate(zip(*values, strict=True)) if x != y]
            if differ:
                gap = max(abs(values[0][j] - values[1][j]) for j in differ)
                lines.append(
                    f"{name}: same tokens, but the log-probabilities of {len(differ)} of them "
                    f"differ (first: token {differ[0]}; largest gap {gap:.3g})"
                )
    return lines


def emitted_logprobs(output: CompletionOutput) -> list[float]:
    """The log-probability of each emitted token (the request asked for logprobs)."""
    return [
        entry[token].logprob for entry, token in zip(output.logprobs, output.token_ids, strict=True)
    ]


def with_logprobs(requests: Sequence[ReplayRequest]) -> list[ReplayRequest]:
    """The same requests asking for their tokens' log-probabilities (`logprobs=0`), so that
    `mismatches` compares values too. (Such requests take the synchronous step only.)"""
    return [ReplayRequest(r.prompt, dataclasses.replace(r.params, logprobs=0)) for r in requests]


def make_batch_dependent(monkeypatch, scale: float = 0.05) -> None:
    """The negative control: every step's logits gain `scale` x the mean of the step's logits
    rows, a term that depends on what else the step holds (alone, a row gains `scale` x
    itself). The engine stays deterministic, but a row's tokens now depend on its batch."""
    compute_logits = LlamaForCausalLM.compute_logits

    def batch_dependent(self, hidden, out=None):
        logits = compute_logits(self, hidden)
        logits = logits + scale * logits.mean(dim=0, keepdim=True)
        return logits if out is None else out.copy_(logits)

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", batch_dependent)


# ------------------------------------------------------------------------- models, drafters
def float_model_dir(path: Path) -> Path:
    """The tiny Llama (`models_fixtures.TINY_CONFIGS["llama"]`) as a float HF checkpoint."""
    return save_hf_model(make_hf_model("llama"), path)


def gguf_model_file(path: Path) -> Path:
    """The same tiny Llama as a GGUF file of Q4_1 / Q8_0 tensors (head and norms float): on
    the CPU the default load (quantization "auto") keeps it quantized."""
    import gguf

    qtype = gguf.GGMLQuantizationType
    hf_model = make_hf_model("llama")
    names = {}
    for layer in range(hf_model.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            names[f"blk.{layer}.{part}.weight"] = qtype.Q4_1
        names[f"blk.{layer}.ffn_down.weight"] = qtype.Q8_0
    return write_gguf(path / "tiny.gguf", hf_model, arch="llama", qtype_of=names)


def drafter_dirs(float_dir: Path, root: Path) -> dict[str, Path]:
    """Drafters of the tiny Llama (they read its float weights; the GGUF file holds the same
    model): an EAGLE head briefly distilled on its features, and DFlash / DSpark block drafters
    close to it (DSpark's confidence scheduler on, so its verify lengths vary)."""
    from block_drafter_fixtures import save_tiny_block_drafter
    from eagle_fixtures import trained_head
    from specdec.models import load_model

    target = load_model(float_dir).model
    dspark = {"confidence_scale": 10.0, "confidence_bias": -0.5, "min_survival_probability": 0.3}
    return {
        "eagle": trained_head(float_dir, root / "eagle"),
        "dflash": save_tiny_block_drafter(
            root / "dflash", "dflash", target, block_size=4, noise=0.05
        ),
        "dspark": save_tiny_block_drafter(
            root / "dspark", "dspark", target, block_size=4, noise=0.05, **dspark
        ),
    }


def drafter_spec(drafter: str, dirs: dict[str, Path], **keys: Any) -> dict:
    """A speculative_config of `drafter` with the default verifier (and adaptive K): only the
    drafter (its checkpoint) and `keys` are set."""
    if drafter == "ngram":
        spec = {"method": "ngram"}
    elif drafter == "draft_model":
        spec = {"method": "draft_model", "model": "truncated:1"}
    else:
        spec = {"method": drafter, "model": str(dirs[drafter])}
    return {**spec, **keys}


EngineFactory = Callable[..., LLMEngine]


def engine_factory(model: Path | str | None, device: str = "cpu", **defaults: Any) -> EngineFactory:
    """`make(spec=None, **engine_args)`: a fresh engine of `model` (None: the built-in one) on
    `device`, max_model_len 128 and `defaults` unless `engine_args` say otherwise."""

    def make(spec: dict | None = None, **engine_args: Any) -> LLMEngine:
        args = {"max_model_len": MAX_MODEL_LEN, **defaults, **engine_args}
        if device == "cuda":  # several engines live at once: none sized to the GPU's memory
            args.setdefault("num_kv_blocks", CUDA_KV_BLOCKS)
        config = EngineConfig(model=None if model is None else str(model), device=device, **args)
        return LLMEngine(config, SpeculativeConfig.from_dict(spec))

    return make


class AloneOutputs:
    """Per model (and with or without logprobs): each request alone on an idle plain engine
    (speculation off), computed once."""

    def __init__(self, factories: dict[str, EngineFactory], requests: list[ReplayRequest]):
        self.factories, self.requests = factories, requests
        self.cache: dict[tuple[str, bool], list[CompletionOutput]] = {}

    def __call__(self, model: str, values: bool = False) -> list[CompletionOutput]:
        if (model, values) not in self.cache:
            batch = with_logprobs(self.requests) if values else self.requests
            self.cache[model, values] = run_alone(self.factories[model](), batch)
        return self.cache[model, values]


def replay(
    make: EngineFactory,
    requests: Sequence[ReplayRequest],
    want: Sequence[CompletionOutput],
    pattern: str,
    spec: dict | None = None,
    overrides: dict[int, dict] | None = None,
    **engine_args: Any,
) -> tuple[LLMEngine, StepLog, list[str]]:
    """The replay check: `requests` arriving by `pattern` on a fresh engine (`make(spec,
    **engine_args)`), compared with `want` (`mismatches`). Returns (the engine, its step log,
    the mismatches)."""
    engine = make(spec, **engine_args)
    log = spy_schedule(engine)
    got = drive(engine, requests, arrivals(pattern, len(requests)).schedule, overrides)
    return engine, log, mismatches(want, got, requests)
