"""Which architectures have Llama's decoder layer exactly (pre-norm, full rotary, per-head q/k
norm where any): the code that rebuilds a target's layers outside `llama.py` as Llama's (the
draft-model trainer's layer math, MTP drafting) is written for them and refuses the others by
name rather than computing something else. (Block drafters build the target family's layers:
`drafters/block/network.py`.)"""

from __future__ import annotations

from specdec.models.config import ModelConfig

LLAMA_LAYOUT_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def check_llama_layout(config: ModelConfig, what: str) -> None:
    """Raises ValueError naming `what` and the architecture when `config`'s layers are not
    Llama's (Phi-3, OLMo 2, Gemma, ...)."""
    if config.architecture not in LLAMA_LAYOUT_ARCHITECTURES:
        raise ValueError(
            f"{what} is not available for {config.architecture} targets yet (its layers are "
            f"built as Llama's: {', '.join(LLAMA_LAYOUT_ARCHITECTURES)})"
        )
