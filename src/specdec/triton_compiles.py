"""Counts the Triton kernel variants this process compiles (or loads from Triton's disk cache),
so that an engine can report those that came after its warm-up.

Each one is a stall of the step that needs it: a variant costs 0.3-0.7 s to compile on the
H200 (`triton_specialization`), a disk-cache load tens of milliseconds. A warmed-up server
should compile none under traffic; `/metrics` reports the count (specdec:triton_compiles_after_
warm_up, by kernel) beside the CUDA graphs captured after the warm-up.

Design: Triton (3.5+) calls one process-wide hook, `knobs.runtime.jit_post_compile_hook`, once
per new variant of any `triton.jit` kernel. `install` chains a counter in front of whatever hook
was set (it calls that one on, with the same arguments), once per process. The counter is
process-wide, not per engine: tests and servers hold one engine at a time on a GPU. Where Triton
is missing (the CPU machines) or has no such hook, nothing is counted and `available()` says so.
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_by_kernel: Counter[str] = Counter()
_installed: bool | None = None  # None: not tried yet; False: no hook in this Triton


def install() -> bool:
    """Chains the counter into Triton's post-compile hook (idempotent). Returns whether the
    counter is in place."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        try:
            from triton import knobs

            runtime = knobs.runtime
            previous = runtime.jit_post_compile_hook
        except Exception:  # no Triton, or one without the hook
            _installed = False
            return False

        def counted(*args, **kwargs):
            info = kwargs.get("fn")
            name = getattr(info, "name", None) or "unknown"
            with _lock:
                _by_kernel[name] += 1
            if previous is not None:
                return previous(*args, **kwargs)
            return None

        runtime.jit_post_compile_hook = counted
        _installed = True
        return True


def available() -> bool:
    """Whether compiles are being counted (`install` ran and found the hook)."""
    return bool(_installed)


def total() -> int:
    """Variants compiled (or loaded) since `install`, every kernel together."""
    with _lock:
        return sum(_by_kernel.values())


def by_kernel() -> dict[str, int]:
    """Variants compiled (or loaded) since `install`, by kernel name."""
    with _lock:
        return dict(_by_kernel)


def since(baseline: dict[str, int]) -> dict[str, int]:
    """Per kernel, the variants counted beyond `baseline` (a `by_kernel()` taken earlier);
    kernels with none left out."""
    now = by_kernel()
    grown = {name: count - baseline.get(name, 0) for name, count in now.items()}
    return {name: count for name, count in grown.items() if count > 0}
