"""Scaffolding the drafter-format tests share: feeding a drafter the target's features for token
prefixes, the draft batch those tests propose over, and one engine run synchronous then with
`async_scheduling`. Checks stay in the tests; nothing here asserts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from specdec.drafters import DraftBatch, TargetFeatures
from specdec.drafters.config import SpeculativeConfig
from specdec.models import AttentionMetadata
from specdec.sampling import SamplingParams, SamplingTensors


def observe_prefixes(drafter, target, tokens: list[list[int]], anchors: list[int]) -> list[str]:
    """Feed `drafter` the target's features of each `tokens[b][: anchors[b] - 1]` (one prefill
    in a fresh paged cache of block size 4, in one step); returns the request ids `r0, r1, ...`.

    Mutates: the drafter's per-request context.
    """
    rows = []
    for row_tokens, anchor in zip(tokens, anchors, strict=True):
        fed = row_tokens[: anchor - 1]
        kv = target.allocate_kv_cache(-(-len(fed) // 4), 4)
        attn = AttentionMetadata.build([len(fed)], [len(fed)], [list(range(kv.num_blocks))], 4)
        with torch.inference_mode():
            _, layers = target.forward_with_layers(
                torch.tensor(fed), torch.arange(len(fed)), attn, kv, drafter.feature_layers
            )
        rows.append(torch.cat(layers, dim=-1))
    ids = [f"r{i}" for i in range(len(tokens))]
    drafter.observe(TargetFeatures(ids, [0] * len(ids), rows))
    return ids


def draft_batch(
    tokens: list[list[int]], anchors: list[int], request_ids: list[str], k: int, methods: list[str]
) -> DraftBatch:
    """The batch of `tokens[b][: anchors[b]]`, k drafts each, seeds 3, 4, ..., temperature 1."""
    num_rows = len(tokens)
    return cpu_draft_batch(
        [t[:a] for t, a in zip(tokens, anchors, strict=True)],
        anchors,
        list(range(3, 3 + num_rows)),
        [k] * num_rows,
        methods,
        1.0,
        request_ids,
    )


def cpu_draft_batch(
    tokens: list[list[int]],
    anchors: list[int],
    seeds: list[int],
    num_draft: list[int],
    methods: list[str],
    temperature: float,
    request_ids: list[str],
) -> DraftBatch:
    """The DraftBatch of `tokens` as given (row b anchored at anchors[b], seeded seeds[b],
    num_draft[b] drafts, verified by methods[b]), every row's sampling parameters at
    `temperature` on the CPU."""
    return DraftBatch(
        token_ids=tokens,
        seeds=torch.tensor(seeds),
        anchors=torch.tensor(anchors),
        num_draft=torch.tensor(num_draft),
        methods=methods,
        params=SamplingTensors.build(len(tokens), torch.device("cpu"), temperature),
        request_ids=request_ids,
    )


def finals_sync_then_async(
    model_dir: Path,
    spec: SpeculativeConfig,
    prompts: list[list[int]],
    params_for: Callable[[int], SamplingParams],
):
    """Run `prompts` (prompt i with `params_for(i)`) through an `LLMEngine` of `model_dir` with
    `spec`, first without then with `async_scheduling` (max_model_len 64, block size 4).

    Returns:
        ([the synchronous run's {request_id: token_ids}, the async run's], the async engine).
    """
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine

    finals = []
    for async_scheduling in (False, True):
        config = EngineConfig(
            model=str(model_dir), max_model_len=64, block_size=4, async_scheduling=async_scheduling
        )
        engine = LLMEngine(config, spec)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params_for(i))
        done = {}
        while engine.has_unfinished:
            for out in engine.step(only_finished=True):
                done[out.request_id] = out.outputs[0].token_ids
        finals.append(done)
    return finals, engine


def target_hidden(target_hf, tokens: list[int], post_norm: bool = True) -> torch.Tensor:
    """[T, D] the `transformers` target's last hidden state for `tokens`: after its final norm
    (what EAGLE's ea_model.py, Medusa and DeepSeek-V3's MTP read as `base_model.model(...)[0]`),
    or before it (the residual stream MiMo's MTP reads; elsewhere a wrong variant)."""
    captured = []
    hook = target_hf.model.layers[-1].register_forward_hook(
        lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = target_hf.model(torch.tensor([tokens]))
    hook.remove()
    return out.last_hidden_state[0] if post_norm else captured[0][0]


def plain_and_speculative_tokens(model_dir: Path, spec, prompts, params, **llm_kwargs):
    """Generate `prompts` with `params` through `LLM(model_dir, **llm_kwargs)`, plain and then with
    `speculative_config=spec`.

    Returns:
        (plain decoding's token ids per prompt, speculation's, the speculative `LLM`).
    """
    from specdec.engine.llm import LLM

    plain = LLM(str(model_dir), **llm_kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir), speculative_config=spec, **llm_kwargs)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in plain], [o.outputs[0].token_ids for o in drafted], llm
