"""Where a speculative round's wall time goes at long context: the decode of one long request
(after its first token) under cProfile, beside its wall time, for one drafter with state of its
own (bench_long_context's engines: Llama-3-8B shape, random bf16 weights, K = 4 pinned).

    PYTHONPATH=src:tests:benchmarks python3 benchmarks/probes/probe_long_round_host.py \\
        --out DIR [--length 131072] [--drafter eagle] [--new-tokens 64] [--shape llama-3-8b] \\
        [--device cuda]

Writes DIR/long_round_host_<length>_<drafter>.txt (the decode's wall time and loop counters,
then cProfile's functions by own time and by cumulative time). cProfile slows Python calls, so
the wall time is an upper bound; what it shows is which host functions (or waits on the
device, which cProfile books to the call that waits) take the round's time. A probe: never
imported by tests.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_long_context as blc  # the long-context engines and prompts
from probes.probe_triton_compiles import kernel_variants


def variant_keys(qualified: str) -> list[str]:
    """The specialization keys of a Triton kernel's compiled variants ("module.name")."""
    module, name = qualified.rsplit(".", 1)
    caches = getattr(sys.modules[module], name).device_caches
    keys = []
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        keys += [str(key)[:1500] for key in cache]
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--drafter", default="eagle", choices=["eagle", "dflash", "dspark"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(blc.SHAPES))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from specdec.sampling import SamplingParams

    args.out.mkdir(parents=True, exist_ok=True)
    model = blc.build_model(args.shape, args.device)
    vocab = model.config.vocab_size
    prompt = blc.long_prompt(args.length - args.new_tokens - 5, vocab, seed=args.length)
    common = {"device": args.device, "max_model_len": args.length, "prefill_chunk": 2048}
    llm = blc.make_llm(model, blc.drafter_config(model, args.drafter, 4), **common)
    blc.warm_up(llm, vocab, args.device, args.length)
    profile = cProfile.Profile()
    first: list[float] = []

    variants = [kernel_variants()]

    def on_tokens(output) -> None:
        if not first and output.outputs[0].token_ids:
            first.append(time.perf_counter())
            variants.append(kernel_variants())
            profile.enable()

    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False, on_tokens=on_tokens)[0]
    blc.sync(args.device)
    profile.disable()
    end = time.perf_counter()
    variants.append(kernel_variants())
    grown = [
        {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
        for before, after in itertools.pairwise(variants)
    ]
    keys = {name: variant_keys(name) for name in (grown[1] if len(grown) > 1 else {})}
    tokens = len(out.outputs[0].token_ids)
    text = io.StringIO()
    text.write(f"command: python {' '.join(sys.argv)}\ndate: {time.strftime('%Y-%m-%d %H:%M')}\n")
    text.write(f"prefill s {first[0] - start:.2f}; decode s {end - first[0]:.3f} for ")
    text.write(f"{tokens - 1} tokens ({(end - first[0]) / max(tokens - 1, 1) * 1e3:.2f} ms each)\n")
    text.write(f"loop: {llm.get_metrics().get('loop')}\n")
    text.write(f"Triton variants compiled in the prefill: {grown[0]}\n")
    text.write(f"... in the decode: {grown[1] if len(grown) > 1 else None}\n")
    for name, specializations in keys.items():  # what made the new variant differ
        text.write(f"{name} variants:\n" + "".join(f"  {key}\n" for key in specializations))
    text.write("\n")
    for order in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(30)
    path = args.out / f"long_round_host_{args.length}_{args.drafter}.txt"
    path.write_text(text.getvalue())
    blc.log(text.getvalue()[:600])


if __name__ == "__main__":
    main()
