"""Do Triton kernels compile again inside timed generate calls? (the plain arm's stalls)

With the policy's plain arm on, a few SmolLM2 generate calls take 2.5x as long as the others
(one 449 ms step; benchmarks/results/h200-2026-12-01-s9 and -s10) while no CUDA graph is
captured. A Triton kernel compiles a new variant (~0.3-0.5 s) whenever an integer argument
changes between 1, a multiple of 16 and anything else, or a pointer's 16-byte alignment
changes, and the eager paths (the head's catch-up after plain steps, whose entry counts and
block-table widths vary per visit) pass such arguments. This probe runs the same generate call
several times per configuration and records, after each, its seconds and the variants every
specdec Triton kernel gained (`new_variants`), and for each new variant its specialisation key
(`new_variant_keys`: the key string, cut to 600 characters, and the arguments in which it differs
from the nearest variant compiled before, by name: the argument whose value class, alignment or
constexpr value changed). Where the installed Triton keeps no specialisation beside a key, the
keys and counts alone.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/probe_triton_compiles.py --out DIR \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf

Writes DIR/triton_compiles.json. A profile, not a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_spec_round import load_smollm2, make_engine, smollm2_batch  # noqa: E402

KEY_CHARS = 600  # of each new variant's key in the JSON


def specdec_kernels() -> dict:
    """Every Triton kernel (`JITFunction`) defined in a loaded specdec module, by
    "module.name" ({} without Triton)."""
    try:
        from triton.runtime.jit import JITFunction
    except Exception:
        return {}
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("specdec") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                found[f"{name}.{attr}"] = value
    return found


def compiled_variants(kernel) -> dict[str, tuple | None]:
    """A kernel's compiled variants on every device: key string -> its specialisation (per
    argument a (type, specialisation) pair, e.g. ('*bf16', 'D'), ('i32', None),
    ('constexpr', 5)) where this Triton keeps one, else None. Triton 3.2+ keeps per device
    (kernel_cache {key: kernel}, kernel_key_cache {(specialisation, options): key}, ...) in
    `device_caches`; older ones {key: kernel} per device in `cache`."""
    variants: dict[str, tuple | None] = {}
    try:
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            caches = getattr(kernel, "cache", {})
        for entry in list(caches.values()):
            compiled, key_cache = entry, {}
            if isinstance(entry, tuple):
                compiled = entry[0]
                if len(entry) > 1 and isinstance(entry[1], dict):
                    key_cache = entry[1]
            specs = {}
            for raw, key in list(key_cache.items()):
                if isinstance(raw, tuple) and raw and isinstance(raw[0], tuple):
                    specs[str(key)] = raw[0]
            for key in list(compiled):
                variants[str(key)] = specs.get(str(key))
    except Exception:
        pass
    return variants


def snapshot() -> dict[str, dict[str, tuple | None]]:
    """Per specdec kernel, its compiled variants (`compiled_variants`)."""
    return {name: compiled_variants(kernel) for name, kernel in specdec_kernels().items()}


def named_arguments(kernel, spec: tuple | None) -> dict[str, str] | None:
    """A specialisation by argument name: {"Q_PER_SEQ": "constexpr 5", "query_ptr": "*bf16 D",
    ...}, or None where it cannot be read."""
    try:
        names = list(getattr(kernel, "arg_names", None) or [])
        if spec is None or len(names) != len(spec):
            return None
        named = {}
        for name, part in zip(names, spec, strict=True):
            if isinstance(part, tuple):
                named[name] = " ".join(str(p) for p in part)[:80]
            else:
                named[name] = str(part)[:80]
        return named
    except Exception:
        return None


def describe_new(kernel, before: dict, after: dict) -> list[dict]:
    """For each variant in `after` but not in `before`: its key (cut to KEY_CHARS) and the
    arguments in which it differs from the nearest other variant (those compiled before the
    call first), as {name: [that variant's, this one's]}."""
    described = []
    for key, spec in after.items():
        if key in before:
            continue
        item: dict = {"key": key[:KEY_CHARS]}
        try:
            mine = named_arguments(kernel, spec)
            others = [k for k in before] or [k for k in after if k != key]
            nearest = None
            for other in others:
                theirs = named_arguments(kernel, after.get(other, before.get(other)))
                if mine is None or theirs is None:
                    continue
                diff = {n: [theirs[n], v] for n, v in mine.items() if theirs.get(n) != v}
                if nearest is None or len(diff) < len(nearest):
                    nearest = diff
            if nearest is not None:
                item["differs_from_nearest"] = nearest
        except Exception as error:  # the key alone then
            item["error"] = repr(error)[:200]
        described.append(item)
    return described


def grown_variants(before: dict, after: dict) -> tuple[dict[str, int], dict[str, list[dict]]]:
    """(new variants per kernel, their keys and differences: `describe_new`)."""
    counts, keys = {}, {}
    kernels = specdec_kernels()
    for name, variants in after.items():
        old = before.get(name, {})
        grown = len(variants) - len(old)
        if grown > 0:
            counts[name] = grown
            keys[name] = describe_new(kernels.get(name), old, variants)
    return counts, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    model, tokenizer, encoded, head = load_smollm2(args.gguf, "cuda")
    adaptive = {**head, "num_speculative_tokens": 4, "adaptive": True}
    results = {}
    for batch, temperature, plain_arm in ((8, 1.0, True), (32, 0.0, True), (32, 0.0, False)):
        prompts, blocks, params = smollm2_batch(encoded, batch, args.output_len, temperature)
        spec = {**adaptive, "plain_arm": plain_arm}
        built = snapshot()
        llm = make_engine(
            model, tokenizer, spec, device="cuda", max_num_seqs=batch, max_model_len=1024,
            blocks=blocks,
        )  # fmt: skip
        calls = []
        before = snapshot()
        # (the drafter's set-up compiles its eager catch-up's variants: printed, not timed)
        print(f"[compiles] set-up: {grown_variants(built, before)[0]}", flush=True)
        for _ in range(args.calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            after = snapshot()
            grown, keys = grown_variants(before, after)
            calls.append(
                {"ms": round(seconds * 1e3, 2), "new_variants": grown, "new_variant_keys": keys}
            )
            before = after
        name = f"b{batch} T={temperature:g} {'plain-arm' if plain_arm else 'rounds'}"
        results[name] = calls
        counts = [{"ms": call["ms"], "new_variants": call["new_variants"]} for call in calls]
        print(f"[compiles] {name}: {json.dumps(counts)}", flush=True)
        for index, call in enumerate(calls):
            for kernel, described in call["new_variant_keys"].items():
                for item in described:
                    what = item.get("differs_from_nearest", item["key"][:200])
                    print(f"  call {index + 1} {kernel}: {what}", flush=True)
        del llm
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "triton_compiles.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'triton_compiles.json'}")


if __name__ == "__main__":
    main()
