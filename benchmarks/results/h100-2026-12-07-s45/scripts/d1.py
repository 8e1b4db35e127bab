"""s45 diagnostic: which path gives the joining case other bits on CUDA. Requests 0..2 of the
[joining] case, standard verifier, K pinned, run sync / rounds, with and without the late
request; also with the prompt graphs for every length (PROMPT_GRAPH_STEPS large)."""

import pathlib
import sys
import tempfile

import torch

sys.path[:0] = ["tests", "tests/unit/drafters"]
from eagle_fixtures import VOCAB, trained_head  # noqa: E402
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model  # noqa: E402
from specdec.drafters.eagle import device as eagle_device  # noqa: E402
from specdec.engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from specdec.engine.llm_engine import LLMEngine  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

tmp = pathlib.Path(tempfile.mkdtemp())
torch.manual_seed(0)
model_dir = save_hf_model(make_hf_model("llama"), tmp / "m")
head_dir = trained_head(model_dir, tmp / "h")
LENGTHS = [9, 30, 150, 40]


def run(rounds, late, join_step=3, k=3, verifier="standard"):
    spec = {
        "method": "eagle",
        "model": str(head_dir),
        "num_speculative_tokens": k,
        "rejection_sample_method": verifier,
        "adaptive": False,
    }
    config = EngineConfig(
        model=str(model_dir), max_model_len=256, block_size=4, async_scheduling=rounds
    )
    engine = LLMEngine(config, SpeculativeConfig.from_dict(spec))
    prompts = prompt_tokens(VOCAB, LENGTHS, seed=11)
    ids = []
    for i, prompt in enumerate(prompts[:3]):
        params = SamplingParams(temperature=1.0, seed=40 + i, max_tokens=24, ignore_eos=True)
        ids.append(engine.add_request(prompt, params))
    finals, steps = {}, 0
    while engine.has_unfinished:
        steps += 1
        if late and steps == join_step:
            params = SamplingParams(temperature=1.0, seed=43, max_tokens=24, ignore_eos=True)
            ids.append(engine.add_request(prompts[3], params))
        for out in engine.step(only_finished=True):
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
    st = engine.loop_stats
    return [finals[i] for i in ids], (st.num_device_rounds, st.num_round_joins)


def first_diff(a, b):
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


res = {}
for name, kw in [
    ("sync", dict(rounds=False, late=False)),
    ("sync_late", dict(rounds=False, late=True)),
    ("rounds", dict(rounds=True, late=False)),
    ("rounds_late", dict(rounds=True, late=True)),
    ("sync_late5", dict(rounds=False, late=True, join_step=5)),
    ("rounds_late5", dict(rounds=True, late=True, join_step=5)),
]:
    toks, stats = run(**kw)
    res[name] = toks
    print(name, stats, flush=True)
eagle_device.PROMPT_GRAPH_STEPS = 100
toks, stats = run(rounds=True, late=True)
res["rounds_late_graphs"] = toks
print("rounds_late_graphs", stats)
toks, stats = run(rounds=True, late=False)
res["rounds_graphs"] = toks
print("rounds_graphs", stats)
ref = res["sync"]
for name, toks in res.items():
    print(
        f"{name:20s}",
        [first_diff(ref[i], toks[i]) for i in range(3)],
        "late:",
        None
        if len(toks) < 4
        else first_diff(res["sync_late"][3], toks[3])
        if len(res["sync_late"]) > 3
        else None,
    )
