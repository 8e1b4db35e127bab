"""Test helpers for specdec.models: tiny HF checkpoints, paged-cache runs (GGUF writing:
`gguf_fixtures`).

Random weights come from seeded generators here (tests only); nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.models import AttentionMetadata, LlamaForCausalLM, ModelConfig, prompt_logits
from specdec.models.weights import assign_weights
from specdec.runner.model_runner import PagedModelRunner, StepInput

FULL_ATTENTION = "full_attention"  # a `rope_parameters` key of per-layer-kind RoPE (Gemma 3)

# Tiny configs of each supported architecture (head_dim 16, GQA 4:2, a few layers).
_COMMON: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0, **_COMMON},
    "llama3_rope": {
        "architectures": ["LlamaForCausalLM"],
        **_COMMON,
        # Small original context so that all three frequency bands occur at head_dim 16.
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2_bias": {"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6, **_COMMON},
    "qwen3_qk_norm": {
        "architectures": ["Qwen3ForCausalLM"],
        "rope_theta": 1e6,
        "head_dim": 24,  # differs from hidden / heads, as in real Qwen3 models
        **_COMMON,
    },
    "mistral_window": {
        "architectures": ["MistralForCausalLM"],
        "rope_theta": 1e6,
        "sliding_window": 7,  # shorter than the prompts, so the window matters
        **_COMMON,
    },
    "smollm2_tied": {
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        **{**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 1},
    },
}


def _rope_config(mpe: int, **rope: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        **{**_COMMON, "max_position_embeddings": mpe},
        "rope_parameters": {"rope_theta": 10000.0, **rope},
    }


# One tiny Llama per RoPE scaling type, each with an original window of 64 positions (dynamic and
# linear: max_position_embeddings) so that prompts of 512 tokens reach far past it.
ROPE_SCALING_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3": _rope_config(
        512,
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    "yarn": _rope_config(512, rope_type="yarn", factor=8.0, original_max_position_embeddings=64),
    "yarn_mscale": _rope_config(
        512,
        rope_type="yarn",
        factor=8.0,
        original_max_position_embeddings=64,
        beta_fast=16.0,
        beta_slow=2.0,
        mscale=1.0,
        mscale_all_dim=0.5,
        truncate=False,
    ),
    "yarn_attention_factor": _rope_config(
        512,
        rope_type="yarn",
        factor=8.0,
        original_max_position_embeddings=64,
        attention_factor=0.9,
    ),
    "linear": _rope_config(64, rope_type="linear", factor=8.0),
    "dynamic": _rope_config(64, rope_type="dynamic", factor=8.0),
}


# Tiny configs of the families beyond Llama, kept apart from TINY_CONFIGS (every entry of which
# the tensor-parallel and GPU decode tests run): Phi-3 (fused qkv_proj / gate_up_proj; LongRoPE
# with a short original context and partial rotary; a sliding window) and OLMo 2 (norms after
# each sublayer, q/k norms over the whole projection).
_PHI3: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "rope_theta": 10000.0,
    **_COMMON,
    "pad_token_id": 0,  # Phi3Config's default (32000) lies outside the tiny vocabulary
}
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "phi3": _PHI3,
    "phi3_longrope": {
        **_PHI3,
        # Positions from 32 on take the long factors; 12 of the 16 head dimensions rotate.
        "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.75,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
        },
    },
    "phi3_window": {**_PHI3, "sliding_window": 7},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "rope_theta": 10000.0, **_COMMON},
}


def make_family_hf_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """`make_hf_model` for a FAMILY_CONFIGS entry (`overrides` replace its keys): a
    `transformers` model with seeded random weights (norm weights near 1, others
    ~N(0, 0.15^2)), fp32, eval."""
    return _seeded_hf_model({**FAMILY_CONFIGS[name], **overrides}, seed)


# Tiny Gemma 3 text configs (`Gemma3TextConfig` keywords): sliding and full layers alternate
# (sliding_window_pattern 2: layers 0 and 2 slide, 1 and 3 see everything), a window of 8
# shorter than the prompts, the sliding layers' own RoPE base, a query_pre_attn_scalar that
# is not head_dim (the scale matters); "gemma3_linear" adds linear RoPE scaling on the full
# layers (Gemma 3 4B and larger); "gemma3_capped" sets Gemma 2's two soft-caps, at values that
# would bind at this scale (released Gemma 3 checkpoints set none; `transformers` caps Gemma 3's
# final logits and never its attention scores).
_GEMMA3: dict[str, Any] = {
    **{key: value for key, value in _COMMON.items() if key != "num_hidden_layers"},
    "num_hidden_layers": 4,
    "head_dim": 16,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "query_pre_attn_scalar": 24,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "pad_token_id": 0,
}
GEMMA3_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3": _GEMMA3,
    "gemma3_linear": {**_GEMMA3, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "gemma3_capped": {**_GEMMA3, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
}


# Tiny Gemma 2 configs (`Gemma2Config` keywords): sliding and full layers alternate (its
# default), a window of 8, a query_pre_attn_scalar that is not head_dim, and caps that bind at
# this scale (attention scores reach ~+-6 and logits ~+-6 here; Gemma 2's own 50 and 30 would
# hardly touch them, so a lost cap would pass unseen); "gemma2_uncapped" has neither cap
# (config.json's nulls).
_GEMMA2: dict[str, Any] = {
    **{key: value for key, value in _GEMMA3.items() if not key.startswith("rope_local")},
    "rope_theta": 10_000.0,
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
}
del _GEMMA2["sliding_window_pattern"]
GEMMA2_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": _GEMMA2,
    "gemma2_uncapped": {
        **_GEMMA2,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    },
}


def make_gemma3_hf_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A `transformers` Gemma3ForCausalLM of a GEMMA3_CONFIGS entry (`overrides` replace its
    keys) with seeded random weights (norm weights ~N(0, 0.2^2): Gemma scales by 1 + w; others
    ~N(0, 0.15^2)), fp32, eval."""
    import transformers

    config = transformers.Gemma3TextConfig(
        **{**GEMMA3_CONFIGS[name], **overrides},
        architectures=["Gemma3ForCausalLM"],
        attn_implementation="sdpa",
    )
    return _seeded_gemma(transformers.Gemma3ForCausalLM(config), seed)


def make_gemma2_hf_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """`make_gemma3_hf_model` for a GEMMA2_CONFIGS entry: a Gemma2ForCausalLM with eager
    attention (`transformers`' SDPA path has no soft-capping)."""
    import transformers

    config = transformers.Gemma2Config(
        **{**GEMMA2_CONFIGS[name], **overrides},
        architectures=["Gemma2ForCausalLM"],
        attn_implementation="eager",
    )
    return _seeded_gemma(transformers.Gemma2ForCausalLM(config), seed)


def _seeded_gemma(model: Any, seed: int) -> Any:
    """`model` with seeded weights: norm weights ~N(0, 0.2^2), others ~N(0, 0.15^2); eval."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            scale = 0.2 if param_name.endswith("norm.weight") else 0.15
            param.copy_(scale * torch.randn(param.shape, generator=generator))
    return model.eval()


# Tiny mixture-of-experts configs: Mixtral (6 experts, top-2, renormalised) and Qwen3-MoE (8
# experts, top-2, q/k norms per head; layer 1 dense through `mlp_only_layers`; `norm_topk_prob`
# both ways).
_MOE_COMMON: dict[str, Any] = {**_COMMON, "rope_theta": 10000.0, "num_experts_per_tok": 2}
_QWEN3_MOE: dict[str, Any] = {
    **_MOE_COMMON,
    "architectures": ["Qwen3MoeForCausalLM"],
    "head_dim": 16,
    "num_experts": 8,
    "moe_intermediate_size": 48,
    "mlp_only_layers": [1],
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
}
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {**_MOE_COMMON, "architectures": ["MixtralForCausalLM"], "num_local_experts": 6},
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_moe_unnormed": {**_QWEN3_MOE, "norm_topk_prob": False},
}


def make_moe_hf_model(name: str, seed: int = 0) -> Any:
    """A `transformers` model of a MOE_CONFIGS entry with seeded random weights (norm weights
    near 1, others ~N(0, 0.15^2); router weights ~N(0, 1) so that routes are far from ties),
    fp32, eval."""
    return _seeded_hf_model(MOE_CONFIGS[name], seed, router_scale=1.0)


def hf_decode_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """[T, V] float32 logits of `transformers` fed one token per call with its cache: what its
    decoding computes token by token (for LongRoPE it differs from one call over the sequence,
    which takes the long factors for every token once the sequence passes the original
    context)."""
    import inspect

    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # The cache's keyword: `cache` in transformers 5.25, `past_key_values` in 5.17 (the GPU
    # machine's), whose forward takes any other keyword silently: each token would then be
    # decoded without its context (s26: Gemma's decode path "off by 4.8" on the H100).
    parameters = inspect.signature(model.forward).parameters
    keyword = "cache" if "cache" in parameters else "past_key_values"
    if keyword not in parameters:
        raise TypeError(f"{type(model).__name__}.forward takes neither cache nor past_key_values")
    rows = []
    with torch.no_grad():
        for position, token in enumerate(token_ids):
            out = model(
                torch.tensor([[token]]),
                position_ids=torch.tensor([[position]]),
                use_cache=True,
                **{keyword: cache},
            )
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def make_hf_model(name: str, seed: int = 0) -> Any:
    """A `transformers` model of the tiny config `name`, with seeded random weights (fp32, eval).

    Norm weights and biases are randomised too so that a loader mixing them up fails.
    """
    return _seeded_hf_model({**TINY_CONFIGS, **ROPE_SCALING_CONFIGS}[name], seed)


def _seeded_hf_model(
    hf_config: dict[str, Any], seed: int, router_scale: float | None = None
) -> Any:
    """The `transformers` model of a config.json dict (its `<Family>Config` and
    `<Family>ForCausalLM`, SDPA attention) with seeded weights: norm weights 1 + N(0, 0.2^2),
    router weights (`gate.weight`) N(0, router_scale^2) where given, others N(0, 0.15^2);
    fp32, eval."""
    import transformers

    hf_config = dict(hf_config)
    architecture = hf_config.pop("architectures")[0]
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(**hf_config, architectures=[architecture], attn_implementation="sdpa")
    model = getattr(transformers, architecture)(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif router_scale is not None and param_name.endswith("gate.weight"):
                param.copy_(router_scale * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    return model.eval()


def save_hf_model(model: Any, path: Path, **kwargs: Any) -> Path:
    """save_pretrained as safetensors into `path`; returns `path`."""
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def hf_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """[T, V] float32 logits of `transformers` over the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


def prompt_tokens(vocab_size: int, lengths: Sequence[int], seed: int = 1) -> list[list[int]]:
    """Seeded random token sequences of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


class PagedRunner:
    """Drives a model step by step over a paged cache with scattered, non-contiguous blocks.

    Block ids are handed out from a fixed shuffled order, so the tables of different sequences
    interleave and are never contiguous.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()
        self.free_blocks = order
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Appends `new_tokens[seq]` to each listed sequence; returns their [q_len, V] logits."""
        seq_ids = list(new_tokens)
        query_lens, context_lens, tables, input_ids, positions = [], [], [], [], []
        for seq in seq_ids:
            start = self.lengths.get(seq, 0)
            end = start + len(new_tokens[seq])
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop(0))
            self.lengths[seq] = end
            query_lens.append(len(new_tokens[seq]))
            context_lens.append(end)
            tables.append(table)
            input_ids += new_tokens[seq]
            positions += range(start, end)
        device = self.kv_cache.k_cache.device
        attn = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, device)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, device=device),
                torch.tensor(positions, device=device),
                attn,
                self.kv_cache,
            )
            logits = self.model.compute_logits(hidden)
        return dict(zip(seq_ids, logits.split(query_lens), strict=True))


def decode_path_step(
    runner: PagedRunner, new_tokens: dict[int, list[int]], query_per_seq: int
) -> dict[int, torch.Tensor]:
    """`runner.step` through the model's decode path: one `DecodeMetadata` step (what the
    runner's decode graphs replay; on the CPU a `DecodePlanCPU`) of `query_per_seq` rows per
    listed sequence, shorter ones padded (rows that write and return nothing). Blocks and
    lengths are the runner's, so prefill steps (`runner.step`) and decode steps interleave.

    Returns: per sequence its [len(new_tokens[seq]), V] logits."""
    from specdec.models.attention import DecodeMetadata

    seq_ids = list(new_tokens)
    input_ids = [0] * (len(seq_ids) * query_per_seq)
    positions = [0] * len(input_ids)
    slots = [-1] * len(input_ids)
    context_lens, query_lens, tables = [], [], []
    for b, seq in enumerate(seq_ids):
        tokens = new_tokens[seq]
        assert 0 < len(tokens) <= query_per_seq
        start = runner.lengths.get(seq, 0)
        end = start + len(tokens)
        table = runner.tables.setdefault(seq, [])
        while len(table) * runner.block_size < end:
            table.append(runner.free_blocks.pop(0))
        runner.lengths[seq] = end
        for j, token in enumerate(tokens):
            row, position = b * query_per_seq + j, start + j
            input_ids[row], positions[row] = token, position
            block = table[position // runner.block_size]
            slots[row] = block * runner.block_size + position % runner.block_size
        context_lens.append(end)
        query_lens.append(len(tokens))
        tables.append(table)
    width = max(len(table) for table in tables)
    device = runner.kv_cache.k_cache.device

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    meta = DecodeMetadata(
        block_tables=tensor([table + [-1] * (width - len(table)) for table in tables]),
        context_lens=tensor(context_lens),
        query_lens=tensor(query_lens),
        slot_mapping=tensor(slots),
        query_per_seq=query_per_seq,
    )
    with torch.inference_mode():
        hidden, _ = runner.model.model(tensor(input_ids), tensor(positions), meta, runner.kv_cache)
        logits = runner.model.compute_logits(hidden)  # [B * Q, V]
    rows = logits.view(len(seq_ids), query_per_seq, -1)
    return {seq: rows[b, : query_lens[b]] for b, seq in enumerate(seq_ids)}


def max_error(ours: Sequence[torch.Tensor], references: Sequence[torch.Tensor]) -> float:
    """The largest absolute difference between paired tensors."""
    return max((a - b).abs().max().item() for a, b in zip(ours, references, strict=True))


def prompt_error(model: LlamaForCausalLM, hf_model: Any, prompts: Sequence[list[int]]) -> float:
    """The largest logit error of one batched prefill of `prompts` (blocks of 4) against
    `transformers` over each whole prompt."""
    references = [hf_logits(hf_model, prompt) for prompt in prompts]
    return max_error(prompt_logits(model, list(prompts), block_size=4), references)


def eager(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` attending through the eager masked path instead of the CPU's row plan."""
    model.model._plans_rows = lambda input_ids: False
    return model


def drop_attention_cap(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` without its attention logit soft-capping (a negative control)."""
    for layer in model.model.layers:
        layer.self_attn.softcap = None
    return model


def drop_final_cap(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` without its final logit soft-capping (a negative control)."""
    model.final_softcap = None
    return model


def paged_steps_error(
    model: LlamaForCausalLM,
    references: Sequence[torch.Tensor],
    sequences: Sequence[list[int]],
    schedule: Sequence[Sequence[int]],
) -> float:
    """Runs `sequences` through a `PagedRunner` (blocks of 4, scattered) in the eager steps of
    `schedule` (per step, each sequence's new token count; 0: absent) and returns the largest
    logit error against `references` ([len(seq), V] each). Every sequence must be consumed."""
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    done = [0] * len(sequences)
    worst = 0.0
    for step in schedule:
        new = {b: sequences[b][done[b] : done[b] + n] for b, n in enumerate(step) if n > 0}
        for b, logits in runner.step(new).items():
            worst = max(worst, max_error([logits], [references[b][done[b] : done[b] + step[b]]]))
        done = [d + n for d, n in zip(done, step, strict=True)]
    assert done == [len(seq) for seq in sequences], "the schedule must consume every sequence"
    return worst


def decode_path_error(
    model: LlamaForCausalLM,
    references: Sequence[torch.Tensor],
    sequences: Sequence[list[int]],
    prefill: int = 3,
    query_per_seq: int = 4,
) -> float:
    """Prefills each sequence's first `prefill` tokens, then runs the rest through the decode
    path (`decode_path_step`) in steps of 1 to `query_per_seq` rows (varying by step and
    sequence, padded to `query_per_seq`); returns the largest logit error against
    `references` ([len(seq), V] each)."""
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    runner.step({b: seq[:prefill] for b, seq in enumerate(sequences)})
    done, step, worst = [prefill] * len(sequences), 0, 0.0
    while any(d < len(seq) for d, seq in zip(done, sequences, strict=True)):
        new = {}
        for b, seq in enumerate(sequences):
            count = min(1 + (step + b) % query_per_seq, len(seq) - done[b])
            if count > 0:
                new[b] = seq[done[b] : done[b] + count]
        for b, logits in decode_path_step(runner, new, query_per_seq).items():
            expected = references[b][done[b] : done[b] + len(new[b])]
            worst = max(worst, max_error([logits], [expected]))
            done[b] += len(new[b])
        step += 1
    return worst


def llm_greedy(llm: Any, prompts: list[list[int]], max_tokens: int = 24, **kwargs: Any) -> list:
    """`llm.generate` greedily for `max_tokens` tokens each (EOS ignored); `kwargs` pass on
    (e.g. speculative={"enabled": False})."""
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False, **kwargs)


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`transformers`' greedy `generate` of `max_new_tokens` tokens (no EOS stop; every
    prompt token attended, a pad id among them too: `generate` would mask it otherwise)."""
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# Prompts of the families' greedy checks (`llm_greedy` against `hf_greedy`): three random ones
# and one holding token id 0 twice, on which every family's `generate` without an attention
# mask (token 0 masked as padding) gives other tokens, so that a masking reference is caught.
GREEDY_PROMPTS = [*prompt_tokens(97, [6, 8, 3], seed=7), [52, 0, 19, 0, 71, 33]]


# n-gram speculation with K pinned at 3 (so that drafting runs on a busy machine too), and
# prompts that repeat themselves so that n-grams match.
NGRAM_SPEC: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
_LOOP = [5, 17, 33, 8]
NGRAM_PROMPTS = [_LOOP * 3, prompt_tokens(97, [7], seed=9)[0] + _LOOP * 2, _LOOP * 5]


def speculative_equals_plain(llm: Any, prompts: list[list[int]]) -> list:
    """Greedy through `llm` (its speculation configured) with speculation off, then on:
    asserts the same tokens for every prompt and that drafts were proposed; returns the
    speculative outputs."""
    plain = llm_greedy(llm, prompts, speculative={"enabled": False})
    speculative = llm_greedy(llm, prompts)
    for a, b in zip(plain, speculative, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert sum(out.spec_decode_stats["num_draft_tokens"] for out in speculative) > 0
    return speculative


def tree_speculation_equals_plain(target: Path, draft: Path, prompts: list[list[int]]) -> None:
    """Greedy draft trees (the draft model `draft`; 4 nodes, depth 2, top-2: a region of 5
    keys, inside a window of 8) emit plain greedy's tokens (blocks of 4), some of them
    accepted."""
    from specdec.engine.llm import LLM

    common = {"max_model_len": 96, "block_size": 4, "max_num_batched_tokens": 64}
    spec = {
        "method": "draft_model",
        "model": str(draft),
        "draft_sample_method": "greedy",
        "tree": {"nodes": 4, "depth": 2, "topk": 2},
        "adaptive": False,  # every step a tree round
    }
    plain = llm_greedy(LLM(str(target), **common), prompts)
    llm = LLM(str(target), speculative_config=spec, **common)
    for a, b in zip(plain, llm_greedy(llm, prompts), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def greedy_generate(
    model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy decoding of one prompt through the paged cache (prefill, then one token per step)."""
    block_size = 16
    num_blocks = -(-(len(prompt) + max_new_tokens) // block_size)
    runner = PagedRunner(model, num_blocks, block_size)
    logits = runner.step({0: prompt})[0]
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        generated.append(token)
        if token in stop_ids:
            break
        logits = runner.step({0: [token]})[0]
    return generated


def seeded_model(
    name: str, device: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any
) -> LlamaForCausalLM:
    """A TINY_CONFIGS (or ROPE_SCALING_CONFIGS, FAMILY_CONFIGS) model with seeded weights (norm
    weights near 1, others ~N(0, 0.15^2)); `overrides` replace config.json keys (e.g. a longer
    max_position_embeddings)."""
    configs = {**TINY_CONFIGS, **ROPE_SCALING_CONFIGS, **FAMILY_CONFIGS}
    config = ModelConfig.from_hf_config({**configs[name], **overrides})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    state = {
        param_name: 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        if param_name.endswith("norm.weight")
        else 0.15 * torch.randn(param.shape, generator=generator)
        for param_name, param in model.named_parameters()
    }
    assign_weights(model, state.get, name, dtype, device)
    return model


def compare_decode_path(
    name: str,
    device: str,
    *,
    use_graphs: bool,
    dtype: torch.dtype = torch.float32,
    atol: float = 1e-5,
) -> tuple[PagedModelRunner, list[int]]:
    """Runs the same prefill + decode/verify steps through an eager runner and a decode-path
    runner (batches padded to graph buckets) and asserts equal logits, features and KV caches.

    Block tables are scattered; steps mix 1 and 4 query tokens and batch sizes 3 and 5 (padded to
    4 and 8). Returns the decode-path runner and the blocks its sequences hold.
    """
    num_blocks, block_size = 40, 4
    eager = PagedModelRunner(
        seeded_model(name, device, dtype), num_blocks, block_size, max_num_seqs=8
    )
    fast = PagedModelRunner(
        seeded_model(name, device, dtype),
        num_blocks,
        block_size,
        max_num_seqs=8,
        max_model_len=64,
        max_query_len=4,
        enforce_eager=not use_graphs,
        decode_path=True,
        pad_batches=True,
    )
    vocab = eager.model.config.vocab_size
    layers = (0, eager.model.config.num_hidden_layers - 1)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(5)).tolist()
    prompts = prompt_tokens(vocab, [9, 3, 14, 6, 1], seed=11)
    tables: list[list[int]] = [[] for _ in prompts]
    lengths = [0] * len(prompts)
    stream = prompt_tokens(vocab, [200], seed=12)[0]

    def step_inputs(new: dict[int, list[int]], all_logits: bool) -> list[StepInput]:
        inputs = []
        for b, tokens in new.items():
            end = lengths[b] + len(tokens)
            while len(tables[b]) * block_size < end:
                tables[b].append(order.pop())
            rows = len(tokens) if all_logits else 1
            inputs.append(StepInput(tokens, lengths[b], list(tables[b]), rows))
            lengths[b] = end
        return inputs

    inputs = step_inputs(dict(enumerate(prompts)), all_logits=False)
    for runner in (eager, fast):  # prefill: the eager path in both
        runner.run(inputs)
    schedule = [
        {0: 1, 1: 1, 2: 1},
        {0: 4, 1: 1, 2: 4, 3: 2, 4: 4},
        {1: 4, 3: 1, 4: 1},
        {0: 1, 1: 1, 2: 1, 3: 1, 4: 1},
    ]
    cursor = 0
    for counts in schedule:
        new = {}
        for b, count in counts.items():
            new[b] = stream[cursor : cursor + count]
            cursor += count
        inputs = step_inputs(new, all_logits=True)
        want_logits, want_features = eager.run_with_features(inputs, layers)
        got_logits, got_features = fast.run_with_features(inputs, layers)
        for want, got in zip(want_logits, got_logits, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        for want, got in zip(want_features, got_features, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    used = sorted(block for table in tables for block in table)
    for cache_name in ("k_cache", "v_cache"):
        want = getattr(eager.kv_cache, cache_name)[:, used]
        got = getattr(fast.kv_cache, cache_name)[:, used]
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    return fast, used


def rope_per_token_error(launch: Any, device: str) -> tuple[float, float]:
    """RoPE + cache write with a frequency table per token (longrope's short factors before
    position 32, long ones from it on), through `launch` (`fused.rope_write_kv`'s signature)
    on `device` against the twin on the CPU: (largest |difference| of the query and both
    caches; the same with the short table given to every token, on the long-factor rows: a
    negative control that should be large)."""
    from specdec.models import fused

    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 31, 32, 33, 60])
    short = torch.rand(head_dim // 2, generator=generator)
    per_token = torch.where((positions >= 32)[:, None], short / 8, short)
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim, generator=generator)
    slots = torch.tensor([0, 5, 31, -1, 33, 60])

    def run(write: Any, on: str, table: torch.Tensor) -> list[torch.Tensor]:
        caches = [torch.zeros(16, block_size, kv_heads, head_dim, device=on) for _ in "kv"]
        query = write(
            qkv.to(on), positions.to(on), table.to(on), *caches, slots.to(on), heads, kv_heads
        )
        return [t.cpu() for t in (query, *caches)]

    twin = run(fused.rope_write_kv_ref, "cpu", per_token)
    got = run(launch, device, per_token)
    error = max((g - w).abs().max().item() for g, w in zip(got, twin, strict=True))
    short_only = run(launch, device, short)[0]
    control = (short_only - twin[0])[positions >= 32].abs().max().item()
    return error, control
