"""A GGUF file's RoPE settings read back as `transformers` states them: the
`{arch}.rope.scaling.*` keys (linear, yarn) as a RopeScaling, and a Phi-3 file's partial
rotary and LongRoPE (`phi3_rope`). Reads the metadata and factors it is given; never opens a
file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specdec.models.rope import RopeScaling, parse_rope_scaling

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Phi-3's LongRoPE factors (float32, rotary_dim / 2 each), written by llama.cpp's converter
# only for a longrope (or "su") checkpoint: HF's `long_factor`, `short_factor`.
PHI3_ROPE_FACTORS = {
    "long_factor": "rope_factors_long.weight",
    "short_factor": "rope_factors_short.weight",
}
# The metadata keys the converter writes beside them (`phi3.<key>`).
_PHI3_LONGROPE_KEYS = (
    "context_length",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
)
# GGUF yarn keys (`{arch}.rope.scaling.<key>`) -> the HF rope_scaling key they set (None: checked
# to be 1.0, HF's implied value).
GGUF_YARN_KEYS = {
    "original_context_length": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "attn_factor": None,
}


def rope_scaling(metadata: dict[str, Any], architecture: str, path: Path) -> RopeScaling | None:
    """`{arch}.rope.scaling.*` of the file at `path` as a RopeScaling: none, linear (`factor`),
    or yarn (`factor`, `original_context_length`, `yarn_beta_fast`, `yarn_beta_slow`,
    `attn_factor` 1.0); Llama 3.1 scaling comes as frequency factors (`rope_freqs.weight`)
    instead.

    Raises:
        ValueError: another scaling type, or a scaling key not read here (named).
    """
    prefix = f"{architecture}.rope.scaling."
    keys = {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix)}
    scaling_type = keys.pop("type", None)
    keys.pop("finetuned", None)  # informational
    if scaling_type in (None, "none"):
        return None
    known = {"linear": {"factor"}, "yarn": set(GGUF_YARN_KEYS) | {"factor"}}
    if scaling_type not in known:
        raise ValueError(
            f"{path}: unsupported GGUF rope scaling {scaling_type!r} (supported: none, "
            f"linear, yarn, or Llama 3.1 frequency factors in {ROPE_FREQS_TENSOR})"
        )
    unknown = sorted(set(keys) - known[scaling_type])
    if unknown:
        raise ValueError(f"{path}: unsupported GGUF {scaling_type} rope keys {unknown}")
    if "factor" not in keys:
        raise ValueError(f"{path}: GGUF {scaling_type} rope scaling lacks {prefix}factor")
    if scaling_type == "linear":
        return RopeScaling("linear", float(keys["factor"]))
    if float(keys.get("attn_factor", 1.0)) != 1.0:
        raise ValueError(
            f"{path}: GGUF yarn attn_factor={keys['attn_factor']} is not supported (1.0)"
        )
    hf = {"rope_type": "yarn", "factor": float(keys["factor"])}
    for gguf_key, hf_key in GGUF_YARN_KEYS.items():
        if gguf_key in keys and hf_key is not None:
            hf[hf_key] = keys[gguf_key]
    context = int(metadata.get(f"{architecture}.context_length", 2048))
    return parse_rope_scaling(hf, context)


def phi3_rope(
    metadata: dict[str, Any],
    path: Path,
    head_dim: int,
    factors: dict[str, list[float]],
    scaling: RopeScaling | None,
) -> dict[str, Any]:
    """A Phi-3 file's `partial_rotary_factor` and `rope_scaling` (ModelConfig options) as
    llama.cpp's converter states them: `phi3.rope.dimension_count` rotated dimensions of each
    head; LongRoPE from the `factors` tensors (PHI3_ROPE_FACTORS' keys -> their values),
    `rope.scaling.original_context_length` and `context_length`, as `transformers` reads a
    config.json of those. `rope.scaling.attn_factor` (m; the converter derives it from the two
    lengths, sqrt(1 + ln(s) / ln(original)) for their ratio s > 1) is HF's rule when it equals
    that in float32 (the converter's value, unrounded), else carried as stored: llama.cpp
    multiplies its rotations by the stored value, as `transformers` does by an explicit
    `attention_factor`. `scaling`: the file's `rope.scaling.type` scaling, if any.

    Raises:
        ValueError: a dimension count partial_rotary_factor cannot state; LongRoPE factors
            without their other tensor, lengths or `attn_factor`, or beside a
            `rope.scaling.type` scaling; an `attn_factor` other than 1 without them (named).
    """
    rotary_dim = int(metadata.get("phi3.rope.dimension_count", head_dim))
    partial = rotary_dim / head_dim
    if int(head_dim * partial) != rotary_dim:
        raise ValueError(
            f"{path}: phi3.rope.dimension_count={rotary_dim} of head_dim {head_dim} is not a "
            "partial_rotary_factor this loader can state"
        )
    options: dict[str, Any] = {"partial_rotary_factor": partial, "rope_scaling": scaling}
    attn_factor = metadata.get("phi3.rope.scaling.attn_factor")
    if not factors:
        if attn_factor is not None and float(attn_factor) != 1.0:
            raise ValueError(
                f"{path}: phi3.rope.scaling.attn_factor={attn_factor} without LongRoPE factors "
                f"({', '.join(PHI3_ROPE_FACTORS.values())}) is not supported"
            )
        return options
    missing = sorted(
        {name for key, name in PHI3_ROPE_FACTORS.items() if key not in factors}
        | {f"phi3.{key}" for key in _PHI3_LONGROPE_KEYS if f"phi3.{key}" not in metadata}
    )
    if missing:
        raise ValueError(f"{path}: GGUF phi3 file with LongRoPE factors lacks {', '.join(missing)}")
    if scaling is not None:
        raise ValueError(
            f"{path}: GGUF phi3 file with LongRoPE factors sets rope.scaling.type "
            f"{scaling.rope_type!r} too"
        )
    hf = {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": int(
            metadata["phi3.rope.scaling.original_context_length"]
        ),
    }
    context = int(metadata["phi3.context_length"])
    longrope = parse_rope_scaling(hf, context, longrope=True)
    if np.float32(attn_factor) != np.float32(longrope.attention_factor):
        hf["attention_factor"] = float(attn_factor)
        longrope = parse_rope_scaling(hf, context, longrope=True)
    options["rope_scaling"] = longrope
    return options
