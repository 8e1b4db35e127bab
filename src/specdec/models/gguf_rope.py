"""A GGUF file's RoPE settings read back as `transformers` states them: the
`{arch}.rope.scaling.*` keys (linear, yarn) as a RopeScaling. Reads metadata it is given;
never opens a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.models.rope import RopeScaling, parse_rope_scaling

ROPE_FREQS_TENSOR = "rope_freqs.weight"
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
