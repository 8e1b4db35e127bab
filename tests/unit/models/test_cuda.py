"""The same forward pass on CUDA: paged steps agree with the CPU run of the same weights."""

from __future__ import annotations

import pytest
import torch

from models_fixtures import TINY_CONFIGS, PagedRunner, prompt_tokens
from specdec.models import LlamaForCausalLM, ModelConfig
from specdec.models.weights import assign_weights


def _seeded_model(name: str, device: str) -> LlamaForCausalLM:
    config = ModelConfig.from_hf_config(TINY_CONFIGS[name])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    state = {
        param_name: 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        if param_name.endswith("norm.weight")
        else 0.15 * torch.randn(param.shape, generator=generator)
        for param_name, param in model.named_parameters()
    }
    assign_weights(model, state.get, name, torch.float32, device)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_cuda_matches_cpu(name: str) -> None:
    cpu_runner = PagedRunner(_seeded_model(name, "cpu"), num_blocks=24, block_size=4)
    cuda_model = _seeded_model(name, "cuda")
    cuda_runner = PagedRunner(cuda_model, num_blocks=24, block_size=4)
    sequences = prompt_tokens(97, [19, 9, 24], seed=3)
    done = [0, 0, 0]
    for step in [[11, 4, 13], [5, 1, 8], [1, 3, 1], [1, 1, 1]]:
        new = {b: sequences[b][done[b] : done[b] + n] for b, n in enumerate(step)}
        cpu_logits = cpu_runner.step(new)
        cuda_logits = cuda_runner.step(new)
        for b in new:
            assert cuda_logits[b].device.type == "cuda"
            torch.testing.assert_close(cuda_logits[b].cpu(), cpu_logits[b], atol=1e-4, rtol=1e-4)
        done = [d + n for d, n in zip(done, step, strict=True)]
