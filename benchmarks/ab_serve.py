"""Versions of the engine side by side under `bench_serve.py`, on one machine in one go: the
serving figures of one GPU lease differ from the next by 20-35% (s32: the same `--no-spec`
server at c = 64 read 21,370, 28,588 and 32,215 tokens/s in three leases), so a change is
judged against the code before it in the same lease, never against an older lease's table.

Two steps, because the device machine gets a copy of the working tree without `.git`:

    # here: each revision's src/ into a folder that travels (the shipped drafter's weights
    # left out, about 2 MB a revision; taken from the working tree where it runs)
    python benchmarks/ab_serve.py prepare --rev 9d57f0d --rev HEAD~3 --out .carry/ab
    # there: bench_serve.py once per version (each prepared revision, then the working tree),
    # each with its own server pair, and the versions' spec / --no-spec side by side
    python benchmarks/ab_serve.py run --versions .carry/ab --runs 2 --out-dir OUT -- \\
        --serve MODEL --device cuda --concurrency 16 64 256 --requests-per-level 768 \\
        --max-tokens 128 --temperature 0.8 --no-spec-server

`run` writes OUT/VERSION-RUN/serve.json (and .md) for each run and OUT/ab.md, a table of spec /
`--no-spec` and plain / `--no-spec` per load, a row per version and run (the runs show the
spread).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NO_SPEC_MODE = "no-spec server"  # bench_serve.py's mode of the --no-spec server's levels
SHIPPED_WEIGHTS = "specdec/drafters/default"  # weights left out of a prepared revision


def prepare(revisions: list[str], out: Path) -> list[Path]:
    """Each revision's src/ (git archive, *.safetensors left out) as out/<short hash>/specdec."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for rev in revisions:
        short = subprocess.run(
            ["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
            text=True,
        ).stdout.strip()  # fmt: skip
        archive = subprocess.run(
            ["git", "archive", "--format=tar", rev, "src"], cwd=REPO, check=True,
            capture_output=True,
        ).stdout  # fmt: skip
        target = out / short
        if target.exists():
            shutil.rmtree(target)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".safetensors") or not member.name.startswith("src/"):
                    continue
                member.name = member.name.removeprefix("src/")
                if member.name:
                    tar.extract(member, target, filter="data")
        made.append(target)
        print(f"{rev} -> {target}", flush=True)
    return made


def with_weights(version: Path) -> None:
    """The working tree's shipped drafter weights copied into a prepared revision (where it
    lacks them)."""
    source = REPO / "src" / SHIPPED_WEIGHTS
    for weights in source.rglob("*.safetensors"):
        copy = version / SHIPPED_WEIGHTS / weights.relative_to(source)
        if copy.parent.exists() and not copy.exists():
            shutil.copy2(weights, copy)


def ratios(report: dict) -> dict[str, tuple[float | None, float | None]]:
    """Per load: (spec / --no-spec, plain / --no-spec) output tokens/s of one bench_serve
    report (None where a mode is missing)."""
    by = {(x["mode"], x["load"]): x["output_tokens_per_s"] for x in report["levels"]}
    loads = dict.fromkeys(load for mode, load in by if mode == NO_SPEC_MODE)
    out = {}
    for load in loads:
        base = by[(NO_SPEC_MODE, load)]
        spec, plain = by.get(("spec", load)), by.get(("plain", load))
        out[load] = (spec / base if spec else None, plain / base if plain else None)
    return out


def table(reports: dict[str, dict]) -> str:
    """Markdown: a row per version and run, spec / `--no-spec` (plain / `--no-spec`) per load."""
    loads = list(dict.fromkeys(load for r in reports.values() for load in ratios(r)))
    lines = [
        "| version | " + " | ".join(loads) + " |",
        "|---|" + "---|" * len(loads),
    ]
    for name, report in reports.items():
        cells = []
        for load in loads:
            spec, plain = ratios(report).get(load, (None, None))
            cells.append(
                "" if spec is None else f"{spec:.2f}x" + (f" ({plain:.2f}x)" if plain else "")
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "spec / `--no-spec` server output tokens/s (plain requests / `--no-spec`)."]
    return "\n".join(lines) + "\n"


def run(versions: Path | None, runs: int, out_dir: Path, bench_args: list[str]) -> str:
    """bench_serve.py with `bench_args` for each prepared version (its servers run its src) and the
    working tree, `runs` times in turn (A, B, A, B: drift shows in both); returns ab.md."""
    candidates = sorted(p for p in versions.iterdir() if p.is_dir()) if versions else []
    sources = {p.name: p for p in candidates} | {"tree": REPO / "src"}
    for source in sources.values():
        with_weights(source)
    reports = {}
    for attempt in range(1, runs + 1):
        for name, source in sources.items():
            label = f"{name}-{attempt}"
            target = out_dir / label
            # The version's engine serves; this tree's benchmark drives it (a prepared revision
            # may predate specdec.bench_serve)
            command = [sys.executable, str(HERE / "bench_serve.py"), *bench_args]
            command += ["--server-src", str(source), "--out-dir", str(target)]
            print(f"== {label}: {source}", flush=True)
            subprocess.run(command, check=True)
            reports[label] = json.loads((target / "serve.json").read_text())
    text = table(reports)
    (out_dir / "ab.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    made = steps.add_parser("prepare", help="revisions' src/ into a folder that travels")
    made.add_argument("--rev", action="append", required=True, help="a git revision")
    made.add_argument("--out", type=Path, required=True)
    ran = steps.add_parser("run", help="bench_serve.py per version (args after --)")
    ran.add_argument("--versions", type=Path, default=None, help="prepare's --out")
    ran.add_argument("--runs", type=int, default=1, help="rounds over the versions")
    ran.add_argument("--out-dir", type=Path, required=True)
    ran.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.rev, args.out)
        return
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if "--out-dir" in bench_args or "--out" in bench_args:
        parser.error("run sets each version's --out-dir itself: pass --out-dir to ab_serve.py")
    if "--no-spec-server" not in bench_args:
        parser.error("run compares against the --no-spec server: pass --no-spec-server")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    print(run(args.versions, args.runs, args.out_dir, bench_args))


if __name__ == "__main__":
    main()
