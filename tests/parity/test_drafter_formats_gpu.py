"""The public drafter checkpoint formats on CUDA (issue 36): the tiny random checkpoints of the CPU
format tests (`public_drafter_fixtures`: EAGLE-3 in SpecForge's style, EAGLE-1/2, Medusa in
FasterDecoding's names, z-lab's DFlash, MiMo's and DeepSeek-V3's MTP layers inside the target,
and a DeepSeek-V3 chain of two MTP layers), each loaded through `LLMEngine` in float32 (the
CPU tests' dtype). Greedy speculation emits greedy plain decoding's tokens and the default
verifier (coupled) at temperature 0.8 emits plain sampling's tokens for the same seeds; the
draft logits of the drafter on CUDA equal the CPU drafter's on the same target features.

The path each takes is CUDA's default (async_scheduling "auto", on for CUDA; CUDA graphs), and
is checked: EAGLE-3, EAGLE-1/2, one MTP layer (through `EagleDrafter`) and DFlash run device
rounds replayed from CUDA graphs; Medusa and an MTP chain have no device drafting, so the engine
runs their rounds in the synchronous step. K is pinned (`adaptive: False`) so that every round
drafts. The random drafters' greedy drafts are almost never the target's argmax (0 to 2 of
~185 accepted on the CPU), so greedy runs check that rounds drafted; coupled sampling draws
drafts and tokens from the same noise, so it accepts some (6 to 22 of ~150 on the CPU), and
asserts acceptance.

`SPECDEC_FORMAT_TEST_DEVICE=cpu` runs the same checks on the CPU (async_scheduling on: the same
device rounds op by op over the buffers CUDA graphs replay), to check the test itself.
"""

from __future__ import annotations

import os

import pytest
import torch

from drafter_format_fixtures import draft_batch, observe_prefixes
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from public_drafter_fixtures import (
    DFLASH_CONFIG,
    EAGLE1_CONFIG,
    deep_target,
    dflash_target,
    dflash_tensors,
    eagle1_tensors,
    eagle3_config,
    eagle3_tensors,
    medusa_config,
    medusa_tensors,
    mtp_tensors,
    write_checkpoint,
    write_mtp_target,
)
from replay_fixtures import ReplayRequest, drive, engine_factory
from specdec.drafters import DrafterSetup, TargetFeatures
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.registry import build_drafter
from specdec.models import load_model
from specdec.sampling import SamplingParams

DEVICE = os.environ.get("SPECDEC_FORMAT_TEST_DEVICE", "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise ValueError(f"SPECDEC_FORMAT_TEST_DEVICE must be cuda or cpu, got {DEVICE!r}")

pytestmark = [
    *([pytest.mark.gpu] if DEVICE == "cuda" else []),
    pytest.mark.filterwarnings("ignore:.*has no tokenizer"),
]

VOCAB, K = 97, 3
FORMATS = ("eagle3", "eagle1", "medusa", "dflash", "mtp-mimo", "mtp-deepseek", "mtp-chain")
SYNCHRONOUS = {"medusa", "mtp-chain"}  # no device drafting: rounds in the synchronous step
# CUDA against the CPU in float32, every kernel IEEE (no TF32): other summation orders through
# the drafter's layers and up to three chained steps whose random outputs grow (logits of ~30)
# leave ~1e-6 .. 1e-5 of the scale; a wiring difference shows at > 1e-3 (the CPU tests'
# negative controls).
LOGITS_RTOL = 1e-4
# Entries 4, 9 and 23 before the round: the graphed catch-up and the general one.
TOKENS = prompt_tokens(VOCAB - 1, [30, 30, 30], seed=12)  # (DFlash's mask id is VOCAB - 1)
ANCHORS = [6, 11, 25]


def _build(name: str, root):
    """(target directory, speculative_config) of format `name`, written under `root`."""
    if name.startswith("mtp"):
        naming = "mimo" if name == "mtp-mimo" else "deepseek"
        layers = 2 if name == "mtp-chain" else 1
        target = make_hf_model("qwen2_bias" if naming == "mimo" else "llama")
        tensors = mtp_tensors(naming, target, num_layers=layers)
        path = write_mtp_target(target, root / "target", naming, tensors, num_layers=layers)
        return path, {"method": "mtp", "model": str(path)}  # (the target's own files)
    if name == "eagle3":
        target, method = deep_target(), "eagle3"
        config, tensors = eagle3_config("specforge", [1, 3, 6]), eagle3_tensors("midlayer.")
    elif name == "eagle1":
        target, method = make_hf_model("llama"), "eagle"
        config, tensors = EAGLE1_CONFIG, eagle1_tensors(embedding=target.model.embed_tokens.weight)
    elif name == "medusa":
        target, method = make_hf_model("llama"), "medusa"
        config, tensors = (
            medusa_config(K, 1, "fasterdecoding"),
            medusa_tensors(K, 1, "fasterdecoding"),
        )
    else:
        target, method = dflash_target(), "dflash"
        config, tensors = DFLASH_CONFIG, dflash_tensors()
    head = write_checkpoint(root / "head", config, tensors)
    return save_hf_model(target, root / "target"), {"method": method, "model": str(head)}


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request, tmp_path_factory):
    """(format name, target directory, speculative_config with K pinned)."""
    target_dir, spec = _build(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, target_dir, {**spec, "num_speculative_tokens": K, "adaptive": False}


def _make(target_dir):
    """Engines of CUDA's default configuration in float32 (`replay_fixtures.engine_factory`:
    `num_kv_blocks` on CUDA); on the CPU async_scheduling on, as "auto" is on CUDA."""
    extra = {} if DEVICE == "cuda" else {"async_scheduling": True}
    return engine_factory(target_dir, DEVICE, dtype="float32", **extra)


def _tokens(engine, prompts, params):
    """Each prompt's tokens, all added before the first step (a closed batch)."""
    requests = [ReplayRequest(p, q) for p, q in zip(prompts, params, strict=True)]
    outputs = drive(engine, requests, [(0, i) for i in range(len(requests))])
    return [list(out.token_ids) for out in outputs]


def _plain_and_speculative(fmt, prompts, params):
    """(plain tokens, speculative tokens, the speculative engine) on DEVICE."""
    _name, target_dir, spec = fmt
    make = _make(target_dir)
    plain = _tokens(make(), prompts, params)
    engine = make(spec)
    drafted = _tokens(engine, prompts, params)
    return plain, drafted, engine


def _check_path(name, engine):
    """The rounds took CUDA's default path for this format, and drafted."""
    assert engine.stats.num_drafts > 0 and engine.stats.num_draft_tokens > 0
    assert engine.runner.graphs is not None
    assert engine.runner.graphs.use_graphs == (DEVICE == "cuda")
    if name in SYNCHRONOUS:
        assert engine.loop_stats.num_device_rounds == 0 and not engine.device_rounds
    else:
        assert engine.loop_stats.num_device_rounds > 0


def test_greedy_speculation_equals_greedy_plain(fmt):
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    plain, drafted, engine = _plain_and_speculative(fmt, prompts, params)
    assert drafted == plain
    _check_path(fmt[0], engine)


def test_coupled_sampling_equals_plain_sampling(fmt):
    """The default verifier (coupled), temperature 0.8: plain sampling's tokens, seed by seed."""
    prompts = prompt_tokens(VOCAB, [5, 9, 14], seed=5)
    params = [
        SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)
    ]
    plain, drafted, engine = _plain_and_speculative(fmt, prompts, params)
    assert engine.speculative_config.rejection_sample_method == "coupled"
    assert drafted == plain
    _check_path(fmt[0], engine)
    assert engine.stats.num_accepted_tokens > 0


def _propose(target_dir, spec, device, features=None):
    """The drafter of `spec` over the target on `device` (float32; built through the registry,
    graphs as the engine builds them), fed `features` (None: the target's own, recorded) for
    TOKENS at ANCHORS; proposes K sampled drafts (temperature 1: the raw logits) per request.

    Returns:
        (the proposal, the features it was fed).
    """
    target = load_model(target_dir, dtype=torch.float32, device=device).model
    config = SpeculativeConfig(**{key: v for key, v in spec.items() if key != "adaptive"})
    setup = DrafterSetup(num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64)
    drafter = build_drafter(config, target, setup)
    if features is None:
        recorder = _Recorder(drafter.feature_layers)
        observe_prefixes(recorder, target, TOKENS, ANCHORS)
        features = recorder.features
    # On the target's device, as the engine delivers them (DFlash projects them where they are).
    rows = [f.to(device) for f in features.features]
    drafter.observe(TargetFeatures(features.request_ids, features.starts, rows))
    batch = draft_batch(TOKENS, ANCHORS, features.request_ids, K, ["standard", "coupled", "block"])
    with torch.inference_mode():
        return drafter.propose(batch), features


class _Recorder:
    """Stands in for a drafter in `observe_prefixes`: keeps the features it is fed."""

    def __init__(self, feature_layers):
        self.feature_layers = feature_layers
        self.features: TargetFeatures | None = None

    def observe(self, features: TargetFeatures) -> None:
        self.features = features


def test_draft_logits_on_cuda_equal_the_cpu_drafters(fmt):
    """Both drafters fed the CPU target's features, the same batch (seeds, anchors): each
    draft's logits agree to LOGITS_RTOL of their scale (over the entries both leave finite:
    EAGLE-3's draft vocabulary), compared up to a row's first draft the two drew differently
    (later drafts then condition on other tokens)."""
    name, target_dir, spec = fmt
    want, features = _propose(target_dir, spec, "cpu")
    got, _ = _propose(target_dir, spec, DEVICE, features)
    assert torch.equal(got.num_draft.cpu(), want.num_draft) and int(want.num_draft.min()) > 0
    compared = 0
    for b in range(len(TOKENS)):
        same = (got.draft_token_ids[b].cpu() == want.draft_token_ids[b]).tolist()
        for i in range(same.index(False) + 1 if False in same else len(same)):
            g, w = got.draft_logits[b, i].cpu(), want.draft_logits[b, i]
            finite = torch.isfinite(w)
            assert torch.equal(finite, torch.isfinite(g)), (name, b, i)
            error = (g - w)[finite].abs().max() / w[finite].abs().max()
            assert error < LOGITS_RTOL, (name, b, i, float(error))
            compared += 1
    assert compared >= len(TOKENS) * (K - 1)  # (a flip on a near tie is rare; not every one)
