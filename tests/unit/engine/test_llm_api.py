"""`LLM` in vLLM's shape: the engine seed, tensor_parallel_size checks, get_tokenizer, chat's
template options, n samples and best_of, the per-request verifier's one name, and the shipped
head rule (a tiny random-weight model with a character tokenizer; CPU)."""

from __future__ import annotations

import pytest

from e2e.server_fixtures import make_tiny_model_dir
from specdec.engine.llm import LLM
from specdec.sampling import SamplingParams

PARAMS = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-chat"))


def make(model_dir, **kwargs):
    return LLM(str(model_dir), speculative_config=None, max_model_len=64, **kwargs)


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def test_engine_seed_replays_unseeded_requests(model_dir):
    prompts = ["one", "two", "three"]
    first = make(model_dir, seed=0).generate(prompts, PARAMS, use_tqdm=False)
    again = make(model_dir, seed=0).generate(prompts, PARAMS, use_tqdm=False)
    other = make(model_dir, seed=1).generate(prompts, PARAMS, use_tqdm=False)
    assert texts(first) == texts(again) != texts(other)
    assert len({o.seed for o in first}) == 3  # each request its own seed, recorded
    replay = make(model_dir).generate(
        "two", SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=first[1].seed)
    )
    assert texts(replay) == [texts(first)[1]]
    unseeded = make(model_dir)
    assert texts(unseeded.generate(prompts, PARAMS, use_tqdm=False)) != texts(
        unseeded.generate(prompts, PARAMS, use_tqdm=False)
    )


def test_tensor_parallel_size_is_checked(model_dir):
    """Sizes below 1 are refused by the config; TP > 1 runs (tests/e2e/test_tensor_parallel.py)."""
    assert make(model_dir, tensor_parallel_size=1).engine.config.tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        make(model_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"unknown engine arguments \['trust_remote_code'\]"):
        make(model_dir, trust_remote_code=True)


def test_get_tokenizer_and_chat_options(model_dir):
    llm = make(model_dir)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("abc", add_special_tokens=False)) == "abc"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    render = tokenizer.apply_chat_template
    assert render(messages).endswith("assistant: hel\nassistant: ")
    assert render(messages, add_generation_prompt=False).endswith("assistant: hel\n")
    continued_text = render(messages, add_generation_prompt=False, continue_final_message=True)
    assert continued_text.endswith("assistant: hel")
    opened = llm.chat(messages, greedy, use_tqdm=False)[0]
    assert opened.prompt_token_ids == tokenizer.encode_chat(messages)
    closed = llm.chat(messages, greedy, add_generation_prompt=False, use_tqdm=False)[0]
    continued = llm.chat(
        messages,
        greedy,
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )[0]
    assert continued.prompt_token_ids == closed.prompt_token_ids[:-1]  # without the newline
    assert continued.prompt_token_ids == tokenizer.encode(continued_text, add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot be combined with add_generation_prompt"):
        llm.chat(messages, greedy, continue_final_message=True, use_tqdm=False)
    own = llm.chat(messages, greedy, chat_template="{{ messages[-1]['content'] }}!")[0]
    assert tokenizer.decode(own.prompt_token_ids) == "hel!"


def test_n_samples_and_best_of(model_dir):
    llm = make(model_dir)
    out = llm.generate("x", SamplingParams(n=3, seed=2, max_tokens=6, best_of=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.text for c in out.outputs}) > 1
    with pytest.raises(ValueError, match="best_of=4 is not supported"):
        SamplingParams(n=3, best_of=4)


def test_per_request_verifier_is_rejection_sample_method(model_dir):
    llm = LLM(str(model_dir), speculative_config={"method": "ngram"}, max_model_len=64)
    out = llm.generate(
        "abcabcabc",
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        speculative={"rejection_sample_method": "block", "num_speculative_tokens": 2},
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids
    with pytest.raises(ValueError, match='"rejection_sample_method"'):
        llm.generate("x", PARAMS, speculative={"method": "block"})


def test_eagle_without_a_model_needs_the_built_in_target(model_dir):
    with pytest.raises(ValueError, match="only the built-in model has a shipped head"):
        LLM(str(model_dir), speculative_config={"method": "eagle"}, max_model_len=64)
    with pytest.raises(ValueError, match='"dflash" needs "model"'):
        LLM(str(model_dir), speculative_config={"method": "dflash"}, max_model_len=64)


def test_generate_shows_vllms_progress_bar_with_token_rates(model_dir, capsys):
    llm = make(model_dir)
    llm.generate(["one", "two", "three"], PARAMS)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "3/3" in err
    assert "est. speed input:" in err and "output:" in err
    llm.generate(["one"], PARAMS, use_tqdm=False)
    assert capsys.readouterr().err == ""
