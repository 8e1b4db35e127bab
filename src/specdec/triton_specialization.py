"""Keeps Triton from compiling a kernel again mid-run for a new value class of its metadata.

Triton specialises a kernel on each integer argument's value class (equal to 1, a multiple of
16, anything else) and on each pointer's 16-byte alignment, compiling a new variant (0.3-0.7 s
on the H200) the first time a class is seen. Eager steps pass block-table widths that vary with
the longest request and metadata tensors sliced from one packed copy (an int64 slice at an odd
offset is 8-byte aligned), so a variant could first be needed hundreds of steps into a run
(measured: `benchmarks/probes/probe_triton_compiles.py`, a 727 ms generate call against
~165 ms). Metadata read once per program gains nothing from either specialisation; this names
those arguments for `triton.jit`.
"""

from __future__ import annotations

import inspect


def unspecialized(ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()) -> dict:
    """`triton.jit` keyword arguments that specialise neither the integer arguments `ints` on
    their value nor the pointer arguments `pointers` on their alignment (each option only where
    the installed Triton has it)."""
    import triton

    accepted = inspect.signature(triton.jit).parameters
    options: dict = {}
    if ints and "do_not_specialize" in accepted:
        options["do_not_specialize"] = list(ints)
    if pointers and "do_not_specialize_on_alignment" in accepted:
        options["do_not_specialize_on_alignment"] = list(pointers)
    return options
