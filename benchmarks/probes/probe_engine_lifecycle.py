"""A second engine in one process on CUDA: an engine is built with the default memory sizing,
serves a few requests (graphs captured), is dropped, and another is built. Prints what the
process holds after each stage (allocated and reserved), and whether the first engine object was
freed (a weak reference).

`PYTHONPATH=src:tests python3 benchmarks/probes/probe_engine_lifecycle.py [--model GGUF]
[--spec JSON]`
"""

from __future__ import annotations

import argparse
import gc
import json
import weakref

import torch


def held(stage: str) -> None:
    gib = 1 << 30
    print(
        f"{stage}: allocated {torch.cuda.memory_allocated() / gib:.2f} GiB, reserved "
        f"{torch.cuda.memory_reserved() / gib:.2f} GiB, free "
        f"{torch.cuda.mem_get_info()[0] / gib:.2f} GiB",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--spec", type=json.loads, default=None)
    args = parser.parse_args()
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.sampling import SamplingParams

    held("start")
    for attempt in range(2):
        config = EngineConfig(model=args.model, device="cuda", max_model_len=512)
        engine = LLMEngine(config, SpeculativeConfig.from_dict(args.spec))
        for index in range(4):
            engine.add_request([1, 2, 3, 4 + index], SamplingParams(max_tokens=32, seed=index))
        while engine.has_unfinished:
            engine.step()
        held(f"engine {attempt} served")
        ref = weakref.ref(engine)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        held(f"engine {attempt} dropped (object freed: {ref() is None})")
        if ref() is not None:
            for referrer in gc.get_referrers(ref())[:6]:
                print("  held by", type(referrer).__name__, str(referrer)[:200], flush=True)


if __name__ == "__main__":
    main()
