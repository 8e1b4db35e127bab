"""The start-up lines of `serve` and `generate` say the weight format (a GGUF file's formats kept
quantized, quantized at load, or float, and what a dequantized GGUF file held) and the
speculation (K pinned, or chosen per step by the adaptive policy), read from a loaded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_fixtures import write_gguf
from models_fixtures import make_hf_model, save_hf_model
from specdec.cli.describe import gguf_formats, speculation_note, weights_note
from specdec.drafters.default import DEFAULT_EAGLE_DIR
from specdec.engine.config import SpeculativeConfig
from specdec.models import load_model

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) writes the files")
GGML = gguf.GGMLQuantizationType


def _gguf_file(tmp_path: Path, down: object = GGML.Q8_0) -> Path:
    """A tiny Llama GGUF: Q4_1 attention and gate/up, `down` for down_proj, Q8_0 embeddings,
    float32 norms."""
    hf_model = make_hf_model("llama")
    names = {"token_embd.weight": GGML.Q8_0}
    for layer in range(hf_model.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            names[f"blk.{layer}.{part}.weight"] = GGML.Q4_1
        names[f"blk.{layer}.ffn_down.weight"] = down
    return write_gguf(tmp_path / "m.gguf", hf_model, arch="llama", qtype_of=names)


def test_gguf_weights_kept_quantized_name_their_formats(tmp_path):
    path = _gguf_file(tmp_path)
    assert gguf_formats(path) == ["Q4_1", "Q8_0"]
    model = load_model(path, quantization="gguf").model
    assert model.model.is_quantized
    assert weights_note(model, str(path)) == "weights Q4_1/Q8_0 kept quantized"


def test_gguf_formats_the_kernels_do_not_take_are_named_as_dequantized(tmp_path):
    path = _gguf_file(tmp_path, down=GGML.Q5_0)
    model = load_model(path, quantization="gguf").model
    assert weights_note(model, str(path)) == (
        "weights Q4_1/Q8_0 kept quantized (Q5_0 dequantized to float32)"
    )


def test_a_dequantized_gguf_file_says_what_it_held(tmp_path):
    path = _gguf_file(tmp_path)
    model = load_model(path, quantization=None).model
    assert not model.model.is_quantized
    assert weights_note(model, str(path)) == "weights float32 (dequantized from GGUF Q4_1/Q8_0)"


def test_hf_weights_float_or_quantized_at_load(tmp_path):
    path = save_hf_model(make_hf_model("llama"), tmp_path / "hf")
    assert gguf_formats(path) == []
    assert weights_note(load_model(path).model, str(path)) == "weights float32"
    model = load_model(path, quantization="int8").model
    assert weights_note(model, str(path)) == "weights int8 (quantized at load)"


def test_speculation_note_says_whether_k_adapts():
    assert speculation_note(None) == "off"
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert speculation_note(spec) == "ngram, K chosen per step in 0..4, coupled verification"
    pinned = SpeculativeConfig(method="ngram", adaptive=False, rejection_sample_method="block")
    assert speculation_note(pinned) == "ngram, K=4 fixed, block verification"
    head = SpeculativeConfig(method="eagle", model=str(DEFAULT_EAGLE_DIR), num_speculative_tokens=1)
    assert speculation_note(head).startswith("eagle (the shipped head), K chosen per step in 0..1")
    tree = SpeculativeConfig(
        method="draft_model", model="truncated:1", tree={"nodes": 8, "depth": 4, "topk": 2}
    )
    assert speculation_note(tree) == (
        "draft_model (truncated:1), a tree of 8 drafts (depth 4, top-2), coupled verification"
    )
