"""GPU parity: the Triton twins against the PyTorch references on the CPU.

Bit for bit where the contract says so (Philox words, uniforms, processed logits), token for token
elsewhere (inputs are continuous random values, so near-ties have probability ~1e-6 per decision).
Every input is drawn fresh from the test's own seeded generator; Triton is imported only inside the
tests, so collecting this module needs no GPU stack.
"""

from __future__ import annotations

import re

import pytest
import torch

from specdec.rng import Stream, philox4x32_10, uniform
from specdec.sampling import SamplingTensors, filter_threshold, sample, sample_ref, scale_logits
from specdec.verify import verify, verify_ref

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
MASK32 = 0xFFFFFFFF

# Random123 known-answer vectors for philox4x32_10 (kat_vectors): counter, key -> output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeds(num: int, gen: torch.Generator) -> torch.Tensor:
    """int64 seeds covering the whole signed range, including the edge values."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (num,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([0, -1, 2**32, 2**32 + 5, -(2**63), 2**63 - 1, 12345], dtype=torch.int64)
    seeds[: min(num, len(edges))] = edges[: min(num, len(edges))]
    return seeds


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ----------------------------------------------------------------------------------------------
# RNG


def test_philox_known_answers_and_torch_twin() -> None:
    from specdec.rng.philox_triton import philox_triton

    counters = torch.tensor([c for c, _, _ in PHILOX_KAT], dtype=torch.int64)
    keys = torch.tensor([k for _, k, _ in PHILOX_KAT], dtype=torch.int64)
    expected = torch.tensor([o for _, _, o in PHILOX_KAT], dtype=torch.int64)
    assert torch.equal(philox_triton(counters.to(CUDA), keys.to(CUDA)).cpu(), expected)

    gen = _generator(0)
    counters = torch.randint(0, 2**32, (4096, 4), generator=gen, dtype=torch.int64)
    keys = torch.randint(0, 2**32, (4096, 2), generator=gen, dtype=torch.int64)
    want = torch.stack(philox4x32_10(*counters.unbind(1), *keys.unbind(1)), dim=1)
    assert torch.equal(philox_triton(counters.to(CUDA), keys.to(CUDA)).cpu(), want)


@pytest.mark.parametrize("num_lanes", [1, 2, 3, 4, 5, 13, 1000, 4099, 32003])
def test_uniform_bitwise(num_lanes: int) -> None:
    from specdec.rng.philox_triton import uniform_triton

    gen = _generator(num_lanes)
    num_rows = 24
    seeds = _seeds(num_rows, gen)
    positions = torch.randint(0, 2**32, (num_rows,), generator=gen, dtype=torch.int64)
    positions[:3] = torch.tensor([0, 1, 2**32 - 1])
    step_tensor = torch.randint(0, 2**32, (num_rows,), generator=gen, dtype=torch.int64)
    stream_tensor = torch.randint(0, 2**32, (num_rows,), generator=gen, dtype=torch.int64)
    cases = [(stream, 0) for stream in Stream]
    cases += [(Stream.ACCEPT, 2**32 - 1), (Stream.DRAFT, step_tensor), (stream_tensor, step_tensor)]
    for stream, step in cases:
        want = uniform(seeds, positions, stream, num_lanes, step=step)
        got = uniform_triton(
            seeds.to(CUDA),
            positions.to(CUDA),
            stream.to(CUDA) if isinstance(stream, torch.Tensor) else stream,
            num_lanes,
            step=step.to(CUDA) if isinstance(step, torch.Tensor) else step,
        )
        assert torch.equal(_bits(got.cpu()), _bits(want)), (stream, step)


# ----------------------------------------------------------------------------------------------
# sample


def _sample_inputs(num_rows: int, vocab: int, dtype: torch.dtype, seed: int):
    gen = _generator(seed)
    logits = (3 * torch.randn(num_rows, vocab, generator=gen)).to(dtype)
    seeds = _seeds(num_rows, gen)
    positions = torch.randint(0, 2**31, (num_rows,), generator=gen, dtype=torch.int64)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.5, 0.3], dtype=torch.float32).repeat(num_rows)
    temperature = temperature[torch.randperm(len(temperature), generator=gen)[:num_rows]]
    return gen, logits, seeds, positions, temperature


def _filters(kind: str, num_rows: int, vocab: int, gen: torch.Generator) -> dict:
    if kind == "none":
        return {}
    if kind == "top_k":
        return {"top_k": torch.randint(0, 60, (num_rows,), generator=gen, dtype=torch.int64)}
    if kind == "top_p":
        return {"top_p": 0.2 + 0.8 * torch.rand(num_rows, generator=gen)}
    if kind == "min_p":
        return {"min_p": 0.2 * torch.rand(num_rows, generator=gen)}
    return {"top_k": 50, "top_p": 0.9, "min_p": 0.02}


def _to(device: torch.device, kwargs: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _assert_sample_equal(got, want) -> None:
    assert torch.equal(_bits(got.processed_logits.cpu()), _bits(want.processed_logits.cpu()))
    assert torch.equal(got.token_ids.cpu(), want.token_ids.cpu())
    torch.testing.assert_close(got.logsumexp.cpu(), want.logsumexp.cpu(), rtol=2e-6, atol=2e-6)


def _thresholds(logits: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    params = SamplingTensors.build(
        logits.shape[0],
        logits.device,
        kwargs["temperature"],
        kwargs.get("top_k"),
        kwargs.get("top_p"),
        kwargs.get("min_p"),
    )
    scaled = scale_logits(logits, params.temperature)
    return filter_threshold(scaled, params.top_k, params.top_p, params.min_p)


@pytest.mark.parametrize(
    ("num_rows", "vocab", "dtype"),
    [
        (1, 151936, torch.float32),
        (6, 151936, torch.bfloat16),
        (33, 32000, torch.float32),
        (17, 32000, torch.bfloat16),
        (9, 1000, torch.float16),
        (5, 4097, torch.float32),
        (3, 7, torch.float32),
    ],
)
@pytest.mark.parametrize("filters", ["none", "top_k", "top_p", "min_p", "all"])
def test_sample_matches_reference(
    num_rows: int, vocab: int, dtype: torch.dtype, filters: str
) -> None:
    """Against the CPU reference on every row whose filter threshold (computed by the same torch
    `filter_threshold` on each device) is bit-identical on both devices. Top-p thresholds come
    from a softmax and a cumsum whose rounding differs between devices, so a token at the
    nucleus boundary can fall on either side; such rows are checked against the reference on
    the GPU, which sees the same threshold as the kernel."""
    gen, logits, seeds, positions, temperature = _sample_inputs(num_rows, vocab, dtype, vocab)
    kwargs = {"temperature": temperature, **_filters(filters, num_rows, vocab, gen)}
    gpu_kwargs = _to(CUDA, kwargs)
    gpu_inputs = (logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA))
    want = sample_ref(logits, seeds, positions, **kwargs)
    got = sample(*gpu_inputs, **gpu_kwargs)
    cpu_threshold = _thresholds(logits, kwargs)
    same = torch.ones(num_rows, dtype=torch.bool)
    if cpu_threshold is not None:
        gpu_threshold = _thresholds(gpu_inputs[0], gpu_kwargs).cpu()
        same = _bits(cpu_threshold) == _bits(gpu_threshold)
    assert int((~same).sum()) <= max(2, num_rows // 8)
    assert torch.equal(_bits(got.processed_logits.cpu()[same]), _bits(want.processed_logits[same]))
    assert torch.equal(got.token_ids.cpu()[same], want.token_ids[same])
    torch.testing.assert_close(
        got.logsumexp.cpu()[same], want.logsumexp[same], rtol=2e-6, atol=2e-6
    )
    if not bool(same.all()):
        _assert_sample_equal(got, sample_ref(*gpu_inputs, **gpu_kwargs))


def test_sample_streams_steps_and_scalar_temperature() -> None:
    _, logits, seeds, positions, _ = _sample_inputs(12, 5000, torch.float32, 1)
    steps = positions - 3
    for kwargs in (
        {"temperature": 0.8, "stream": Stream.DRAFT, "step": steps},
        {"temperature": 1.0, "stream": Stream.RESIDUAL, "step": 2**32 - 1},
        {"temperature": 0.0},
    ):
        want = sample_ref(logits, seeds, positions, **kwargs)
        got = sample(logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA), **_to(CUDA, kwargs))
        _assert_sample_equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "bad_position"),
    [
        ({"temperature": -1.0}, False),
        ({"temperature": float("nan")}, False),
        ({"temperature": 1.0, "top_p": 0.0}, False),
        ({"temperature": 1.0, "min_p": 1.5}, False),
        ({"temperature": 1.0, "top_k": -2}, False),
        ({"temperature": 1.0, "step": -1}, False),
        ({"temperature": torch.tensor([1.0, -0.5, 1.0, 0.0])}, False),
        ({"temperature": 1.0, "top_k": torch.tensor([1, -3, 0, 5])}, False),
        (
            {
                "temperature": torch.tensor([1.0, 1.0, 0.0, 1.0]),
                "step": torch.tensor([0, 2**32, 0, 0]),
            },
            False,
        ),
        ({"temperature": 0.7}, True),
        # Accepted by the reference (greedy rows draw no noise, so their keys are not checked):
        (
            {
                "temperature": torch.tensor([0.0, 1.0, 1.0, 1.0]),
                "step": torch.tensor([2**32, 0, 0, 0]),
            },
            False,
        ),
        ({"temperature": 0.0, "step": -5}, False),
    ],
)
def test_sample_arguments_like_the_reference(kwargs: dict, bad_position: bool) -> None:
    """Invalid arguments raise exactly what `sample_ref` raises; what it accepts, sample accepts
    and answers identically."""
    _, logits, seeds, positions, _ = _sample_inputs(4, 100, torch.float32, 2)
    if bad_position:
        positions[1] = -1
    gpu = (logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA))
    try:
        want = sample_ref(logits, seeds, positions, **kwargs)
    except ValueError as error:
        with pytest.raises(ValueError) as got:
            sample(*gpu, **_to(CUDA, kwargs))
        assert str(got.value) == str(error)
        return
    _assert_sample_equal(sample(*gpu, **_to(CUDA, kwargs)), want)


def test_sample_without_value_checks_is_the_same_sample() -> None:
    """`check_values=False` (the engine's and drafters' calls) skips only the read-back checks:
    tokens, processed logits and log-normalisers equal the checked call's, bit for bit."""
    gen, logits, seeds, positions, temperature = _sample_inputs(64, 32000, torch.float32, 5)
    kwargs = {"temperature": temperature, **_filters("top_p", 64, 32000, gen)}
    args = (logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA))
    checked = sample(*args, **_to(CUDA, kwargs))
    unchecked = sample(*args, check_values=False, **_to(CUDA, kwargs))
    assert torch.equal(checked.token_ids, unchecked.token_ids)
    assert torch.equal(_bits(checked.processed_logits), _bits(unchecked.processed_logits))
    assert torch.equal(_bits(checked.logsumexp), _bits(unchecked.logsumexp))


def test_sample_into_strided_columns_is_the_same_sample() -> None:
    """`out=` one column of [N, K, V] / [N, K] proposal buffers (a device round's drafts): the
    kernels write there the bits they return without it, and touch no other column."""
    from specdec.sampling import SampleOutput

    gen, logits, seeds, positions, temperature = _sample_inputs(24, 32000, torch.float32, 6)
    kwargs = _to(CUDA, {"temperature": temperature, **_filters("top_k", 24, 32000, gen)})
    args = (logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA))
    want = sample(*args, check_values=False, **kwargs)
    ids = torch.full((24, 3), -1, dtype=torch.int64, device=CUDA)
    lse = torch.zeros(24, 3, device=CUDA)
    proposal = torch.full((24, 3, 32000), float("-inf"), device=CUDA)
    column = SampleOutput(ids[:, 2], proposal[:, 2], lse[:, 2])
    got = sample(*args, check_values=False, out=column, **kwargs)
    assert got is column
    assert torch.equal(ids[:, 2], want.token_ids)
    assert torch.equal(_bits(proposal[:, 2]), _bits(want.processed_logits))
    assert torch.equal(_bits(lse[:, 2]), _bits(want.logsumexp))
    assert bool((ids[:, :2] == -1).all()) and bool((proposal[:, :2] == float("-inf")).all())


def test_sample_batch_invariance() -> None:
    """A row alone == in a batch == permuted, bit for bit (processed logits, token, logsumexp)."""
    _, logits, seeds, positions, temperature = _sample_inputs(16, 151936, torch.bfloat16, 3)
    logits, seeds, positions, temperature = (
        t.to(CUDA) for t in (logits, seeds, positions, temperature)
    )
    batch = sample(logits, seeds, positions, temperature=temperature, top_p=0.95)
    perm = torch.randperm(16, generator=_generator(4)).to(CUDA)
    permuted = sample(
        logits[perm], seeds[perm], positions[perm], temperature=temperature[perm], top_p=0.95
    )
    assert torch.equal(permuted.token_ids, batch.token_ids[perm])
    assert torch.equal(_bits(permuted.processed_logits), _bits(batch.processed_logits[perm]))
    assert torch.equal(_bits(permuted.logsumexp), _bits(batch.logsumexp[perm]))
    for row in (0, 5, 15):
        alone = sample(
            logits[row : row + 1],
            seeds[row : row + 1],
            positions[row : row + 1],
            temperature=temperature[row : row + 1],
            top_p=0.95,
        )
        assert torch.equal(alone.token_ids, batch.token_ids[row : row + 1])
        assert torch.equal(_bits(alone.logsumexp), _bits(batch.logsumexp[row : row + 1]))


# ----------------------------------------------------------------------------------------------
# verify


def _verify_case(
    seed: int,
    method: str,
    draft_kind: str,
    *,
    batch: int = 8,
    k: int = 4,
    vocab: int = 5000,
    dtype: torch.dtype = torch.float32,
    filters: dict | None = None,
):
    """CPU inputs for `verify`: drafts sampled by `sample_ref` from a draft = target + noise of a
    per-request strength (so chains are accepted, partly accepted and rejected), or one-hot."""
    gen = _generator(seed)
    target = (2 * torch.randn(batch, k + 1, vocab, generator=gen)).to(dtype)
    seeds = _seeds(batch, gen)
    anchors = torch.randint(0, 2**31, (batch,), generator=gen, dtype=torch.int64)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.0, 0.9, 1.0] * batch)[:batch]
    num_draft = torch.tensor([k, 0, 2, k, 1, 3, k, k] * batch, dtype=torch.int64)[:batch]
    num_draft = num_draft.clamp_max(k)
    filters = filters or {}
    draft_logits = draft_lse = None
    if draft_kind == "one_hot":
        argmax = target[:, :k].float().argmax(dim=-1)
        random_ids = torch.randint(0, vocab, (batch, k), generator=gen)
        keep = torch.rand(batch, k, generator=gen) < 0.7
        drafts = torch.where(keep, argmax, random_ids)
    else:
        strength = torch.tensor([0.1, 0.5, 2.0, 0.05] * batch)[:batch, None, None]
        noise = torch.randn(batch, k, vocab, generator=gen)
        raw = target[:, :k].float() + strength * noise
        coupled = method == "coupled"
        rows = batch * k
        out = sample_ref(
            raw.reshape(rows, vocab),
            seeds.repeat_interleave(k),
            (anchors[:, None] + torch.arange(k)).flatten(),
            temperature=temperature.repeat_interleave(k),
            stream=Stream.TARGET if coupled else Stream.DRAFT,
            step=0 if coupled else anchors.repeat_interleave(k),
            **{
                key: v.repeat_interleave(k) if isinstance(v, torch.Tensor) else v
                for key, v in filters.items()
            },
        )
        drafts = out.token_ids.view(batch, k)
        draft_logits = out.processed_logits.view(batch, k, vocab)
        if draft_kind == "sampled_lse":
            draft_lse = out.logsumexp.view(batch, k)
    kwargs = {
        "temperature": temperature,
        "num_draft": num_draft,
        "method": method,
        "draft_logsumexp": draft_lse,
        **filters,
    }
    return (target, drafts, draft_logits, seeds, anchors), kwargs


def _run_both(args, kwargs):
    want = verify_ref(*args, **kwargs)
    gpu_args = [a.to(CUDA) if a is not None else None for a in args]
    got = verify(*gpu_args, **_to(CUDA, kwargs))
    return got, want


def _assert_verify_equal(got, want) -> None:
    assert torch.equal(got.num_accepted.cpu(), want.num_accepted.cpu())
    assert torch.equal(got.token_ids.cpu(), want.token_ids.cpu())


METHODS = ["standard", "block", "coupled"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("draft_kind", ["sampled", "sampled_lse", "one_hot"])
@pytest.mark.parametrize(
    ("vocab", "dtype"), [(151936, torch.float32), (32000, torch.bfloat16), (4999, torch.float32)]
)
def test_verify_matches_reference(
    method: str, draft_kind: str, vocab: int, dtype: torch.dtype
) -> None:
    for seed in range(3):
        args, kwargs = _verify_case(seed + vocab, method, draft_kind, vocab=vocab, dtype=dtype)
        got, want = _run_both(args, kwargs)
        _assert_verify_equal(got, want)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("drafts", 10**9, "draft_token_ids must lie"),
        ("drafts", -5, "draft_token_ids must lie"),
        ("num_draft", 9, "num_draft must lie"),
        ("num_draft", -3, "num_draft must lie"),
        ("positions", -1, "positions must lie"),
        ("temperature", float("nan"), "temperature must be finite"),
    ],
)
def test_verify_invalid_values_raise_while_kernels_stay_in_bounds(
    method: str, field: str, value: float, message: str
) -> None:
    """`verify` checks values while its kernels run: a bad value raises the reference's
    ValueError, and the kernels, launched on it, touched no memory out of bounds (the device
    keeps working and the next valid call matches the reference)."""
    args, kwargs = _verify_case(11, method, "sampled")
    drafts, anchors = args[1], args[4]
    bad_args, bad_kwargs = list(args), dict(kwargs)
    if field == "drafts":
        bad = drafts.clone()
        bad[0, 0] = int(value)
        bad_args[1] = bad
    elif field == "positions":
        bad = anchors.clone()
        bad[2] = int(value)
        bad_args[4] = bad
    else:
        bad = kwargs[field].clone()
        bad[0] = value
        bad_kwargs[field] = bad
    with pytest.raises(ValueError, match=message):
        verify_ref(*bad_args, **bad_kwargs)
    gpu_args = [a.to(CUDA) if a is not None else None for a in bad_args]
    with pytest.raises(ValueError, match=message):
        verify(*gpu_args, **_to(CUDA, bad_kwargs))
    torch.cuda.synchronize()
    got, want = _run_both(args, kwargs)
    _assert_verify_equal(got, want)


def _invalid_value_case(gen: torch.Generator, trial: int):
    """Random `ValueCheck` arguments where each rule is broken in some row with probability 0.15
    (positions, num_draft, drafts, temperature, top_k, top_p, min_p, the drafts' logits)."""
    batch = int(torch.randint(1, 700, (1,), generator=gen))
    k = int(torch.randint(0, 6, (1,), generator=gen))
    vocab = 50
    active = int(torch.randint(0, batch + 1, (1,), generator=gen))
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    positions = torch.randint(0, 1000, (batch,), generator=gen)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    logits = torch.randn(batch, k, vocab, generator=gen)
    temperature = torch.rand(batch, generator=gen)
    top_k = torch.randint(0, 10, (batch,), generator=gen)
    top_p = 0.1 + 0.9 * torch.rand(batch, generator=gen)
    min_p = torch.rand(batch, generator=gen)

    def row() -> int:
        return int(torch.randint(0, batch, (1,), generator=gen))

    def col() -> int:
        return int(torch.randint(0, k, (1,), generator=gen))

    breakers = [
        lambda r: positions.__setitem__(r, [-1, 2**32, 2**40][r % 3]),
        lambda r: num_draft.__setitem__(r, [-1, k + 1, 100][r % 3]),
        lambda r: k and drafts.__setitem__((r, col()), [-1, vocab, 10**9][r % 3]),
        lambda r: temperature.__setitem__(r, [float("nan"), float("inf"), -0.5][r % 3]),
        lambda r: top_k.__setitem__(r, -1),
        lambda r: top_p.__setitem__(r, [0.0, 1.5, float("nan")][r % 3]),
        lambda r: min_p.__setitem__(r, [-0.1, 1.5, float("nan")][r % 3]),
        lambda r: k and logits.__setitem__((r, col(), 7), [float("-inf"), float("nan")][r % 2]),
    ]
    for breaker in breakers:
        if torch.rand(1, generator=gen) < 0.15:
            breaker(row())
    given = torch.rand(3, generator=gen) < 0.6
    params = SamplingTensors(
        temperature,
        top_k if given[0] else None,
        top_p if given[1] else None,
        min_p if given[2] else None,
    )
    draft_logits = None if trial % 4 == 0 else logits
    if trial % 5 == 0 and draft_logits is not None:
        draft_logits = draft_logits.to(torch.bfloat16)
    method = METHODS[trial % 3]
    return drafts, draft_logits, positions, num_draft, params, method, active, vocab


def test_value_rules_kernel_matches_the_cpu_rules() -> None:
    """The GPU's rule word (one bit per `verify` value rule) equals the PyTorch rules' on random
    arguments that break each rule in some trials; every rule is seen broken and intact."""
    from specdec.verify import ValueCheck

    gen = _generator(2024)
    seen = 0
    clean = 0
    for trial in range(400):
        drafts, logits, positions, num_draft, params, method, active, vocab = _invalid_value_case(
            gen, trial
        )
        want = ValueCheck(drafts, logits, positions, num_draft, params, method, active, vocab)
        fields = (params.temperature, params.top_k, params.top_p, params.min_p)
        gpu_params = SamplingTensors(*(None if t is None else t.to(CUDA) for t in fields))
        got = ValueCheck(
            drafts.to(CUDA),
            None if logits is None else logits.to(CUDA),
            positions.to(CUDA),
            num_draft.to(CUDA),
            gpu_params,
            method,
            active,
            vocab,
        )
        assert got.bits() == want.bits(), trial
        seen |= want.bits()
        clean += want.bits() == 0
    assert seen == 0xFF and clean > 20


def test_strided_and_zero_dim_key_tensors() -> None:
    """Seeds, positions and steps given as strided CUDA views or a 0-d step: the kernels read
    them as the reference does (they index per-row tensors with unit stride, so `sample` and the
    argument checks make them contiguous), and invalid values in a strided view still raise."""
    gen = _generator(5)
    logits = torch.randn(16, 3000, generator=gen)
    all_seeds = _seeds(32, gen)
    all_positions = torch.randint(0, 1000, (32,), generator=gen)
    seeds, positions = all_seeds[::2], all_positions[::2]
    cuda_seeds, cuda_positions = all_seeds.to(CUDA)[::2], all_positions.to(CUDA)[::2]
    assert cuda_positions.stride(0) == 2
    all_steps = torch.arange(32)
    for step, cuda_step in (
        (torch.tensor(7), torch.tensor(7, device=CUDA)),
        (all_steps[::2], all_steps.to(CUDA)[::2]),
    ):
        want = sample_ref(logits, seeds, positions, temperature=0.9, stream=Stream.DRAFT, step=step)
        got = sample(
            logits.to(CUDA),
            cuda_seeds,
            cuda_positions,
            temperature=0.9,
            stream=Stream.DRAFT,
            step=cuda_step,
        )
        _assert_sample_equal(got, want)
    bad = all_positions.clone()
    bad[6] = -1  # row 3 of the strided view
    with pytest.raises(ValueError, match="positions"):
        sample_ref(logits, seeds, bad[::2], temperature=0.9)
    with pytest.raises(ValueError, match="positions"):
        sample(logits.to(CUDA), cuda_seeds, bad.to(CUDA)[::2], temperature=0.9)
    args, kwargs = _verify_case(3, "standard", "sampled", batch=8)
    want = verify_ref(*args, **kwargs)
    gpu_args = [a.to(CUDA) if a is not None else None for a in args]
    wide = torch.stack([gpu_args[4], torch.full_like(gpu_args[4], -1)], dim=1)
    gpu_args[4] = wide[:, 0]  # the anchors as a stride-2 view (the -1 between them is invalid)
    _assert_verify_equal(verify(*gpu_args, **_to(CUDA, kwargs)), want)


def test_sample_rules_kernel_agrees_with_the_reference() -> None:
    """`sample` on CUDA raises exactly when `sample_ref` does, on random arguments that break
    each per-row rule (positions, temperature, stream, step, top-k, top-p, min-p) in some trials;
    valid calls return the reference's tokens."""
    gen = _generator(77)
    raised = 0
    for trial in range(150):
        num = int(torch.randint(1, 600, (1,), generator=gen))
        logits = torch.randn(num, 20, generator=gen)
        positions = torch.randint(0, 1000, (num,), generator=gen)
        seeds = _seeds(num, gen)
        temperature = torch.rand(num, generator=gen)
        temperature[torch.rand(num, generator=gen) < 0.3] = 0.0
        stream = torch.randint(0, 4, (num,), generator=gen)
        step = torch.randint(0, 100, (num,), generator=gen)
        top_k = torch.randint(0, 10, (num,), generator=gen)
        top_p = 0.1 + 0.9 * torch.rand(num, generator=gen)
        min_p = 0.5 * torch.rand(num, generator=gen)
        breakers = [
            (positions, [-1, 2**32]),
            (temperature, [float("nan"), float("inf"), -1.0]),
            (stream, [-1, 2**32]),
            (step, [-1, 2**33]),
            (top_k, [-2]),
            (top_p, [0.0, 1.2, float("nan")]),
            (min_p, [-0.5, 1.5, float("nan")]),
        ]
        for tensor, values in breakers:
            if torch.rand(1, generator=gen) < 0.12:
                row = int(torch.randint(0, num, (1,), generator=gen))
                tensor[row] = values[row % len(values)]
        use = (torch.rand(6, generator=gen) < 0.6).tolist()
        kwargs = {
            "temperature": temperature if use[0] else 0.7,
            "stream": stream if use[1] else 1,
            "step": step if use[2] else 0,
            "top_k": top_k if use[3] else None,
            "top_p": top_p if use[4] else None,
            "min_p": min_p if use[5] else None,
        }
        try:
            want = sample_ref(logits, seeds, positions, **kwargs)
        except ValueError as error:
            raised += 1
            with pytest.raises(ValueError, match=re.escape(str(error))):
                sample(logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA), **_to(CUDA, kwargs))
            continue
        got = sample(logits.to(CUDA), seeds.to(CUDA), positions.to(CUDA), **_to(CUDA, kwargs))
        # The first rows only: with 20 tokens a row, a near-tie between the GPU's and the CPU's
        # noise (they differ by ~3e-7) would show up about once in 1e5 rows.
        assert torch.equal(got.token_ids[:8].cpu(), want.token_ids[:8]), trial
    assert 20 < raised < 130


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("draft_kind", ["sampled", "one_hot"])
def test_verify_with_filters_matches_reference(method: str, draft_kind: str) -> None:
    """With top-k / top-p / min-p, against the reference run on the GPU copies: top-p thresholds
    come from torch's softmax and cumsum, whose rounding is device-dependent (see
    `test_sample_matches_reference`), so the same-device reference sees the kernel's threshold."""
    batch = 8
    gen = _generator(7)
    filters = {
        "top_k": torch.randint(0, 40, (batch,), generator=gen, dtype=torch.int64),
        "top_p": 0.5 + 0.5 * torch.rand(batch, generator=gen),
        "min_p": 0.05 * torch.rand(batch, generator=gen),
    }
    for seed in range(3):
        args, kwargs = _verify_case(seed, method, draft_kind, batch=batch, filters=filters)
        gpu_args = [a.to(CUDA) if a is not None else None for a in args]
        gpu_kwargs = _to(CUDA, kwargs)
        got = verify(*gpu_args, **gpu_kwargs)
        _assert_verify_equal(got, verify_ref(*gpu_args, **gpu_kwargs))


@pytest.mark.parametrize("method", METHODS)
def test_verify_acceptance_paths_are_exercised(method: str) -> None:
    """Over many requests the comparison sees full chains (bonus), rejections (residual) and
    greedy rows: it is not passing on a single path."""
    accepted = []
    for seed in range(4):
        args, kwargs = _verify_case(100 + seed, method, "sampled", batch=32, k=3, vocab=3000)
        got, want = _run_both(args, kwargs)
        _assert_verify_equal(got, want)
        sampled = kwargs["temperature"] > 0
        accepted.append(want.num_accepted[sampled] - kwargs["num_draft"][sampled])
    gap = torch.cat(accepted)
    assert bool((gap == 0).any()) and bool((gap < 0).any())


@pytest.mark.parametrize("method", METHODS)
def test_verify_padded_rows_are_inert(method: str) -> None:
    """Rows >= active_rows hold junk (NaN logits, out-of-range drafts): they stay -1 / 0, and the
    active rows equal the reference on the active slice alone."""
    (target, drafts, draft_logits, seeds, anchors), kwargs = _verify_case(
        21, method, "sampled", batch=8
    )
    active = 5
    target[active:] = float("nan")
    draft_logits[active:] = float("nan")
    drafts[active:] = 10**6
    want = verify_ref(
        target[:active],
        drafts[:active],
        draft_logits[:active],
        seeds[:active],
        anchors[:active],
        **{k: v[:active] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
    )
    got = verify(
        target.to(CUDA),
        drafts.to(CUDA),
        draft_logits.to(CUDA),
        seeds.to(CUDA),
        anchors.to(CUDA),
        active_rows=active,
        **_to(CUDA, kwargs),
    )
    assert torch.equal(got.token_ids[active:].cpu(), torch.full((3, 5), -1, dtype=torch.int64))
    assert torch.equal(got.num_accepted[active:].cpu(), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(got.token_ids[:active].cpu(), want.token_ids)
    assert torch.equal(got.num_accepted[:active].cpu(), want.num_accepted)
    nothing = verify(
        target.to(CUDA),
        drafts.to(CUDA),
        draft_logits.to(CUDA),
        seeds.to(CUDA),
        anchors.to(CUDA),
        active_rows=0,
        **_to(CUDA, kwargs),
    )
    assert bool((nothing.token_ids == -1).all()) and bool((nothing.num_accepted == 0).all())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_without_drafts_is_one_plain_sample(method: str, one_hot: bool) -> None:
    """K = 0: the emitted token is the plain sampler's token from the same logits and key."""
    gen = _generator(31)
    batch, vocab = 6, 3000
    target = 2 * torch.randn(batch, 1, vocab, generator=gen)
    seeds = _seeds(batch, gen)
    anchors = torch.randint(0, 2**31, (batch,), generator=gen, dtype=torch.int64)
    temperature = torch.tensor([1.0, 0.0, 0.5, 1.2, 0.9, 1.0])
    want = sample_ref(target[:, 0], seeds, anchors, temperature=temperature).token_ids
    draft_logits = None if one_hot else torch.zeros(batch, 0, vocab, device=CUDA)
    got = verify(
        target.to(CUDA),
        torch.zeros(batch, 0, dtype=torch.int64, device=CUDA),
        draft_logits,
        seeds.to(CUDA),
        anchors.to(CUDA),
        temperature=temperature.to(CUDA),
        method=method,
    )
    assert torch.equal(got.token_ids[:, 0].cpu(), want)
    assert bool((got.num_accepted == 0).all())


@pytest.mark.parametrize("method", METHODS)
def test_verify_batch_invariance(method: str) -> None:
    """A request alone == in a batch == permuted, token for token."""
    args, kwargs = _verify_case(41, method, "sampled", batch=8, vocab=151936)
    args = [a.to(CUDA) for a in args]
    kwargs = _to(CUDA, kwargs)
    batch = verify(*args, **kwargs)
    perm = torch.randperm(8, generator=_generator(5)).to(CUDA)

    def rows(index: torch.Tensor) -> tuple[list, dict]:
        sub = {k: v[index] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return [a[index] for a in args], sub

    permuted = verify(*rows(perm)[0], **rows(perm)[1])
    assert torch.equal(permuted.token_ids, batch.token_ids[perm])
    assert torch.equal(permuted.num_accepted, batch.num_accepted[perm])
    for row in range(8):
        index = torch.tensor([row], device=CUDA)
        alone = verify(*rows(index)[0], **rows(index)[1])
        assert torch.equal(alone.token_ids, batch.token_ids[index])
        assert torch.equal(alone.num_accepted, batch.num_accepted[index])
