"""Speculative rounds on the device (`async_scheduling=True` with speculation; on the CPU they run
op by op on the same buffers a CUDA graph replays): with K pinned, they emit token for token what
the synchronous step emits for the same seeds, for every drafter that has a device path x
{standard, block, coupled} x temperature 0 and > 0 (with top-k / top-p), through stop tokens,
length limits, requests joining mid-run, aborts and preemption; rounds really overlap (a round is
launched before the previous one is read); the adaptive policy chooses K from rounds already read
only, and keeps coupled and greedy output identical to plain decoding. A negative control (the next
round reading a stale input token) must break the equality."""

from __future__ import annotations

import pytest
import torch

from block_drafter_fixtures import save_tiny_block_drafter
from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine import device_round
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.models import load_model
from specdec.sampling import SamplingParams

VOCAB = 97
LENGTHS = [5, 9, 14, 3]


def word(token_id: int) -> str:
    """Token i's text: a letter (i mod 26), repeated 1 + i // 26 times."""
    return chr(ord("a") + token_id % 26) * (1 + token_id // 26)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama with a word-level tokenizer (so that texts and stop strings exist)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-rounds"))
    vocab = {word(i): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=word(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    return trained_head(model_dir, tmp_path_factory.mktemp("eagle-rounds"))


@pytest.fixture(scope="module")
def block_dirs(model_dir, tmp_path_factory):
    """Block drafters close to the target (so rounds both accept and reject): DFlash, and
    DSpark with its confidence scheduler on (each slot's verify length then varies)."""
    target = load_model(model_dir).model
    root = tmp_path_factory.mktemp("block-rounds")
    dspark = {"confidence_scale": 10.0, "confidence_bias": -0.5, "min_survival_probability": 0.3}
    return {
        "dflash": save_tiny_block_drafter(
            root / "dflash", "dflash", target, block_size=4, noise=0.05
        ),
        "dspark": save_tiny_block_drafter(
            root / "dspark", "dspark", target, block_size=4, noise=0.05, **dspark
        ),
    }


@pytest.fixture(scope="module")
def dirs(head_dir, block_dirs):
    return {"eagle": head_dir, **block_dirs}


@pytest.fixture(scope="module")
def prompts():
    # Repeating halves give prompt lookup something to find.
    return [p + p for p in prompt_tokens(VOCAB, LENGTHS, seed=3)]


def spec_for(drafter: str, dirs: dict, method: str, k: int = 3, adaptive: bool = False) -> dict:
    spec = {
        "num_speculative_tokens": k,
        "rejection_sample_method": method,
        "adaptive": adaptive,
    }
    if drafter == "ngram":
        spec["method"] = "ngram"
    elif drafter.startswith("eagle"):
        spec.update(method="eagle", model=str(dirs["eagle"]))
        if drafter == "eagle-greedy":
            spec["draft_sample_method"] = "greedy"
    elif drafter.startswith(("dflash", "dspark")):
        kind = drafter.split("-")[0]
        spec.update(method=kind, model=str(dirs[kind]))
        if drafter.endswith("-greedy"):
            spec["draft_sample_method"] = "greedy"
    else:
        spec.update(method="draft_model", model="truncated:1")
    return spec


def make_engine(model_dir, spec, async_scheduling: bool, **kwargs) -> LLMEngine:
    args = {"model": str(model_dir), "max_model_len": 96, "block_size": 4, **kwargs}
    config = EngineConfig(**args, async_scheduling=async_scheduling)
    return LLMEngine(config, SpeculativeConfig.from_dict(spec))


def drive(engine, requests, *, late=(), abort_after=None):
    """Final (tokens, finish reason, stop reason, text) per request id, and how many rounds were
    read while the next one had already been launched."""
    for prompt, params in requests:
        engine.add_request(prompt, params)
    finals, steps = {}, 0
    while engine.has_unfinished:
        outputs = engine.step(only_finished=True)
        steps += 1
        if steps == 4:
            for prompt, params in late:
                engine.add_request(prompt, params)
        if abort_after is not None and steps == abort_after[1]:
            engine.abort(abort_after[0])
        for out in outputs:
            if out.finished:
                finals[out.request_id] = [
                    (o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in out.outputs
                ]
    overlapped = engine._rounds.num_overlapped_reads if engine._rounds is not None else 0
    return finals, overlapped


def both(model_dir, spec, requests, **kwargs):
    engine_args = kwargs.pop("engine_args", {})
    sync_engine = make_engine(model_dir, spec, False, **engine_args)
    sync, _ = drive(sync_engine, requests, **kwargs)
    rounds_engine = make_engine(model_dir, spec, True, **engine_args)
    rounds, overlapped = drive(rounds_engine, requests, **kwargs)
    return sync, rounds, rounds_engine, overlapped


def params_for(temperature: float, seed: int, **kwargs) -> SamplingParams:
    filters = {"top_k": 20, "top_p": 0.9} if temperature > 0 else {}
    kwargs.setdefault("max_tokens", 20)
    return SamplingParams(temperature=temperature, ignore_eos=True, seed=seed, **filters, **kwargs)


@pytest.mark.parametrize(
    "drafter",
    ["ngram", "draft_model", "eagle", "eagle-greedy", "dflash", "dflash-greedy", "dspark"],
)
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_rounds_emit_what_the_synchronous_step_emits(
    model_dir, dirs, prompts, drafter, method, temperature
):
    spec = spec_for(drafter, dirs, method)
    requests = [(p, params_for(temperature, 7 + i)) for i, p in enumerate(prompts)]
    sync, rounds, engine, overlapped = both(model_dir, spec, requests)
    assert rounds == sync
    loop = engine.loop_stats
    assert loop.num_device_rounds > 0 and overlapped > 0  # launched before the last read
    assert set(loop.k_chosen) == {3}  # pinned K
    if temperature == 0:  # rounds both accept and reject (at T = 1 prompt lookup may not hit)
        assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens


@pytest.mark.parametrize(
    "drafter",
    [
        "eagle",
        pytest.param("dflash", marks=pytest.mark.slow),
        pytest.param("dspark", marks=pytest.mark.slow),
    ],
)
def test_stops_joins_aborts_and_preemption(model_dir, dirs, prompts, drafter):
    """Stop tokens, stop strings and max_tokens (tokens past a stop are dropped), a request
    joining mid-run (the rounds drain and resume), and a cache so small that rounds cannot grow
    ahead (the synchronous step preempts)."""
    spec = spec_for(drafter, dirs, "standard")
    # 14 of the 97 ids stop: some request stops, whatever the drafter (which changes the tokens).
    stop_ids = list(range(5, VOCAB, 7))
    stop = SamplingParams(temperature=1.0, max_tokens=30, seed=3, stop_token_ids=stop_ids)
    strings = ["e", "q", "x", "k"]  # 16 of the 97 tokens hold one of these letters
    requests = [
        (prompts[0], stop),
        (prompts[1], params_for(1.0, 4)),
        (prompts[2], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        (prompts[3], SamplingParams(temperature=0.8, seed=10, max_tokens=20, stop=strings)),
        (prompts[1], SamplingParams(temperature=1.0, seed=11, max_tokens=20, stop=strings)),
    ]
    late = [(prompts[3], params_for(0.5, 9))]
    sync, rounds, engine, _ = both(model_dir, spec, requests, late=late)
    assert rounds == sync and engine.loop_stats.num_device_rounds > 0
    assert any(final[0][1] == "stop" for final in sync.values())
    assert any(isinstance(final[0][2], str) for final in sync.values())  # a stop string hit
    small = {"num_kv_blocks": 24, "max_model_len": 48}
    long = [(p, params_for(1.0, 20 + i)) for i, p in enumerate(prompts)]
    sync, rounds, engine, _ = both(model_dir, spec, long, engine_args=small)
    assert rounds == sync
    assert engine.scheduler.allocator.num_free_blocks == 24  # everything given back


@pytest.mark.parametrize("drafter", ["draft_model", "dflash", "dspark"])
def test_abort_mid_stream_keeps_the_others_and_frees_everything(model_dir, dirs, prompts, drafter):
    spec = spec_for(drafter, dirs, "block")
    requests = [(p, params_for(1.0, 30 + i)) for i, p in enumerate(prompts)]
    full, _ = drive(make_engine(model_dir, spec, False), requests)
    engine = make_engine(model_dir, spec, True)
    rounds, _ = drive(engine, requests, abort_after=("1", 5))
    assert "1" not in rounds  # an aborted request is forgotten, as in the synchronous loop
    assert rounds == {request_id: final for request_id, final in full.items() if request_id != "1"}
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def record_verify_lengths(monkeypatch) -> list[int]:
    """The drafts each device round verified per live request (as read back)."""
    lengths: list[int] = []
    original = device_round.DeviceRounds.read

    def read(self):
        read_round = original(self)
        lengths.extend(e.num_draft for _, e in read_round[0])
        return read_round

    monkeypatch.setattr(device_round.DeviceRounds, "read", read)
    return lengths


@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_dspark_verify_length_is_the_schedulers_on_the_device(
    model_dir, dirs, prompts, method, monkeypatch
):
    """DSpark's confidence scheduler picks each request's verify length inside the round (a
    device tensor, the round keeping its width K = 3): the rounds verify 1, 2 or 3 drafts as
    the synchronous step does (same tokens, same draft and acceptance counts)."""
    lengths = record_verify_lengths(monkeypatch)
    spec = spec_for("dspark", dirs, method)
    requests = [(p, params_for(1.0, 80 + i)) for i, p in enumerate(prompts)]
    sync_engine = make_engine(model_dir, spec, False)
    sync, _ = drive(sync_engine, requests)
    rounds_engine = make_engine(model_dir, spec, True)
    rounds, _ = drive(rounds_engine, requests)
    assert rounds == sync
    assert rounds_engine.stats.as_dict() == sync_engine.stats.as_dict()
    for n in (1, 2, 3):
        assert lengths.count(n) > 0, lengths


def test_negative_control_dspark_rounds_ignoring_the_scheduler(
    model_dir, dirs, prompts, monkeypatch
):
    """If the device rounds verified every drafted token (the scheduler's lengths ignored),
    the draft counts, and so the tokens, would differ from the synchronous step's."""
    from specdec.drafters.block import device

    spec = spec_for("dspark", dirs, "standard")
    requests = [(p, params_for(1.0, 80 + i)) for i, p in enumerate(prompts)]
    sync_engine = make_engine(model_dir, spec, False)
    sync, _ = drive(sync_engine, requests)
    original = device.DSparkDeviceDrafting._draw

    def whole_chains(self, view, hidden, k):
        original(self, view, hidden, k)
        return torch.full((view.num_rows,), k, dtype=torch.int64)

    monkeypatch.setattr(device.DSparkDeviceDrafting, "_draw", whole_chains)
    rounds_engine = make_engine(model_dir, spec, True)
    rounds, _ = drive(rounds_engine, requests)
    assert rounds_engine.stats.as_dict() != sync_engine.stats.as_dict()
    assert rounds != sync


@pytest.mark.parametrize("drafter", ["eagle", "dflash", "dspark"])
def test_adaptive_k_is_non_anticipating_and_keeps_coupled_and_greedy_exact(
    model_dir, dirs, prompts, monkeypatch, drafter
):
    """The policy picks each round's K at launch, when the round before it has not been read
    (only earlier rounds inform it); whatever it picks, coupled and greedy output equals plain
    decoding's."""
    seen = []
    original = device_round.DeviceRounds.launch

    def spy(self, k, last_positions):
        seen.append((len(self.inflight), self.num_rounds))
        return original(self, k, last_positions)

    monkeypatch.setattr(device_round.DeviceRounds, "launch", spy)
    for method, temperature in (("coupled", 1.0), ("standard", 0.0)):
        requests = [(p, params_for(temperature, 50 + i)) for i, p in enumerate(prompts)]
        expected, _ = drive(make_engine(model_dir, None, False), requests)
        spec = spec_for(drafter, dirs, method, k=3, adaptive=True)
        engine = make_engine(model_dir, spec, True)
        got, _ = drive(engine, requests)
        assert got == expected
        assert len(engine.loop_stats.k_chosen) > 1  # the policy tried several K
    # Every launch after the first happens with the previous round still unread.
    assert all(in_flight == 1 for in_flight, launched in seen if launched > 0)


def test_negative_control_a_stale_input_token_breaks_the_equality(
    model_dir, dirs, prompts, monkeypatch
):
    """If the next round read the previous round's input token instead of the token it emitted,
    the comparison above must fail."""
    spec = spec_for("draft_model", dirs, "standard")
    requests = [(p, params_for(0.0, 1)) for p in prompts]
    sync, _ = drive(make_engine(model_dir, spec, False), requests)

    finish_round = device_round.finish_round

    def stale_input_token(token_ids, num_accepted, live, results, anchors, last_tokens):
        before = last_tokens.clone()
        finish_round(token_ids, num_accepted, live, results, anchors, last_tokens)
        last_tokens.copy_(before)

    monkeypatch.setattr(device_round, "finish_round", stale_input_token)
    rounds, _ = drive(make_engine(model_dir, spec, True), requests)
    assert rounds != sync


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle", "dflash", "dspark"])
def test_a_round_run_twice_around_its_saved_state_runs_once(
    model_dir, dirs, prompts, drafter, monkeypatch
):
    """A CUDA graph's capture runs the round once as a warm-up before the replay runs it
    again: with the buffers the round names as its state saved and put back in between, the
    round still takes effect once. Emulated on the CPU by running every round that way: the
    output is the synchronous step's."""
    from specdec.runner.cuda_graph import GraphCache

    def twice(self, key, step, state=None):
        if state is None:
            return step()
        saved = [(t, t.clone()) for t in state()]
        step()
        for tensor, copy in saved:
            tensor.copy_(copy)
        return step()

    monkeypatch.setattr(GraphCache, "run", twice)
    spec = spec_for(drafter, dirs, "standard")
    requests = [(p, params_for(1.0, 60 + i)) for i, p in enumerate(prompts)]
    sync, rounds, engine, _ = both(model_dir, spec, requests)
    assert rounds == sync and engine.loop_stats.num_device_rounds > 0


@pytest.mark.parametrize("drafter", ["eagle", "dspark"])
def test_a_round_of_k_drafts_runs_the_target_over_k_plus_1_rows(
    model_dir, dirs, prompts, monkeypatch, drafter
):
    """The round's target pass covers the input token and its k drafts only (not the widest
    round's K + 1 rows): with the policy scripted through K = 0, 1 and 3, each round's forward
    has k + 1 rows a slot, and the drafters that read its features (EAGLE's entries, DSpark's
    context) keep coupled and greedy output equal to plain decoding's."""
    widths = []
    original = device_round.DeviceRounds._round

    def spy(self, k):
        forward = self.runner.graphs.forward

        def recorded(num_seqs, query_per_seq, *args, **kwargs):
            widths.append((k, query_per_seq))
            return forward(num_seqs, query_per_seq, *args, **kwargs)

        self.runner.graphs.forward = recorded
        try:
            return original(self, k)
        finally:
            del self.runner.graphs.forward

    monkeypatch.setattr(device_round.DeviceRounds, "_round", spy)
    for method, temperature in (("coupled", 1.0), ("standard", 0.0)):
        requests = [(p, params_for(temperature, 70 + i)) for i, p in enumerate(prompts)]
        expected, _ = drive(make_engine(model_dir, None, False), requests)
        engine = make_engine(model_dir, spec_for(drafter, dirs, method, k=3, adaptive=True), True)
        engine.policy = scripted_policy((0, 1, 3))
        got, _ = drive(engine, requests)
        assert got == expected
    assert {k for k, _ in widths} == {0, 1, 3}
    assert all(query == k + 1 for k, query in widths)


@pytest.mark.parametrize("rule", ["on", "off (negative control)"])
def test_a_step_holding_a_prefill_chunk_drafts_nothing_beside_it(
    model_dir, dirs, prompts, monkeypatch, rule
):
    """With device rounds and the adaptive policy, a step that admits a joining request holds
    its prefill chunk beside the running requests' decode rows: those rows draft nothing (K =
    0), and the step is launched ahead in the overlapped loop (s29) instead of an eager verify
    step with host drafting (s27: ~30 ms a step on an H100). Coupled output still equals plain
    decoding's. Negative control: with the overlapped loop turned off for speculative batches,
    the same steps are synchronous and hold drafts. (Arrivals joining the running rounds without a
    drain, `_joins_rounds`, are turned off here: they take no step beside the rounds' rows;
    `test_arrivals_join_running_rounds_without_a_drain` covers them.)"""
    from specdec.engine import llm_engine
    from specdec.engine.overlapped_loop import OverlappedLoop
    from specdec.engine.speculative_loops import SpeculativeLoops

    monkeypatch.setattr(SpeculativeLoops, "_joins_rounds", lambda self: False)
    if rule != "on":
        monkeypatch.setattr(OverlappedLoop, "_overlaps", lambda self: False)
    mixed_drafts = []
    run_step, launch = llm_engine.LLMEngine._run_step, llm_engine.LLMEngine._launch

    def record(scheduled):
        if any(share.request.in_prefill for share in scheduled):
            mixed_drafts.extend(s.num_draft for s in scheduled if not s.request.in_prefill)

    def spy_run_step(self, scheduled, only_finished):
        record(scheduled)
        return run_step(self, scheduled, only_finished)

    def spy_launch(self, scheduled, previous, measured=False):
        record(scheduled)
        return launch(self, scheduled, previous, measured)

    monkeypatch.setattr(llm_engine.LLMEngine, "_run_step", spy_run_step)
    monkeypatch.setattr(llm_engine.LLMEngine, "_launch", spy_launch)
    requests = [(p, params_for(1.0, 70 + i)) for i, p in enumerate(prompts)]
    expected, _ = drive(make_engine(model_dir, None, False), requests[:2], late=requests[2:])
    spec = spec_for("eagle", dirs, "coupled", k=3, adaptive=True)
    engine = make_engine(model_dir, spec, True)
    got, _ = drive(engine, requests[:2], late=requests[2:])
    assert got == expected
    assert engine.loop_stats.num_device_rounds > 0
    assert mixed_drafts, "no decode row shared a step with a joining request's prefill"
    if rule == "on":
        assert set(mixed_drafts) == {0}
        assert engine.loop_stats.num_overlapped_prefill_steps > 0  # the overlapped loop ran
    else:
        assert any(mixed_drafts)
        assert engine.loop_stats.num_overlapped_prefill_steps == 0


@pytest.mark.parametrize("cache", ["ample", "small"])
def test_requests_the_rounds_cannot_take_decode_overlapped_beside_them(
    model_dir, dirs, prompts, monkeypatch, cache
):
    """Requests the rounds cannot take (a multi-token bad word; speculation switched off for
    one) decode beside the rounds, one plain token each in the overlapped steps launched
    between two rounds, drafting nothing, while the others take the rounds from the start
    (s43; they used to keep the whole batch out of the rounds until they finished). Coupled
    output (and logprobs, which the rounds take) equal plain decoding's; no step is
    synchronous. With a cache too small for all of them (preemptions), the same, and every
    block is given back."""
    from specdec.engine.scheduler import Scheduler

    beside = []
    schedule_joining = Scheduler.schedule_joining

    def spy(self, joining, budget, accept, decoding=()):
        shares = schedule_joining(self, joining, budget, accept, decoding)
        beside.append(sum(share.request in decoding for share in shares))
        return shares

    monkeypatch.setattr(Scheduler, "schedule_joining", spy)

    def sampled(seed: int, max_tokens: int, **kwargs) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, **kwargs)

    requests = {f"r{i}": (p, sampled(90 + i, 20, ignore_eos=True)) for i, p in enumerate(prompts)}
    requests["r0"] = (prompts[0], sampled(90, 8, logprobs=2))
    requests["r1"] = (prompts[1], sampled(91, 10, repetition_penalty=1.5, bad_words=["b c"]))
    requests["off"] = (prompts[2], sampled(99, 12, top_p=0.9))

    def run(engine, spec_off=()):
        for rid, (prompt, params) in requests.items():
            speculative = {"enabled": False} if rid in spec_off else None
            engine.add_request(prompt, params, request_id=rid, speculative=speculative)
        finals = {}
        while engine.has_unfinished:
            for out in engine.step(only_finished=True):
                finals[out.request_id] = [(o.token_ids, o.logprobs) for o in out.outputs]
        return finals

    args = {"num_kv_blocks": 16} if cache == "small" else {}
    expected = run(make_engine(model_dir, None, False, **args))
    spec = spec_for("eagle", dirs, "coupled", k=3, adaptive=True)
    engine = make_engine(model_dir, spec, True, **args)
    assert run(engine, spec_off={"off"}) == expected
    assert expected["r0"][0][1]  # logprobs were compared
    loop = engine.loop_stats
    assert loop.num_device_rounds > 0 and loop.num_side_rows == sum(beside) > 0
    if cache == "ample":
        assert max(beside) == 2  # both decoded beside the rounds, in the same steps
        assert loop.num_sync_steps == 0
    else:
        assert engine.num_preemptions > 0
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def drive_arrivals(engine, requests, arrivals):
    """Adds requests[i] at step arrivals[i] (0: before the first) and runs to the end; the
    final (tokens, finish reason) per request id."""
    pending = sorted(zip(arrivals, range(len(requests)), strict=True))
    finals, steps = {}, 0
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= steps:
            _, i = pending.pop(0)
            prompt, params = requests[i]
            engine.add_request(prompt, params, request_id=f"r{i}")
        for out in engine.step(only_finished=True):
            if out.finished:
                finals[out.request_id] = [(o.token_ids, o.finish_reason) for o in out.outputs]
        steps += 1
    return finals


@pytest.mark.parametrize("admission", ["admit", "stale token (negative control)"])
@pytest.mark.parametrize(
    ("drafter", "method", "temperature"),
    [
        ("eagle", "coupled", 1.0),
        ("eagle-adaptive", "coupled", 1.0),
        ("eagle", "standard", 0.0),
        ("ngram", "coupled", 1.0),
        ("draft_model", "coupled", 1.0),
    ],
)
def test_arrivals_join_running_rounds_without_a_drain(
    model_dir, dirs, prompts, monkeypatch, admission, drafter, method, temperature
):
    """Requests arriving while device rounds run join them without a drain: their prompts
    (chunked at 8 tokens a step) run in overlapped prefill steps between two rounds, and each
    then takes a free slot (a finished request's, once no round in flight holds it: 3 slots
    for 8 requests) for the next round, while the running requests keep drafting. The rounds
    are left once, at the end; no step is synchronous; coupled and greedy output equal plain
    decoding's for the same seeds. Negative control: an admission that gives the slot its
    request's previous token as input (one position stale) must change the tokens."""
    if admission != "admit":
        columns = device_round.DeviceRounds._columns

        def stale(self, requests):
            values = columns(self, requests)
            values[self.last_tokens] = [r.all_token_ids[-2] for r in requests]
            return values

        monkeypatch.setattr(device_round.DeviceRounds, "_columns", stale)
    from specdec.engine import llm_engine

    leaves, late_sync_steps = [], []
    leave, run_step = device_round.DeviceRounds.end, llm_engine.LLMEngine._run_step
    monkeypatch.setattr(
        device_round.DeviceRounds, "end", lambda self: (leaves.append(1), leave(self))[1]
    )

    def spy_run_step(self, scheduled, only_finished):
        if self._rounds is not None:  # a synchronous step after the rounds began
            late_sync_steps.append([share.request.request_id for share in scheduled])
        return run_step(self, scheduled, only_finished)

    monkeypatch.setattr(llm_engine.LLMEngine, "_run_step", spy_run_step)
    all_prompts = prompts + [p[::-1] for p in prompts]
    requests = [
        (p, params_for(temperature, 130 + i, max_tokens=12 + 3 * (i % 4)))
        for i, p in enumerate(all_prompts)
    ]
    arrivals = [0, 0, 3, 5, 6, 9, 14, 15]
    args = {"max_num_seqs": 3, "max_num_batched_tokens": 8 + 3 * 4}
    expected = drive_arrivals(make_engine(model_dir, None, False, **args), requests, arrivals)
    adaptive = drafter.endswith("-adaptive")
    spec = spec_for(drafter.removesuffix("-adaptive"), dirs, method, k=3, adaptive=adaptive)
    engine = make_engine(model_dir, spec, True, **args)
    if adaptive:  # K by a script (a measured choice would vary run to run)
        engine.policy = scripted_policy((3, 0, 2, 1))
    got = drive_arrivals(engine, requests, arrivals)
    loop = engine.loop_stats
    if admission != "admit":
        assert got != expected
        return
    assert got == expected
    assert loop.num_round_joins >= 5, loop.as_dict()  # those arriving while rounds ran
    assert not late_sync_steps  # only the first batch's prefill was synchronous (K pinned)
    assert len(leaves) == 1  # the rounds were never drained for an arrival
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def count_joining_prefills(monkeypatch) -> list[int]:
    """The requests of each prefill step launched between two rounds (`_launch_joining_prefill`),
    appended as the engine launches them."""
    from specdec.engine.speculative_loops import SpeculativeLoops

    launches = []
    launch = SpeculativeLoops._launch_joining_prefill

    def spy(self):
        before = self._round_prefill
        launch(self)
        if self._round_prefill is not before and self._round_prefill is not None:
            launches.append(len(self._round_prefill.requests))

    monkeypatch.setattr(SpeculativeLoops, "_launch_joining_prefill", spy)
    return launches


def scripted_policy(ks: tuple[int, ...], max_k: int = 3):
    """An adaptive policy (K up to max_k) whose rounds take the Ks of `ks` in turn (no
    measurement involved: a measured choice would vary run to run)."""
    from specdec.engine.spec_policy import SpeculationPolicy

    class Scripted(SpeculationPolicy):
        def _choose(self, bucket, remaining=None, in_rounds=True, *_beside):
            return ks[self._rounds % len(ks)]

    return Scripted(max_k)


def record_begins(monkeypatch) -> list[int]:
    """Per entry into the device rounds (`DeviceRounds.begin`), appended: how many requests."""
    begins = []
    begin = device_round.DeviceRounds.begin
    monkeypatch.setattr(
        device_round.DeviceRounds,
        "begin",
        lambda self, requests: (begins.append(len(requests)), begin(self, requests))[1],
    )
    return begins


@pytest.mark.parametrize("late", ["joins", "beside"])
def test_bursts_and_single_arrivals_join_the_rounds(model_dir, dirs, prompts, monkeypatch, late):
    """Under the adaptive policy, a burst (six arrivals beside two running) and a single
    arrival beside seven both join the running rounds without a drain: the rounds are entered
    once (s41; a single arrival used to drain them into overlapped steps and pay a re-entry).
    A late request the rounds cannot take (a multi-token bad word, which reads the output's
    tail on the host) no longer drains them either: it decodes beside them, in the overlapped
    steps launched between two rounds, without a slot. Coupled output equals plain decoding's
    either way."""
    begins = record_begins(monkeypatch)
    all_prompts = prompts + [p[::-1] for p in prompts]
    requests = [(p, params_for(1.0, 150 + i, max_tokens=24)) for i, p in enumerate(all_prompts)]
    if late != "joins":  # the single arrival: a short request with a multi-token bad word
        late_params = params_for(1.0, 157, max_tokens=4, bad_words=["b c"])
        requests[-1] = (all_prompts[-1], late_params)
    spec = spec_for("eagle", dirs, "coupled", k=3, adaptive=True)
    args = {"max_num_seqs": 8}
    for arrivals, burst in (([0, 0, 4, 4, 4, 4, 4, 4], True), ([0] * 7 + [6], False)):
        begins.clear()
        expected = drive_arrivals(make_engine(model_dir, None, False, **args), requests, arrivals)
        engine = make_engine(model_dir, spec, True, **args)
        engine.policy = scripted_policy((3, 2))
        assert drive_arrivals(engine, requests, arrivals) == expected
        joins = engine.loop_stats.num_round_joins
        if burst and late == "joins":  # six arrive beside two: they join, entered once
            assert joins == 6 and len(begins) == 1, (joins, begins)
        elif burst:  # five take slots; the one with a bad word decodes beside the rounds
            assert joins == 5 and len(begins) == 1, (joins, begins)
        elif late == "joins":  # one arrives beside seven: it joins too
            assert joins == 1 and len(begins) == 1, (joins, begins)
        else:
            assert joins == 0 and len(begins) == 1, (joins, begins)


def test_under_a_drafter_that_cannot_admit_arrivals_drain_while_others_decode_beside(
    model_dir, dirs, prompts
):
    """Under DFlash (its rounds take no request while they run: `DeviceDrafting.admits` is
    False) a request the rounds cannot take still decodes beside them, but arrivals are never
    taken in through the step beside the rounds (no slot could seat them): they drain the
    rounds as before. Greedy output (block verification) equals plain decoding's."""
    all_prompts = prompts + [p[::-1] for p in prompts]
    requests = [
        (
            p,
            SamplingParams(
                temperature=0.0,
                max_tokens=16,
                ignore_eos=True,
                bad_words=["b c"] if i == 0 else None,
            ),
        )
        for i, p in enumerate(all_prompts)
    ]
    arrivals = [0, 0, 0, 0, 5, 5, 6, 6]
    expected = drive_arrivals(make_engine(model_dir, None, False), requests, arrivals)
    engine = make_engine(model_dir, spec_for("dflash", dirs, "block", adaptive=True), True)
    assert drive_arrivals(engine, requests, arrivals) == expected
    loop = engine.loop_stats
    assert loop.num_device_rounds > 0 and loop.num_side_rows > 0, loop.as_dict()
    assert loop.num_round_joins == 0 and loop.num_sync_steps == 0, loop.as_dict()


RULED = [
    {"repetition_penalty": 1.6, "presence_penalty": 0.7, "frequency_penalty": 0.5},
    {"logit_bias": {3: 2.0, 10: -50.0}, "allowed_token_ids": list(range(60))},
    {"bad_words": ["c"], "min_tokens": 6, "stop_token_ids": [4, 11], "frequency_penalty": 1.2},
]


@pytest.mark.parametrize(
    "method, temperature, control",
    [
        ("coupled", 1.0, False),
        ("standard", 0.0, False),
        ("block", 0.0, False),
        ("coupled", 1.0, True),
    ],
)
def test_penalties_biases_and_bans_ride_the_rounds(
    model_dir, dirs, prompts, monkeypatch, method, temperature, control
):
    """Requests with penalties, a logit bias, allowed_token_ids, a single-token bad word and
    min_tokens decode in the device rounds (their rules held in their slots on the device,
    `SlotRules`), among requests without, and join the running rounds without a drain: the
    rounds are entered once, no step is synchronous. They emit exactly plain decoding's tokens
    (coupled at T = 1; any verifier at T = 0, where drafts change no token).
    Control: rounds that never count their emitted tokens in the slots' outputs
    (`SlotRules.observe` a no-op) must change the tokens."""
    from specdec.sampling.slot_rules import SlotRules

    begins = record_begins(monkeypatch)
    if control:
        monkeypatch.setattr(SlotRules, "observe", lambda self, emitted, accepted, live: None)
    all_prompts = prompts + [p[::-1] for p in prompts]
    requests = [
        (p, params_for(temperature, 170 + i, max_tokens=24, **RULED[i % 4] if i % 4 < 3 else {}))
        for i, p in enumerate(all_prompts)
    ]
    arrivals = [0, 0, 0, 0, 4, 4, 4, 4]
    args = {"max_num_seqs": 8}
    expected = drive_arrivals(make_engine(model_dir, None, False, **args), requests, arrivals)
    engine = make_engine(
        model_dir, spec_for("eagle", dirs, method, k=3, adaptive=True), True, **args
    )
    engine.policy = scripted_policy((3, 2))
    got = drive_arrivals(engine, requests, arrivals)
    assert (got == expected) != control
    loop = engine.loop_stats
    assert loop.num_sync_steps == 0 and loop.num_round_joins == 4 and begins == [4]
    assert engine._rounds._ruled


def trickling(model_dir, dirs, prompts, seed: int, max_tokens: int):
    """12 requests at the start and 4 arriving six steps apart through 16 slots: the requests,
    their arrival steps, plain decoding's finals, and an adaptive EAGLE engine (K = 2) with
    device rounds to run them."""
    all_prompts = (prompts + [p[::-1] for p in prompts]) * 2
    requests = [
        (p, params_for(1.0, seed + i, max_tokens=max_tokens)) for i, p in enumerate(all_prompts)
    ]
    arrivals = [0] * 12 + [6, 12, 18, 24]
    args = {"max_num_seqs": 16}
    expected = drive_arrivals(make_engine(model_dir, None, False, **args), requests, arrivals)
    engine = make_engine(
        model_dir, spec_for("eagle", dirs, "coupled", k=2, adaptive=True), True, **args
    )
    return requests, arrivals, expected, engine


def record_waits(engine) -> list[bool]:
    """Per engine step, appended as it runs: whether requests waited and none was admitted."""
    waited = []
    step = engine.step

    def spy_step(only_finished=False):
        waiting = len(engine.scheduler.waiting)
        outputs = step(only_finished)
        waited.append(bool(waiting) and len(engine.scheduler.waiting) == waiting)
        return outputs

    engine.step = spy_step
    return waited


@pytest.mark.parametrize("max_wait", [3600.0, 0.0])
def test_trickling_arrivals_gather_before_they_join(
    model_dir, dirs, prompts, monkeypatch, max_wait
):
    """Beside a running batch of 12, arrivals six steps apart are admitted once one waits per
    8 running (two at a time here) or the first has waited MAX_ADMISSION_WAIT_S: four arrivals
    join the rounds in two prefill steps, where admitting each at once (a wait of 0: the
    control that must differ) takes four; the rounds are entered once either way. A request
    waits through steps meanwhile; coupled output equals plain decoding's either way."""
    from specdec.engine import overlapped_loop

    monkeypatch.setattr(overlapped_loop, "MAX_ADMISSION_WAIT_S", max_wait)
    begins = record_begins(monkeypatch)
    launches = count_joining_prefills(monkeypatch)
    requests, arrivals, expected, engine = trickling(model_dir, dirs, prompts, 170, 60)
    engine.policy = scripted_policy((2,), max_k=2)
    waited = record_waits(engine)
    assert drive_arrivals(engine, requests, arrivals) == expected
    assert engine.loop_stats.num_sync_steps == 0
    assert len(begins) == 1 and engine.loop_stats.num_round_joins == 4, (begins, launches)
    if max_wait:
        assert launches == [2, 2] and any(waited), (launches, waited)
    else:
        assert launches == [1, 1, 1, 1], launches


@pytest.mark.parametrize("rows", ["right rows", "next row (negative control)"])
@pytest.mark.parametrize(
    ("drafter", "method", "temperature", "adaptive"),
    [
        ("eagle", "coupled", 1.0, True),
        ("eagle", "coupled", 1.0, False),
        ("eagle", "standard", 0.0, False),
        ("ngram", "coupled", 1.0, False),
        ("draft_model", "coupled", 0.7, True),
    ],
)
def test_requests_with_logprobs_ride_the_rounds(
    model_dir, dirs, prompts, monkeypatch, rows, drafter, method, temperature, adaptive
):
    """Requests that ask for logprobs (0, 1 or 3 top entries, beside one that asks for none)
    decode in device rounds, their logprobs computed after each round from the round's raw
    target logits: tokens and logprob entries (ids, values, ranks) equal plain decoding's for
    the same seeds; under the adaptive policy no step is synchronous (with K pinned the first
    step is). Negative control: logprobs taken one row later (the next position's logits) must
    differ."""
    if rows != "right rows":
        launch = device_round.DeviceRounds._launch_logprobs

        def shifted(self, k):
            logits = self.runner.graphs.logits
            saved = logits.clone()
            logits[:-1] = saved[1:]
            try:
                return launch(self, k)
            finally:
                logits.copy_(saved)

        monkeypatch.setattr(device_round.DeviceRounds, "_launch_logprobs", shifted)
    tops = [0, 1, 3, None]
    requests = [
        (p, SamplingParams(temperature=temperature, seed=40 + i, max_tokens=14, logprobs=n))
        for i, (p, n) in enumerate(zip(prompts, tops, strict=True))
    ]

    def run(engine):
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(prompt, params, request_id=f"r{i}")
        finals = {}
        while engine.has_unfinished:
            for out in engine.step(only_finished=True):
                finals[out.request_id] = [
                    (o.token_ids, o.finish_reason, o.logprobs) for o in out.outputs
                ]
        return finals

    expected = run(make_engine(model_dir, None, False))
    engine = make_engine(model_dir, spec_for(drafter, dirs, method, adaptive=adaptive), True)
    got = run(engine)
    assert all(expected[f"r{i}"][0][2] for i in range(3))  # logprobs were compared
    loop = engine.loop_stats
    assert loop.num_device_rounds > 0  # every request in them: the rounds take all or none
    assert loop.num_sync_steps == (0 if adaptive else 1)
    if rows == "right rows":
        assert got == expected
    else:
        assert [got[r][0][:2] for r in got] == [expected[r][0][:2] for r in got]  # tokens
        assert got != expected


def test_a_batch_that_does_not_speculate_takes_the_plain_loop(model_dir, dirs, prompts):
    """An engine with a drafter whose requests all switch speculation off runs the overlapped
    plain loop as an engine without one does: no synchronous step, no joining visit, no target
    features for the drafter. A request that speculates, arriving later, makes the step in
    flight be read and the engine take its speculative paths (rounds). Tokens equal plain
    decoding's (coupled) throughout."""
    requests = [
        (p, SamplingParams(temperature=1.0, seed=70 + i, max_tokens=16, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]

    def run(engine, speculating=(), late=()):
        steps, finals = 0, {}
        for i, (prompt, params) in enumerate(requests):
            if i not in late:
                on = {"enabled": i in speculating}
                engine.add_request(prompt, params, request_id=f"r{i}", speculative=on)
        while engine.has_unfinished:
            steps += 1
            if steps == 5:
                for i in late:
                    engine.add_request(*requests[i], request_id=f"r{i}")
            for out in engine.step(only_finished=True):
                finals[out.request_id] = [o.token_ids for o in out.outputs]
        return finals

    expected = run(make_engine(model_dir, None, True))
    engine = make_engine(model_dir, spec_for("eagle", dirs, "coupled", adaptive=True), True)
    observed = []
    observe = engine.drafter.observe
    engine.drafter.observe = lambda features: (observed.append(features), observe(features))
    assert run(engine) == expected
    loop = engine.loop_stats
    assert loop.num_sync_steps == 0 and loop.num_device_rounds == 0
    assert loop.num_overlapped_steps > 0 and not observed

    engine = make_engine(model_dir, spec_for("eagle", dirs, "coupled", adaptive=True), True)
    assert run(engine, speculating={3}, late={3}) == expected
    assert engine.loop_stats.num_device_rounds > 0  # the late request speculated


@pytest.mark.parametrize("rule", ["gathered", "every freed place (negative control)"])
def test_places_freed_while_others_join_wait_for_the_next_gathering(
    model_dir, dirs, prompts, monkeypatch, rule
):
    """A queue behind full rounds (a burst: it joins them without a drain): a place freed while
    earlier joiners still wait for their prefill or a slot is not filled by a prefill step of
    its own; waiting requests are taken in only when admission is due again (one per 8 running,
    4 of 32 here, with the 50 ms clock stopped), so joining prefill steps carry several requests.
    Control: taking every freed place at once (s40's rule) runs about a prefill step a join.
    Coupled output equals plain decoding's either way."""
    from specdec.engine import overlapped_loop, speculative_loops

    monkeypatch.setattr(overlapped_loop, "MAX_ADMISSION_WAIT_S", 3600.0)
    if rule != "gathered":  # every request here can join: the old rule, accept them all
        monkeypatch.setattr(speculative_loops, "_nobody", lambda request: True)
    launches = count_joining_prefills(monkeypatch)
    all_prompts = (prompts + [p[::-1] for p in prompts]) * 12
    requests = [
        (p, params_for(1.0, 300 + i, max_tokens=6 + (7 * i) % 23))
        for i, p in enumerate(all_prompts)
    ]
    arrivals = [0] * len(requests)
    args = {"max_num_seqs": 32}
    expected = drive_arrivals(make_engine(model_dir, None, False, **args), requests, arrivals)
    engine = make_engine(
        model_dir, spec_for("eagle", dirs, "coupled", k=2, adaptive=True), True, **args
    )
    engine.policy = scripted_policy((2,), max_k=2)
    assert drive_arrivals(engine, requests, arrivals) == expected
    joins = engine.loop_stats.num_round_joins
    assert joins >= 16, engine.loop_stats.as_dict()
    per_step = joins / len(launches)
    # (measured: 40 joins in 7 prefill steps gathered, 44 in 14 taking every freed place)
    if rule == "gathered":
        assert per_step >= 4.5, (joins, launches)
    else:
        assert per_step < 4.5, (joins, launches)


@pytest.mark.parametrize("speculative", [False, True])
def test_plain_batches_on_a_speculating_engine_admit_at_once(
    model_dir, dirs, prompts, monkeypatch, speculative
):
    """On an engine with device rounds, arrivals are gathered (`_admission_due`) only for a
    batch bound for the rounds: requests with speculation switched off run the overlapped loop
    as an engine without a drafter does, each arrival admitted at its first step. Control: the
    same arrivals beside speculating requests wait to be gathered (the 50 ms clock stopped).
    Tokens equal plain decoding's either way."""
    from specdec.engine import overlapped_loop

    monkeypatch.setattr(overlapped_loop, "MAX_ADMISSION_WAIT_S", 3600.0)
    requests, arrivals, expected, engine = trickling(model_dir, dirs, prompts, 400, 30)
    if not speculative:
        add = engine.add_request
        engine.add_request = lambda *a, **k: add(*a, speculative={"enabled": False}, **k)
    waited = record_waits(engine)
    assert drive_arrivals(engine, requests, arrivals) == expected
    if speculative:
        assert any(waited) and engine.loop_stats.num_device_rounds > 0
    else:
        assert not any(waited) and engine.loop_stats.num_device_rounds == 0
