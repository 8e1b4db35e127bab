"""CPU decoding speed of the built-in SmolLM2-135M-Instruct: specdec beside HF `transformers` on the
same GGUF (greedy), plain at batch 1 and 8, and speculative (n-gram, truncated draft) at batch 1.

Usage: python benchmarks/bench_cpu_engine.py --out bench-results/cpu_engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from specdec.bench import DEFAULT_PROMPTS
from specdec.drafters.default import DEFAULT_EAGLE_DIR
from specdec.engine.llm import LLM
from specdec.models import default_model_path
from specdec.sampling import SamplingParams

NEW_TOKENS = 64


def hf_batch1(prompts: list[str]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokens, seconds = 0, 0.0
    with torch.no_grad():
        warm = tokenizer(prompts[0], return_tensors="pt").input_ids
        model.generate(warm, max_new_tokens=8, do_sample=False)
        for prompt in prompts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
            start = time.perf_counter()
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - ids.shape[1]
    return {
        "name": "HF transformers generate, batch 1",
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def specdec_run(name: str, prompts: list[str], batch: int, spec: dict | None) -> dict:
    llm = LLM(speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    tokens, seconds = 0, 0.0
    outputs = []
    before = llm.get_metrics()
    for i in range(0, len(conversations), batch):
        chunk = conversations[i : i + batch]
        start = time.perf_counter()
        out = llm.chat(chunk, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(o.outputs[0].token_ids) for o in out)
        outputs.extend(o.outputs[0].token_ids for o in out)
    after = llm.get_metrics()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {
        "name": name,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench-results/cpu_engine.json")
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    prompts = list(DEFAULT_PROMPTS[: args.num_prompts])
    runs = [hf_batch1(prompts)]
    runs.append(specdec_run("specdec plain, batch 1", prompts, 1, None))
    runs.append(specdec_run("specdec plain, batch 8", prompts, 8, None))
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    runs.append(specdec_run("specdec ngram K=4, batch 1", prompts, 1, ngram))
    eagle = {"method": "eagle", "model": str(DEFAULT_EAGLE_DIR), "num_speculative_tokens": 2}
    runs.append(specdec_run("specdec shipped EAGLE head K=2, batch 1", prompts, 1, eagle))
    truncated = {"method": "draft_model", "model": "truncated:10", "num_speculative_tokens": 4}
    runs.append(specdec_run("specdec draft truncated:10 K=4, batch 1", prompts, 1, truncated))
    reference = runs[1]["outputs"]
    for run in runs[2:]:
        run["identical_to_plain_greedy"] = run.pop("outputs") == reference
    runs[1].pop("outputs")
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor()}, torch threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF dequantized to float32",
        "new_tokens_per_request": NEW_TOKENS,
        "prompts": len(prompts),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    print(f"{'run':<42} {'tokens/s':>9} {'accept len':>10}  identical")
    for run in runs:
        length = run.get("mean_acceptance_length")
        shown = f"{length:.2f}" if length else "-"
        identical = run.get("identical_to_plain_greedy", "")
        print(f"{run['name']:<42} {run['tokens_per_s']:>9.1f} {shown:>10}  {identical}")


if __name__ == "__main__":
    main()
