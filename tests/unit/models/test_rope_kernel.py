"""The RoPE + cache-write kernel with a frequency table per token (Phi-3's LongRoPE: short
factors before `original_max_position_embeddings`, long ones from it on), under Triton's CPU
interpreter (skipped unless TRITON_INTERPRET=1) against its PyTorch twin: within 1e-5 (float32;
the interpreter's sin/cos are NumPy's). Negative control: the short table given to every token
moves the long-factor rows off. GPU parity: tests/parity/test_longrope_gpu.py.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from models_fixtures import rope_per_token_error

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreted_kernel_takes_a_table_per_token() -> None:
    from specdec.models import fused_triton

    error, control = rope_per_token_error(fused_triton.rope_write_kv_triton, "cpu")
    assert error <= 1e-5
    assert control > 1e-2


def test_twin_takes_a_table_per_token() -> None:
    """The twin itself: a per-token table whose rows all equal the one table gives the one
    table's bits (the broadcast is the same product)."""
    import torch

    from specdec.models import fused

    qkv = torch.randn(5, 8 * 16, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, 3, 31, 32, 40])
    table = torch.rand(8, generator=torch.Generator().manual_seed(2))
    outs = []
    for freq in (table, table.expand(5, 8)):
        caches = [torch.zeros(16, 4, 2, 16) for _ in "kv"]
        slots = torch.arange(5)
        outs.append([fused.rope_write_kv_ref(qkv, positions, freq, *caches, slots, 4, 2), *caches])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
