"""Probe (issue 38): a batch-1 CPU decode step whose decoder layers run through one
`torch.compile`d function (inductor, CPU), against the engine's eager decode step
(`DecodeGraphs.run`, the `DecodePlanCPU` path), on the built-in SmolLM2 GGUF kept quantized.

The compiled layer takes its weights as arguments (one compiled graph serves every layer: the
int4 products stay PyTorch's kernel, an extern call in inductor's code), the RoPE row, the K/V
slot, and the context as (first slot, length) of consecutive cache slots (the length dynamic).

Reports per step: milliseconds (median of --repeats runs of --steps steps; with --cpu-time the
process CPU clock, a proxy on a busy machine with --threads 1), the compile time, and whether
each step's logits equal the eager step's bit for bit (and the K/V written).

    python benchmarks/probes/probe_cpu_compiled_step.py [--threads 2] [--cpu-time] \
        [--cpp-wrapper] > FILE.txt

Never imported by tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def int4_mm(x: torch.Tensor, weight) -> torch.Tensor:
    """`QuantizedWeight.matmul` of a cpu_int4 weight without a source group (4-bit rows)."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16),
        weight._tensors["packed"],
        weight._meta["group_size"],
        weight._tensors["scale_zero"],
    )
    return out.to(torch.float32)


@torch.library.custom_op("specdec_probe::rms_norm", mutates_args=())
def opaque_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """aten's RMSNorm kernel, opaque to inductor (which would otherwise decompose it)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@opaque_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


RMS_NORM = {"opaque": False}
HALVES_DYNAMIC = False


def rms(x, weight, eps):
    if RMS_NORM["opaque"]:
        return opaque_rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def make_layer_fn(num_heads: int, num_kv: int, head_dim: int, scale: float, eps: float, group):
    def layer(out, residual, in_w, post_w, qkv_p, qkv_sz, o_p, o_sz, gu_p, gu_sz, d_p, d_sz,
              cos, sin, half_swap, slot, kc, vc, start: int, length: int):  # fmt: skip
        summed = out + residual
        normed = rms(summed, in_w, eps)
        qkv = torch.ops.aten._weight_int4pack_mm_for_cpu(
            normed.to(torch.bfloat16), qkv_p, group, qkv_sz
        ).to(torch.float32)
        heads = qkv.view(1, num_heads + 2 * num_kv, head_dim)
        qk = heads[:, : num_heads + num_kv]
        rotated = qk * cos + qk.index_select(-1, half_swap) * sin
        key, value = rotated[:, num_heads:], heads[:, num_heads + num_kv :]
        flat_k, flat_v = kc.view(-1, num_kv, head_dim), vc.view(-1, num_kv, head_dim)
        flat_k.index_copy_(0, slot, key)
        flat_v.index_copy_(0, slot, value)
        keys = flat_k[start : start + length].transpose(0, 1)[None]
        values = flat_v[start : start + length].transpose(0, 1)[None]
        query = rotated[:, :num_heads].transpose(0, 1)[None]
        att = F.scaled_dot_product_attention(
            query, keys, values, scale=scale, enable_gqa=num_heads != num_kv
        )
        attn_out = att[0, :, 0].reshape(1, num_heads * head_dim)
        o = torch.ops.aten._weight_int4pack_mm_for_cpu(
            attn_out.to(torch.bfloat16), o_p, group, o_sz
        ).to(torch.float32)
        summed2 = o + summed
        normed2 = rms(summed2, post_w, eps)
        gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(
            normed2.to(torch.bfloat16), gu_p, group, gu_sz
        ).to(torch.float32)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        down = torch.ops.aten._weight_int4pack_mm_for_cpu(
            act.to(torch.bfloat16), d_p, group, d_sz
        ).to(torch.float32)
        return down, summed2

    return layer


def make_halves(eps, group):
    """(before attention, after attention): the layer's products and norms in two compiled
    regions; RoPE, the K/V write and attention stay the engine's eager calls (per row)."""

    def before(out, residual, in_w, qkv_p, qkv_sz):
        summed = out + residual
        normed = rms(summed, in_w, eps)
        qkv = torch.ops.aten._weight_int4pack_mm_for_cpu(
            normed.to(torch.bfloat16), qkv_p, group, qkv_sz
        ).to(torch.float32)
        return qkv, summed

    def after(attn_out, summed, o_p, o_sz, post_w, gu_p, gu_sz, d_p, d_sz):
        o = torch.ops.aten._weight_int4pack_mm_for_cpu(
            attn_out.to(torch.bfloat16), o_p, group, o_sz
        ).to(torch.float32)
        summed2 = o + summed
        normed2 = rms(summed2, post_w, eps)
        gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(
            normed2.to(torch.bfloat16), gu_p, group, gu_sz
        ).to(torch.float32)
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch.ops.aten._weight_int4pack_mm_for_cpu(
            (F.silu(gate) * up).to(torch.bfloat16), d_p, group, d_sz
        ).to(torch.float32)
        return down, summed2

    return before, after


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--cpp-wrapper", action="store_true")
    parser.add_argument(
        "--opaque-norm", action="store_true", help="RMSNorm as aten's kernel (a custom op)"
    )
    parser.add_argument(
        "--fallback-norm",
        action="store_true",
        help="RMSNorm as aten's kernel (inductor's decomposition removed: a fallback call)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    RMS_NORM["opaque"] = args.opaque_norm
    if args.fallback_norm:  # inductor calls aten's RMSNorm kernel instead of decomposing it
        from torch._inductor import decomposition

        for op in (torch.ops.aten.rms_norm.default, torch.ops.aten._fused_rms_norm.default):
            decomposition.decompositions.pop(op, None)
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.cpp_wrapper:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = True
    from specdec.engine.llm import LLM
    from specdec.models.decode_cpu import _rope_tables

    llm = LLM(speculative_config=None)
    engine = llm.engine
    model = engine.model
    graphs = engine.runner.graphs
    kv = engine.runner.kv_cache
    inner = model.model
    attn0 = inner.layers[0].self_attn
    nh, nkv, hd = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    eps = inner.layers[0].input_layernorm.eps
    group = inner.layers[0].mlp.down_proj.quantized._meta["group_size"]
    layer_fn = torch.compile(
        make_layer_fn(nh, nkv, hd, attn0.scale, eps, group), fullgraph=True, dynamic=None
    )
    weights = []

    def packed(linear) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = linear.quantized._tensors
        return tensors["packed"], tensors["scale_zero"]

    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        weights.append(
            (
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                *packed(a.qkv_proj),
                *packed(a.o_proj),
                *packed(m.gate_up_proj),
                *packed(m.down_proj),
            )
        )
    inv_freq = inner.rotary_emb.inv_freq_at(torch.zeros(1, dtype=torch.int64))
    half = hd // 2
    half_swap = torch.cat((torch.arange(half, 2 * half), torch.arange(half)))
    blocks = list(range(8))  # consecutive blocks: keys at slots 0 .. pos
    block_size = kv.block_size if hasattr(kv, "block_size") else engine.config.block_size
    zeros = torch.zeros(1, model.config.hidden_size)

    def compiled_step(token: int, pos: int) -> torch.Tensor:
        ids = torch.tensor([token])
        positions = torch.tensor([pos])
        cos, sin = _rope_tables(positions, inv_freq)
        slot = torch.tensor([pos])
        out, residual = inner.embed(ids), zeros
        for index, w in enumerate(weights):
            out, residual = layer_fn(
                out, residual, *w, cos, sin, half_swap, slot,
                kv.k_cache[index], kv.v_cache[index], 0, pos + 1,
            )  # fmt: skip
        hidden = F.rms_norm(out + residual, (out.shape[-1],), inner.norm.weight, inner.norm.eps)
        return model.compute_logits(hidden)

    before, after = (
        torch.compile(f, fullgraph=True, dynamic=HALVES_DYNAMIC) for f in make_halves(eps, group)
    )
    from specdec.models.attention import AttentionMetadata
    from specdec.models.decode_cpu import DecodePlanCPU, decode_attention_cpu, rope_write_kv_cpu

    def halves_step(token: int, pos: int) -> torch.Tensor:
        ids = torch.tensor([token])
        positions = torch.tensor([pos])
        meta = AttentionMetadata.build(
            query_lens=[1], context_lens=[pos + 1], block_tables=[blocks],
            block_size=block_size, device=torch.device("cpu"),
        )  # fmt: skip
        plan = DecodePlanCPU.from_attention(meta, positions, inv_freq, block_size)
        out, residual = inner.embed(ids), zeros
        for index, w in enumerate(weights):
            qkv, summed = before(out, residual, w[0], w[2], w[3])
            query = rope_write_kv_cpu(qkv, plan, kv.k_cache[index], kv.v_cache[index], nh, nkv)
            attn_out = decode_attention_cpu(
                query, kv.k_cache[index], kv.v_cache[index], plan, attn0.scale
            ).reshape(1, nh * hd)
            out, residual = after(attn_out, summed, w[4], w[5], w[1], *w[6:])
        hidden = F.rms_norm(out + residual, (out.shape[-1],), inner.norm.weight, inner.norm.eps)
        return model.compute_logits(hidden)

    def eager_step(token: int, pos: int) -> torch.Tensor:
        logits, _ = graphs.run([[token]], [pos], [blocks], stacked=True)
        return logits[0].clone()

    tokens = [(7 * i + 3) % 1000 + 5 for i in range(args.steps)]
    with torch.inference_mode():
        # the same prefix in both: eager writes positions 0..steps-1, compiled rewrites them
        eager_logits = [eager_step(t, p) for p, t in enumerate(tokens)]
        k_eager, v_eager = kv.k_cache[:, 0:2].clone(), kv.v_cache[:, 0:2].clone()
        start = time.perf_counter()
        compiled_step(tokens[0], 0)
        compiled_step(tokens[1], 1)
        compiled_step(tokens[2], 2)
        print(f"compile (first three steps): {time.perf_counter() - start:.1f} s", flush=True)
        compiled_logits = [compiled_step(t, p) for p, t in enumerate(tokens)]
        same = sum(torch.equal(a, b) for a, b in zip(eager_logits, compiled_logits, strict=True))
        kv_same = torch.equal(k_eager, kv.k_cache[:, 0:2]) and torch.equal(
            v_eager, kv.v_cache[:, 0:2]
        )
        for index in range(kv.k_cache.shape[0]):
            if not torch.equal(k_eager[index], kv.k_cache[index, 0:2]):
                print(f"first layer whose K differs: {index}")
                break
        diff = max(
            (a - b).abs().max().item() for a, b in zip(eager_logits, compiled_logits, strict=True)
        )
        print(f"logits equal to eager: {same}/{len(tokens)} steps (max |diff| {diff:.3g}); "
              f"K/V equal: {kv_same}")  # fmt: skip
        halves_step(tokens[0], 0)
        halves_step(tokens[1], 1)
        halves_step(tokens[2], 2)
        halves = [halves_step(t, p) for p, t in enumerate(tokens)]
        same = sum(torch.equal(a, b) for a, b in zip(eager_logits, halves, strict=True))
        print(f"halves: logits equal to eager {same}/{len(tokens)}")
        loop = "its C++ loop" if inner._native else "its Python loop"
        print(f"eager: the engine's step ({loop}; SPECDEC_CPU_NATIVE=0 for the other)")
        for name, fn in (
            ("eager", eager_step), ("compiled", compiled_step), ("halves", halves_step)
        ):  # fmt: skip
            samples = []
            for _ in range(args.repeats):
                begin = clock()
                for p, t in enumerate(tokens):
                    fn(t, p)
                samples.append((clock() - begin) / len(tokens) * 1e3)
            print(f"{name:9s} {statistics.median(samples):6.2f} ms a step "
                  f"(runs: {', '.join(f'{s:.2f}' for s in samples)})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
