"""Which Triton kernel variants a warmed-up engine still compiles under traffic, and why (issue
34, item 3: the server's first c = 16 level compiled three `_linear_kernel` variants after the
warm-up and stalled ~1.3 s; H100, s28).

Builds the engine of tests/parity/test_warm_up_gpu.py (a tiny Llama with a trained EAGLE head;
with `--gguf`, also the built-in model with its shipped head), warms it up, then runs the load
that walks every batch bucket (`warm_up_fixtures.run_load`) and reports each kernel variant
compiled during the load: the arguments in which it differs from the nearest variant compiled
before (`probe_triton_compiles.grown_variants`), and for `_linear_kernel` the launches that
needed it (x and weight shapes, the tile, pointer alignments, the calling functions).

    PYTHONPATH=src:tests:benchmarks python3 benchmarks/probes/probe_warm_up_compiles.py \
        --out DIR [--gguf GGUF]

Writes DIR/warm_up_compiles.json. A profile, not a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent / "tests"))

from probe_triton_compiles import grown_variants, snapshot  # noqa: E402

FRAMES = 7  # calling functions kept per launch


def record_linear_launches():
    """Wraps `linear_triton.launch_linear`: each launch's (weight shape, tile, alignments) key
    goes into `launch.seen`; while `launch.frozen`, those not seen before are appended to
    `launch.log` with the shapes and callers. Returns the wrapper."""
    from specdec.models import linear_triton

    inner = linear_triton.launch_linear

    def launch(x, weight, bias, out, tile):
        key = (
            tuple(weight.shape),
            str(x.dtype),
            tile,
            x.data_ptr() % 16,
            out.data_ptr() % 16,
            weight.data_ptr() % 16,
            bias is None or bias.data_ptr() % 16,
        )
        seen, log = launch.seen, launch.log
        if key not in seen:
            if launch.frozen:
                stack = [
                    f"{f.name}:{f.lineno}" for f in traceback.extract_stack()[-FRAMES - 1 : -1]
                ]
                log.append(
                    {
                        "x": list(x.shape),
                        "x_stride": list(x.stride()),
                        "key": str(key),
                        "stack": stack,
                    }
                )
            seen.add(key)
        return inner(x, weight, bias, out, tile)

    launch.seen, launch.log, launch.frozen = set(), [], False
    linear_triton.launch_linear = launch
    return launch


def probe(target: str, gguf: str | None, tmp: Path, launch) -> dict:
    import torch

    from eagle_fixtures import trained_head
    from models_fixtures import make_hf_model, save_hf_model
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm_engine import LLMEngine
    from warm_up_fixtures import run_load

    if target == "builtin":
        from specdec.drafters.default import default_speculative_config

        spec = default_speculative_config(None, "cuda")
        model, max_model_len, vocab = gguf, 4096, None
    else:
        model_dir = save_hf_model(make_hf_model("llama"), tmp / "tiny")
        head_dir = trained_head(model_dir, tmp / "head")
        spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3}
        model, max_model_len, vocab = str(model_dir), 256, 97
    launch.seen, launch.log, launch.frozen = set(), [], False
    log = launch.log
    config = EngineConfig(model=model, max_num_seqs=16, max_model_len=max_model_len)
    engine = LLMEngine(config, SpeculativeConfig.from_dict(spec))
    vocab = vocab or engine.model_config.vocab_size
    engine.warm_up(progress=False)
    before = snapshot()
    launch.frozen = True
    run_load(engine, True, vocab_size=vocab)
    run_load(engine, False, seed=1, vocab_size=vocab)
    torch.cuda.synchronize()
    counts, keys = grown_variants(before, snapshot())
    result = {
        "triton_compiles_after_warm_up": engine.triton_compiles_after_warm_up,
        "new_variants": counts,
        "differs_from_nearest": {
            kernel: [item.get("differs_from_nearest", item["key"][:300]) for item in items]
            for kernel, items in keys.items()
        },
        "new_linear_launches": log[:40],
    }
    print(f"[compiles] {target}: {json.dumps(result['triton_compiles_after_warm_up'])}")
    for kernel, items in result["differs_from_nearest"].items():
        for item in items:
            print(f"   {kernel}: {item}")
    for item in log[:20]:
        print(f"   new linear launch: x {item['x']} {item['key']}\n      {item['stack']}")
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launch = record_linear_launches()
    result = {"tiny": probe("tiny", None, out / "tmp", launch)}
    if args.gguf:
        result["builtin"] = probe("builtin", args.gguf, out / "tmp", launch)
    (out / "warm_up_compiles.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
