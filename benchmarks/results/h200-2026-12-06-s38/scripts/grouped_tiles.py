"""Grouped expert GEMM launch variants at the Qwen3-30B-A3B shape: graphed us per launch and bits
against the current launch (BLOCK_N, warps, stages; BLOCK_M and BLOCK_K fixed: the bits contract)."""
import json, sys, itertools
import torch, triton
sys.path.insert(0, "benchmarks/probes")
from probe_batch_invariance import graphed_ms
from specdec.models import moe_triton
from specdec.models.moe import GROUPED_BLOCK_K, route, step_tiles
from specdec.models.moe_triton import _grouped_linear_kernel

def launch(x, w, tiles, source, dest, rows, block_n, warps, stages, out):
    _, n, k = w.shape
    grid = (triton.cdiv(n, block_n), tiles.tile_start.shape[0])
    _grouped_linear_kernel[grid](x, w, out, source, dest, tiles.tile_expert, tiles.tile_start, tiles.tile_end,
        x.stride(0), out.stride(0), NUM_COLS=n, DEPTH=k, BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        BLOCK_K=GROUPED_BLOCK_K, IEEE=False, EVEN_K=k % GROUPED_BLOCK_K == 0, WIDEN=False,
        num_warps=warps, num_stages=stages)
    return out

g = torch.Generator(device="cuda").manual_seed(0)
E, D, F, K = 128, 2048, 768, 8
gate_up = (torch.randn(E, 2 * F, D, device="cuda", generator=g) * 0.02).bfloat16()
down = (torch.randn(E, D, F, device="cuda", generator=g) * 0.02).bfloat16()
res = {}
for T in (1, 8, 64):
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    weights, experts = route(torch.randn(T, E, device="cuda", generator=g), K, True)
    tiles = step_tiles(experts, E)
    P = T * K
    for name, xin, w, src, dst in (("gate_up", x, gate_up, tiles.token, tiles.position),
                                   ("down", torch.randn(P, F, device="cuda", generator=g).bfloat16(), down, tiles.position, tiles.pair)):
        out0 = torch.empty(P, w.shape[1], device="cuda", dtype=torch.bfloat16)
        launch(xin, w, tiles, src, dst, P, moe_triton.GROUPED_BLOCK_N, 4, 3, out0)
        base = graphed_ms(lambda: launch(xin, w, tiles, src, dst, P, moe_triton.GROUPED_BLOCK_N, 4, 3, out0)) * 1e3
        cands = {}
        for bn, warps, st in itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4, 5)):
            out = torch.empty_like(out0)
            try:
                launch(xin, w, tiles, src, dst, P, bn, warps, st, out)
                same = bool(torch.equal(out, out0))
                us = graphed_ms(lambda: launch(xin, w, tiles, src, dst, P, bn, warps, st, out)) * 1e3
            except Exception:
                same, us = None, float("inf")
            cands[str((bn, warps, st))] = (round(us, 2), same)
        best = sorted(cands.items(), key=lambda kv: kv[1][0])[:5]
        active = min(P, E) * w.shape[1] * w.shape[2] * 2 / 1e9  # at most the routed experts' bytes
        print(f"T={T} {name}: current {base:.1f} us, best {best}, all same={all(v[1] for v in cands.values() if v[1] is not None)}", flush=True)
        res[f"T={T} {name}"] = {"current_us": base, "top5": best, "all_same": all(v[1] for v in cands.values() if v[1] is not None)}
json.dump(res, open(sys.argv[1], "w"), indent=1)
