"""Paged execution of a model: one forward step over a mixed batch (prefill chunks and
decode/verify rows). Steps made only of decode/verify rows take the fused decode
path, replayed from CUDA graphs on the GPU; other steps run eagerly. Used by the engine for the
target and by drafters for their own models. Never samples or draws randomness.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.draft_tree import region_rows, verify_step_mask, verify_step_positions
from specdec.models.attention import AttentionMetadata
from specdec.models.llama import LlamaForCausalLM
from specdec.runner.decode_step import DecodeGraphs
from specdec.transfer import to_device


@dataclass(frozen=True, slots=True)
class StepInput:
    """One sequence's share of a forward step.

    Attributes:
        token_ids: the query tokens fed this step.
        start: position of token_ids[0] (tokens 0..start-1 already have K/V in the cache).
        block_ids: the sequence's cache blocks, covering start + len(token_ids) slots.
        num_logit_rows: logits are wanted for the last `num_logit_rows` query tokens.
        tree_parents: for a tree verify step (token_ids = [input token, node 0, ...]), each
            node's parent (`specdec.draft_tree`): node n is rotated as position start + 1 +
            depth[n] and attends to the cached prefix and its ancestors only; its K/V go to
            slot start + 1 + n until the accepted path is compacted. None: a causal step.
    """

    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_logit_rows: int
    tree_parents: list[int] | None = None


class PagedModelRunner:
    """Owns a model and its KV cache (`num_blocks` x `block_size` slots).

    Inputs that want logits for all of their (at most `max_query_len`) query tokens (decode: 1,
    verify: K + 1, tree verify: N + 1) run the fused decode path: on CUDA, replayed from CUDA
    graphs captured per (padded batch size, query length, tree or not) unless `enforce_eager`.
    With `prefill_width`, prefill chunks of at most that many tokens that want at most their last
    row's logits take the decode path too, in a step of their own padded to that width (graphed
    prefill): a step that mixes them with decode or verify rows runs as those two graphs, so
    that the rows are not padded to the chunks' width. Steps with other inputs (longer prefill
    chunks, prompt logprobs) run the eager path. Every row's numbers are its own whichever way
    its step runs (the kernels are batch invariant: `tests/parity/test_replay_gpu.py`).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int,
        max_model_len: int | None = None,
        max_query_len: int = 1,
        enforce_eager: bool = False,
        decode_path: bool | None = None,
        pad_batches: bool | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        prefill_width: int = 0,
    ) -> None:
        """Args:
        model, num_blocks, block_size: the model and its cache geometry.
        max_num_seqs: most sequences in one decode step (CUDA-graph batch buckets stop there).
        max_model_len: longest sequence (sizes the graphs' block tables; None: the whole cache).
        max_query_len: most query tokens per sequence on the decode path (K + 1).
        enforce_eager: never capture CUDA graphs.
        decode_path: use the fused decode path for decode steps (None: on CUDA, and on the
            CPU for quantized models).
        pad_batches: pad decode batches to the graph buckets (None: when capturing graphs).
        kv_cache_dtype: the cache's dtype (None: the model's; float8 e4m3 on CUDA only).
        prefill_width: most tokens of a prefill chunk on the decode path (0: none).
        """
        if kv_cache_dtype == torch.float8_e4m3fn and model.device.type != "cuda":
            raise ValueError("kv_cache_dtype='fp8' needs CUDA")
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.max_query_len = max_query_len
        self.prefill_width = prefill_width
        self.num_graphed_prefill_steps = 0  # steps `_is_graphed_prefill` sent to the graphs
        self.max_num_seqs = max_num_seqs
        if decode_path is None:
            # On the CPU only for quantized models: there per-operation overhead bounds the
            # step and the decode path plans it once; float models keep the eager path (whose
            # forward plans every row the same way: `LlamaModel._plans_rows`).
            decode_path = model.config.decode_path_reason(self.device.type) is None and (
                self.device.type == "cuda" or model.quantization is not None
            )
        if decode_path:
            reason = model.config.decode_path_reason(self.device.type)
            if reason is not None:
                raise ValueError(f"the decode path has no {reason}; run eagerly")
            # Before the cache: fused weights allocated after it would take the free tail of
            # the cache's CUDA segment, and, living as long as the model, keep the whole
            # segment reserved after this runner is gone (the next engine's cache could not
            # be sized into it).
            model.fuse_projections()
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size, kv_cache_dtype)
        self.graphs: DecodeGraphs | None = None
        if decode_path:
            max_blocks = -(-(max_model_len or num_blocks * block_size) // block_size)
            self.graphs = DecodeGraphs(
                model,
                self.kv_cache,
                max_num_seqs=max_num_seqs,
                max_query_len=max_query_len,
                max_blocks_per_seq=max_blocks,
                block_size=block_size,
                use_graphs=self.device.type == "cuda" and not enforce_eager,
                pad_batches=pad_batches,
                prefill_width=prefill_width,
            )

    def _is_decode_row(self, step_input: StepInput) -> bool:
        """An input of the decode step: all of its (at most `max_query_len`) rows' logits."""
        count = len(step_input.token_ids)
        return 0 < count <= self.max_query_len and step_input.num_logit_rows == count

    def _is_decode_step(self, inputs: list[StepInput]) -> bool:
        return len(inputs) <= self.max_num_seqs and all(map(self._is_decode_row, inputs))

    def _graphed_parts(self, inputs: list[StepInput]) -> tuple[list[int], list[int]] | None:
        """A step for the decode path's graphs in two parts: (indices of its decode / verify
        rows, indices of its prefill chunks of at most `prefill_width` tokens that want at most
        their last row's logits: the last-row graphs), or None when some input is neither (or
        graphed prefill is off)."""
        width = self.prefill_width
        if width == 0 or len(inputs) > self.max_num_seqs:
            return None
        rows, chunks = [], []
        for i, s in enumerate(inputs):
            if self._is_decode_row(s):
                rows.append(i)
            elif 0 < len(s.token_ids) <= width and s.num_logit_rows <= 1 and s.tree_parents is None:
                chunks.append(i)
            else:
                return None
        return rows, chunks

    def run(
        self, inputs: list[StepInput], first_tokens: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """One forward step over every input; K/V of all query tokens are written.
        `first_tokens` (optional [len(inputs)] int64, on the model's device) replaces each
        input's first query token: tokens sampled on the device and not read by the host yet.

        Returns:
            Per input, [num_logit_rows, V] float32 logits predicting the token after each of its
            last num_logit_rows query tokens. On the decode path these are views of a static
            buffer: valid until the next `run`.

        Mutates: the KV cache slots of the query tokens.
        """
        return self.run_with_features(inputs, (), first_tokens)[0]

    def announce_device_forward(
        self, num_seqs: int, query_per_seq: int, feature_layers: Sequence[int], times: int = 1
    ) -> None:
        """Before work that runs `graphs.forward(..., broadcast_inputs=True)` `times` times
        (a speculative round filled on the device): nothing to do in one process (under tensor
        parallelism the workers are told to run it beside the driver: `TensorParallelRunner`)."""

    @contextlib.contextmanager
    def device_step(self):
        """Around work that runs target steps outside `run` (a speculative round): nothing in
        one process (under tensor parallelism a failure is named as `run`'s are)."""
        yield

    def run_rows(
        self, inputs: list[StepInput], first_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`run` for inputs of one query token each that want its logits (plain decode):
        [len(inputs), V] float32 logits, one row per input (on the decode path a view of a
        static buffer, valid until the next `run`)."""
        return self.run_rows_with_features(inputs, (), first_tokens)[0]

    @torch.inference_mode()
    def run_rows_with_features(
        self,
        inputs: list[StepInput],
        feature_layers: Sequence[int],
        first_tokens: torch.Tensor | None = None,
        min_rows: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run_rows`, also returning the [len(inputs), F] target features of each input's
        token (None when feature_layers is empty; on the decode path a view of a static buffer,
        valid until the next `run`). `min_rows`: the graph's batch bucket is at least this."""
        if any(len(s.token_ids) != 1 or s.num_logit_rows != 1 for s in inputs):
            raise ValueError("run_rows takes inputs of one query token with its logits")
        layers = tuple(feature_layers)
        if self.graphs is not None and self._is_decode_step(inputs):
            logits, features = self.graphs.run(
                [s.token_ids for s in inputs],
                [s.start for s in inputs],
                [s.block_ids for s in inputs],
                layers,
                first_tokens=first_tokens,
                stacked=True,
                min_rows=min_rows,
            )
        else:
            logits, features = self._run_eager(inputs, layers, first_tokens)
        rows = logits[0] if len(logits) == 1 else torch.cat(logits)
        if not features:
            return rows, None
        return rows, features[0] if len(features) == 1 else torch.cat(features)

    @torch.inference_mode()
    def run_with_features(
        self,
        inputs: list[StepInput],
        feature_layers: Sequence[int],
        first_tokens: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`run`, also returning the target features of every query token.

        Args:
            inputs: the step's sequences.
            feature_layers: 0-based decoder layers; a token's feature is the concatenation of
                their outputs (residual stream after the layer, before the final norm).

        Returns:
            (per input [num_logit_rows, V] float32 logits, per input [len(token_ids), F]
            features with F = len(feature_layers) * hidden size; [] when feature_layers is
            empty).

        Mutates: the KV cache slots of the query tokens.
        """
        if not inputs:
            return [], []
        layers = tuple(feature_layers)
        if self.graphs is None:
            return self._run_eager(inputs, layers, first_tokens)
        if self._is_decode_step(inputs):
            return self._run_decode_rows(inputs, layers, first_tokens)
        parts = self._graphed_parts(inputs)
        if parts is None:
            return self._run_eager(inputs, layers, first_tokens)
        self.num_graphed_prefill_steps += 1
        rows, chunks = parts
        logits: list[torch.Tensor | None] = [None] * len(inputs)
        features: list[torch.Tensor | None] = [None] * len(inputs)
        # Decode rows first (their graph is the step's longer one), then the chunks, padded to
        # prefill_width in a graph of their own; the two write separate logits buffers.
        for part, last_rows in ((rows, False), (chunks, True)):
            if not part:
                continue
            part_inputs = [inputs[i] for i in part]
            part_firsts = _take(first_tokens, part)
            if last_rows:
                part_logits, part_features = self.graphs.run(
                    [s.token_ids for s in part_inputs],
                    [s.start for s in part_inputs],
                    [s.block_ids for s in part_inputs],
                    layers,
                    part_firsts,
                    last_rows=True,
                )
                part_logits = [
                    row[: s.num_logit_rows] for row, s in zip(part_logits, part_inputs, strict=True)
                ]
            else:
                part_logits, part_features = self._run_decode_rows(part_inputs, layers, part_firsts)
            for k, i in enumerate(part):
                logits[i] = part_logits[k]
                if part_features:
                    features[i] = part_features[k]
        return logits, features if layers else []

    def _run_decode_rows(
        self,
        inputs: list[StepInput],
        layers: tuple[int, ...],
        first_tokens: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        trees = [s.tree_parents for s in inputs]
        return self.graphs.run(
            [s.token_ids for s in inputs],
            [s.start for s in inputs],
            [s.block_ids for s in inputs],
            layers,
            first_tokens,
            tree_parents=trees if any(p is not None for p in trees) else None,
        )

    def _run_eager(
        self,
        inputs: list[StepInput],
        feature_layers: tuple[int, ...],
        first_tokens: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        token_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for step_input in inputs:
            n = len(step_input.token_ids)
            offset = len(token_ids)
            token_ids.extend(step_input.token_ids)
            if step_input.tree_parents is None:
                positions.extend(range(step_input.start, step_input.start + n))
            else:
                positions.extend(tree_step_positions(step_input))
            logit_rows.extend(range(offset + n - step_input.num_logit_rows, offset + n))
        attn = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in inputs],
            context_lens=[s.start + len(s.token_ids) for s in inputs],
            block_tables=[s.block_ids for s in inputs],
            block_size=self.block_size,
            device=self.device,
        )
        if any(s.tree_parents is not None for s in inputs):
            attn = dataclasses.replace(attn, tree_mask=tree_step_mask(inputs).to(self.device))
        firsts: list[int] = []
        if first_tokens is not None:
            offset = 0
            for step_input in inputs:
                firsts.append(offset)
                offset += len(step_input.token_ids)
        # One copy (pinned on CUDA, so it does not wait for the work already queued).
        packed = to_device(token_ids + positions + logit_rows + firsts, torch.int64, self.device)
        input_ids, position_ids, rows, first_rows = packed.split(
            [len(token_ids), len(positions), len(logit_rows), len(firsts)]
        )
        if first_tokens is not None:
            input_ids[first_rows] = first_tokens  # a view of this step's own packed copy
        hidden, layers = self.model.forward_with_layers(
            input_ids, position_ids, attn, self.kv_cache, feature_layers
        )  # [T, D], [T, D] per layer
        logits = self.model.compute_logits(hidden[rows])  # [N, V]
        logits_per_input = list(logits.split([s.num_logit_rows for s in inputs]))
        if not layers:
            return logits_per_input, []
        features = torch.cat(layers, dim=-1)  # [T, F]
        return logits_per_input, list(features.split([len(s.token_ids) for s in inputs]))


def _take(first_tokens: torch.Tensor | None, index: list[int]) -> torch.Tensor | None:
    """The entries `index` (ascending) of a step's device tokens: a slice when they are
    consecutive (the usual case: running requests first, arrivals after), else one gather."""
    if first_tokens is None:
        return None
    if index[-1] - index[0] == len(index) - 1:
        return first_tokens[index[0] : index[-1] + 1]
    return first_tokens.index_select(0, to_device(index, torch.int64, first_tokens.device))


def tree_step_positions(step_input: StepInput) -> list[int]:
    """RoPE positions of a tree verify step's tokens: start, then start + 1 + depth[n]."""
    parents = torch.tensor([step_input.tree_parents], dtype=torch.int64)
    anchors = torch.tensor([step_input.start + 1], dtype=torch.int64)
    return verify_step_positions(parents, anchors)[0].tolist()


def tree_step_mask(inputs: list[StepInput]) -> torch.Tensor:
    """[B, max Q, W] bool tree region (the last W keys, W = the longest tree input) of an eager
    step with tree inputs: a tree input's rows see the prefix and their ancestors; every other
    input (a prefill chunk, a chain) keeps the causal rule over the region."""
    num_queries = max(len(s.token_ids) for s in inputs)
    width = max(len(s.token_ids) for s in inputs if s.tree_parents is not None)
    mask = torch.zeros(len(inputs), num_queries, width, dtype=torch.bool)
    for b, step_input in enumerate(inputs):
        n = len(step_input.token_ids)
        step_mask = None
        if step_input.tree_parents is not None:
            parents = torch.tensor([step_input.tree_parents], dtype=torch.int64)
            step_mask = verify_step_mask(parents)[0]
        mask[b, :n] = region_rows(step_mask, n, width)
    return mask
