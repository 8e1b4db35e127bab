"""The same forward pass on CUDA: paged steps agree with the CPU run of the same weights."""

from __future__ import annotations

import pytest
import torch

from models_fixtures import TINY_CONFIGS, PagedRunner, prompt_tokens, seeded_model


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_cuda_matches_cpu(name: str) -> None:
    cpu_runner = PagedRunner(seeded_model(name, "cpu"), num_blocks=24, block_size=4)
    cuda_model = seeded_model(name, "cuda")
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
