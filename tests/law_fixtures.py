"""Shared pieces of the engine-level law tests: a tiny vocabulary-8 Llama target and the exact
probability of each continuation of its prompt (tests only; weights from a seeded generator)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from specdec.models import load_model, prompt_logits
from specdec.sampling import process_logits

VOCAB = 8
PROMPT = [1, 5, 2, 7]
# For structured outputs: the text of each token id of the vocabulary-8 target (None: special;
# bos 1, eos 2), written as a byte-level tokenizer by `write_grammar_tokenizer`.
GRAMMAR_TOKEN_TEXTS = (b"a", None, None, b"b", b"c", b"ab", b"bc", b"d")
GRAMMAR_EOS = 2


def write_grammar_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer over GRAMMAR_TOKEN_TEXTS (and <s>, </s>) written into `path`
    (tokenizer.json, tokenizer_config.json)."""
    import json

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t.decode(): i for i, t in enumerate(GRAMMAR_TOKEN_TEXTS) if t is not None}
    vocab |= {"<s>": 1, "</s>": 2}
    merges = [("a", "b"), ("b", "c")]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.add_special_tokens(["<s>", "</s>"])
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def save_vocab8_target(path: Path) -> Path:
    """Writes a 3-layer Llama over 8 tokens with seeded N(0, 0.6^2) weights (norms near 1) as a
    Hugging Face directory at `path`; returns `path`."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.6
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path, safe_serialization=True)
    return path


def exact_continuation_law(
    model_dir: Path,
    temperature: float,
    num_tokens: int,
    rules=None,
    quantization: str | None = None,
) -> torch.Tensor:
    """[V ** num_tokens] float64 probability of each continuation of PROMPT under the processed
    target (cells in `itertools.product` order), the target quantized as `quantization`; with
    `rules` (a `LogitsRules`), each position's logits first go through the audit's independent
    twin of the rules, with the continuation so far as output."""
    from specdec.audit.laws import rules_logits_reference

    model = load_model(model_dir, quantization=quantization).model
    prefixes = [
        list(p) for n in range(num_tokens) for p in itertools.product(range(VOCAB), repeat=n)
    ]
    logits = prompt_logits(model, [PROMPT + p for p in prefixes])
    probs = {}
    for prefix, row in zip(prefixes, logits, strict=True):
        last = row[-1:].double()
        if rules is not None:
            last = rules_logits_reference(last[0], rules, PROMPT, prefix)[None]
        processed = process_logits(last, torch.tensor([temperature]))
        probs[tuple(prefix)] = processed.softmax(-1)[0]
    law = torch.zeros(VOCAB**num_tokens, dtype=torch.float64)
    for cell, seq in enumerate(itertools.product(range(VOCAB), repeat=num_tokens)):
        p = 1.0
        for i in range(num_tokens):
            p *= float(probs[seq[:i]][seq[i]])
        law[cell] = p
    return law


def first_token_counts(
    model_dir: Path,
    spec: dict | None,
    temperature: float,
    max_tokens: int,
    num_tokens: int,
    num_trials: int,
    engine_args: dict | None = None,
    **sampling: object,
) -> tuple[torch.Tensor, dict]:
    """(counts [V ** num_tokens] float64 of the first num_tokens emitted tokens of num_trials
    requests seeded 0 .. num_trials - 1 through the engine (with `engine_args`), the engine's
    spec-decode metrics); `sampling`: further SamplingParams fields of every request."""
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    llm = LLM(
        str(model_dir),
        speculative_config=spec,
        max_model_len=32,
        block_size=4,
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        **(engine_args or {}),
    )
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=s, **sampling
        )
        for s in range(num_trials)
    ]
    outputs = llm.generate([PROMPT] * num_trials, params, use_tqdm=False)
    counts = torch.zeros(VOCAB**num_tokens, dtype=torch.float64)
    for out in outputs:
        cell = 0
        for token in out.outputs[0].token_ids[:num_tokens]:
            cell = cell * VOCAB + token
        counts[cell] += 1
    return counts, llm.get_metrics()


# Penalties, a bias and bans through the whole engine (no tokenizer: no bad_words here; the
# multi-token bad words are covered by the audit's toy checks).
RULES = {
    "repetition_penalty": 1.8,
    "presence_penalty": 1.0,
    "frequency_penalty": 0.8,
    "logit_bias": {3: 1.5},
    "allowed_token_ids": [0, 1, 2, 3, 4, 5, 6],
    "min_tokens": 2,
    "stop_token_ids": [5],
}


def rules_law(model_dir, temperature: float, num_tokens: int) -> torch.Tensor:
    """[V ** num_tokens] float64 exact law of the first tokens under temperature and `RULES`."""
    from specdec.sampling import LogitsRules, SamplingParams

    rules = LogitsRules.from_params(
        SamplingParams(ignore_eos=True, max_tokens=num_tokens, **RULES),
        vocab_size=VOCAB,
        eos_token_id=None,
    )
    return exact_continuation_law(model_dir, temperature, num_tokens, rules)
