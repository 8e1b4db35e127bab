"""Models: the Llama-family forward pass over a paged KV cache, and loading weights and tokenizers.

HF safetensors directories and GGUF files; `transformers` is the reference for every forward pass.
Nothing here samples or draws randomness.
"""

from specdec.models.attention import (
    AttentionMetadata,
    AttentionPlan,
    KVCache,
    paged_attention,
    write_kv,
)
from specdec.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specdec.models.llama import LlamaForCausalLM, prompt_logits
from specdec.models.loader import (
    LoadedModel,
    default_quantization,
    load_model,
    quantize_model,
    resolve_quantization,
)
from specdec.models.quant import QuantizedWeight
from specdec.models.quant_formats import QUANTIZATIONS
from specdec.models.registry import default_model_path, is_builtin_model
from specdec.models.rope import RopeScaling
from specdec.models.tokenizer import Tokenizer
from specdec.models.weights import CheckpointError

__all__ = [
    "QUANTIZATIONS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "AttentionPlan",
    "CheckpointError",
    "KVCache",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "QuantizedWeight",
    "RopeScaling",
    "Tokenizer",
    "default_model_path",
    "default_quantization",
    "is_builtin_model",
    "load_model",
    "paged_attention",
    "prompt_logits",
    "quantize_model",
    "resolve_quantization",
    "write_kv",
]
