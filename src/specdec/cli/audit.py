"""`specdec audit`: the statistical conformance audit of the sampler and the verifiers."""

from __future__ import annotations

import argparse
import sys
import time


def add_audit(commands) -> None:
    from specdec.cli.flags import add_threads_flag

    audit = commands.add_parser(
        "audit",
        help="statistical conformance audit of the sampler and the three verifiers",
        description=(
            "Drive the real sampler and verifiers on toy Markov models over many seeded requests "
            "and test what they emit against exact probabilities. Each check that must pass "
            "fails by chance with probability <= 1e-6; negative controls (deliberately broken "
            "variants) must be rejected. Exit status 0 iff every verdict is as expected."
        ),
    )
    audit.add_argument(
        "--quick", action="store_true", help="smaller samples: same thresholds, less power"
    )
    audit.add_argument(
        "--seed", type=int, default=0, help="mixed into every request seed (default 0)"
    )
    add_threads_flag(
        audit,
        1,
        "the audit's tensors are small, and one thread does not stall on a busy machine as "
        "OpenMP spin-waits do",
    )
    audit.add_argument(
        "-v", "--verbose", action="store_true", help="print each check's numbers under its row"
    )
    audit.set_defaults(handler=_audit)


def _verdict(result) -> str:
    if result.expected_to_pass:
        return "pass" if result.passed else "FAIL"
    return "NOT REJECTED (no power)" if result.passed else "rejected (as it must be)"


def _audit(args: argparse.Namespace) -> int:
    from specdec.audit import run_audit

    started = time.perf_counter()
    done = 0

    def progress(result, seconds: float) -> None:
        nonlocal done
        done += 1
        mark = "ok " if result.ok else "!! "
        print(f"{mark}[{done:3d}] {seconds:5.1f}s  {result.name}", file=sys.stderr, flush=True)

    mode = "quick" if args.quick else "full"
    print(f"specdec audit ({mode}, seed {args.seed}): one line per check", file=sys.stderr)
    results = run_audit(args.quick, seed=args.seed, on_result=progress)
    elapsed = time.perf_counter() - started

    width = max(len(r.name) for r in results)
    header = f"{'check':<{width}}  {'statistic':>10}  {'threshold':>9}  verdict"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.name:<{width}}  {r.statistic:>10.3g}  {r.threshold:>9.3g}  {_verdict(r)}")
        if args.verbose:
            print(f"{'':<{width}}    {r.detail}")
    print("-" * len(header))
    print(
        "statistic <= threshold passes. -log10 p for chi-square and exact tests (6 = p 1e-6); "
        "|z| (or one-sided z) for z-tests (5.3);\nmismatches for identity and invariance "
        "checks (0); relative error for the exact far-tail mass (1e-4). -v shows the numbers."
    )
    controls = [r for r in results if not r.expected_to_pass]
    checks = [r for r in results if r.expected_to_pass]
    failed = [r for r in results if not r.ok]
    print(
        f"{sum(r.passed for r in checks)}/{len(checks)} checks passed, "
        f"{sum(not r.passed for r in controls)}/{len(controls)} negative controls rejected "
        f"in {elapsed:.0f} s: " + ("AUDIT PASSED" if not failed else "AUDIT FAILED")
    )
    for r in failed:
        print(f"  unexpected: {r.name}: {r.detail}")
    return 0 if not failed else 1
