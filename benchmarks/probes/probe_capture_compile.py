"""Whether a Triton kernel met for the first time inside a CUDA graph capture (its variant
compiled and its module loaded mid-capture) breaks the capture, in each capture error mode.

    python benchmarks/probes/probe_capture_compile.py --out FILE.json

Each mode runs in a fresh process (a failed capture can leave the context unusable): a tiny
Triton kernel is launched once eagerly with an int argument of one value class, then captured
with a value of another class (1, a multiple of 16, other: a new specialisation), and the graph
is replayed and checked. -> FILE.json: per mode, captured or the error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, torch, triton, triton.language as tl

@triton.jit
def _add_kernel(x_ptr, n, value):
    i = tl.arange(0, 16)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + value, mask=i < n)

x = torch.zeros(16, device="cuda")
_add_kernel[(1,)](x, 5, 1.0)  # n = 5: the "other" class
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
mode = sys.argv[1]
with torch.cuda.graph(graph, capture_error_mode=mode):
    _add_kernel[(1,)](x, 16, 1.0)  # n = 16: a multiple of 16, a new variant
graph.replay()
torch.cuda.synchronize()
print("ok", x[:16].tolist())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {}
    # Triton reads a kernel's source from its file: the child runs from one.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as child:
        child.write(CHILD)
    for mode in ("global", "thread_local", "relaxed"):
        run = subprocess.run(
            [sys.executable, child.name, mode], capture_output=True, text=True, timeout=300
        )
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        result[mode] = {"returncode": run.returncode, "tail": tail}
        print(mode, run.returncode, tail[-1] if tail else "")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
