"""GPU twins for structured outputs (skipped without CUDA): the Triton bitmask kernel equals
`apply_bitmask_ref` bit for bit, a constrained `LogitsContext` on CUDA equals the CPU one, and
the engine on CUDA with a grammar keeps greedy speculation == greedy plain and coupled == plain.
"""

from __future__ import annotations

import pytest
import torch

from specdec.audit import toy_grammar_matchers
from specdec.audit.laws import GRAMMAR_TOKENS
from specdec.sampling import LogitsContext
from specdec.sampling.bitmask import apply_bitmask, apply_bitmask_ref

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.mark.parametrize("vocab", [31, 32, 1000, 128_256])
def test_bitmask_kernel_equals_the_twin(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=generator).to(torch.int32)
    rows = torch.tensor([5, 0, 3])
    reference = logits.clone()
    apply_bitmask_ref(reference, bitmask, rows)
    on_device = logits.to(CUDA)
    apply_bitmask(on_device, bitmask.to(CUDA), rows.to(CUDA))
    assert torch.equal(on_device.cpu(), reference)


def test_constrained_context_on_cuda_equals_cpu():
    vocab = len(GRAMMAR_TOKENS)
    raw = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([0, 0, 1, 1])
    prefix = torch.tensor([[-1, -1], [1, -1], [2, 3], [4, 0]])

    def run(device):
        matchers = toy_grammar_matchers(2)
        context = LogitsContext([None, None], [[0], [0]], [[], []], matchers)
        return context.apply(raw.to(device), rows.to(device), prefix.to(device)).cpu()

    assert torch.equal(run(CUDA), run(torch.device("cpu")))


def plain_and_speculative(model_dir, prompt, params, method):
    """The requests' tokens through plain decoding and through speculation (draft model = the
    target's first layer, K = 2, `method`) on CUDA: ({"plain": ..., "spec": ...}, the
    speculating LLM)."""
    from specdec import LLM

    spec = {
        "method": "draft_model",
        "model": "truncated:1",
        "num_speculative_tokens": 2,
        "rejection_sample_method": method,
    }
    outputs = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = LLM(
            str(model_dir),
            speculative_config=config,
            max_model_len=32,
            device="cuda",
            num_kv_blocks=64,
        )
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        outputs[name] = [o.outputs[0].token_ids for o in outs]
    return outputs, llm


@pytest.mark.parametrize(
    ("method", "temperature"), [("coupled", 0.8), ("standard", 0.0), ("block", 0.0)]
)
def test_engine_with_a_grammar_on_cuda(tmp_path, method, temperature):
    """On CUDA: constrained speculation (draft model = the target's first layer, K = 2) emits
    exactly plain constrained decoding's tokens (coupled at 0.8; greedy with any verifier), and
    every output is in the language."""
    from law_fixtures import PROMPT, save_vocab8_target, write_grammar_tokenizer
    from specdec import SamplingParams, StructuredOutputsParams
    from specdec.audit.laws import GRAMMAR_REGEX

    save_vocab8_target(tmp_path)
    write_grammar_tokenizer(tmp_path)
    constraint = StructuredOutputsParams(regex=GRAMMAR_REGEX)
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=8, structured_outputs=constraint)
        for s in range(64)
    ]
    outputs, _ = plain_and_speculative(tmp_path, PROMPT, params, method)
    assert outputs["plain"] == outputs["spec"]
    assert all(7 not in tokens for tokens in outputs["spec"])  # "d" is never in the language


def test_constrained_requests_decode_beside_graphed_rounds(tmp_path):
    """On CUDA with the default loop (graphed device rounds, the adaptive policy, coupled at
    0.8): a third of the requests constrained, a third penalised, a third without rules. The
    constrained ones decode beside the rounds (s43), the others take them; every request emits
    plain decoding's tokens."""
    from law_fixtures import PROMPT, save_vocab8_target, write_grammar_tokenizer
    from specdec import SamplingParams, StructuredOutputsParams
    from specdec.audit.laws import GRAMMAR_REGEX

    save_vocab8_target(tmp_path)
    write_grammar_tokenizer(tmp_path)
    constraint = StructuredOutputsParams(regex=GRAMMAR_REGEX)
    rules = [{"structured_outputs": constraint}, {"presence_penalty": 0.8}, {}]
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True, **rules[s % 3])
        for s in range(48)
    ]
    outputs, speculating = plain_and_speculative(tmp_path, PROMPT, params, "coupled")
    assert outputs["plain"] == outputs["spec"]
    loop = speculating.get_metrics()["loop"]
    assert loop["num_graph_rounds"] > 0 and loop["num_sync_steps"] == 0
    assert loop["num_side_rows"] > 0  # the constrained ones decoded beside the rounds
