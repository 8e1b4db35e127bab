"""specdec beside llama.cpp on the CPU, on the built-in SmolLM2-135M-Instruct Q4_1 GGUF: batch-1
greedy decoding (specdec plain and with its default speculation, both on the default load,
which keeps the GGUF's weights quantized; specdec plain with the GGUF dequantized to float32,
`quantization=None`; llama.cpp plain), prefill of a ~1,000-token prompt, a batch of 32 prompts, and
each engine's peak resident memory, in one interleaved run.

    python benchmarks/bench_cpu_quant.py --out bench-results/cpu_quant.json \
        --llama-python /tmp/llamacpp-venv/bin/python [--threads 2] [--rounds 3] \
        [--new-tokens 64] \
        [--engines llama.cpp,specdec-plain,specdec-spec,specdec-float,specdec-plain-python] \
        [--llama-kwargs '{"use_extra_bufts": true}']

llama.cpp runs through llama-cpp-python, which is not a dependency of this project: install it
in a virtual environment of its own (`python -m venv /tmp/llamacpp-venv &&
/tmp/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36`) and pass that interpreter as
--llama-python. Every engine runs in a worker process of its own (so each peak RSS is its own)
and the driver alternates them request by request, round after round, so that drift in the
machine's load hits all alike. All engines get the same prompt token ids (the chat template
rendered by specdec's tokenizer) and the same thread count, decode greedily and ignore EOS.
llama.cpp's extra buffer types (its AMX / repacked Q4 and Q8 weights) are off by default: with
them this build crashed on its first decode on an AMX machine; `--llama-kwargs
'{"use_extra_bufts": true}'` turns them on where they work.

Reported per engine: batch-1 tokens/s (generation wall time over generated tokens, the prompt's
prefill included) and decode-only TPOT (generation minus a 1-token run of the same prompt),
prefill tokens/s, 32-prompt throughput (specdec batches the prompts; llama-cpp-python runs them
one after another, as it has no batched API), peak RSS after the batch-1 part and at the end,
and whether greedy outputs match specdec plain's. Writes JSON with machine, date and command.
Never imported by tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 1..10.",
    "List the days of the week, one per line, each followed by its number in the week.",
    "Write a JSON object describing three books with title, author and year fields.",
    "Explain what a hash map is, then give an example in Python.",
    "Write the multiplication table of 7 from 7 x 1 to 7 x 12.",
    "Write a bash script that prints the numbers from 1 to 20 and says whether each is even.",
    "Repeat the sentence 'The quick brown fox jumps over the lazy dog.' five times.",
    "Write a SQL query that selects the ten most recent orders with their customer names.",
)
ENGINES = ("llama.cpp", "specdec-plain", "specdec-spec", "specdec-float", "specdec-plain-python")
# specdec-plain-python: plain, with the CPU decode step's Python loop and PyTorch's kernels
# instead of its C++ loop and q8_linear (SPECDEC_CPU_NATIVE=0): the layers' bits, the head in
# bfloat16 through the int4 kernel, and the speed before them.
PREFILL_TOKENS = 1018
BATCH = 32


# --------------------------------------------------------------------------- workers
def _rss() -> dict:
    with open("/proc/self/statm") as file:
        current = int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rss_mb": current, "peak_rss_mb": peak}


class SpecdecWorker:
    def __init__(self, kind: str, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        from specdec.engine.llm import LLM

        start = time.perf_counter()
        if kind in ("specdec-plain", "specdec-plain-python"):
            self.llm = LLM(speculative_config=None)
        elif kind == "specdec-spec":
            self.llm = LLM()  # the default speculation of the built-in model
        else:
            self.llm = LLM(quantization=None, speculative_config=None)
        self.load_s = time.perf_counter() - start
        self.torch_version = torch.__version__

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        tokenizer = self.llm.engine.tokenizer
        return [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True
                )
            )
            for p in prompts
        ]

    def generate(self, ids: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        from specdec.sampling import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(ids, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [list(o.outputs[0].token_ids) for o in outputs]

    def info(self) -> dict:
        return {"load_s": self.load_s, "torch": self.torch_version, "model": "built-in"}


class LlamaCppWorker:
    def __init__(self, threads: int, model: str, kwargs: dict) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as low

        # llama.cpp's extra buffer types (the AMX/CPU repacking of Q4/Q8 weights) crash this
        # build on the first decode (AMX_INT8 machine, 0.3.36); `Llama` has no argument for
        # them, so the default model parameters are patched (--llama-extra-bufts: keep them).
        extra_bufts = kwargs.pop("use_extra_bufts", False)
        default_params = low.llama_model_default_params

        def model_params():
            params = default_params()
            params.use_extra_bufts = extra_bufts
            return params

        low.llama_model_default_params = model_params
        self.extra_bufts = extra_bufts
        start = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=model,
            n_ctx=4096,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **kwargs,
        )
        self.load_s = time.perf_counter() - start
        self.version = llama_cpp.__version__

    def generate(self, ids: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        outputs, seconds = [], 0.0
        for prompt in ids:
            self.llm.reset()  # no prefix reuse between requests
            start = time.perf_counter()
            tokens = []
            for token in self.llm.generate(
                prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True
            ):
                tokens.append(int(token))
                if len(tokens) == max_tokens:
                    break
            seconds += time.perf_counter() - start
            outputs.append(tokens)
        return seconds, outputs

    def info(self) -> dict:
        return {
            "load_s": self.load_s,
            "llama_cpp_python": self.version,
            "use_extra_bufts": self.extra_bufts,
        }


def worker_main(kind: str, threads: int, model: str | None, kwargs: dict) -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not reach the protocol stream
    if kind == "llama.cpp":
        assert model is not None
        worker = LlamaCppWorker(threads, model, kwargs)
    else:
        worker = SpecdecWorker(kind, threads)
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            break
        if op == "tokenize":
            reply = {"ids": worker.tokenize(request["prompts"])}
        elif op == "generate":
            seconds, tokens = worker.generate(request["ids"], request["max_tokens"])
            reply = {"seconds": seconds, "tokens": tokens}
        elif op == "rss":
            reply = _rss()
        else:
            reply = worker.info()
        out.write(json.dumps(reply) + "\n")
        out.flush()


# --------------------------------------------------------------------------- driver
class Worker:
    def __init__(self, kind: str, args: argparse.Namespace, model: str) -> None:
        python = args.llama_python if kind == "llama.cpp" else sys.executable
        command = [
            python,
            str(Path(__file__).resolve()),
            "--worker",
            kind,
            "--threads",
            str(args.threads),
            "--model",
            model,
            "--llama-kwargs",
            args.llama_kwargs,
        ]
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(args.threads)
        if kind == "specdec-plain-python":
            env["SPECDEC_CPU_NATIVE"] = "0"
        self.kind = kind
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def ask(self, **request) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.kind} died (see its stderr above)")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, BrokenPipeError, ValueError):
            self.ask(op="quit")
        self.process.wait(timeout=60)


def long_prompt(tokenizer_worker: Worker, target: int) -> list[int]:
    """A chat prompt of about `target` tokens: the prompts repeated inside one user message."""
    text = ""
    while True:
        text += " ".join(PROMPTS) + " "
        ids = tokenizer_worker.ask(op="tokenize", prompts=[text])["ids"][0]
        if len(ids) >= target:
            return ids[:target]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results/cpu_quant.json")
    parser.add_argument("--llama-python", default="/tmp/llamacpp-venv/bin/python")
    parser.add_argument("--llama-kwargs", default="{}", help="extra llama_cpp.Llama arguments")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--engines", default=",".join(ENGINES[:3]))
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.threads, args.model, json.loads(args.llama_kwargs))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from specdec.models import default_model_path

    model = str(default_model_path())
    kinds = args.engines.split(",")
    workers = {kind: Worker(kind, args, model) for kind in kinds}
    try:
        results = run(workers, args)
    finally:
        for worker in workers.values():
            worker.close()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()} {_cpu_name()}, {os.cpu_count()} CPUs",
        "threads": args.threads,
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "model": model,
        "engines": {kind: results[kind].pop("info") for kind in kinds},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print_table(results, kinds)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(workers: dict[str, Worker], args: argparse.Namespace) -> dict:
    tokenizer = (
        next(w for k, w in workers.items() if k != "llama.cpp")
        if any(k != "llama.cpp" for k in workers)
        else None
    )
    if tokenizer is None:
        raise SystemExit("at least one specdec engine is needed (it renders the prompts)")
    prompts = tokenizer.ask(op="tokenize", prompts=list(PROMPTS))["ids"]
    prefill = long_prompt(tokenizer, PREFILL_TOKENS)
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    results = {kind: {"info": w.ask(op="info")} for kind, w in workers.items()}
    for worker in workers.values():  # warm-up: first-call set-up out of the timings
        worker.ask(op="generate", ids=prompts[:1], max_tokens=8)
    decode = {kind: {"gen_s": [], "first_s": [], "tokens": 0} for kind in workers}
    outputs: dict[str, list] = {kind: [] for kind in workers}
    for round_index in range(args.rounds):
        for prompt in prompts:
            for kind, worker in workers.items():
                full = worker.ask(op="generate", ids=[prompt], max_tokens=args.new_tokens)
                first = worker.ask(op="generate", ids=[prompt], max_tokens=1)
                decode[kind]["gen_s"].append(full["seconds"])
                decode[kind]["first_s"].append(first["seconds"])
                decode[kind]["tokens"] += len(full["tokens"][0])
                if round_index == 0:
                    outputs[kind].append(full["tokens"][0])
    for kind, worker in workers.items():
        row = decode[kind]
        gen, first = sum(row["gen_s"]), sum(row["first_s"])
        results[kind]["batch1"] = {
            "tokens_per_s": row["tokens"] / gen,
            "tpot_ms": (gen - first) / (row["tokens"] - len(row["gen_s"])) * 1e3,
            "requests": len(row["gen_s"]),
        }
        results[kind]["rss_after_batch1"] = worker.ask(op="rss")
    prefill_s: dict[str, list[float]] = {kind: [] for kind in workers}
    batch_s: dict[str, list[float]] = {kind: [] for kind in workers}
    batch_tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for kind, worker in workers.items():
            prefill_s[kind].append(
                worker.ask(op="generate", ids=[prefill], max_tokens=1)["seconds"]
            )
        for kind, worker in workers.items():
            reply = worker.ask(op="generate", ids=batch, max_tokens=args.new_tokens)
            batch_s[kind].append(reply["seconds"])
            batch_tokens[kind] = sum(len(t) for t in reply["tokens"])
    reference = outputs.get("specdec-plain")
    for kind, worker in workers.items():
        results[kind]["prefill"] = {
            "prompt_tokens": len(prefill),
            "tokens_per_s": len(prefill) / statistics.median(prefill_s[kind]),
        }
        results[kind][f"batch{args.batch}"] = {
            "tokens_per_s": batch_tokens[kind] / statistics.median(batch_s[kind])
        }
        results[kind]["rss_end"] = worker.ask(op="rss")
        if reference is not None:
            same = sum(a == b for a, b in zip(outputs[kind], reference, strict=True))
            results[kind]["greedy_identical_to_specdec_plain"] = f"{same}/{len(reference)}"
    return results


def print_table(results: dict, kinds: list[str]) -> None:
    base = results.get("llama.cpp", {}).get("batch1", {}).get("tokens_per_s")
    print(
        f"{'engine':<15} {'b1 tok/s':>9} {'vs llama':>8} {'TPOT ms':>8} {'prefill':>8} "
        f"{'batch tok/s':>11} {'peak MB b1':>10} {'same greedy':>11}"
    )
    for kind in kinds:
        row = results[kind]
        batch_key = next(k for k in row if k.startswith("batch") and k != "batch1")
        ratio = row["batch1"]["tokens_per_s"] / base if base else float("nan")
        print(
            f"{kind:<15} {row['batch1']['tokens_per_s']:>9.1f} {ratio:>8.2f} "
            f"{row['batch1']['tpot_ms']:>8.2f} {row['prefill']['tokens_per_s']:>8.0f} "
            f"{row[batch_key]['tokens_per_s']:>11.1f} "
            f"{row['rss_after_batch1']['peak_rss_mb']:>10.0f} "
            f"{row.get('greedy_identical_to_specdec_plain', '-'):>11}"
        )


if __name__ == "__main__":
    main()
