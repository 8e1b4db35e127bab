"""What an engine runs, in the words of the commands' start-up lines (`serve`'s, `generate`'s):
the weight format and the speculation. Reads a loaded engine and, for a GGUF model, the file's
header; never changes either.
"""

from __future__ import annotations

from pathlib import Path

from specdec.engine.config import SpeculativeConfig

# GGML types that are plain floats (the rest are block-quantized formats).
FLOAT_TYPES = ("F64", "F32", "F16", "BF16")


def speculation_note(spec: SpeculativeConfig | None) -> str:
    """ "off", or the drafter, how many drafts a step verifies (K pinned, or chosen per step up
    to K by the adaptive policy, or a tree) and the verification, e.g. "ngram, K chosen per
    step in 0..4, coupled verification"."""
    if spec is None:
        return "off"
    from specdec.drafters.default import DEFAULT_EAGLE_DIR

    drafter = spec.method
    if spec.model == str(DEFAULT_EAGLE_DIR):
        drafter += " (the shipped head)"
    elif spec.model:
        drafter += f" ({spec.model})"
    if spec.tree is not None:
        tree = spec.tree
        drafts = f"a tree of {tree.nodes} drafts (depth {tree.depth}, top-{tree.topk})"
    elif spec.adaptive:
        drafts = f"K chosen per step in 0..{spec.num_speculative_tokens}"
    else:
        drafts = f"K={spec.num_speculative_tokens} fixed"
    return f"{drafter}, {drafts}, {spec.rejection_sample_method} verification"


def weights_note(model, path: str | Path | None) -> str:
    """The weight format of a loaded model: "weights Q4_1/Q8_0 kept quantized" (a GGUF file's
    own formats), "weights int8 (quantized at load)", or "weights float32" (with the GGUF
    formats it was dequantized from, for a GGUF file).

    Args:
        model: the loaded `LlamaForCausalLM` (its `quantization` and activation `dtype`).
        path: its file or directory (None: the built-in model).
    """
    dtype = str(model.dtype).removeprefix("torch.")
    formats = gguf_formats(path)
    if model.quantization == "gguf":
        from specdec.models.gguf_blocks import GGUF_QUANT_TYPES

        kept = [t for t in formats if t in GGUF_QUANT_TYPES]
        others = [t for t in formats if t not in GGUF_QUANT_TYPES]
        return f"weights {'/'.join(kept) or 'GGUF'} kept quantized" + (
            f" ({'/'.join(others)} dequantized to {dtype})" if others else ""
        )
    if model.quantization is not None:
        return f"weights {model.quantization} (quantized at load)"
    if formats:
        return f"weights {dtype} (dequantized from GGUF {'/'.join(formats)})"
    return f"weights {dtype}"


def gguf_formats(path: str | Path | None) -> list[str]:
    """The block-quantized GGML types of a GGUF file's tensors, sorted ([] for a file of floats
    or a model that is not a GGUF file)."""
    from specdec.models import default_model_path
    from specdec.models.gguf_file import GGUFFile
    from specdec.models.loader import is_gguf

    path = path if path is not None else default_model_path()
    if not is_gguf(path):
        return []
    file = GGUFFile(path)
    types = {file.tensor_type(name) for name in file.tensor_names()}
    return sorted(types - set(FLOAT_TYPES))
