"""Decode tiles for the Qwen3-30B-A3B shape's attention projections and LM head: graphed time
of each candidate tile at rows 1 and 8, and whether its output equals the current tile's bits."""
import json, sys, itertools
import torch
import torch.nn.functional as F
sys.path.insert(0, "benchmarks/probes")
from probe_batch_invariance import graphed_ms
from specdec.models.linear_triton import LinearTile, launch_linear, linear_tile

out_path = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
res = {}
for cols, depth in [(5120, 2048), (2048, 4096), (151936, 2048), (4096, 4096), (6144, 4096)]:
    w = (torch.randn(cols, depth, device="cuda", generator=g) * 0.02).bfloat16()
    for rows in (1, 8):
        x = torch.randn(rows, depth, device="cuda", generator=g).bfloat16()
        out = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
        cur = linear_tile(rows, cols, depth)
        launch_linear(x, w, None, out, cur); ref = out.clone()
        cur_us = graphed_ms(lambda: launch_linear(x, w, None, out, cur)) * 1e3
        cub = graphed_ms(lambda: F.linear(x, w)) * 1e3
        cands = {}
        for n, k, warps, st in itertools.product((16, 32), (256, 512), (4, 8), (3, 4, 6)):
            if cols > 8192 and n == 16 and k == 512:
                continue
            t = LinearTile(16, n, k, warps, st)
            try:
                o2 = torch.empty_like(out)
                launch_linear(x, w, None, o2, t)
                same = bool(torch.equal(o2, ref))
                us = graphed_ms(lambda t=t, o2=o2: launch_linear(x, w, None, o2, t)) * 1e3
            except Exception as e:
                same, us = None, float("inf")
            cands[str((16, n, k, warps, st))] = (round(us, 2), same)
        best = sorted(cands.items(), key=lambda kv: kv[1][0])[:6]
        gb = cols * depth * 2 / 1e9
        line = (f"{cols}x{depth} M={rows}: cuBLAS {cub:.1f} us, current {cur} {cur_us:.1f} us "
                f"({gb / cur_us * 1e6:.0f} GB/s), best {best[0][0]} {best[0][1][0]} us "
                f"({gb / best[0][1][0] * 1e6:.0f} GB/s) same={best[0][1][1]}")
        print(line, flush=True)
        res[f"{cols}x{depth} M={rows}"] = {"cublas_us": cub, "current": str(cur), "current_us": cur_us, "top6": best,
                                           "all_same": all(v[1] for v in cands.values() if v[1] is not None)}
json.dump(res, open(out_path, "w"), indent=1)
