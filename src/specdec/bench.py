"""Speculative vs plain decoding on one workload: tokens/s, TPOT, TTFT, acceptance figures.

Runs the same prompts and seeds through an engine without drafts and through one with the chosen
speculative_config, writes the figures as JSON and a PNG plot. Measures only what it runs.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from specdec.drafters.config import TREE_METHODS, TreeConfig
from specdec.engine.llm import LLM
from specdec.engine.outputs import RequestOutput
from specdec.sampling import SamplingParams

# A repetitive workload (code and structured text): n-gram and small drafters do well on it.
DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 1..10.",
    "List the days of the week, one per line, each followed by its number in the week.",
    "Write a JSON object describing three books with title, author and year fields.",
    "Explain what a hash map is, then give an example in Python.",
    "Write the multiplication table of 7 from 7 x 1 to 7 x 12.",
    "Write a bash script that prints the numbers from 1 to 20 and says whether each is even.",
    "Repeat the sentence 'The quick brown fox jumps over the lazy dog.' five times.",
    "Write a SQL query that selects the ten most recent orders with their customer names.",
)


@dataclass(frozen=True, slots=True)
class RunFigures:
    """Figures of one engine on the workload."""

    name: str
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    mean_ttft_s: float
    mean_tpot_s: float
    mean_acceptance_length: float
    acceptance_rate: float
    acceptance_per_position: list[float]


def run_workload(
    llm: LLM,
    name: str,
    prompts: list[list[int]],
    params: SamplingParams,
    progress: bool = True,
    speculative: dict | None = None,
) -> tuple[RunFigures, list[RequestOutput]]:
    """Generates for every prompt; times first tokens and completions per request.
    `speculative` is a per-request override (e.g. {"num_speculative_tokens": 2})."""
    first_token_at: dict[str, float] = {}
    done_at: dict[str, float] = {}
    finished = [0]
    start = time.perf_counter()

    def on_tokens(output: RequestOutput) -> None:
        now = time.perf_counter()
        first_token_at.setdefault(output.request_id, now)
        if output.finished:
            done_at[output.request_id] = now
            finished[0] += 1
            if progress:
                _draw(name, finished[0], len(prompts))

    before = llm.get_metrics()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        speculative=speculative,
        use_tqdm=False,
        on_tokens=on_tokens,
    )
    wall = time.perf_counter() - start
    if progress:
        sys.stderr.write("\n")
    after = llm.get_metrics()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts, tpots = [], []
    for out in outputs:
        n = len(out.outputs[0].token_ids)
        ttft = first_token_at[out.request_id] - start
        ttfts.append(ttft)
        if n > 1:
            tpots.append((done_at[out.request_id] - first_token_at[out.request_id]) / (n - 1))
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    per_position = (
        [
            (
                a
                - (
                    before["accepted_per_position"][i]
                    if i < len(before["accepted_per_position"])
                    else 0
                )
            )
            / drafts
            for i, a in enumerate(after["accepted_per_position"])
        ]
        if drafts
        else []
    )
    figures = RunFigures(
        name=name,
        wall_s=wall,
        output_tokens=tokens,
        tokens_per_s=tokens / wall,
        mean_ttft_s=sum(ttfts) / len(ttfts),
        mean_tpot_s=sum(tpots) / len(tpots) if tpots else float("nan"),
        mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
        acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
        acceptance_per_position=per_position,
    )
    return figures, outputs


def _draw(name: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{name:>12} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    sys.stderr.flush()


def machine_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (CPU)"


def write_results(path: Path, runs: list[RunFigures], meta: dict) -> Path:
    """Writes the JSON figures and a PNG plot beside them; returns the PNG path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=2))
    png = path.with_suffix(".png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r.name for r in runs]
    left.bar(names, [r.tokens_per_s for r in runs], color="tab:blue")
    left.set_ylabel("output tokens / s")
    left.set_title("throughput")
    for run in runs:
        if run.acceptance_per_position:
            positions = range(1, len(run.acceptance_per_position) + 1)
            right.plot(positions, run.acceptance_per_position, marker="o", label=run.name)
    right.set_xlabel("draft position")
    right.set_ylabel("P(accepted length >= position)")
    right.set_ylim(0, 1)
    right.set_title("acceptance per position")
    if right.lines:
        right.legend()
    fig.suptitle(meta.get("title", "specdec bench"))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One drafter at one K and temperature, beside plain decoding at that temperature."""

    drafter: str
    k: int
    temperature: float
    mean_acceptance_length: float
    acceptance_per_position: list[float]
    tokens_per_s: float
    plain_tokens_per_s: float  # the mean of plain decoding's rates before and after the drafters
    speedup: float  # tokens_per_s / plain_tokens_per_s
    tree: str | None = None  # "NODESxDEPTHxTOPK" for a tree point (k = its nodes), else None
    plain_before_after: tuple[float, float] | None = None  # plain tokens/s timed first and last


def run_sweep(
    model: str | None,
    drafters: dict[str, dict],
    prompts: list[list[int]],
    ks: list[int],
    temperatures: list[float],
    output_len: int,
    seed: int,
    engine_args: dict,
    trees: list[dict] | None = None,
) -> list[SweepPoint]:
    """Acceptance and speed-up of each drafter for every K and temperature on the same prompts
    and seeds; plain decoding is timed per temperature before the drafters and again after them,
    and speed-ups are against the mean of the two (a machine whose rate drifts during the sweep
    shows it in `plain_before_after`, where one plain run at the start misread s13's batch-1
    speed-up by 20%). One engine per drafter (its K set
    per request), so the model loads once per drafter. `trees` ({"nodes", "depth", "topk"}
    each) adds tree points for the drafters that draft trees (eagle / mtp / draft_model), one
    engine per tree,
    on the synchronous engine path (async_scheduling off: trees have no device rounds yet)."""

    def params(temperature: float) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=seed + i
            )
            for i in range(len(prompts))
        ]

    warmed: set[int] = set()  # engines whose own warm-up ran

    def warm_up(llm: LLM, temperature: float, speculative: dict | None = None) -> None:
        """Untimed work with the run's settings: the engine's own warm-up once (its CUDA graphs,
        the CPU decode loop; not with --no-warm-up), one short request (Triton compiles and
        graphs the warm-up does not cover), then every prompt's prefill and first round (the
        work done once per prompt length: on CUDA, kernel plans for each new shape). Without
        the last part the first timed run of a sweep paid it alone (GPU plain decoding at
        T = 0 measured 420 tokens/s against 668 at T = 1). Figures are counter deltas, so this
        adds none."""
        if id(llm.engine) not in warmed:
            warmed.add(id(llm.engine))
            if llm.engine.config.warm_up:
                llm.engine.warm_up()
        warm = SamplingParams(temperature=temperature, max_tokens=min(output_len, 16), seed=seed)
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], warm, speculative=speculative, use_tqdm=False
        )
        first = SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True, seed=seed)
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            first,
            speculative=speculative,
            use_tqdm=False,
        )

    def time_plain(label: str) -> dict[float, float]:
        plain = LLM(model, speculative_config=None, **engine_args)
        rates = {}
        for temperature in temperatures:
            warm_up(plain, temperature)
            figures, _ = run_workload(
                plain, f"plain{label} T={temperature:g}", prompts, params(temperature)
            )
            rates[temperature] = figures.tokens_per_s
        plain.close()  # stops tensor-parallel workers before the next engine starts
        return rates

    plain_rate = time_plain("")
    points = []
    for name, spec in drafters.items():
        llm = LLM(
            model, speculative_config={**spec, "num_speculative_tokens": max(ks)}, **engine_args
        )
        for temperature in temperatures:
            for k in ks:
                warm_up(llm, temperature, {"num_speculative_tokens": k})
                figures, _ = run_workload(
                    llm,
                    f"{name} K={k} T={temperature:g}",
                    prompts,
                    params(temperature),
                    speculative={"num_speculative_tokens": k},
                )
                points.append(
                    SweepPoint(
                        drafter=name,
                        k=k,
                        temperature=temperature,
                        mean_acceptance_length=figures.mean_acceptance_length,
                        # The engine's counters span every K run so far: keep this K's positions.
                        acceptance_per_position=figures.acceptance_per_position[:k],
                        tokens_per_s=figures.tokens_per_s,
                        plain_tokens_per_s=plain_rate[temperature],
                        speedup=figures.tokens_per_s / plain_rate[temperature],
                    )
                )
        llm.close()
        del llm
        if spec.get("method") not in TREE_METHODS:
            continue
        for tree in trees or []:
            tree_args = {**engine_args, "async_scheduling": False}
            # Every step a tree round (the figures are the tree's), unless the drafter's own
            # config says otherwise: the adaptive policy would draft no tree where one loses.
            tree_spec = {"adaptive": False, **spec, "tree": tree}
            llm = LLM(model, speculative_config=tree_spec, **tree_args)
            label = tree_label(tree)
            for temperature in temperatures:
                warm_up(llm, temperature)
                figures, _ = run_workload(
                    llm, f"{name} tree {label} T={temperature:g}", prompts, params(temperature)
                )
                points.append(
                    SweepPoint(
                        drafter=name,
                        k=tree["nodes"],
                        temperature=temperature,
                        mean_acceptance_length=figures.mean_acceptance_length,
                        acceptance_per_position=figures.acceptance_per_position[: tree["depth"]],
                        tokens_per_s=figures.tokens_per_s,
                        plain_tokens_per_s=plain_rate[temperature],
                        speedup=figures.tokens_per_s / plain_rate[temperature],
                        tree=label,
                    )
                )
            del llm
    after = time_plain(" again")
    bracketed = []
    for point in points:
        before_after = (plain_rate[point.temperature], after[point.temperature])
        plain = sum(before_after) / 2
        bracketed.append(
            replace(
                point,
                plain_tokens_per_s=plain,
                speedup=point.tokens_per_s / plain,
                plain_before_after=before_after,
            )
        )
    return bracketed


def plain_drift(points: list[SweepPoint]) -> str | None:
    """A line naming the temperatures whose plain rate moved by more than 10% between the
    sweep's first and last plain runs (its speed-ups are then uncertain at that level), or None."""
    moved = {}
    for point in points:
        if point.plain_before_after is not None:
            before, after = point.plain_before_after
            if abs(after / before - 1) > 0.10:
                moved[point.temperature] = (before, after)
    if not moved:
        return None
    parts = ", ".join(f"T = {t:g}: {b:.1f} then {a:.1f} tokens/s" for t, (b, a) in moved.items())
    return f"plain decoding's rate moved by more than 10% during the sweep ({parts})"


def tree_label(tree: dict) -> str:
    """A tree setting as NODESxDEPTHxTOPK."""
    return f"{tree['nodes']}x{tree['depth']}x{tree['topk']}"


def parse_trees(text: str) -> list[dict]:
    """Comma-separated NODESxDEPTHxTOPK settings -> tree dicts (checked by `TreeConfig`)."""
    trees = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--trees expects NODESxDEPTHxTOPK items such as 8x4x2, got {item!r}")
        tree = dict(zip(("nodes", "depth", "topk"), map(int, parts), strict=True))
        TreeConfig.from_dict(tree)
        trees.append(tree)
    return trees


def sweep_table(points: list[SweepPoint]) -> str:
    """A Markdown table of the sweep."""
    lines = [
        "| drafter | K (chain) or tree N x D x k | T | mean acceptance length "
        "| acceptance per position | tokens/s | plain tokens/s | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        per_position = " ".join(f"{rate:.2f}" for rate in p.acceptance_per_position)
        shape = p.k if p.tree is None else f"tree {p.tree}"
        lines.append(
            f"| {p.drafter} | {shape} | {p.temperature:g} | {p.mean_acceptance_length:.2f} | "
            f"{per_position} | {p.tokens_per_s:.1f} | {p.plain_tokens_per_s:.1f} | "
            f"{p.speedup:.2f}x |"
        )
    drift = plain_drift(points)
    if drift is not None:
        lines += ["", f"Note: {drift}."]
    return "\n".join(lines)


def write_sweep(path: Path, points: list[SweepPoint], meta: dict) -> Path:
    """Writes the sweep as JSON and a PNG (acceptance length and speed-up against K, one line per
    drafter and temperature); returns the PNG path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "points": [asdict(p) for p in points]}, indent=2))
    png = path.with_suffix(".png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    chains = [p for p in points if p.tree is None]
    for p in points:
        if p.tree is not None:  # tree points: one star each at x = its nodes
            label = f"{p.drafter} tree {p.tree}, T={p.temperature:g}"
            left.plot([p.k], [p.mean_acceptance_length], "*", markersize=10, label=label)
            right.plot([p.k], [p.speedup], "*", markersize=10, label=label)
    series = sorted({(p.drafter, p.temperature) for p in chains})
    for drafter, temperature in series:
        line = sorted(
            (p for p in chains if (p.drafter, p.temperature) == (drafter, temperature)),
            key=lambda p: p.k,
        )
        label = f"{drafter}, T={temperature:g}"
        style = "-" if temperature == 0 else "--"
        left.plot(
            [p.k for p in line],
            [p.mean_acceptance_length for p in line],
            style,
            marker="o",
            label=label,
        )
        right.plot([p.k for p in line], [p.speedup for p in line], style, marker="o", label=label)
        widest = max(line, key=lambda p: p.k)
        positions = range(1, len(widest.acceptance_per_position) + 1)
        middle.plot(
            positions,
            widest.acceptance_per_position,
            style,
            marker="o",
            label=f"{label}, K={widest.k}",
        )
    left.set_xlabel("K (drafts per round; trees: nodes)")
    left.set_ylabel("mean acceptance length")
    left.set_title("acceptance length")
    middle.set_xlabel("draft position")
    middle.set_ylabel("P(accepted length >= position)")
    middle.set_ylim(0, 1)
    middle.set_title("acceptance per position")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_xlabel("K (drafts per round; trees: nodes)")
    right.set_ylabel("tokens/s over plain decoding")
    right.set_title("speed-up")
    for axis in (left, middle, right):
        axis.legend(fontsize=7)
    fig.suptitle(meta.get("title", "specdec bench --sweep"))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
