"""Asynchronous scheduling (`async_scheduling=True`) changes when tokens are read, never which:
every request ends with the tokens, text, finish reason and logprobs of the synchronous loop,
through stop tokens and strings, length limits, n > 1, requests joining mid-run, aborts,
preemption and mixed batches where some steps cannot be overlapped; and the overlapped path
really runs (steps are launched before the previous step's tokens are read)."""

from __future__ import annotations

import pytest

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama-async"))


def make_engine(model_dir, async_scheduling: bool, **kwargs) -> LLMEngine:
    args = {"model": str(model_dir), "max_model_len": 64, "block_size": 4, **kwargs}
    config = EngineConfig(**args, async_scheduling=async_scheduling)
    return LLMEngine(config, SpeculativeConfig.from_dict(None))


def drive(
    engine: LLMEngine, requests, *, late=(), abort_after=None, only_finished=True, queued=False
):
    """Final outputs by request id (tokens, finish reasons, stop reasons, text, logprobs), and
    how many steps were launched while another was in flight (`queued`: and requests waited)."""
    for prompt, params in requests:
        engine.add_request(prompt, params)
    finals, steps, overlapped = {}, 0, 0
    while engine.has_unfinished:
        in_flight_before = engine._inflight is not None
        waited = bool(engine.scheduler.waiting)
        outputs = engine.step(only_finished=only_finished)
        steps += 1
        launched = in_flight_before and engine._inflight is not None
        overlapped += launched and (waited or not queued)
        if steps == 3:
            for prompt, params in late:
                engine.add_request(prompt, params)
        if abort_after is not None and steps == abort_after[1]:
            engine.abort(abort_after[0])
        for out in outputs:
            if out.finished:
                finals[out.request_id] = [
                    (o.token_ids, o.finish_reason, o.stop_reason, o.text, o.logprobs)
                    for o in out.outputs
                ]
    return finals, overlapped


def both(model_dir, requests, **kwargs):
    engine_args = kwargs.pop("engine_args", {})
    sync, _ = drive(make_engine(model_dir, False, **engine_args), requests, **kwargs)
    overlapped_run, overlapped = drive(
        make_engine(model_dir, True, **engine_args), requests, **kwargs
    )
    return sync, overlapped_run, overlapped


def test_sampled_and_greedy_batches_match_and_overlap(model_dir):
    prompts = prompt_tokens(VOCAB, [5, 9, 3, 12, 6, 4], seed=4)
    params = [
        SamplingParams(temperature=1.0, top_k=7, seed=1, max_tokens=19, ignore_eos=True),
        SamplingParams(temperature=0.6, top_p=0.8, seed=2, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, seed=3),
        SamplingParams(temperature=1.3, min_p=0.1, seed=4, max_tokens=21, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=17, n=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=6, max_tokens=30, ignore_eos=True),
    ]
    sync, overlapped_run, overlapped = both(model_dir, list(zip(prompts, params, strict=True)))
    assert overlapped_run == sync
    assert overlapped > 10  # the overlapped path ran for most steps


def test_stops_limits_late_requests_and_logprobs(model_dir):
    prompts = prompt_tokens(VOCAB, [5, 9, 3, 7, 6, 8], seed=11)
    probe = drive(
        make_engine(model_dir, False),
        [(prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))],
    )[0]
    stop_token = probe["0"][0][0][4]  # greedy request 0 stops at its 5th token
    requests = [
        (prompts[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token])),
        (prompts[1], SamplingParams(temperature=1.0, seed=7, max_tokens=25, min_tokens=3)),
        (prompts[2], SamplingParams(temperature=0.8, seed=8, max_tokens=40)),
    ]
    late = [
        (prompts[3], SamplingParams(temperature=1.0, seed=9, max_tokens=9, logprobs=2)),
        (prompts[4], SamplingParams(temperature=0.7, seed=10, max_tokens=13, stop_token_ids=[3])),
        (prompts[5], SamplingParams(temperature=0, max_tokens=6)),
    ]
    sync, overlapped_run, overlapped = both(model_dir, requests, late=late)
    assert overlapped_run == sync
    assert overlapped > 0
    assert sync["0"][0][1] == "stop"


def test_preemption_and_aborts(model_dir):
    prompts = prompt_tokens(VOCAB, [7, 5, 9, 6, 8], seed=21)
    requests = [
        (p, SamplingParams(temperature=1.0, seed=30 + i, max_tokens=28, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    # A small cache preempts; an abort removes a request while a step holding it is in flight.
    for engine_args in ({"num_kv_blocks": 18}, {}):
        sync, overlapped_run, _ = both(
            model_dir, requests, abort_after=("2", 6), engine_args=engine_args
        )
        assert "2" not in sync
        assert overlapped_run == sync


def test_streamed_outputs_end_the_same(model_dir):
    prompts = prompt_tokens(VOCAB, [4, 6], seed=5)
    requests = [
        (prompts[0], SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)),
        (prompts[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
    ]
    sync, overlapped_run, _ = both(model_dir, requests, only_finished=False)
    assert overlapped_run == sync


def test_a_full_batch_overlaps_while_requests_queue(model_dir):
    """Requests waiting behind a full batch (max_num_seqs running) cannot join until one
    finishes, so the batch's steps still overlap; each finish lets the next request in, with
    the synchronous loop's tokens. Before this, any waiting request stopped the overlapped loop
    (0 steps overlapped while the queue was non-empty: a saturated server decoded
    synchronously)."""
    prompts = prompt_tokens(VOCAB, [5, 9, 3, 12, 6, 4, 7, 8], seed=14)
    requests = [
        (p, SamplingParams(temperature=1.0, seed=40 + i, max_tokens=10 + 3 * i))
        for i, p in enumerate(prompts)
    ]
    requests[2] = (prompts[2], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[5]))
    engine_args = {"max_num_seqs": 3}
    sync, _ = drive(make_engine(model_dir, False, **engine_args), requests)
    overlapped_run, queued = drive(
        make_engine(model_dir, True, **engine_args), requests, queued=True
    )
    assert overlapped_run == sync and len(sync) == 8
    assert queued > 10  # steps launched in flight while requests waited


def drive_arrivals(engine: LLMEngine, arrivals: dict[int, list]) -> tuple[dict, dict]:
    """Adds `arrivals[step]` before that step (requests joining a running engine), runs to the
    end; final outputs by request id, and how the steps ran: synchronous steps (`_run_step`),
    steps launched while another was in flight, and steps whose launch held a prefill chunk."""
    counts = {"sync": 0, "launched_in_flight": 0, "prefill_rows": 0}
    run_step = engine._run_step

    def counted(*args, **kwargs):
        counts["sync"] += 1
        return run_step(*args, **kwargs)

    engine._run_step = counted
    finals, step = {}, 0
    while engine.has_unfinished or any(s >= step for s in arrivals):
        for prompt, params in arrivals.get(step, []):
            engine.add_request(prompt, params)
        in_flight_before = engine._inflight is not None
        outputs = engine.step(only_finished=True)
        counts["launched_in_flight"] += in_flight_before and engine._inflight is not None
        step += 1
        for out in outputs:
            finals[out.request_id] = [
                (o.token_ids, o.finish_reason, o.text, o.logprobs, out.prompt_logprobs)
                for o in out.outputs
            ]
    counts["prefill_rows"] = engine.loop_stats.rows["prefill"]
    counts["loop"] = engine.loop_stats.as_dict()
    return finals, counts


def test_requests_join_and_leave_without_draining(model_dir):
    """Requests arriving at several steps (prompts of 3 to 30 tokens, chunked at a budget of
    8 tokens a step), finishing by length and by a stop token, with sampled and greedy
    parameters, two with logprobs, one with prompt logprobs, three with logits rules
    (penalties, min_tokens, biases, allowed ids): every request ends with the synchronous
    loop's tokens (and logprobs), and no step of the
    overlapped run is synchronous (each arrival's prefill chunks ride in steps launched ahead
    beside the running decode rows; each finish just leaves the next step). Before, every
    arrival and every finish read the step in flight first and ran a synchronous step."""
    prompts = prompt_tokens(VOCAB, [5, 30, 3, 12, 17, 4, 9, 22], seed=31)
    params = [
        SamplingParams(temperature=1.0, seed=50 + i, max_tokens=6 + 2 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[3] = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[7, 11, 13])
    params[5] = SamplingParams(temperature=0.7, top_p=0.9, seed=9, max_tokens=14, n=2)
    # logprobs are computed on the device and read with the tokens (two numbers of top ids)
    params[1] = SamplingParams(temperature=1.0, seed=51, max_tokens=12, logprobs=3)
    params[6] = SamplingParams(temperature=0.9, seed=56, max_tokens=10, logprobs=0)
    # prompt logprobs too (a 22-token prompt split over three steps)
    params[7] = SamplingParams(temperature=1.0, seed=57, max_tokens=8, prompt_logprobs=2)
    # logits rules count the token still on the device as output
    params[0] = SamplingParams(
        temperature=1.0, seed=50, max_tokens=14, repetition_penalty=1.8, frequency_penalty=0.9
    )
    params[4] = SamplingParams(
        temperature=0.8,
        seed=54,
        max_tokens=16,
        presence_penalty=1.5,
        min_tokens=6,
        stop_token_ids=[3, 8, 12],
        logit_bias={5: 4.0, 9: -100.0},
    )
    params[2] = SamplingParams(
        temperature=0, max_tokens=9, allowed_token_ids=list(range(10, 40)), repetition_penalty=2.0
    )
    schedule = {0: [0, 1], 2: [2], 3: [3, 4], 7: [5], 11: [6], 12: [7]}
    arrivals = {
        step: [(prompts[i], params[i]) for i in indices] for step, indices in schedule.items()
    }
    engine_args = {"max_num_seqs": 6, "max_num_batched_tokens": 8}
    sync, _ = drive_arrivals(make_engine(model_dir, False, **engine_args), arrivals)
    overlapped_run, counts = drive_arrivals(make_engine(model_dir, True, **engine_args), arrivals)
    assert overlapped_run == sync and len(sync) == len(prompts)
    assert counts["sync"] == 0 == counts["loop"]["num_sync_steps"]
    assert counts["launched_in_flight"] > 20
    assert counts["loop"]["num_overlapped_prefill_steps"] >= len(prompts)
    assert counts["prefill_rows"] > sum(len(p) for p in prompts) - len(prompts)


def test_a_cache_that_must_preempt_reads_the_step_in_flight_first(model_dir):
    """A cache too small for the running requests' next tokens: the next step cannot be
    scheduled ahead without preempting (`schedule_ahead` gives None), so the loop reads the
    step in flight first, then the usual schedule preempts and the loop goes on overlapped
    (the preempted requests recompute), with the synchronous loop's tokens."""
    prompts = prompt_tokens(VOCAB, [9, 7, 11, 6], seed=32)
    arrivals = {
        0: [
            (p, SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
    }
    engine_args = {"num_kv_blocks": 16}
    sync, _ = drive_arrivals(make_engine(model_dir, False, **engine_args), arrivals)
    engine = make_engine(model_dir, True, **engine_args)
    ahead = engine.scheduler.schedule_ahead
    refused = []

    def spy(hold, admit=True):
        scheduled = ahead(hold, admit)
        refused.append(scheduled is None)
        return scheduled

    engine.scheduler.schedule_ahead = spy
    overlapped_run, counts = drive_arrivals(engine, arrivals)
    assert overlapped_run == sync
    assert engine.num_preemptions > 0 and any(refused)
    assert counts["sync"] == 0  # after the read, the preempting step is launched overlapped


def test_negative_control_rules_that_miss_the_token_in_flight(model_dir, monkeypatch):
    """Penalties and allowed ids counting only the output the host has read (the token still
    on the device left out of the rules' context) move the tokens off the synchronous loop's:
    the comparison above has power over the rules' prefix."""
    from specdec.engine.overlapped_loop import OverlappedLoop

    prompts = prompt_tokens(VOCAB, [5, 30, 3], seed=31)
    penalised = SamplingParams(
        temperature=1.0, seed=50, max_tokens=20, repetition_penalty=1.8, frequency_penalty=0.9
    )
    allowed = SamplingParams(
        temperature=0, max_tokens=9, allowed_token_ids=list(range(10, 40)), repetition_penalty=2.0
    )
    arrivals = {0: [(prompts[0], penalised)], 2: [(prompts[2], allowed)]}
    sync, _ = drive_arrivals(make_engine(model_dir, False), arrivals)
    overlapped_run, _ = drive_arrivals(make_engine(model_dir, True), arrivals)
    assert overlapped_run == sync
    monkeypatch.setattr(OverlappedLoop, "_pending_prefix", staticmethod(lambda *args: None))
    blind, counts = drive_arrivals(make_engine(model_dir, True), arrivals)
    assert counts["sync"] == 0 and blind != sync
