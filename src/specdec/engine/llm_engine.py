"""The step loop: schedule -> propose -> target forward -> verify -> commit -> metrics.

Owns the requests, the scheduler, the model runner and the drafter. Every token it emits comes
from `specdec.sampling.sample` (no drafts) or `specdec.verify.verify` (drafts): the engine itself
never draws randomness.

The host work of a step is kept small, since it adds to every step's GPU time: per-request
constants (seeds, sampling parameters) stay on the device while the batch keeps its requests,
each step sends its per-request values with one copy per sampler or verifier call, and outputs
(detokenized text included) are built only for the requests a caller is told about.
"""

from __future__ import annotations

import gc
import itertools
import warnings
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from specdec.drafters import DraftBatch, Drafter, DrafterSetup, Proposal, TargetFeatures
from specdec.drafters.config import check_num_speculative_tokens
from specdec.drafters.registry import build_drafter
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from specdec.engine.request import Request, RequestStatus, SpecSettings
from specdec.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from specdec.metrics import SpecDecodeStats
from specdec.models import LlamaForCausalLM, Tokenizer, default_model_path, load_model
from specdec.rng import derive_seed, fresh_seed, to_signed64
from specdec.runner import BlockAllocator, PagedModelRunner, StepInput
from specdec.sampling import SamplingParams, SamplingTensors, compute_logprobs, sample
from specdec.transfer import Readback, to_device
from specdec.verify import VERIFY_METHODS, check_verify_inputs, verify_checked

CPU_KV_CACHE_BYTES = 1 << 30
_CPU = torch.device("cpu")
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(slots=True, eq=False)
class RequestGroup:
    """The n samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seed: int
    samples: list[Request]
    stop_token_ids: frozenset[int] = frozenset()  # stop_token_ids, and EOS unless ignored
    texts: list[str | None] = field(default_factory=list)  # a stop-truncated text, else None
    stop_reasons: list[str | int | None] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)


# One share's result of a step: (emitted tokens, num_draft, num_accepted, the share's raw target
# logits [num_draft + 1, V], whose first len(tokens) rows are the emitted tokens' distributions).
_Emission = tuple[list[int], int, int, torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Drafts:
    """One step's proposal, and for each request that got drafts (keyed by id(request)): its
    row of the proposal and its draft ids."""

    proposal: Proposal
    rows: dict[int, tuple[int, list[int]]]


@dataclass(frozen=True, slots=True)
class _Inflight:
    """A plain decode step launched but not read (asynchronous scheduling): its requests in
    batch order, their sampled tokens on the device, and the asynchronous copy reading them."""

    requests: list[Request]
    token_ids: torch.Tensor
    readback: Readback


class _BatchConstants:
    """The seeds and sampling parameters of a batch of requests, as tensors on `device`.

    They are fixed per request, so the engine keeps them while the same requests come in the same
    order (`LLMEngine._constants`) instead of rebuilding them (and copying them to the device) at
    every step. Each tensor is built on first use: an all-greedy batch of plain decoding never
    needs them.
    """

    __slots__ = ("_params", "_seeds", "device", "greedy", "requests")

    def __init__(self, requests: list[Request], device: torch.device) -> None:
        self.requests = requests
        self.device = device
        self.greedy = all(r.params.temperature == 0 for r in requests)
        self._seeds: torch.Tensor | None = None
        self._params: SamplingTensors | None = None

    @property
    def seeds(self) -> torch.Tensor:
        """[B] int64 request seeds."""
        if self._seeds is None:
            self._seeds = to_device([r.seed for r in self.requests], torch.int64, self.device)
        return self._seeds

    @property
    def params(self) -> SamplingTensors:
        """[B] sampling parameters (see `_sampling_tensors`)."""
        if self._params is None:
            self._params = _sampling_tensors([r.params for r in self.requests], self.device)
        return self._params


class LLMEngine:
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
        self.device = _resolve_device(config.device)
        dtype = _resolve_dtype(config.dtype, self.device)
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling == "auto":
            self.async_scheduling = self.device.type == "cuda"
        if model is None:
            path = config.model or str(default_model_path())
            model, _, tokenizer = load_model(path, dtype=dtype, device=self.device)
        self.model = model
        self.tokenizer = tokenizer
        self._eos_token_id = None if tokenizer is None else tokenizer.eos_token_id
        self.model_config = model.config
        context = self.model_config.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = config.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > context:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context of {context}"
            )
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        if num_blocks * config.block_size < self.max_model_len:
            # A request alone must always fit, or it could neither run nor be preempted for.
            warnings.warn(
                f"max_model_len lowered from {self.max_model_len} to the KV cache's "
                f"{num_blocks * config.block_size} slots",
                stacklevel=2,
            )
            self.max_model_len = num_blocks * config.block_size
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.runner = PagedModelRunner(
            model,
            num_blocks,
            config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            # Verify rounds of the default K take the decode path; a request asking for more
            # drafts runs its rounds eagerly.
            max_query_len=1
            + (speculative_config.num_speculative_tokens if speculative_config else 0),
            enforce_eager=config.enforce_eager,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            self.allocator,
        )
        if speculative_config is not None:
            self._check_round_fits(speculative_config.num_speculative_tokens)
        self.speculative_config = speculative_config
        self.drafter = self._build_drafter(speculative_config)
        self.stats = SpecDecodeStats()
        self.groups: dict[str, RequestGroup] = {}
        self._group_of: dict[int, RequestGroup] = {}
        self._inflight: _Inflight | None = None
        self._ids = itertools.count()
        self._batch_constants: dict[str, _BatchConstants] = {}

    # ------------------------------------------------------------------ setup
    def _default_num_blocks(self) -> int:
        cfg = self.model_config
        itemsize = self.model.model.embed_tokens.weight.element_size()
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize
        if self.device.type == "cuda":
            # Memory of engines that are gone (e.g. an earlier one in this process) is garbage
            # or cached by the allocator: give it back before measuring what is free.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1.0 - self.config.gpu_memory_utilization) * total
        else:
            needed = self.config.max_num_seqs * self.max_model_len * per_token
            budget = min(CPU_KV_CACHE_BYTES, needed)
        num_blocks = int(budget // (per_token * self.config.block_size))
        minimum = -(-self.max_model_len // self.config.block_size)
        if num_blocks < minimum:
            raise ValueError(
                f"the KV cache fits {num_blocks} blocks, fewer than one request of "
                f"max_model_len={self.max_model_len} needs ({minimum}); lower max_model_len"
            )
        return num_blocks

    def _check_round_fits(self, k: int) -> None:
        if k + 1 > self.config.max_num_batched_tokens:
            raise ValueError(
                f"a round of {k} drafts needs {k + 1} tokens, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}"
            )

    def _build_drafter(self, spec: SpeculativeConfig | None) -> Drafter | None:
        if spec is None:
            return None
        setup = DrafterSetup(
            num_blocks=self.allocator.num_blocks,
            block_size=self.config.block_size,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=self.config.enforce_eager,
        )
        return build_drafter(spec, self.model, setup)

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
                "method": "standard" | "block" | "coupled"}; None follows speculative_config.

        Raises:
            ValueError: bad prompt, bad override, or a prompt too long for max_model_len.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        spec = self._spec_settings(speculative)
        seed = to_signed64(params.seed) if params.seed is not None else fresh_seed()
        samples = []
        for index in range(params.n):
            request = Request(
                f"{request_id}#{index}", list(token_ids), params, derive_seed(seed, index), spec
            )
            self.scheduler.add(request)
            samples.append(request)
        stop_token_ids = set(params.stop_token_ids or [])
        if self._eos_token_id is not None and not params.ignore_eos:
            stop_token_ids.add(self._eos_token_id)
        group = RequestGroup(
            request_id, text, list(token_ids), seed, samples, frozenset(stop_token_ids)
        )
        group.texts = [None] * params.n
        group.stop_reasons = [None] * params.n
        group.logprobs = [[] if params.logprobs is not None else None for _ in range(params.n)]
        self.groups[request_id] = group
        for request in samples:
            self._group_of[id(request)] = group
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
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
            return SpecSettings(default.num_speculative_tokens, default.rejection_sample_method)
        known = {"enabled", "num_speculative_tokens", "method"}
        unknown = sorted(set(override) - known)
        if unknown:
            raise ValueError(f"unknown speculative keys {unknown}; known: {sorted(known)}")
        if not override.get("enabled", True):
            return None
        if self.drafter is None:
            raise ValueError("speculation was requested but the engine has no speculative_config")
        k = override.get("num_speculative_tokens", default.num_speculative_tokens)
        method = override.get("method", default.rejection_sample_method)
        check_num_speculative_tokens(k)
        if method not in VERIFY_METHODS:
            raise ValueError(f"method must be one of {VERIFY_METHODS}, got {method!r}")
        self._check_round_fits(k)
        return SpecSettings(k, method)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks (unknown ids are ignored)."""
        group = self.groups.get(request_id)
        if group is None:
            return
        for request in group.samples:
            if not request.status.finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._group_of.pop(id(request), None)
        del self.groups[request_id]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    # ------------------------------------------------------------------- step
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the requests that emitted tokens or finished
        (finished groups are then forgotten). `only_finished` skips building the outputs of
        unfinished requests (callers that do not stream). With `async_scheduling`, a step may
        launch work whose tokens the next call reports."""
        if self.async_scheduling and self.drafter is None:
            return self._step_async(only_finished)
        scheduled = self._schedule()
        if not scheduled:
            return []
        return self._run_step(scheduled, only_finished)

    def _schedule(self) -> list[ScheduledRequest]:
        out = self.scheduler.schedule()
        if self.drafter is not None:
            for request in out.preempted:
                self.drafter.release(request.request_id)
        if not out.scheduled and self.scheduler.has_unfinished:
            raise RuntimeError("no request could be scheduled: the KV cache is too small")
        return out.scheduled

    def _run_step(
        self, scheduled: list[ScheduledRequest], only_finished: bool
    ) -> list[RequestOutput]:
        """Proposes, runs, samples or verifies, and commits one scheduled step."""
        drafts = self._propose(scheduled)
        inputs = self._step_inputs(scheduled, drafts)
        feature_layers = self.drafter.feature_layers if self.drafter is not None else ()
        if feature_layers:
            logits, features = self.runner.run_with_features(inputs, feature_layers)
        else:
            logits, features = self.runner.run(inputs), []
        emitted = self._emit(scheduled, logits, drafts)
        if features:
            self._deliver_features(scheduled, inputs, features, emitted)
        # Streaming: every group that emitted; else only those with a request that finished.
        reported: dict[str, RequestGroup] = {}
        for share, step_input, emission in zip(scheduled, inputs, emitted, strict=True):
            request = share.request
            end = step_input.start + len(step_input.token_ids)
            if emission is None:
                self.scheduler.commit(request, end)
                continue
            tokens, num_draft, num_accepted, rows = emission
            self.scheduler.commit(request, end - (num_draft - num_accepted))
            if num_draft:
                request.stats.observe(num_draft, num_accepted)
                self.stats.observe(num_draft, num_accepted)
            group = self._group_of[id(request)]
            finished = self._append(request, group, tokens, rows)
            if finished or not only_finished:
                reported[group.request_id] = group
        return self._outputs(reported, only_finished)

    def _outputs(
        self, reported: dict[str, RequestGroup], only_finished: bool
    ) -> list[RequestOutput]:
        if only_finished:
            return [
                self._output(group)
                for group in reported.values()
                if all(r.status.finished for r in group.samples)
            ]
        return [self._output(group) for group in reported.values()]

    # ------------------------------------------------------- asynchronous scheduling
    def _step_async(self, only_finished: bool) -> list[RequestOutput]:
        """One call of the overlapped loop. With a step in flight: launch the next one when the
        batch is certain to be the same requests (its input tokens are the in-flight step's
        samples, still on the device), then read and commit the in-flight step's tokens while
        the new one runs; otherwise read the in-flight step first. With none in flight: run the
        scheduled step as usual, or launch it without reading when it can be overlapped."""
        inflight = self._inflight
        if inflight is not None:
            self._inflight = None
            if self._can_overlap(inflight):
                self._inflight = self._launch(self._schedule(), inflight)
            return self._resolve(inflight, only_finished)
        scheduled = self._schedule()
        if not scheduled:
            return []
        if all(self._overlappable(share) for share in scheduled):
            self._inflight = self._launch(scheduled, None)
            return []
        return self._run_step(scheduled, only_finished)

    def _overlappable(self, share: ScheduledRequest) -> bool:
        """A plain decode share whose output needs nothing but the sampled token."""
        request = share.request
        return (
            share.emits
            and share.num_query_tokens == 1
            and request.spec is None
            and request.num_computed_tokens == request.num_tokens - 1
            and request.params.logprobs is None
        )

    def _can_overlap(self, inflight: _Inflight) -> bool:
        """Whether the next schedule is certainly the in-flight requests again, each decoding
        one more token: nothing waits, nothing finished or was aborted, every request may still
        emit after its pending token, and the cache has a slot for each without preempting."""
        scheduler = self.scheduler
        running = scheduler.running
        if scheduler.waiting or len(running) != len(inflight.requests):
            return False
        if len(running) > scheduler.config.max_num_batched_tokens:
            return False
        block_size = scheduler.allocator.block_size
        new_blocks = 0
        for request, expected in zip(running, inflight.requests, strict=True):
            if request is not expected or request.status.finished:
                return False
            if len(request.output_token_ids) + request.num_pending >= self._output_limit(request):
                return False
            if request.num_computed_tokens + 1 > len(request.block_ids) * block_size:
                new_blocks += 1
        return new_blocks <= scheduler.allocator.num_free_blocks

    def _launch(self, scheduled: list[ScheduledRequest], previous: _Inflight | None) -> _Inflight:
        """Runs and samples a plain decode step without reading its tokens. With `previous`,
        each request's input token is that step's sample (same requests, same order)."""
        requests = [share.request for share in scheduled]
        first_tokens = None
        if previous is not None:
            if requests != previous.requests:
                raise RuntimeError("asynchronous scheduling: the batch changed unexpectedly")
            first_tokens = previous.token_ids
        inputs = self._step_inputs(scheduled, None)
        rows = self.runner.run_rows(inputs, first_tokens)  # [B, V]
        token_ids = self._sample_rows(requests, rows)
        for request, step_input in zip(requests, inputs, strict=True):
            self.scheduler.commit(request, step_input.start + 1)
            request.num_pending += 1
        return _Inflight(requests, token_ids, Readback({"tokens": token_ids}, {}))

    def _resolve(self, inflight: _Inflight, only_finished: bool) -> list[RequestOutput]:
        """Reads a launched step's tokens and commits them as a synchronous step would have
        (requests that finished meanwhile drop theirs)."""
        tokens = inflight.readback.values()["tokens"].tolist()
        reported: dict[str, RequestGroup] = {}
        for request, token in zip(inflight.requests, tokens, strict=True):
            request.num_pending -= 1
            if request.status.finished:
                continue
            group = self._group_of[id(request)]
            finished = self._append(request, group, [token], None)
            if finished or not only_finished:
                reported[group.request_id] = group
        return self._outputs(reported, only_finished)

    def _step_inputs(
        self, scheduled: list[ScheduledRequest], drafts: _Drafts | None
    ) -> list[StepInput]:
        """The runner's input of every share: a decode round feeds the last token and its drafts
        (logits for all of them); a prefill chunk feeds its slice of the tokens (logits for the
        last one when the chunk completes the prompt)."""
        draft_rows = drafts.rows if drafts is not None else {}
        inputs = []
        for share in scheduled:
            request = share.request
            last = request.num_tokens - 1
            if share.emits and request.num_computed_tokens >= last:  # not request.in_prefill
                tokens = [request.last_token_id]
                if draft_rows:
                    entry = draft_rows.get(id(request))
                    if entry is not None:
                        tokens += entry[1]
                inputs.append(StepInput(tokens, last, request.block_ids, len(tokens)))
            else:
                start = request.num_computed_tokens
                tokens = request.all_token_ids[start : start + share.num_query_tokens]
                inputs.append(StepInput(tokens, start, request.block_ids, int(share.emits)))
        return inputs

    def _deliver_features(self, scheduled, inputs, features, emitted) -> None:
        """Hands the drafter the target features of this step's committed query tokens (a prefill
        chunk; a round's input token and accepted drafts), never those of rejected drafts."""
        request_ids, starts, kept = [], [], []
        for share, step_input, rows, emission in zip(
            scheduled, inputs, features, emitted, strict=True
        ):
            if share.request.spec is None:
                continue
            num_valid = len(step_input.token_ids)
            if emission is not None:
                _, num_draft, num_accepted, _ = emission
                num_valid -= num_draft - num_accepted
            request_ids.append(share.request.request_id)
            starts.append(step_input.start)
            kept.append(rows[:num_valid])
        if request_ids:
            self.drafter.observe(TargetFeatures(request_ids, starts, kept))

    def _constants(
        self, purpose: str, requests: list[Request], device: torch.device
    ) -> _BatchConstants:
        """The constants of `requests` for `purpose` ("plain", "draft" or a verify method): the
        cached ones while the batch keeps the same requests in the same order, else new ones."""
        cached = self._batch_constants.get(purpose)
        if cached is None or cached.device != device or cached.requests != requests:
            cached = self._batch_constants[purpose] = _BatchConstants(requests, device)
        return cached

    def _propose(self, scheduled: list[ScheduledRequest]) -> _Drafts | None:
        """Drafts for the decode shares with num_draft > 0 (None: no request got drafts)."""
        if self.drafter is None:
            return None
        shares = [s for s in scheduled if s.num_draft > 0]
        if not shares:
            return None
        requests = [s.request for s in shares]
        constants = self._constants("draft", requests, _CPU)
        batch = DraftBatch(
            token_ids=[r.all_token_ids for r in requests],
            seeds=constants.seeds,
            anchors=torch.tensor([r.num_tokens for r in requests], dtype=torch.int64),
            num_draft=torch.tensor([s.num_draft for s in shares], dtype=torch.int64),
            methods=[r.spec.method for r in requests],
            params=constants.params,
            request_ids=[r.request_id for r in requests],
        )
        proposal = self.drafter.propose(batch)
        counts = proposal.num_draft.tolist()  # one device sync each for the whole batch
        draft_ids = proposal.draft_token_ids.tolist()
        rows = {
            id(request): (b, draft_ids[b][:n])
            for b, (request, n) in enumerate(zip(requests, counts, strict=True))
            if n
        }
        return _Drafts(proposal, rows) if rows else None

    def _emit(
        self, scheduled: list[ScheduledRequest], logits: list[torch.Tensor], drafts: _Drafts | None
    ) -> list[_Emission | None]:
        """Samples or verifies every emitting share: per share, its `_Emission` (None for a
        prefill chunk that emits nothing)."""
        emitted: list[_Emission | None] = [None] * len(scheduled)
        plain: list[int] = []
        spec: dict[str, list[int]] = {}
        draft_rows = drafts.rows if drafts is not None else {}
        for i, share in enumerate(scheduled):
            if not share.emits:
                continue
            if draft_rows and id(share.request) in draft_rows:
                spec.setdefault(share.request.spec.method, []).append(i)
            else:
                plain.append(i)
        if plain:
            self._sample_plain(plain, scheduled, logits, emitted)
        for method in VERIFY_METHODS:
            if method in spec:
                self._verify_group(spec[method], scheduled, logits, drafts, method, emitted)
        return emitted

    def _sample_plain(
        self,
        indices: list[int],
        scheduled: list[ScheduledRequest],
        logits: list[torch.Tensor],
        emitted: list[_Emission | None],
    ) -> None:
        """Samples one token for each share in `indices` (no drafts) with one sampler call; sets
        their entries of `emitted`."""
        requests = [scheduled[i].request for i in indices]
        row_logits = [logits[i] for i in indices]  # [1, V] each: one logit row was asked for
        rows = row_logits[0] if len(row_logits) == 1 else torch.cat(row_logits)  # [B, V]
        sampled = self._sample_rows(requests, rows).tolist()  # one device sync for the batch
        for i, token, row in zip(indices, sampled, row_logits, strict=True):
            emitted[i] = ([token], 0, 0, row)

    def _sample_rows(self, requests: list[Request], rows: torch.Tensor) -> torch.Tensor:
        """[B] int64 device tokens sampled from [B, V] logit rows at each request's next
        position (not read by the host)."""
        constants = self._constants("plain", requests, rows.device)
        if constants.greedy:
            # All greedy: `sample` would take the argmax (first maximum) without noise; the
            # filters never remove the maximum. One kernel instead of the sampler's setup.
            return rows.argmax(dim=-1)
        params = constants.params
        return sample(
            rows,
            constants.seeds,
            to_device([r.num_tokens for r in requests], torch.int64, rows.device),
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            check_values=False,  # parameters validated by SamplingParams, keys by the engine
        ).token_ids

    def _verify_group(
        self,
        indices: list[int],
        scheduled: list[ScheduledRequest],
        logits: list[torch.Tensor],
        drafts: _Drafts,
        method: str,
        emitted: list[_Emission | None],
    ) -> None:
        """Verifies the drafts of the shares in `indices` (all of `method`) with one verifier
        call; sets their entries of `emitted`."""
        requests = [scheduled[i].request for i in indices]
        entries = [drafts.rows[id(r)] for r in requests]  # (proposal row, draft ids)
        counts = [len(ids) for _, ids in entries]
        k = max(counts)
        # [B, K+1, V], zero-padded past each request's drafts (one copy: pad_sequence copies
        # row by row, so it is kept for ragged groups only).
        target_rows = [logits[i] for i in indices]
        if min(counts) == k:
            target = torch.stack(target_rows)
        else:
            target = pad_sequence(target_rows, batch_first=True)
        device = target.device
        positions, num_draft, flat_ids = _device_int64(
            [r.num_tokens for r in requests],
            counts,
            [t for _, ids in entries for t in ids + [-1] * (k - len(ids))],
            device=device,
        )
        draft_logits = draft_logsumexp = None
        proposal = drafts.proposal
        if proposal.draft_logits is not None:
            rows = [b for b, _ in entries]
            draft_logits = _draft_rows(proposal.draft_logits, rows, counts, k).to(device)
            if proposal.draft_logsumexp is not None:
                draft_logsumexp = _draft_rows(proposal.draft_logsumexp, rows, counts, k).to(device)
        constants = self._constants(method, requests, device)
        params = constants.params
        # Valid by construction (ids from the drafter, params from SamplingParams): skip the
        # value checks' host round trip.
        inputs = check_verify_inputs(
            target,
            flat_ids.view(len(requests), k),
            draft_logits,
            constants.seeds,
            positions,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            num_draft=num_draft,
            method=method,
            draft_logsumexp=draft_logsumexp,
            check_values=False,
        )
        out = verify_checked(inputs)
        host_accepted = out.num_accepted.tolist()  # one device sync each for the whole group
        host_tokens = out.token_ids.tolist()
        for i, tokens, accepted, n in zip(indices, host_tokens, host_accepted, counts, strict=True):
            emitted[i] = (tokens[: accepted + 1], n, accepted, logits[i])

    # ----------------------------------------------------------------- output
    def _append(self, request: Request, group: RequestGroup, tokens: list[int], rows) -> bool:
        """Appends emitted tokens one by one, stopping at the first stop condition. Returns
        whether the request finished."""
        params = request.params
        output = request.output_token_ids
        check_text = bool(params.stop) and self.tokenizer is not None
        limit = self._output_limit(request)
        for j, token in enumerate(tokens):
            output.append(token)
            if params.logprobs is not None:
                lp = compute_logprobs(rows[j : j + 1], torch.tensor([token]), params.logprobs)
                top = dict(zip(lp.top_ids[0].tolist(), lp.top_logprobs[0].tolist(), strict=True))
                group.logprobs[group.samples.index(request)].append(
                    TokenLogprob(token, float(lp.token_logprobs[0]), top)
                )
            num_out = len(output)
            if num_out >= params.min_tokens:
                if token in group.stop_token_ids:
                    reason = None if token == self._eos_token_id else token
                    group.stop_reasons[group.samples.index(request)] = reason
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    return True
                if check_text:
                    text = self._text(request)
                    hit = _find_stop(text, params.stop)
                    if hit is not None:
                        position, stop = hit
                        keep = position + (len(stop) if params.include_stop_str_in_output else 0)
                        index = group.samples.index(request)
                        group.texts[index] = text[:keep]
                        group.stop_reasons[index] = stop
                        self._finish(request, RequestStatus.FINISHED_STOPPED)
                        return True
            if num_out >= limit:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                return True
        return False

    def _output_limit(self, request: Request) -> int:
        """Output tokens the request may have: max_tokens, or max_model_len tokens in all."""
        limit = self.max_model_len - len(request.prompt_token_ids)
        max_tokens = request.params.max_tokens
        return limit if max_tokens is None else min(limit, max_tokens)

    def _text(self, request: Request) -> str:
        """The output text: decoded incrementally while the request runs (it may lag by an
        incomplete character), decoded whole once it has finished."""
        if self.tokenizer is None:
            return ""
        skip = request.params.skip_special_tokens
        if request.status.finished:
            return self.tokenizer.decode(request.output_token_ids, skip_special_tokens=skip)
        return request.detokenized.update(self.tokenizer, request.output_token_ids, skip)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        if self.drafter is not None:
            self.drafter.release(request.request_id)

    def _output(self, group: RequestGroup) -> RequestOutput:
        outputs = []
        finished = True
        for index, request in enumerate(group.samples):
            status = request.status
            done = status.finished
            finished = finished and done
            logprobs = group.logprobs[index]
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=self._text(request) if group.texts[index] is None else group.texts[index],
                    token_ids=list(request.output_token_ids),
                    finish_reason=status.value if done else None,
                    stop_reason=group.stop_reasons[index],
                    logprobs=None if logprobs is None else list(logprobs),
                    cumulative_logprob=None
                    if logprobs is None
                    else sum(t.logprob for t in logprobs),
                )
            )
        if len(group.samples) == 1:
            stats = group.samples[0].stats  # merging one set into empty counters copies it
        else:
            stats = SpecDecodeStats()
            for request in group.samples:
                stats.merge(request.stats)
        if finished:
            self.groups.pop(group.request_id, None)
            for request in group.samples:
                self._group_of.pop(id(request), None)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            seed=group.seed,
            spec_decode_stats=stats.as_dict(),
        )


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(hits) if hits else None


def _device_int64(*columns: list[int], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors of host columns on `device`, sent with one copy (`_device_tensor`)."""
    packed = to_device(list(itertools.chain.from_iterable(columns)), torch.int64, device)
    return list(packed.split_with_sizes([len(column) for column in columns]))


def _draft_rows(values: torch.Tensor, rows: list[int], counts: list[int], k: int) -> torch.Tensor:
    """[len(rows), k, ...] entries of the given rows of a proposal's [B, K, ...] draft tensor
    (draft logits or their log-normalisers), zero past each row's `counts` drafts (what padding
    each row's own drafts to k gives)."""
    if min(counts) == k and rows == list(range(values.shape[0])):
        return values[:, :k].contiguous()  # the whole proposal: no gather
    picked = values[to_device(rows, torch.int64, values.device), :k]  # a copy
    for b, n in enumerate(counts):
        if n < k:
            picked[b, n:] = 0
    return picked


def _sampling_tensors(params: list[SamplingParams], device: torch.device) -> SamplingTensors:
    def column(values, dtype, off):
        if all(v == off for v in values):
            return None
        return to_device(values, dtype, device)

    return SamplingTensors(
        temperature=to_device([p.temperature for p in params], torch.float32, device),
        top_k=column([p.top_k for p in params], torch.int64, 0),
        top_p=column([p.top_p for p in params], torch.float32, 1.0),
        min_p=column([p.min_p for p in params], torch.float32, 0.0),
    )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)
