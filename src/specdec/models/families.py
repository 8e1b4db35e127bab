"""Which architectures have Llama's decoder layer exactly (pre-norm, full rotary, per-head q/k
norm where any): the code that rebuilds a target's layers outside `llama.py` (block drafters'
layers, the draft-model trainer's layer math) is written for them and refuses the others by name
rather than computing something else. Mixtral and Qwen3-MoE have Llama's attention and norms
around a sparse MLP: code whose own layers are dense (the block drafters) takes them too
(`sparse_mlp=True`)."""

from __future__ import annotations

from specdec.models.config import ModelConfig

LLAMA_LAYOUT_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Llama's layer but for the MLP, which is sparse (top-k softmax experts).
SPARSE_MLP_LLAMA_LAYOUT_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


def check_llama_layout(config: ModelConfig, what: str, sparse_mlp: bool = False) -> None:
    """Raises ValueError naming `what` and the architecture when `config`'s layers are not
    Llama's (Phi-3, OLMo 2, Gemma, ...); `sparse_mlp`: Llama's but for a sparse MLP passes."""
    allowed = LLAMA_LAYOUT_ARCHITECTURES
    if sparse_mlp:
        allowed += SPARSE_MLP_LLAMA_LAYOUT_ARCHITECTURES
    if config.architecture not in allowed:
        raise ValueError(
            f"{what} is not available for {config.architecture} targets yet (its layers are "
            f"built as Llama's: {', '.join(allowed)})"
        )
