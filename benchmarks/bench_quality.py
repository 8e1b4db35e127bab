"""Quality of each weight format against the float model: per-token KL divergence and top-1
agreement on 32 prompts (the built-in SmolLM2-135M-Instruct GGUF by default), and how many greedy
continuations each format reproduces exactly.

    python benchmarks/bench_quality.py --out bench-results/quality.json \
        [--model PATH] [--formats gguf,int8,int4,fp8] [--new-tokens 32] [--threads 2]

The float reference is the checkpoint dequantized to float32 (`quantization=None`). Its greedy
continuation of each chat-formatted prompt is computed once; every format then scores the same
token sequences teacher-forced (one batched prefill; on the CPU its products take the same
weight-only kernels as decoding), giving at each continuation position
KL(float || format) and whether both put the same token first. The engine then decodes each
prompt greedily in each format (the decode path's kernels) and counts continuations identical to
the float one. Writes JSON with the machine, date and command. Never imported by tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def quality_prompts(count: int = 32) -> list[str]:
    """DEFAULT_PROMPTS, then the held-out drafter prompts, then the training prompts, in order."""
    from specdec.bench import DEFAULT_PROMPTS

    prompts = list(DEFAULT_PROMPTS)
    for name in ("heldout_prompts.jsonl", "train_prompts.jsonl"):
        for line in (HERE / "data" / name).read_text().splitlines():
            prompts.append(json.loads(line)["prompt"])
    return prompts[:count]


def greedy_continuations(llm, conversations, new_tokens: int) -> list[list[int]]:
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--formats", default="gguf,int8,int4,fp8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.engine.llm import LLM
    from specdec.models import default_model_path, load_model, prompt_logits

    model_path = args.model or str(default_model_path())
    prompts = quality_prompts(args.num_prompts)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    reference = LLM(model_path, quantization=None, speculative_config=None)
    tokenizer = reference.engine.tokenizer
    prompt_ids = [
        tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True))
        for c in conversations
    ]
    continuations = greedy_continuations(reference, conversations, args.new_tokens)
    sequences = [p + c for p, c in zip(prompt_ids, continuations, strict=True)]
    float_model = reference.engine.model
    float_logits = prompt_logits(float_model, sequences)
    del reference
    rows = {}
    for fmt in args.formats.split(","):
        start = time.perf_counter()
        model = load_model(model_path, quantization=fmt).model
        load_s = time.perf_counter() - start
        logits = prompt_logits(model, sequences)
        kls, agree = [], []
        for ref, got, prompt in zip(float_logits, logits, prompt_ids, strict=True):
            # Rows predicting the continuation's tokens: from the last prompt token on.
            ref_rows, got_rows = ref[len(prompt) - 1 : -1], got[len(prompt) - 1 : -1]
            ref_logp, got_logp = ref_rows.log_softmax(-1), got_rows.log_softmax(-1)
            kls.append((ref_logp.exp() * (ref_logp - got_logp)).sum(-1))
            agree.append(ref_rows.argmax(-1) == got_rows.argmax(-1))
        kl = torch.cat(kls)
        top1 = torch.cat(agree).float()
        llm = LLM(model_path, quantization=fmt, speculative_config=None)
        decoded = greedy_continuations(llm, conversations, args.new_tokens)
        del llm
        identical = sum(a == b for a, b in zip(decoded, continuations, strict=True))
        rows[fmt] = {
            "kl_mean": float(kl.mean()),
            "kl_p99": float(kl.quantile(0.99)),
            "kl_max": float(kl.max()),
            "top1_agreement": float(top1.mean()),
            "tokens_scored": int(kl.numel()),
            "greedy_continuations_identical": f"{identical}/{len(prompts)}",
            "load_s": load_s,
        }
        print(f"{fmt:>6}: {rows[fmt]}", flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": model_path,
        "reference": "the same checkpoint dequantized to float32 (quantization=None)",
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "scoring": "teacher-forced on the float model's greedy continuation (prefill path)",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "formats": rows}, indent=2))
    print(f"{'format':>6} {'KL mean':>9} {'KL p99':>9} {'top-1':>7}  greedy identical")
    for fmt, row in rows.items():
        print(
            f"{fmt:>6} {row['kl_mean']:>9.5f} {row['kl_p99']:>9.5f} "
            f"{row['top1_agreement']:>7.4f}  {row['greedy_continuations_identical']}"
        )


if __name__ == "__main__":
    main()
