"""The serving benchmark's report: the machine, the markdown tables (levels, ratios, the engine's
paths by level, rules) and the plot of output tokens/s and TTFT p99 against the load."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from specdec.bench_serve.client import NO_SPEC_MODE, LevelResult
from specdec.bench_serve.rules import RULES


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def markdown(meta: dict, levels: list[LevelResult]) -> str:
    command = " ".join(meta["argv"])
    lines = [
        f"Date: {meta['date']}. Model: {meta['model']}. Machine: {json.dumps(meta['machine'])}.",
        f"Speculation (server): {json.dumps(meta['speculative_config'])}. "
        f"{meta['max_tokens']} output tokens per request (EOS ignored), temperature "
        f"{meta['temperature']}, at least {meta['requests_per_level']} requests per level; "
        f"prompts: {meta['prompts']}.",
        "",
        "```",
        command,
        "```",
        "",
        "| mode | load | requests | failed | req/s | output tok/s | TTFT p50/p90/p99 ms "
        "| TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | mean acceptance length "
        "| client processes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in levels:
        lines.append(
            f"| {x.mode} | {x.label} | {x.num_requests} | {x.num_failed} "
            f"| {x.requests_per_s:.2f} | {x.output_tokens_per_s:.1f} "
            f"| {x.ttft_p50_ms:.0f}/{x.ttft_p90_ms:.0f}/{x.ttft_p99_ms:.0f} "
            f"| {x.tpot_p50_ms:.1f}/{x.tpot_p90_ms:.1f}/{x.tpot_p99_ms:.1f} "
            f"| {x.itl_p50_ms:.1f}/{x.itl_p90_ms:.1f}/{x.itl_p99_ms:.1f} "
            f"| {x.mean_acceptance_length:.2f} | {x.client_processes} |"
        )
    by_key = {(x.mode, x.label): x for x in levels}
    labels = list(dict.fromkeys(x.label for x in levels if not x.mode.startswith("generate")))
    header = "| load | plain tok/s | spec tok/s | spec / plain |"
    no_spec = any(x.mode == NO_SPEC_MODE for x in levels)
    if no_spec:
        header += " `--no-spec` server tok/s | spec / `--no-spec` |"
    ceiling = any(x.mode.startswith("generate") for x in levels)
    if ceiling:
        header += " server / `LLM.generate`: plain | spec |"
    columns = 4 + 2 * no_spec + 2 * ceiling
    lines += ["", header, "|" + "---|" * columns]
    for label in labels:
        plain, spec = by_key.get(("plain", label)), by_key.get(("spec", label))
        if plain is None or spec is None:
            continue
        ratio = spec.output_tokens_per_s / plain.output_tokens_per_s
        row = (
            f"| {label} | {plain.output_tokens_per_s:.1f} | {spec.output_tokens_per_s:.1f} "
            f"| {ratio:.2f} |"
        )
        if no_spec:
            base = by_key.get((NO_SPEC_MODE, label))
            row += (
                f" {base.output_tokens_per_s:.1f} | "
                f"{spec.output_tokens_per_s / base.output_tokens_per_s:.2f} |"
                if base
                else " | |"
            )
        if ceiling:
            for server, mode in ((plain, "generate plain"), (spec, "generate spec")):
                engine = by_key.get((mode, label))
                row += (
                    f" {server.output_tokens_per_s / engine.output_tokens_per_s:.2f} |"
                    if engine
                    else " |"
                )
        lines.append(row)
    lines += paths_table(meta)
    mixed = [x for x in levels if x.tpot_p50_ms_by_rule]
    if mixed:
        lines += ["", f"Rules ({meta['rules']}): TPOT p50 ms by rule", ""]
        names = [*RULES, "none"] if any("none" in x.tpot_p50_ms_by_rule for x in mixed) else RULES
        lines += ["| mode | load | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for x in mixed:
            tpot = x.tpot_p50_ms_by_rule
            cells = " | ".join(f"{tpot.get(rule, float('nan')):.1f}" for rule in names)
            lines.append(f"| {x.mode} | {x.label} | {cells} |")
    return "\n".join(lines) + "\n"


# The step counters of the paths table: (column, counter); a row's counters as they grew
PATH_COLUMNS = (
    ("overlapped steps", "specdec:num_overlapped_steps_total"),
    ("of them with prefill", "specdec:num_overlapped_prefill_steps_total"),
    ("device rounds", "specdec:num_device_rounds_total"),
    ("round joins", "specdec:num_round_joins_total"),
    ("side rows", "specdec:num_side_rows_total"),
    ("synchronous steps", "specdec:num_sync_steps_total"),
    ("plain-arm steps", "specdec:num_plain_arm_steps_total"),
    ("rows prefill", "specdec:num_rows_total[kind=prefill]"),
    ("rows plain", "specdec:num_rows_total[kind=plain]"),
    ("rows speculative", "specdec:num_rows_total[kind=speculative]"),
)


def paths_table(meta: dict) -> list[str]:
    """Markdown lines: per server level, how its engine ran it (the step counters that level
    grew: joining visits and joins show as overlapped prefill steps beside device rounds)."""
    rows = dict(meta.get("engine_counters_by_level") or {})
    for key, grown in (
        (meta.get("no_spec_server") or {}).get("engine_counters_by_level") or {}
    ).items():
        rows[f"{NO_SPEC_MODE} {key.split(' ', 1)[1]}"] = grown
    rows.update(meta.get("generate_counters_by_level") or {})
    if not rows:
        return []
    lines = [
        "",
        "Engine paths by level (the server's step counters, and the in-process engine's for "
        "`LLM.generate`, as each level grew them)",
        "",
    ]
    lines.append("| level | " + " | ".join(name for name, _ in PATH_COLUMNS) + " |")
    lines.append("|---|" + "---|" * len(PATH_COLUMNS))
    for level, grown in rows.items():
        cells = " | ".join(f"{grown.get(counter, 0):.0f}" for _, counter in PATH_COLUMNS)
        lines.append(f"| {level} | {cells} |")
    return lines


def plot(levels: list[LevelResult], path: Path) -> None:
    """Output tokens/s and TTFT p99 against the load, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(x.label for x in levels))
    fig, (rate_axis, ttft_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(x.mode for x in levels):
        rows = {x.label: x for x in levels if x.mode == mode}
        xs = [i for i, label in enumerate(labels) if label in rows]
        rate_axis.plot(
            xs, [rows[labels[i]].output_tokens_per_s for i in xs], marker="o", label=mode
        )
        if not mode.startswith("generate"):
            ttft_axis.plot(xs, [rows[labels[i]].ttft_p99_ms for i in xs], marker="o", label=mode)
    for axis, title in ((rate_axis, "output tokens/s"), (ttft_axis, "TTFT p99 (ms)")):
        axis.set_xticks(range(len(labels)), labels)
        axis.set_xlabel("load")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
