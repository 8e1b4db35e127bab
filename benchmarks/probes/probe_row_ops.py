"""Which operation of a step first gives a row other bits than the row alone: the model's
forward with every fused kernel, product and norm recorded, one sequence's rows compared between
the sequence alone and the sequence beside others.

Cases, for each of the replay fixtures' six prompts (4-70 tokens) on the model given (`--model`,
loaded through an engine so that its start-up cuBLAS verdicts hold) and on random weights of the
same shape:
- `prefill`: the prompt alone against all six in one prefill step (the flash path);
- `chunked`: the prompt in two chunks against the whole prompt;
- `decode`: `--steps` greedy decode steps of each sequence alone (`DecodeMetadata`, B = 1)
  against all six in one decode step, against the six padded to a bucket of 8 (inert rows), and
  against a step that also holds another sequence's prefill chunk (the flash path);
and, for each case, the first recorded operation whose rows differ (its name, the context length,
the largest difference).

`PYTHONPATH=src:tests:benchmarks python3 benchmarks/probes/probe_row_ops.py --out FILE.json
[--model GGUF] [--steps 24] [--smoke]`
"""

from __future__ import annotations

import argparse
import json
import time

import torch

RECORDS: list[tuple[str, torch.Tensor]] = []
RECORDING = [False]


def log(*args) -> None:
    print(*args, flush=True)


def record(name: str, out):
    if RECORDING[0]:
        tensors = out if isinstance(out, tuple) else (out,)
        for index, tensor in enumerate(tensors):
            if isinstance(tensor, torch.Tensor):
                RECORDS.append((f"{name}[{index}]", tensor.detach().clone()))
    return out


def install_recorders() -> None:
    """Wraps the fused kernels, products, norms and the LM head the forward calls."""
    from specdec.models import decoder_layers, layers, llama

    for name in (
        "rope_write_kv",
        "paged_attention",
        "paged_decode_attention",
        "silu_mul",
        "add_rms_norm",
        "rope_write_kv_cpu",
        "decode_attention_cpu",
    ):
        fn = getattr(decoder_layers, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            return record(_name, _fn(*args, **kwargs))

        setattr(decoder_layers, name, wrapped)
    decode = layers.Linear.decode

    def linear_decode(self, x, _decode=decode):
        shape = "x".join(map(str, self.weight.shape)) if self.weight is not None else "q"
        return record(f"linear {shape}", _decode(self, x))

    layers.Linear.decode = linear_decode
    logits = llama.LlamaForCausalLM.compute_logits

    def compute_logits(self, hidden, out=None, _logits=logits):
        return record("lm_head", _logits(self, hidden, out))

    llama.LlamaForCausalLM.compute_logits = compute_logits
    embed = llama.LlamaModel.embed

    def embed_rec(self, input_ids, _embed=embed):
        return record("embed", _embed(self, input_ids))

    llama.LlamaModel.embed = embed_rec


class Runner:
    """One model, one cache; each sequence owns disjoint blocks."""

    def __init__(self, model, prompts: list[list[int]], block_size: int = 16) -> None:
        self.model, self.block_size = model, block_size
        self.device = model.device
        per_seq = 8  # 128 tokens
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts) + 1)]
        self.cache = model.allocate_kv_cache(per_seq * (len(prompts) + 1), block_size)
        self.prompts = prompts

    def step(self, seqs: list[tuple[int, list[int], int]]):
        """One flash-path step: (sequence, its new tokens, context length after the step) each.
        Returns (the records, the row offset of each entry)."""
        from specdec.models.attention import AttentionMetadata

        q_lens = [len(tokens) for _, tokens, _ in seqs]
        ctx = [c for _, _, c in seqs]
        attn = AttentionMetadata.build(
            q_lens, ctx, [self.tables[s] for s, _, _ in seqs], self.block_size, self.device
        )
        ids = torch.tensor([t for _, tokens, _ in seqs for t in tokens], device=self.device)
        pos = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx, strict=True)])
        return self._run(ids, pos.to(self.device), attn), _offsets(q_lens)

    def decode(self, seqs: list[tuple[int, int, int]], bucket: int | None = None):
        """One decode step (`DecodeMetadata`, Q = 1): (sequence, token, context after) each,
        padded with inert rows to `bucket`."""
        from specdec.models.attention import DecodeMetadata

        rows = list(seqs) + [None] * ((bucket or len(seqs)) - len(seqs))
        width = len(self.tables[0])
        tables = [self.tables[r[0]] if r else [0] * width for r in rows]
        ctx = [r[2] if r else 0 for r in rows]
        slots = [
            self.tables[r[0]][(r[2] - 1) // self.block_size] * self.block_size
            + (r[2] - 1) % self.block_size
            if r
            else -1
            for r in rows
        ]
        meta = DecodeMetadata(
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=self.device),
            query_lens=torch.tensor(
                [1 if r else 0 for r in rows], dtype=torch.int32, device=self.device
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            query_per_seq=1,
        )
        ids = torch.tensor([r[1] if r else 0 for r in rows], device=self.device)
        pos = torch.tensor([r[2] - 1 if r else 0 for r in rows], device=self.device)
        return self._run(ids, pos, meta), list(range(len(rows)))

    @torch.inference_mode()
    def _run(self, ids, pos, attn):
        RECORDS.clear()
        RECORDING[0] = True
        try:
            hidden = self.model(ids, pos, attn, self.cache)
            self.model.compute_logits(hidden)
        finally:
            RECORDING[0] = False
        torch.cuda.synchronize() if self.device.type == "cuda" else None
        return list(RECORDS)


def _offsets(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for length in lengths:
        out.append(total)
        total += length
    return out


def _kind(name: str) -> str:
    """An op's name with the attention kernels as one (a decode row may take either)."""
    return name.replace("paged_decode_attention", "attention").replace(
        "paged_attention", "attention"
    )


def first_difference(ref, ref_rows, got, got_rows) -> dict | None:
    """The first recorded op whose rows `ref_rows` of `ref` differ from rows `got_rows` of
    `got`, or None."""
    if len(ref) != len(got):
        return {"op": "record count", "ref": len(ref), "got": len(got)}
    for index, ((name, a), (name_b, b)) in enumerate(zip(ref, got, strict=True)):
        a, b = a[ref_rows], b[got_rows]
        if _kind(name) != _kind(name_b) or a.shape != b.shape:
            return {"op": index, "name": name, "other": name_b, "shapes": [a.shape, b.shape]}
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs()
            rows = diff.reshape(diff.shape[0], -1).amax(1)
            return {
                "op": index,
                "name": name,
                "max_abs": float(diff.max()),
                "rows_differing": int((rows > 0).sum()),
                "of_rows": int(rows.numel()),
            }
    return None


def probe(model, prompts: list[list[int]], steps: int) -> dict:
    runner = Runner(model, prompts)
    n = len(prompts)
    result: dict = {"prefill": {}, "chunked": {}, "decode": {}}
    # prefill alone / batched
    alone = [runner.step([(i, prompts[i], len(prompts[i]))]) for i in range(n)]
    batched, offsets = runner.step([(i, prompts[i], len(prompts[i])) for i in range(n)])
    result["ops recorded per step"] = sorted({name for name, _ in batched})
    for i in range(n):
        rows = list(range(len(prompts[i])))
        result["prefill"][i] = first_difference(
            alone[i][0], rows, batched, [offsets[i] + r for r in rows]
        )
    # chunked against whole (rows after the cut)
    for i in range(n):
        length = len(prompts[i])
        if length < 10:
            continue
        cut = length // 2 + 3
        whole, _ = runner.step([(i, prompts[i], length)])
        runner.step([(i, prompts[i][:cut], cut)])
        second, _ = runner.step([(i, prompts[i][cut:], length)])
        result["chunked"][i] = first_difference(
            whole, list(range(cut, length)), second, list(range(length - cut))
        )
    # every prompt prefilled alone again (the cache as a request alone would have it)
    for i in range(n):
        runner.step([(i, prompts[i], len(prompts[i]))])
    # greedy decode: the alone run sets the tokens fed to every variant
    tokens = [int(alone[i][0][-1][1][-1].argmax()) for i in range(n)]
    ctx = [len(p) + 1 for p in prompts]
    extra = n  # the sequence whose prefill chunk shares the mixed step
    filler = prompts[-1][:24]
    for _step in range(steps):
        solo = [runner.decode([(i, tokens[i], ctx[i])]) for i in range(n)]
        together, _ = runner.decode([(i, tokens[i], ctx[i]) for i in range(n)])
        bucket, _ = runner.decode([(i, tokens[i], ctx[i]) for i in range(n)], bucket=8)
        mixed, mixed_off = runner.step(
            [(i, [tokens[i]], ctx[i]) for i in range(n)] + [(extra, filler, len(filler))]
        )
        for i in range(n):
            for name, recs, row in (
                ("batch", together, i),
                ("bucket 8", bucket, i),
                ("mixed with a prefill chunk", mixed, mixed_off[i]),
            ):
                diff = first_difference(solo[i][0], [0], recs, [row])
                if diff is not None:
                    diff["context"] = ctx[i]
                    result["decode"].setdefault(f"{i} {name}", []).append(diff)
        # The mixed step wrote each new token's K/V last: write it alone again, so that the
        # next step reads what a request alone would have cached.
        for i in range(n):
            runner.decode([(i, tokens[i], ctx[i])])
        tokens = [int(solo[i][0][-1][1][0].argmax()) for i in range(n)]
        ctx = [c + 1 for c in ctx]
    result["decode"] = {k: [*v[:3], f"{len(v)} steps differ"] for k, v in result["decode"].items()}
    return result


def weights_info(model) -> list:
    out = set()
    for weight in model.float_product_weights():
        out.add(
            (
                tuple(weight.shape),
                weight.is_contiguous(),
                tuple(weight.stride()),
                weight.data_ptr() % 256,
                str(weight.dtype),
            )
        )
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args()
    from replay_fixtures import replay_requests
    from specdec.models import linear as linear_module

    install_recorders()
    prompts = [r.prompt for r in replay_requests()]
    results: dict = {}
    models = {}
    if args.smoke:
        import tempfile
        from pathlib import Path

        from models_fixtures import make_hf_model  # noqa: F401
        from replay_fixtures import float_model_dir
        from specdec.models.loader import load_model

        root = Path(tempfile.mkdtemp())
        models["tiny"] = lambda: load_model(float_model_dir(root / "m"), device="cpu").model
    else:
        from bench_gpu_engine import build_ours

        def random_model():
            from specdec.models.linear import check_cublas_rows

            model = build_ours("smollm2-135m", "cuda")
            model.fuse_projections()
            check_cublas_rows(model.float_product_weights(), 256)
            return model

        models["random"] = random_model
        if args.model:

            def engine_model():
                from specdec.engine.config import EngineConfig, SpeculativeConfig
                from specdec.engine.llm_engine import LLMEngine

                config = EngineConfig(
                    model=args.model, device="cuda", dtype="bfloat16", max_model_len=128
                )
                return LLMEngine(config, SpeculativeConfig.from_dict(None)).model

            models["builtin"] = engine_model
    for name, make in models.items():
        t0 = time.perf_counter()
        linear_module._CUBLAS_ROWS.clear()
        model = make()
        results[name] = {
            "weights": weights_info(model),
            "cublas rows": {str(k[:2]): v for k, v in linear_module._CUBLAS_ROWS.items()},
            "fused": model.model.layers[0].self_attn.qkv_proj is not None,
        }
        results[name].update(probe(model, prompts, args.steps))
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        log(
            name,
            json.dumps({k: v for k, v in results[name].items() if k != "weights"}, default=str)[
                :6000
            ],
        )
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
