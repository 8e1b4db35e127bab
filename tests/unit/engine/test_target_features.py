"""The engine hands drafters that read the target exactly the features of committed tokens:
consecutive positions from 0, equal to the target's own features of the final sequence, and
never those of rejected drafts."""

from __future__ import annotations

import torch

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.drafters import DraftBatch, Drafter, Proposal, TargetFeatures
from specdec.engine.llm import LLM
from specdec.models import AttentionMetadata, load_model
from specdec.sampling import SamplingParams

VOCAB = 97
LAYERS = (0, 2)


class RecordingDrafter(Drafter):
    """Proposes fixed tokens (mostly rejected) and records every feature it is handed."""

    feature_layers = LAYERS

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.seen_at_propose: list[tuple[int, int]] = []

    def observe(self, features: TargetFeatures) -> None:
        for request_id, start, rows in zip(
            features.request_ids, features.starts, features.features, strict=True
        ):
            parts = self.rows.setdefault(request_id, [])
            assert start == sum(p.shape[0] for p in parts), "features must be consecutive"
            parts.append(rows.clone())

    def release(self, request_id: str) -> None:
        pass  # keep the records for the test (no preemption happens here)

    def propose(self, batch: DraftBatch) -> Proposal:
        for request_id, anchor in zip(batch.request_ids, batch.anchors.tolist(), strict=True):
            have = sum(p.shape[0] for p in self.rows[request_id])
            self.seen_at_propose.append((have, anchor))
        k = batch.max_draft
        drafts = torch.full((batch.batch_size, k), 5, dtype=torch.int64)
        for b, tokens in enumerate(batch.token_ids):
            drafts[b, 0] = tokens[-1]  # sometimes right (repetitive greedy output), mostly not
        return Proposal(drafts, None, None, batch.num_draft.clone())


def reference_features(model, tokens: list[int]) -> torch.Tensor:
    """[T, len(LAYERS) * D] features of the whole sequence from one prefill."""
    kv = model.allocate_kv_cache(-(-len(tokens) // 4), 4)
    attn = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(kv.num_blocks))], 4)
    with torch.inference_mode():
        _, layers = model.forward_with_layers(
            torch.tensor(tokens), torch.arange(len(tokens)), attn, kv, LAYERS
        )
    return torch.cat(layers, dim=-1)


def recording_llm(model_dir, **engine_args) -> tuple[LLM, RecordingDrafter]:
    """A speculating LLM of the tiny model whose drafter is a `RecordingDrafter`."""
    llm = LLM(
        str(model_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        max_model_len=64,
        block_size=4,
        **engine_args,
    )
    drafter = RecordingDrafter()
    llm.engine.drafter = drafter
    return llm, drafter


def test_features_cover_committed_tokens_only(tmp_path):
    model_dir = save_hf_model(make_hf_model("llama"), tmp_path)
    # max_num_batched_tokens: chunked prefill of the longer prompts
    llm, drafter = recording_llm(model_dir, max_num_batched_tokens=8)
    prompts = prompt_tokens(VOCAB, [5, 11, 3], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    metrics = llm.get_metrics()
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]  # both outcomes
    # At each propose, features of exactly positions 0 .. anchor - 2 had been delivered.
    assert drafter.seen_at_propose and all(h == a - 1 for h, a in drafter.seen_at_propose)
    model = load_model(model_dir).model
    for out, prompt in zip(outputs, prompts, strict=True):
        tokens = prompt + out.outputs[0].token_ids
        got = torch.cat(drafter.rows[f"{out.request_id}#0"])
        assert got.shape[0] == len(tokens) - 1  # all but the last emitted token
        torch.testing.assert_close(got, reference_features(model, tokens)[:-1])


def test_a_step_of_plain_requests_computes_no_features(tmp_path):
    """On a speculating engine, a step whose requests all have speculation off asks the runner
    for no target features (they would go nowhere); a step with a speculative request does."""
    llm, drafter = recording_llm(save_hf_model(make_hf_model("llama"), tmp_path))
    asked: list[tuple[int, ...]] = []
    run = llm.engine.runner.run_with_features

    def spy(inputs, feature_layers, *args, **kwargs):
        asked.append(tuple(feature_layers))
        return run(inputs, feature_layers, *args, **kwargs)

    llm.engine.runner.run_with_features = spy
    prompts = prompt_tokens(VOCAB, [5, 7], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts, params, speculative={"enabled": False}, use_tqdm=False)
    assert asked and all(layers == () for layers in asked)
    assert not drafter.rows
    asked.clear()
    llm.generate(prompts, params, use_tqdm=False)
    assert asked and all(layers == LAYERS for layers in asked)
