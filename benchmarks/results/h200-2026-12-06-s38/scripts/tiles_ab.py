"""Old (s37) decode tile rule against the new one: graphed us at rows 1, 8, 16 and bits equal."""
import json, sys
import torch
sys.path.insert(0, "benchmarks/probes")
from probe_batch_invariance import graphed_ms
from specdec.models.linear_triton import LinearTile, launch_linear, linear_tile

def old_tile(rows, cols, depth):
    block_n = 16 if cols <= 8192 else 32 if cols <= 32768 else 64
    return LinearTile(16, block_n, 256 if depth >= 512 else 128, 4, 3)

g = torch.Generator(device="cuda").manual_seed(0)
res = {}
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
          (5120, 2048), (2048, 4096), (128, 2048), (8192, 3584), (3584, 4096), (28672, 3584), (3584, 14336), (5120, 4096), (4096, 12288)]
for cols, depth in shapes:
    w = (torch.randn(cols, depth, device="cuda", generator=g) * 0.02).bfloat16()
    for rows in (1, 8, 16):
        new, old = linear_tile(rows, cols, depth), old_tile(rows, cols, depth)
        if new == old:
            continue
        x = torch.randn(rows, depth, device="cuda", generator=g).bfloat16()
        o1 = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16); o2 = torch.empty_like(o1)
        launch_linear(x, w, None, o1, old); launch_linear(x, w, None, o2, new)
        t_old = graphed_ms(lambda: launch_linear(x, w, None, o1, old)) * 1e3
        t_new = graphed_ms(lambda: launch_linear(x, w, None, o2, new)) * 1e3
        line = f"{cols}x{depth} M={rows}: old {t_old:.1f} us new {t_new:.1f} us ({t_old / t_new:.2f}x) same={bool(torch.equal(o1, o2))}"
        print(line, flush=True)
        res[f"{cols}x{depth} M={rows}"] = [t_old, t_new, bool(torch.equal(o1, o2))]
json.dump(res, open(sys.argv[1], "w"), indent=1)
