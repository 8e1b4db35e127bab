"""The step loop: schedule -> propose -> run the target -> sample or verify -> commit.

Owns the requests, the scheduler, the model runner and the drafter; `proposals`, `emitter` and
`output_processor` hold the parts of a step. Every token it emits comes from
`specdec.sampling.sample` (no drafts) or `specdec.verify.verify` (drafts): the engine itself never
draws randomness.

The host work of a step is kept small, since it adds to every step's GPU time: per-request
constants (seeds, sampling parameters) stay on the device while the batch keeps its requests,
each step sends its per-request values with one copy per sampler or verifier call, and outputs
(detokenized text included) are built only for the requests a caller is told about.
"""

from __future__ import annotations

import itertools
import time

import torch

from specdec import triton_compiles
from specdec.drafters import Drafter, DrafterSetup
from specdec.drafters.config import (
    EAGLE_HEAD_METHODS,
    check_num_speculative_tokens,
    round_drafts,
)
from specdec.drafters.default import with_shipped_head
from specdec.drafters.registry import build_drafter
from specdec.engine.config import (
    AUTO_PREFILL_GRAPH_TOKENS,
    PREFILL_GRAPH_WIDTH,
    EngineConfig,
    SpeculativeConfig,
)
from specdec.engine.device_round import DeviceRounds
from specdec.engine.emitter import Emission, Emitter
from specdec.engine.feature_log import FeatureLog
from specdec.engine.inflight import Inflight
from specdec.engine.output_processor import OutputProcessor, RequestGroup, unusable_logits_message
from specdec.engine.outputs import RequestDelta, RequestOutput
from specdec.engine.overlapped_loop import OverlappedLoop
from specdec.engine.proposals import compact_path, deliver_features, propose, step_inputs
from specdec.engine.request import Request, RequestStatus, SpecSettings
from specdec.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from specdec.engine.setup import (
    check_kv_cache_dtype,
    check_tensor_parallel,
    choose_products,
    draft_cache_layers,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_max_model_len,
    size_kv_cache,
    use_native_sampling,
)
from specdec.engine.spec_policy import SYNC_EXPLORE_BUDGET, SYNC_SPEC_MARGIN, SpeculationPolicy
from specdec.engine.speculative_loops import SpeculativeLoops
from specdec.engine.warm_up import WarmUpReport, count_graphs, warm_up
from specdec.metrics import LoopStats, SpecDecodeStats
from specdec.models import (
    LlamaForCausalLM,
    Tokenizer,
    default_model_path,
    is_builtin_model,
    load_model,
)
from specdec.models.loader import load_vocabulary_layers
from specdec.rng import derive_seed, engine_request_seed, fresh_seed, to_signed64
from specdec.runner import BlockAllocator, PagedModelRunner, StepInput
from specdec.runner.tensor_parallel import TensorParallelGroup, TensorParallelRunner, start_target
from specdec.sampling import LogitsRules, SamplingParams, StructuredOutputsParams
from specdec.sampling.grammar import CompiledGrammar, GrammarCompiler
from specdec.verify import VERIFY_METHODS


class LLMEngine(OverlappedLoop, SpeculativeLoops):
    """A whole inference engine on one device."""

    def __init__(
        self,
        config: EngineConfig,
        speculative_config: SpeculativeConfig | None = None,
        *,
        model: LlamaForCausalLM | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """Loads the model (or takes a loaded one) and sizes the KV cache.

        Args:
            config: engine settings.
            speculative_config: the default speculation of every request (None: no drafts unless
                a request asks, which then fails: there is no drafter).
            model, tokenizer: an already loaded model (tests); `config.model` is then ignored.
        """
        self.config = config
        builtin_target = model is None and is_builtin_model(config.model)
        speculative_config = with_shipped_head(speculative_config, builtin_target, config.model)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            triton_compiles.install()  # before any kernel of this engine compiles
        check_kv_cache_dtype(config.kv_cache_dtype, self.device)  # before a model loads
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling == "auto":
            # Overlapped steps are not replayed on tensor-parallel workers (yet).
            self.async_scheduling = self.device.type == "cuda" and config.tensor_parallel_size == 1
        self.tensor_parallel: TensorParallelGroup | None = None
        # The built-in model's path is looked up only when a model is loaded here (a caller
        # handing in `model` needs no checkpoint installed).
        path = config.model or (str(default_model_path()) if model is None else None)
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(config, self.device, model, speculative_config)
            loaded, self.tensor_parallel = start_target(
                path,
                resolve_dtype(config.dtype, self.device),
                self.device,
                config.quantization,
                config.tensor_parallel_size,
            )
            model, tokenizer = loaded.model, loaded.tokenizer
        elif model is None:
            dtype = resolve_dtype(config.dtype, self.device)
            model, _, tokenizer = load_model(
                path, dtype=dtype, device=self.device, quantization=config.quantization
            )
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model.config
        num_blocks, self.max_model_len = size_kv_cache(
            config,
            model,
            resolve_max_model_len(config, model),
            self.device,
            draft_cache_layers(speculative_config, model),
        )
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        # Speculative rounds on the device (overlapped with the host) need the decode path's
        # static buffers, on the CPU too (where they run op by op).
        self.device_rounds = bool(
            self.async_scheduling
            and speculative_config is not None
            and model.config.decode_path_reason(self.device.type) is None
        )
        runner_args = dict(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            # Verify rounds of the default K (a tree's N nodes) take the decode path; a request
            # asking for more drafts runs its rounds eagerly.
            max_query_len=1 + (round_drafts(speculative_config) if speculative_config else 0),
            enforce_eager=config.enforce_eager,
            decode_path=True if self.device_rounds else None,
            kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype, self.device),
        )
        graphed_prefill = config.prefill_graph_tokens
        if graphed_prefill == "auto":
            # On CUDA, under enforce_eager too: the decode path then runs the same chunks op by
            # op, so an eager engine's numbers stay those of the graphed one.
            on_cuda = self.device.type == "cuda"
            graphed_prefill = AUTO_PREFILL_GRAPH_TOKENS if on_cuda else 0
        runner_args["prefill_width"] = PREFILL_GRAPH_WIDTH if graphed_prefill else 0
        if self.device.type == "cpu":
            use_native_sampling()
        if self.tensor_parallel is None:
            self.runner = PagedModelRunner(model, **runner_args)
            choose_products(model, config, runner_args["max_query_len"])
        else:  # every rank builds its runner; each step is replayed on the workers
            self.runner = TensorParallelRunner(model, self.tensor_parallel, runner_args)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                # (no decode path, e.g. a float model on the CPU: every prefill runs eagerly)
                prefill_graph_tokens=graphed_prefill if self.runner.graphs is not None else 0,
                prefill_graph_width=PREFILL_GRAPH_WIDTH,
            ),
            self.allocator,
        )
        if speculative_config is not None:
            self._check_round_fits(round_drafts(speculative_config))
            if speculative_config.tree is not None and self.device_rounds:
                raise ValueError(
                    "speculative_config.tree runs on the synchronous engine path only (no "
                    "device rounds for trees yet): set async_scheduling=False"
                )
        self.speculative_config = speculative_config
        self.drafter = self._build_drafter(speculative_config)
        # Rows of device-held rules for the plain steps' requests (row 0 neutral).
        self.emitter = Emitter(rule_rows=self.config.max_num_seqs + 1)
        self.outputs = OutputProcessor(tokenizer, self.max_model_len, self._finish)
        self.stats = SpecDecodeStats()
        self.loop_stats = LoopStats()
        self._warm_graphs = 0  # CUDA graphs held after the warm-up (`graphs_after_warm_up`)
        # Triton variants by kernel at the end of the warm-up (`triton_compiles_after_warm_up`)
        self._warm_compiles: dict[str, int] = {}
        self.num_preemptions = 0  # engine-wide, for vllm:num_preemptions
        # `step` and `abort` return `RequestDelta`s (each output as its change since the
        # previous one) instead of `RequestOutput`s: `specdec serve`'s engine process sets it,
        # so that a step does not rebuild every running request's whole output.
        self.emit_deltas = False
        self._inflight: Inflight | None = None
        self._rounds: DeviceRounds | None = None  # built on first use
        self._in_rounds = False
        # Requests joining running rounds without draining them (`_step_rounds`): admitted,
        # not in a slot yet (their prefill, then a free slot), and their prefill step in flight.
        self._round_joiners: list[Request] = []
        # Running requests the rounds do not take, decoding beside them (`_enter_rounds`).
        self._round_side: list[Request] = []
        self._round_prefill: Inflight | None = None
        # Since when a waiting request could have been admitted (`_admission_due`); None: none.
        self._admissible_since: float | None = None
        # The policy chose its plain arm for the overlapped loop's batch (`_round_choice`), or
        # in the rounds (they drain, then the batch goes on in the overlapped loop).
        self._plain_chosen = False
        self._next_k: int | None = None  # the K chosen for the first round on entering them
        self._plain_rows = 0  # the rows of the rounds the batch left (plain steps pad to them)
        self._entry_cost = None  # (bucket, host seconds, device marks) of the last entry
        # The speculative requests' target features from overlapped steps, for the drafter.
        self._feature_log = FeatureLog(self.drafter)
        self.policy = None
        if speculative_config is not None:
            tree = speculative_config.tree
            self.policy = SpeculationPolicy(
                # a tree's arm is the whole tree, its acceptance counted by level
                speculative_config.num_speculative_tokens if tree is None else tree.depth,
                speculative_config.adaptive,
                plain_arm=speculative_config.plain_arm,
                tree=tree is not None,
                # Without device rounds (the CPU) every step is synchronous and a drafted step
                # costs about twice a plain one: explore within a share of the time.
                side_budget=None if self.device_rounds else SYNC_EXPLORE_BUDGET,
                margin=0.0 if self.device_rounds else SYNC_SPEC_MARGIN,
            )
        self._sync_k: dict[int, int] = {}  # batch bucket -> the K its last measured step took
        self._sync_emitted: list[tuple[str, Emission | None]] = []  # the last synchronous step's
        self._ids = itertools.count()
        self._unseeded = itertools.count()  # requests without a seed, for `config.seed`
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request

    def _build_drafter(self, spec: SpeculativeConfig | None) -> Drafter | None:
        if spec is None:
            return None
        setup = DrafterSetup(
            num_blocks=self.allocator.num_blocks,
            block_size=self.config.block_size,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=self.config.enforce_eager,
            device_rounds=self.device_rounds,
        )
        target = self.model
        if self.tensor_parallel is not None and spec.method in (*EAGLE_HEAD_METHODS, "draft_model"):
            # The drafter runs on the driver only: it shares the whole-vocabulary embedding
            # and LM head, loaded there once more (the driver's shard holds a slice).
            target = load_vocabulary_layers(
                self.config.model or str(default_model_path()),
                self.model.dtype,
                self.device,
                self.model.quantization,
            )
        return build_drafter(spec, target, setup)

    def close(self) -> None:
        """Stops the tensor-parallel workers (nothing to do on one device); idempotent."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def warm_up(self, *, force: bool = False, progress: bool | None = None) -> WarmUpReport:
        """Runs every step shape this engine takes under traffic once, on inert inputs, so that
        its CUDA graphs are captured now rather than under traffic (`engine.warm_up`: what it
        runs, and why it leaves no trace). Call it on an idle engine, before the first request;
        skipped where nothing is captured (the CPU, enforce_eager) unless `force`. `progress`:
        a progress bar on stderr (None: when stderr is a terminal)."""
        report = warm_up(self, force=force, progress=progress)
        self._warm_graphs = count_graphs(self)
        self._warm_compiles = triton_compiles.by_kernel()
        return report

    @property
    def graphs_after_warm_up(self) -> int:
        """CUDA graphs captured since the warm-up (every one, on an engine never warmed up):
        stays 0 under traffic on a warmed-up engine; each is a stall of the requests in its
        step (`/metrics`: specdec:cuda_graphs_after_warm_up)."""
        return count_graphs(self) - self._warm_graphs

    @property
    def triton_compiles_after_warm_up(self) -> dict[str, int] | None:
        """Triton kernel variants compiled (or loaded from Triton's disk cache) since the
        warm-up, by kernel (since the engine was built, on an engine never warmed up): {} under
        traffic on a warmed-up engine; each is a stall of the requests in its step (`/metrics`:
        specdec:triton_compiles_after_warm_up). None where they are not counted (no Triton, or
        one without the post-compile hook). Counted process-wide (`specdec.triton_compiles`)."""
        if not triton_compiles.available():
            return None
        return triton_compiles.since(self._warm_compiles)

    def _check_round_fits(self, k: int) -> None:
        if k + 1 > self.config.max_num_batched_tokens:
            raise ValueError(
                f"a round of {k} drafts needs {k + 1} tokens, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}"
            )

    # --------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        speculative: dict | None = None,
    ) -> str:
        """Queues one prompt (a string, or token ids). Returns its request id.

        Args:
            prompt: text (tokenized with the model's tokenizer) or token ids.
            params: sampling settings (defaults: SamplingParams()).
            request_id: an id of the caller's; a fresh one when None.
            speculative: per-request override {"enabled": bool, "num_speculative_tokens": int,
                "rejection_sample_method": "standard" | "block" | "coupled"}; None follows
                speculative_config (whose drafter, `method`, every request shares).

        Raises:
            ValueError: bad prompt, bad override, stop strings without a tokenizer, or a prompt
                too long for max_model_len.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need the model's tokenizer, and this model has none "
                "(use stop_token_ids)"
            )
        spec = self._spec_settings(speculative)
        rules = self._logits_rules(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._compile_grammar(params.structured_outputs)
            matchers = [self._grammars.matcher(grammar) for _ in range(params.n)]
        seed = to_signed64(params.seed) if params.seed is not None else self.new_request_seed()
        samples = []
        for index in range(params.n):
            request = Request(
                f"{request_id}#{index}",
                list(token_ids),
                params,
                derive_seed(seed, index),
                spec,
                rules=rules,
                grammar=None if grammar is None else matchers[index],
            )
            self.scheduler.add(request)
            samples.append(request)
        stop_token_ids = set(params.stop_token_ids or [])
        eos = self.outputs.eos_token_id
        if eos is not None and not params.ignore_eos:
            stop_token_ids.add(eos)
        self.outputs.add(
            RequestGroup(
                request_id, text, list(token_ids), seed, samples, frozenset(stop_token_ids)
            )
        )
        return request_id

    def new_request_seed(self) -> int:
        """The seed of a request that brings none: derived from `config.seed` in arrival order,
        or fresh (it is recorded in the request's output either way)."""
        if self.config.seed is None:
            return fresh_seed()
        return engine_request_seed(self.config.seed, next(self._unseeded))

    def _logits_rules(self, params: SamplingParams) -> LogitsRules | None:
        """The request's penalties, biases and bans resolved to token ids (ValueError naming a
        field whose token ids lie outside the vocabulary)."""
        tokenizer = self.tokenizer
        encode = None
        if tokenizer is not None:

            def encode(text: str) -> list[int]:
                return tokenizer.encode(text, add_special_tokens=False)

        return LogitsRules.from_params(
            params,
            vocab_size=self.model_config.vocab_size,
            eos_token_id=self.outputs.eos_token_id,
            encode=encode,
        )

    def _compile_grammar(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """The request's constraint compiled for this model's tokenizer (cached by the
        constraint; ValueError naming an invalid schema, regex or grammar)."""
        if self._grammars is None:
            tokenizer = self.tokenizer
            if tokenizer is None or self.outputs.eos_token_id is None:
                raise ValueError("structured outputs need the model's tokenizer and EOS token")
            self._grammars = GrammarCompiler.from_backend(
                tokenizer.backend, self.model_config.vocab_size, self.outputs.eos_token_id
            )
        return self._grammars.compile(constraint)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer: pass prompts as token ids "
                    '(LLM.generate({"prompt_token_ids": [...]}), or a list of ids)'
                )
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("a prompt must be a string or a list of token ids")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, list(prompt)

    def _spec_settings(self, override: dict | None) -> SpecSettings | None:
        default = self.speculative_config
        if override is None:
            if default is None:
                return None
            return SpecSettings(round_drafts(default), default.rejection_sample_method)
        if default is not None and default.tree is not None:
            k = override.get("num_speculative_tokens", default.tree.nodes)
            if isinstance(k, int) and not isinstance(k, bool) and k > default.tree.nodes:
                raise ValueError(
                    "num_speculative_tokens with speculative_config.tree is the request's node "
                    f"budget a round, at most tree.nodes = {default.tree.nodes}, got {k}"
                )
            if override.get("rejection_sample_method") == "block":
                raise ValueError(
                    "rejection_sample_method 'block' is chain-only: not with "
                    "speculative_config.tree"
                )
        if "method" in override:
            raise ValueError(
                'the speculative override has no "method": the verifier is '
                '"rejection_sample_method" (standard, block or coupled); "method" names the '
                "drafter, which is the engine's speculative_config.method"
            )
        known = {"enabled", "num_speculative_tokens", "rejection_sample_method"}
        unknown = sorted(set(override) - known)
        if unknown:
            raise ValueError(f"unknown speculative keys {unknown}; known: {sorted(known)}")
        if not override.get("enabled", True):
            return None
        if self.drafter is None:
            raise ValueError("speculation was requested but the engine has no speculative_config")
        k = override.get("num_speculative_tokens", round_drafts(default))
        method = override.get("rejection_sample_method", default.rejection_sample_method)
        check_num_speculative_tokens(k)
        if method not in VERIFY_METHODS:
            raise ValueError(
                f"rejection_sample_method must be one of {VERIFY_METHODS}, got {method!r}"
            )
        self._check_round_fits(k)
        return SpecSettings(k, method)

    def abort(self, request_id: str) -> RequestOutput | RequestDelta | None:
        """Stops a request and frees its KV blocks. Returns its final output (finish_reason
        "abort" for the samples it stopped; a `RequestDelta` with `emit_deltas`), or None for
        an unknown id."""
        group = self.outputs.groups.get(request_id)
        if group is None:
            return None
        for request in group.samples:
            if not request.status.finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
        output = self.outputs.delta(group) if self.emit_deltas else self.outputs.output(group)
        self.outputs.forget(group)
        return output

    @property
    def groups(self) -> dict[str, RequestGroup]:
        """The request groups not finished or not reported yet, by request id."""
        return self.outputs.groups

    @property
    def has_unfinished(self) -> bool:
        rounds_inflight = self._rounds is not None and bool(self._rounds.inflight)
        return self.scheduler.has_unfinished or self._inflight is not None or rounds_inflight

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        if self.drafter is not None:
            self.drafter.release(request.request_id)
        if self.policy is not None:
            self.policy.forget(request.request_id)

    # ------------------------------------------------------------------- step
    def step(self, only_finished: bool = False) -> list[RequestOutput] | list[RequestDelta]:
        """Runs one step; returns the outputs of the requests that emitted tokens or finished
        (finished groups are then forgotten; `RequestDelta`s with `emit_deltas`).
        `only_finished` skips building the outputs of unfinished requests (callers that do not
        stream), except, with `emit_deltas`, the deltas of requests whose first tokens this step
        emitted (a stream sent at intervals starts at once: `core.engine_process`). With
        `async_scheduling`, a step may launch work whose tokens the next call reports.

        Three paths: the device rounds (`_step_rounds`: every running request speculating in
        one graphed round, arrivals joining between rounds), the overlapped loop
        (`_step_overlapped`: every step that drafts nothing, with arrivals, prefill chunks and
        the policy's plain arm; it hands the batch to the rounds when the policy picks a K),
        and the synchronous step below (no asynchronous scheduling, as on the CPU; trees; a
        pinned K; drafters without device rounds)."""
        if self._in_rounds:
            return self._step_rounds(only_finished)
        if self._inflight is not None or self._overlaps():
            return self._step_overlapped(only_finished)
        scheduled = self._schedule()
        if not scheduled:
            return []
        chosen = self._sync_step_k(scheduled)
        started = time.perf_counter()
        outputs = self._run_step(scheduled, only_finished)
        if chosen is not None:
            self._observe_sync_step(chosen, time.perf_counter() - started)
        self.loop_stats.num_sync_steps += 1
        if self.device_rounds:
            self._enter_rounds()
        return outputs

    def _run_step(
        self, scheduled: list[ScheduledRequest], only_finished: bool
    ) -> list[RequestOutput]:
        """The algorithm: propose drafts, run the target over [last token + drafts] (or a prefill
        chunk), sample or verify, commit (advance, roll back rejected slots), report."""
        self._count_rows(scheduled)
        drafts = propose(self.drafter, self.emitter.constants, scheduled)
        inputs = step_inputs(scheduled, drafts, self.outputs.wants_prompt_logprobs)
        # Target features only where a request of the step speculates (none for plain requests
        # on a speculating engine: their features would go nowhere), except with CUDA graphs,
        # which the warm-up captured with the drafter's feature layers.
        wanted = self.runner.graphs is not None or any(s.request.spec for s in scheduled)
        layers = self.drafter.feature_layers if self.drafter is not None and wanted else ()
        graphed = self.runner.num_graphed_prefill_steps
        logits, features = self.runner.run_with_features(inputs, layers)
        self.loop_stats.num_graphed_prefill_steps += self.runner.num_graphed_prefill_steps - graphed
        logits = self._take_prompt_logprobs(scheduled, inputs, logits)
        emitted = self.emitter.emit(scheduled, logits, drafts)
        # the policy's acceptance counts, by request (`_observe_sync_step`)
        self._sync_emitted = [
            (s.request.request_id, e) for s, e in zip(scheduled, emitted, strict=True)
        ]
        paths = [None if e is None else e.path for e in emitted]
        if features:
            rejected = [0 if e is None else e.num_rejected for e in emitted]
            deliver_features(self.drafter, scheduled, inputs, features, rejected, paths)
        for step_input, path in zip(inputs, paths, strict=True):
            if path:  # an accepted tree path: its K/V into the consecutive slots it belongs in
                compact_path(self.runner.kv_cache, step_input, path, self.config.block_size)
        commits = []
        for share, step_input, emission in zip(scheduled, inputs, emitted, strict=True):
            end = step_input.start + len(step_input.token_ids)
            rejected = 0 if emission is None else emission.num_rejected
            commits.append((share.request, end - rejected, emission))
        return self._commit(commits, only_finished)

    def _count_rows(self, scheduled: list[ScheduledRequest]) -> None:
        """The step's query rows by kind to `loop_stats` (before the step commits)."""
        prefill = plain = speculative = 0
        for share in scheduled:
            if share.request.in_prefill:
                prefill += share.num_query_tokens
            elif share.num_draft:
                speculative += share.num_query_tokens
            else:
                plain += share.num_query_tokens
        self.loop_stats.observe_rows(prefill, plain, speculative)

    def _take_prompt_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        inputs: list[StepInput],
        logits: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Records the prompt logprobs of prefill chunks that asked for all their logit rows,
        and returns each share's logits as the emitter expects them (the last row of a chunk
        that emits)."""
        out = list(logits)
        for i, (share, step_input) in enumerate(zip(scheduled, inputs, strict=True)):
            request = share.request
            decode = share.emits and request.num_computed_tokens >= request.num_tokens - 1
            if not decode and step_input.num_logit_rows > int(share.emits):
                self.outputs.add_prompt_logprobs(request, step_input.start, logits[i])
                out[i] = logits[i][-1:] if share.emits else logits[i][:0]
        return out

    def _commit(
        self, commits: list[tuple[Request, int | None, Emission | None]], only_finished: bool
    ) -> list[RequestOutput]:
        """The commit path of both loops. Per (request, num_computed, emission): records that
        its first num_computed tokens have K/V (rejected draft slots rolled back; None: committed
        when launched), counts the emission's drafts, appends its tokens under the stop rules,
        or ends the request with an error when its step read a logits row without a
        distribution (that request alone: the others of the step go on); then builds the
        outputs to report (streaming: every group that emitted; else only those with a request
        that finished, and with `emit_deltas` those whose first tokens came now)."""
        reported: dict[str, RequestGroup] = {}
        for request, num_computed, emission in commits:
            if num_computed is not None:
                self.scheduler.commit(request, num_computed)
            if emission is None:
                continue
            if emission.unusable_position is not None:
                self.outputs.fail(request, unusable_logits_message(emission.unusable_position))
                group = self.outputs.group_of(request)
                reported[group.request_id] = group
                continue
            if emission.num_draft:
                request.stats.observe(emission.num_draft, emission.num_accepted)
                self.stats.observe(emission.num_draft, emission.num_accepted)
            before = len(request.output_token_ids)
            finished = self.outputs.append(
                request, emission.tokens, emission.rows, emission.logprobs
            )
            if self.emitter.request_rules is not None and request.rules is not None:
                appended = request.output_token_ids[before:]
                self.emitter.request_rules.committed(request, appended)
            if request.grammar is not None and not request.status.finished:
                request.grammar.commit(request.output_token_ids)
            first = self.emit_deltas and len(request.output_token_ids) <= len(emission.tokens)
            if finished or first or not only_finished:
                group = self.outputs.group_of(request)
                reported[group.request_id] = group
        return self.outputs.outputs(reported, only_finished, self.emit_deltas)

    def _schedule(self) -> list[ScheduledRequest]:
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        if self.drafter is not None:
            for request in out.preempted:
                self._feature_log.drop(request)
                self.drafter.release(request.request_id)
        if not out.scheduled and self.scheduler.has_unfinished:
            raise RuntimeError("no request could be scheduled: the KV cache is too small")
        return out.scheduled
