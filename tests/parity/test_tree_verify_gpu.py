"""GPU parity of tree verification: `tree_triton.verify_tree_triton` against its PyTorch twin
`tree.verify_tree_ref` on the same prepared inputs (built on the CPU, copied to the GPU), token
for token; and the tree path of the engine on the GPU (greedy tree == greedy plain, coupled
tree == plain sampling). Inputs come from the tests' own seeded generators; drafts are drawn
near the target so that most walks go several levels deep and reject siblings on the way."""

from __future__ import annotations

import pytest
import torch

from specdec.verify.inputs import check_verify_inputs
from specdec.verify.tree import prepare_tree, verify_tree_ref
from tree_fixtures import PARITY_SHAPES as SHAPES
from tree_fixtures import near_round

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def to_cuda(prepared):
    import dataclasses

    fields = {}
    for field in dataclasses.fields(prepared):
        value = getattr(prepared, field.name)
        fields[field.name] = value.cuda() if isinstance(value, torch.Tensor) else value
    return type(prepared)(**fields)


@pytest.mark.parametrize("vocab", [37, 1000, 49152])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    "method, temperature, sampled, top_k",
    [
        ("standard", 0.9, True, None),
        ("standard", 0.9, True, 20),
        ("standard", 0.9, False, None),
        ("standard", 0.0, False, None),
        ("coupled", 0.9, True, None),
        ("coupled", 0.0, False, None),
    ],
)
def test_tree_walk_twins_agree(vocab, shape, method, temperature, sampled, top_k):
    from specdec.verify.tree_triton import verify_tree_triton

    generator = torch.Generator().manual_seed(vocab + len(SHAPES[shape]))
    batch = 64
    target, tokens, draft_logits, seeds, positions, num_nodes, parents = near_round(
        generator, SHAPES[shape], batch, vocab, temperature, sampled, top_k
    )
    inputs = check_verify_inputs(
        target, tokens, draft_logits, seeds, positions,
        temperature=temperature, top_k=top_k, num_draft=num_nodes, method=method,
    )  # fmt: skip
    prepared = prepare_tree(inputs, parents)
    ref = verify_tree_ref(prepared)
    gpu = verify_tree_triton(to_cuda(prepared))
    torch.cuda.synchronize()
    assert torch.equal(gpu.num_accepted.cpu(), ref.num_accepted)
    assert torch.equal(gpu.accepted_nodes.cpu(), ref.accepted_nodes)
    assert torch.equal(gpu.token_ids.cpu(), ref.token_ids)
    if temperature > 0 and method == "standard" and sampled and vocab <= 1000:
        assert float(ref.num_accepted.float().mean()) > 0.5  # walks go deep and reject siblings


def test_verify_tree_dispatches_to_triton_on_cuda():
    from specdec.verify.tree import verify_tree

    generator = torch.Generator().manual_seed(1)
    target, tokens, draft_logits, seeds, positions, num_nodes, parents = near_round(
        generator, SHAPES["wide"], 16, 500, 0.9, True, None
    )
    args = (target, parents, tokens, draft_logits, seeds, positions)
    cpu = verify_tree(*args, temperature=0.9, num_nodes=num_nodes)
    gpu = verify_tree(*(a.cuda() for a in args), temperature=0.9, num_nodes=num_nodes.cuda())
    # Prepared on different devices (processed rows may differ in the last bit): tokens agree
    # on inputs without near-ties.
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from eagle_fixtures import trained_head
    from models_fixtures import make_hf_model, save_hf_model

    target_dir = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))
    return target_dir, trained_head(target_dir, tmp_path_factory.mktemp("eagle"))


@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_engine_tree_rounds_on_the_gpu(tiny_dirs, method):
    from models_fixtures import prompt_tokens
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams

    target_dir, head_dir = tiny_dirs
    common = {
        "max_model_len": 96, "block_size": 4, "max_num_batched_tokens": 64, "device": "cuda",
        "dtype": "float32", "async_scheduling": False, "gpu_memory_utilization": 0.2,
    }  # fmt: skip
    spec = {
        "method": "eagle", "model": str(head_dir), "rejection_sample_method": method,
        "tree": {"nodes": 8, "depth": 4, "topk": 2},
    }  # fmt: skip
    prompts = prompt_tokens(97, [5, 9, 14], seed=3)
    for params in (
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=20, seed=5, ignore_eos=True),
    ):
        plain = LLM(str(target_dir), **common).generate(prompts, params, use_tqdm=False)
        llm = LLM(str(target_dir), speculative_config=spec, **common)
        tree = llm.generate(prompts, params, use_tqdm=False)
        if params.temperature == 0 or method == "coupled":
            assert [o.outputs[0].token_ids for o in tree] == [o.outputs[0].token_ids for o in plain]
        assert llm.get_metrics()["num_drafts"] > 0
        del llm  # its KV cache is gone before the next pair of engines measures free memory
