"""Prometheus metrics of one server, in its own registry, with vLLM's names where vLLM has one.

prometheus_client accepts ':' in metric names (the exposition format reserves it for recording
rules, and vLLM uses it), so the spec-decode counters keep vLLM's `vllm:spec_decode_*` names.
Engine figures are read at scrape time from the engine thread's latest `EngineSnapshot`; nothing
here touches the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specdec.core.snapshot import EngineSnapshot

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Queue lengths, KV-cache use and the spec-decode counters from the latest snapshot."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator:
        snap = self._snapshot()
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use.", snap.kv_cache_usage
        )
        yield counter(
            "vllm:num_preemptions",
            "Requests preempted (their KV cache dropped, to be recomputed).",
            snap.num_preemptions,
        )
        yield gauge("specdec:kv_cache_num_blocks", "KV-cache blocks in all.", snap.num_blocks)
        yield gauge("specdec:kv_cache_free_blocks", "Free KV-cache blocks.", snap.num_free_blocks)
        yield counter(
            "vllm:spec_decode_num_drafts", "Verification rounds with drafts.", snap.num_drafts
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", snap.num_draft_tokens
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            snap.num_accepted_tokens,
        )
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose accepted prefix is longer than position.",
            labels=[*labels, "position"],
        )
        for position, count in enumerate(snap.accepted_per_position):
            per_position.add_metric([*values, str(position)], count)
        yield per_position
        # Which path served the steps.
        yield counter(
            "specdec:num_overlapped_steps",
            "Plain steps launched before the previous one was read.",
            snap.num_overlapped_steps,
        )
        yield counter(
            "specdec:num_overlapped_prefill_steps",
            "Overlapped steps that held prefill chunks (requests joining without a drain).",
            snap.num_overlapped_prefill_steps,
        )
        yield counter(
            "specdec:num_device_rounds",
            "Speculative rounds run on the device, launched before the previous one was read.",
            snap.num_device_rounds,
        )
        yield counter(
            "specdec:num_graph_rounds",
            "Device rounds replayed from CUDA graphs.",
            snap.num_graph_rounds,
        )
        yield counter(
            "specdec:num_round_joins",
            "Requests that joined running device rounds without draining them.",
            snap.num_round_joins,
        )
        yield counter(
            "specdec:num_side_rows",
            "Decode rows of requests the device rounds cannot take, run beside them.",
            snap.num_side_rows,
        )
        yield counter(
            "specdec:num_sync_steps", "Steps of the synchronous path.", snap.num_sync_steps
        )
        yield counter(
            "specdec:num_graphed_prefill_steps",
            "Steps that ran prefill chunks on the decode path's CUDA graphs.",
            snap.num_graphed_prefill_steps,
        )
        yield counter(
            "specdec:num_plain_arm_steps",
            "Plain overlapped decode steps the speculation policy chose over device rounds.",
            snap.num_plain_arm_steps,
        )
        yield counter(
            "specdec:cuda_graphs_after_warm_up",
            "CUDA graphs captured under traffic, after the start-up warm-up (each one stalls "
            "the requests of its step; 0 when the warm-up covered every step shape).",
            snap.graphs_after_warm_up,
        )
        if snap.triton_compiles_after_warm_up is not None:  # counted where Triton has the hook
            compiles = CounterMetricFamily(
                "specdec:triton_compiles_after_warm_up",
                "Triton kernel variants compiled (or loaded from Triton's disk cache) under "
                "traffic, after the start-up warm-up, by kernel (each stalls the requests of its "
                "step; none when the warm-up covered every variant).",
                labels=[*labels, "kernel"],
            )
            for kernel, count in snap.triton_compiles_after_warm_up:
                compiles.add_metric([*values, kernel], count)
            yield compiles
        chosen = CounterMetricFamily(
            "specdec:spec_k_chosen",
            "Device rounds by the number of drafts the policy chose (0: no drafts; -1: plain "
            "overlapped decode steps, the plain arm).",
            labels=[*labels, "k"],
        )
        for k, count in snap.k_chosen:
            chosen.add_metric([*values, str(k)], count)
        yield chosen
        policy = GaugeMetricFamily(
            "specdec:spec_policy_step_seconds",
            "The speculation policy's estimated seconds of a step by batch bucket and arm (K; "
            "-1: the plain arm; entry: entering device rounds; catch_up: a drafted step's extra "
            "cost after K = 0 steps, the drafter feeding what they left it).",
            labels=[*labels, "bucket", "k"],
        )
        for bucket, arm, seconds in snap.policy_seconds:
            policy.add_metric([*values, str(bucket), arm], seconds)
        yield policy
        acceptance = GaugeMetricFamily(
            "specdec:spec_policy_acceptance",
            "The speculation policy's running acceptance of draft position i given the drafts "
            "before it were accepted.",
            labels=[*labels, "position"],
        )
        for position, rate in enumerate(snap.policy_acceptance):
            acceptance.add_metric([*values, str(position)], rate)
        yield acceptance
        rows = CounterMetricFamily(
            "specdec:num_rows",
            "The target's query rows by kind: prefill (prompt chunks, recomputed prefixes), "
            "plain (decode rows without drafts), speculative (a request's last token and its "
            "drafts).",
            labels=[*labels, "kind"],
        )
        for kind, count in snap.rows:
            rows.add_metric([*values, kind], count)
        yield rows


class ServerMetrics:
    """The registry of one server and the metrics the request handlers update."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "specdec:http_requests",
            "HTTP requests by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.aborts = Counter(
            "specdec:request_aborts",
            "Requests aborted before they finished (client gone or engine stopped).",
            registry=self.registry,
        )
        self.request_errors = Counter(
            "specdec:request_errors",
            'Samples the engine ended with finish_reason "error" (the model produced no usable '
            "logits for one of their tokens); the requests beside them went on.",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.coalesced_outputs = Counter(
            "specdec:stream_outputs_coalesced",
            "Engine outputs of streaming requests not sent as chunks of their own: the reader "
            "was behind, and the newer output waiting (every output holds all tokens so far) "
            "went out in one chunk instead.",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from admission to the first token.",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=TPOT_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(snapshot, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
