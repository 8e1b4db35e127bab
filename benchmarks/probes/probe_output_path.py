"""What the server's output path costs on the host, per streamed output (issue 35: at 256 streams
the H100 server delivered 0.24x of `LLM.generate`, s28 and s30).

Each engine step of `specdec serve` turns every running request's new tokens into a delta
(detokenized incrementally: since s30 the engine's `RequestDelta`, before it a whole
`RequestOutput` diffed by `DeltaEncoder`), one frame; the HTTP process decodes the frame,
rebuilds each request's output (`OutputAssembler`) and frames an SSE chunk from its text delta.
This runs that path outside the server, with the engine's own steps (a small model on the CPU:
the device step is excluded from every figure), and reports host microseconds per output for
each part:

- engine process: `outputs` (building the `RequestOutput`s), `encode` (deltas + frame);
- HTTP process: `assemble` (frame decoded, outputs rebuilt), `sse` (text delta + chunk JSON).

At G tokens/s a process spends G x (its microseconds per output) / 1e6 of each second on it.

    PYTHONPATH=src python benchmarks/probes/probe_output_path.py --model DIR \
        [--streams 256] [--prompt-tokens 64 1024] [--max-tokens 128] [--out FILE]

DIR: a checkpoint with a tokenizer (`benchmarks/make_checkpoint.py tiny --out DIR`). Writes
FILE (JSON) when given. Run it on an otherwise idle machine (1 torch thread).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "src"))


def run(model: str, streams: int, prompt_tokens: int, max_tokens: int) -> dict:
    from specdec.core import wire
    from specdec.core.snapshot import snapshot_of
    from specdec.core.wire import OutputAssembler, decode_frame, encode_frame
    from specdec.engine import output_processor
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.sampling import SamplingParams
    from specdec.server.responses import _Deltas, _sse

    config = EngineConfig(
        model=model,
        max_num_seqs=streams,
        async_scheduling=True,
        max_model_len=prompt_tokens + max_tokens + 16,
        max_num_batched_tokens=max(2048, streams * 8),
    )
    engine = LLMEngine(config, None)
    # The engine's own deltas (since s30); before them, whole outputs diffed by `DeltaEncoder`.
    direct = hasattr(wire, "delta_row")
    engine.emit_deltas = direct
    to_row = wire.delta_row if direct else wire.DeltaEncoder().encode
    vocab = engine.model_config.vocab_size
    spent = {"outputs": 0.0, "encode": 0.0, "assemble": 0.0, "sse": 0.0}
    build = output_processor.OutputProcessor.outputs

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return build(self, *args, **kwargs)
        finally:
            spent["outputs"] += time.perf_counter() - start

    output_processor.OutputProcessor.outputs = timed
    try:
        assembler = OutputAssembler()
        rng = random.Random(0)
        deltas = {}
        for i in range(streams):
            prompt = [rng.randrange(1, vocab) for _ in range(prompt_tokens)]
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(prompt, params, request_id=str(i))
            assembler.expect(str(i), prompt)
            deltas[str(i)] = _Deltas(1, None)
        num_outputs = steps = 0
        while engine.has_unfinished:
            outputs = engine.step()
            start = time.perf_counter()
            frame = encode_frame("o", [to_row(o) for o in outputs], snapshot_of(engine))
            middle = time.perf_counter()
            _, payload, _ = decode_frame(frame)
            rebuilt = [assembler.assemble(delta) for delta in payload]
            end = time.perf_counter()
            for output in rebuilt:
                completion = output.outputs[0]
                step = deltas[output.request_id].next(completion, 0)
                if step is not None:
                    _sse({"id": output.request_id, "choices": [{"index": 0, "text": step[0]}]})
            spent["encode"] += middle - start
            spent["assemble"] += end - middle
            spent["sse"] += time.perf_counter() - end
            num_outputs += len(outputs)
            steps += 1
    finally:
        output_processor.OutputProcessor.outputs = build
    per_output = {part: round(1e6 * seconds / num_outputs, 2) for part, seconds in spent.items()}
    return {
        "engine_deltas": direct,
        "streams": streams,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "steps": steps,
        "outputs": num_outputs,
        "us_per_output": per_output,
        "engine_process_us_per_output": round(per_output["outputs"] + per_output["encode"], 2),
        "http_process_us_per_output": round(per_output["assemble"] + per_output["sse"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for prompt_tokens in args.prompt_tokens:
        result = run(args.model, args.streams, prompt_tokens, args.max_tokens)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        meta = {
            "date": date.today().isoformat(),
            "argv": sys.argv,
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
