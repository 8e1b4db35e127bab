"""GPU twins of the tensor-API edges and of the context processing (skipped without CUDA):
`sample` / `verify` under `torch.set_default_device("cuda")`, the 2**32 position limit, NaN as
-inf and refused rows, penalties and bans on CUDA equal to the CPU, and the engine with
penalties on CUDA (greedy speculation == greedy plain, coupled == plain).

Inputs come from the test's own seeded generators; comparisons are exact (tokens, and the
processed logits bit for bit where the contract says so).
"""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import LogitsContext, LogitsRules, sample, sample_ref
from specdec.verify import verify, verify_ref

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
B, K, V = 8, 3, 1000
RULES = LogitsRules(
    repetition_penalty=1.4,
    presence_penalty=0.7,
    frequency_penalty=0.3,
    logit_bias=((3, 2.0), (4, -100.0)),
    bad_words_token_ids=((5,), (6, 7), (8, 9, 10)),
    min_tokens=3,
    min_tokens_banned=(0,),
)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(B, K + 1, V, generator=gen) * 3
    draft = torch.randn(B, K, V, generator=gen) * 3
    drafts = draft.argmax(-1)
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=gen)
    positions = torch.randint(1, 10_000, (B,), generator=gen)
    return target, draft, drafts, seeds, positions


def _context() -> LogitsContext:
    outputs = [[6], [8, 9], [], [1, 1, 2], [3], [6, 6], [9], [0, 8, 9]]
    return LogitsContext([RULES] * B, [[1, 2, 3]] * B, outputs)


def test_sample_and_verify_under_default_device_cuda():
    """Staging buffers are pinned on the CPU explicitly: no "Only dense CPU tensors can be
    pinned" when the default device is CUDA, and the same results as without it."""
    target, draft, drafts, seeds, positions = _inputs()
    args = [t.to(CUDA) for t in (target, draft, drafts, seeds, positions)]
    plain_sample = sample(args[0][:, 0], args[3], args[4], temperature=0.8, top_k=50)
    plain_verify = verify(args[0], args[2], None, args[3], args[4], temperature=0.8)
    torch.set_default_device("cuda")
    try:
        under_sample = sample(args[0][:, 0], args[3], args[4], temperature=0.8, top_k=50)
        under_verify = verify(args[0], args[2], None, args[3], args[4], temperature=0.8)
    finally:
        torch.set_default_device(None)
    assert torch.equal(plain_sample.token_ids, under_sample.token_ids)
    assert torch.equal(plain_verify.token_ids, under_verify.token_ids)


@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_the_32_bit_position_limit_is_the_cpu_s(method):
    target, draft, drafts, seeds, _ = _inputs(1)
    draft_logits = None if method == "coupled" else draft
    last = torch.full((B,), 2**32 - 1 - K, dtype=torch.int64)
    cpu = verify_ref(target, drafts, draft_logits, seeds, last, temperature=1.0, method=method)
    on = [None if t is None else t.to(CUDA) for t in (target, drafts, draft_logits, seeds, last)]
    gpu = verify(*on, temperature=1.0, method=method)
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    message = r"positions must lie in \[0, 2\*\*32 - 1 - K\]"
    with pytest.raises(ValueError, match=message):
        verify_ref(target, drafts, draft_logits, seeds, last + 1, temperature=1.0, method=method)
    with pytest.raises(ValueError, match=message):
        verify(*on[:4], on[4] + 1, temperature=1.0, method=method)


def test_nan_is_minus_infinity_and_unusable_rows_are_refused_on_cuda():
    target, draft, drafts, seeds, positions = _inputs(2)
    target[:, :, :50] = float("nan")
    logits = target[:, 0]
    for temperature in (0.0, 0.9):
        cpu = sample_ref(logits, seeds, positions, temperature=temperature, top_p=0.9)
        gpu = sample(
            logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA), temperature=temperature, top_p=0.9
        )
        assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
        assert torch.equal(cpu.processed_logits, gpu.processed_logits.cpu())
    cpu = verify_ref(target, drafts, draft, seeds, positions, temperature=0.9)
    gpu = verify(*(t.to(CUDA) for t in (target, drafts, draft, seeds, positions)), temperature=0.9)
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    bad = logits.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="logits row 3 has no finite logit"):
        sample(bad.to(CUDA), seeds.to(CUDA), positions.to(CUDA), temperature=1.0)
    target[2, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"target_logits\[2, 1\] has no finite logit"):
        verify(*(t.to(CUDA) for t in (target, drafts, draft, seeds, positions)), temperature=1.0)


@pytest.mark.parametrize("fill", [float("nan"), float("-inf"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_only_rows_the_outcome_reads_are_refused_on_cuda(method, temperature, fill):
    """The CPU's contract (tests/unit/test_verify_inputs.py): a garbage bonus row after a
    rejection is never read (the fused kernels emit the CPU's tokens), a bonus row read after
    a full chain and a draft row are refused, naming the row."""
    gen = torch.Generator().manual_seed(7)
    target = torch.full((B, K + 1, V), -10.0) + 0.1 * torch.randn(B, K + 1, V, generator=gen)
    for j in range(K + 1):
        target[:, j, j + 1] = 10.0
    drafts = torch.tensor([[1, 2, 3]] * B)
    drafts[::2, 2] = 0  # even requests reject their draft 2 (target(0) ~ e**-20)
    seeds = torch.arange(B, dtype=torch.int64) + 5
    positions = torch.arange(B, dtype=torch.int64) * 10 + 3

    def spoil(row: torch.Tensor) -> None:
        if fill == float("inf"):
            row[4] = fill
        else:
            row.fill_(fill)

    for b in range(0, B, 2):
        spoil(target[b, K])  # bonus rows after a rejection: never read
    kwargs = {"temperature": temperature, "method": method}
    cpu = verify_ref(target, drafts, None, seeds, positions, **kwargs)
    on = [t.to(CUDA) for t in (target, drafts)]
    gpu = verify(on[0], on[1], None, seeds.to(CUDA), positions.to(CUDA), **kwargs)
    assert cpu.num_accepted.tolist() == [2, 3] * (B // 2)
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    read = target.clone()
    spoil(read[1, K])  # request 1 accepts all 3 drafts: its bonus row is read
    with pytest.raises(ValueError, match=r"target_logits\[1, 3\] .*accepted all 3"):
        verify(read.to(CUDA), on[1], None, seeds.to(CUDA), positions.to(CUDA), **kwargs)
    read = target.clone()
    spoil(read[2, 2])  # request 2's rejected draft row: read
    with pytest.raises(ValueError, match=r"target_logits\[2, 2\] .*its draft 2"):
        verify(read.to(CUDA), on[1], None, seeds.to(CUDA), positions.to(CUDA), **kwargs)


@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_context_processing_on_cuda_equals_the_cpu(method):
    """Penalties, bias and bans: the context's tensors built on CUDA give the CPU's processed
    logits bit for bit, so sample and verify (row j with drafts 0..j-1) agree token for token."""
    target, draft, drafts, seeds, positions = _inputs(3)
    draft_logits = None if method == "coupled" else draft
    context = _context()
    cpu_logits = context.apply(target[:, 0])
    gpu_logits = _context().apply(target[:, 0].to(CUDA))
    assert torch.equal(cpu_logits, gpu_logits.cpu())
    cpu = sample_ref(target[:, 0], seeds, positions, temperature=0.8, context=context)
    gpu = sample(
        target[:, 0].to(CUDA),
        seeds.to(CUDA),
        positions.to(CUDA),
        temperature=0.8,
        context=_context(),
    )
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    cpu_v = verify_ref(
        target,
        drafts,
        draft_logits,
        seeds,
        positions,
        temperature=0.8,
        method=method,
        context=context,
    )
    on = [None if t is None else t.to(CUDA) for t in (target, drafts, draft_logits, seeds)]
    gpu_v = verify(*on, positions.to(CUDA), temperature=0.8, method=method, context=_context())
    assert torch.equal(cpu_v.token_ids, gpu_v.token_ids.cpu())


def test_engine_with_penalties_on_cuda(tmp_path):
    """Through the engine on CUDA with penalties and bans: greedy speculation equals greedy
    plain decoding, coupled equals plain sampling, token for token (the drafter processes its
    drafts with the drafts before them, the verifier each row with the drafts before it)."""
    from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    model_dir = save_hf_model(make_hf_model("llama"), tmp_path)
    prompts = prompt_tokens(97, [5, 9, 14], seed=3)
    rules = {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.4,
        "logit_bias": {5: 1.0},
        "min_tokens": 4,
        "stop_token_ids": [7],
    }
    spec = {"method": "draft_model", "model": "truncated:2", "num_speculative_tokens": 3}
    # Explicit caches: two engines live at once here, and a cache sized from free memory would
    # leave the second none.
    plain = LLM(
        str(model_dir), speculative_config=None, device="cuda", max_model_len=64, num_kv_blocks=256
    )
    for temperature, method in ((0.0, "standard"), (0.0, "block"), (1.0, "coupled")):
        params = SamplingParams(
            temperature=temperature, max_tokens=24, seed=5, ignore_eos=True, **rules
        )
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        llm = LLM(
            str(model_dir),
            speculative_config={**spec, "rejection_sample_method": method},
            device="cuda",
            max_model_len=64,
            num_kv_blocks=256,
        )
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected, method
        assert llm.get_metrics()["num_drafts"] > 0
