"""DFlash and DSpark inside a device round, op by op on the CPU: the device drafts are the host
drafts (same keys, so the same tokens; the same processed logits up to rounding; DSpark's verify
length per slot the scheduler's), every draw goes through `draw_on_device`, inert slots draft
nothing, and the context the round writes back (`observe`, then `end`) is the one the host path
builds from the same features."""

from __future__ import annotations

import inspect

import pytest
import torch

from block_drafter_fixtures import observe_context, target_features, tiny_block_drafter
from models_fixtures import make_hf_model, save_hf_model
from specdec.drafters import DraftBatch, TargetFeatures
from specdec.drafters.block.dflash import DFlashDrafter
from specdec.drafters.block.dspark import DSparkDrafter
from specdec.drafters.device import DeviceSlot, RoundView
from specdec.models import load_model
from specdec.sampling import SamplingTensors
from specdec.sampling import sampler as sampler_module

DRAFTERS = {"dflash": DFlashDrafter, "dspark": DSparkDrafter}
TOKENS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
SEEDS = [11, -22, 33]
IDS = ["a", "b", "c"]
K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("t"))).model


def make_drafter(kind, target, block_size=4):
    extra = {}
    if kind == "dspark":
        extra = {"confidence_scale": 10.0, "confidence_bias": -0.5, "min_survival_probability": 0.3}
    model = tiny_block_drafter(kind, target, block_size=block_size, **extra)
    return DRAFTERS[kind](model, target)


def host_batch(method, k=K, temperature=0.9):
    size = len(TOKENS)
    params = SamplingTensors.build(size, torch.device("cpu"), temperature)
    return DraftBatch(
        token_ids=TOKENS,
        seeds=torch.tensor(SEEDS),
        anchors=torch.tensor([len(t) for t in TOKENS]),
        num_draft=torch.full((size,), k),
        methods=[method] * size,
        params=params,
        request_ids=IDS,
    )


def round_view(method, k=K, temperature=0.9, pad=1) -> RoundView:
    """The three requests in slots 0..2, then `pad` inert slots (greedy, not live)."""
    size = len(TOKENS) + pad
    live = torch.tensor([True] * len(TOKENS) + [False] * pad)
    temperatures = torch.where(live, temperature, 0.0)
    return RoundView(
        num_rows=size,
        k=k,
        method=method,
        anchors=torch.tensor([len(t) for t in TOKENS] + [1] * pad),
        last_tokens=torch.tensor([t[-1] for t in TOKENS] + [0] * pad),
        live=live,
        seeds=torch.tensor(SEEDS + [0] * pad),
        params=SamplingTensors(temperatures.float(), None, None, None),
        max_draft=torch.full((size,), k),
    )


def slots() -> list[DeviceSlot]:
    return [DeviceSlot(b, rid, list(t)) for b, (rid, t) in enumerate(zip(IDS, TOKENS, strict=True))]


def device_drafting(drafter, num_slots=4):
    return drafter.device_drafting(num_slots, K + 1, 64, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_device_drafts_are_the_host_drafts(target, kind, method, monkeypatch):
    drafter = make_drafter(kind, target)
    observe_context(drafter, IDS, TOKENS)
    host = drafter.propose(host_batch(method))
    drafting = device_drafting(drafter)
    drafting.begin(slots(), 4)
    callers = []
    real_gumbel = sampler_module.gumbel

    def gumbel_spy(*args, **kwargs):
        callers.append([frame.function for frame in inspect.stack()[1:6]])
        return real_gumbel(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "gumbel", gumbel_spy)
    ids, logits, lse, drafted = drafting.propose(round_view(method))
    assert callers and all("draw_on_device" in c for c in callers)
    num_draft = host.num_draft.tolist()
    if kind == "dspark":
        assert min(num_draft) < K, "the scheduler must shorten some chain for this test to bite"
    assert drafted[:3].tolist() == num_draft
    if kind == "dspark":
        assert drafted[3] == 0  # an inert slot drafts nothing
    for b, n in enumerate(num_draft):
        assert ids[b, :n].tolist() == host.draft_token_ids[b, :n].tolist()
        torch.testing.assert_close(logits[b, :n], host.draft_logits[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b, :n], host.draft_logsumexp[b, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_drafts_stop_at_the_block_size(target, kind):
    """A round wider than the block (K = 3 > block_size 2) drafts block_size tokens."""
    drafter = make_drafter(kind, target, block_size=2)
    observe_context(drafter, IDS, TOKENS)
    host = drafter.propose(host_batch("standard"))
    drafting = device_drafting(drafter)
    drafting.begin(slots(), 4)
    ids, _, _, drafted = drafting.propose(round_view("standard"))
    assert drafted[:3].tolist() == host.num_draft.tolist()
    assert max(host.num_draft.tolist()) <= 2 and (ids[:, 2] == -1).all()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_observe_and_end_write_back_the_hosts_context(target, kind):
    """A round commits its input token and some drafts (0, 1 and 2 accepted): the context it
    hands back covers them, as the host path's `observe` of the same features would."""
    drafter = make_drafter(kind, target)
    observe_context(drafter, IDS, TOKENS)
    drafting = device_drafting(drafter)
    drafting.begin(slots(), 4)
    view = round_view("standard")
    ids, _, _, _ = drafting.propose(view)
    accepted = torch.tensor([0, 1, 2, 0])
    width = K + 1
    committed, features = [], torch.zeros(4 * width, drafter.model.fc.weight.shape[1])
    emitted = torch.full((4, width), -1, dtype=torch.int64)
    for b, tokens in enumerate(TOKENS):
        n = int(accepted[b])
        new = tokens + ids[b, :n].tolist() + [1]  # drafts accepted, then the emitted token
        committed.append(new)
        rows = target_features(target, new, drafter.feature_layers)  # [len(new), F]
        start = len(tokens) - 1  # the round's input token
        features[b * width : b * width + n + 1] = rows[start : start + n + 1]
        emitted[b, : n + 1] = torch.tensor(new[len(tokens) :])
    drafting.observe(view, features, emitted, accepted)
    drafting.end(
        [DeviceSlot(b, rid, c) for b, (rid, c) in enumerate(zip(IDS, committed, strict=True))]
    )
    reference = make_drafter(kind, target)
    observe_context(reference, IDS, committed)
    for rid, tokens in zip(IDS, committed, strict=True):
        got, want = drafter._contexts[rid], reference._contexts[rid]
        assert got.length == want.length == len(tokens) - 1
        for layer in range(len(got.keys)):
            n = got.length
            torch.testing.assert_close(got.keys[layer][:n], want.keys[layer][:n])
            torch.testing.assert_close(got.values[layer][:n], want.values[layer][:n])


def test_begin_refuses_a_request_without_its_features(target):
    drafter = make_drafter("dflash", target)
    observe_context(drafter, ["a"], [TOKENS[0][:3]])  # features for 2 positions, not 5
    with pytest.raises(ValueError, match="target features for 2 positions"):
        device_drafting(drafter).begin(slots()[:1], 1)
    drafter.observe(TargetFeatures(["a"], [0], [torch.zeros(5, drafter.model.fc.weight.shape[1])]))
    device_drafting(drafter).begin(slots()[:1], 1)
