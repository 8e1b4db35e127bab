"""The decode/verify step on static buffers, replayed from CUDA graphs.

A step of B sequences with at most Q query tokens each runs on a batch padded to a bucket size
(verify steps also padded to the largest Q). Padded sequences are inert (context 0: no K/V read or
written, their logits ignored) and padded query tokens of a live sequence have slot -1 (no K/V
written). One graph is captured per (bucket, Q) on first use; all share one memory pool and one
logits buffer. Never samples or draws randomness.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.models.attention import DecodeMetadata, KVCache
from specdec.models.llama import LlamaForCausalLM
from specdec.runner.cuda_graph import batch_buckets


class DecodeGraphs:
    """Static inputs, a logits buffer, and the captured graphs of the decode step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        *,
        max_num_seqs: int,
        max_query_len: int,
        max_blocks_per_seq: int,
        block_size: int,
        use_graphs: bool,
        pad_batches: bool | None = None,
    ) -> None:
        """Args:
        model, kv_cache: the model and its cache.
        max_num_seqs, max_query_len: the largest step (sizes the static buffers).
        max_blocks_per_seq: width of the block tables.
        block_size: tokens per cache block.
        use_graphs: capture and replay CUDA graphs (else run the same step eagerly).
        pad_batches: pad each step to a bucket size (None: exactly when capturing graphs).
        """
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_query_len = max_query_len
        self.use_graphs = use_graphs
        self.pad_batches = use_graphs if pad_batches is None else pad_batches
        self.buckets = batch_buckets(max_num_seqs)
        device = model.model.embed_tokens.weight.device
        max_rows = max_num_seqs * max_query_len
        # Every per-step input lives in one int64 buffer (block tables last), filled on the host
        # in a pinned twin and sent with one copy per step.
        sizes = [max_rows, max_rows, max_rows, max_num_seqs, max_num_seqs]
        self._tables_offset = sum(sizes)
        self._tables_width = max_blocks_per_seq
        total = self._tables_offset + max_num_seqs * max_blocks_per_seq
        self._inputs = torch.zeros(total, dtype=torch.int64, device=device)
        self._host_inputs = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_view = self._host_inputs.numpy()
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        views = self._inputs[: self._tables_offset].split(sizes)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.query_lens = (
            views
        )
        self.block_tables = self._inputs[self._tables_offset :].view(
            max_num_seqs, max_blocks_per_seq
        )
        vocab = model.config.vocab_size
        self.logits = torch.empty(max_rows, vocab, dtype=torch.float32, device=device)
        weight_dtype = model.model.embed_tokens.weight.dtype
        self._logits_lowp = (
            None
            if weight_dtype == torch.float32
            else torch.empty(max_rows, vocab, dtype=weight_dtype, device=device)
        )
        # (padded batch, Q, feature layers) -> (graph, features the graph writes or None)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self._pool = None

    def _forward(
        self, num_seqs: int, query_per_seq: int, feature_layers: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The step over the first num_seqs x query_per_seq rows of the static buffers; writes
        `self.logits[:rows]` and returns the [rows, F] features of `feature_layers` (or None)."""
        rows = num_seqs * query_per_seq
        meta = DecodeMetadata(
            block_tables=self.block_tables[:num_seqs],
            context_lens=self.context_lens[:num_seqs],
            query_lens=self.query_lens[:num_seqs],
            slot_mapping=self.slot_mapping[:rows],
            query_per_seq=query_per_seq,
        )
        hidden, layers = self.model.model(
            self.input_ids[:rows], self.positions[:rows], meta, self.kv_cache, feature_layers
        )
        weight = self.model.lm_head_weight
        if self._logits_lowp is None:
            torch.mm(hidden, weight.t(), out=self.logits[:rows])
        else:
            torch.mm(hidden, weight.t(), out=self._logits_lowp[:rows])
            self.logits[:rows].copy_(self._logits_lowp[:rows])
        return torch.cat(layers, dim=-1) if layers else None

    def _capture(
        self, num_seqs: int, query_per_seq: int, feature_layers: tuple[int, ...]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        # A warm-up run compiles the kernels; it computes (and writes to the cache) exactly what
        # the replay will, so running the step twice changes nothing.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(num_seqs, query_per_seq, feature_layers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            features = self._forward(num_seqs, query_per_seq, feature_layers)
        self._pool = graph.pool()
        return graph, features

    def run(
        self,
        token_ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        feature_layers: tuple[int, ...] = (),
        first_tokens: torch.Tensor | None = None,
        stacked: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One decode/verify step.

        Args:
            token_ids: per sequence, its 1..max_query_len query tokens.
            starts: per sequence, the position of its first query token.
            block_ids: per sequence, its cache blocks (covering start + len(token_ids) slots).
            feature_layers: decoder layers whose outputs are wanted (see
                `LlamaForCausalLM.forward_with_layers`).
            first_tokens: optional [num_seqs] int64 device tensor that replaces each sequence's
                first query token (tokens sampled by a step whose results the host has not read:
                the engine's asynchronous scheduling).
            stacked: when every sequence has one query token, return the logits as one
                [num_seqs, V] view (a one-element list) instead of a view per sequence.

        Returns:
            (per sequence [len(token_ids[b]), V] float32 logits, per sequence
            [len(token_ids[b]), F] features, or [] when no layers are asked): views of static
            buffers, valid until the next `run`.

        Mutates: the K/V cache slots of the query tokens.
        """
        num_seqs = len(token_ids)
        query_per_seq = max(len(tokens) for tokens in token_ids)
        if self.pad_batches and query_per_seq > 1:
            # Verify steps always use the widest layout: the number of drafts varies from
            # round to round, and one graph per width would mean many captures for little gain.
            query_per_seq = self.max_query_len
        if self.pad_batches:
            num_padded = next(size for size in self.buckets if size >= num_seqs)
        else:
            num_padded = num_seqs
        rows = num_padded * query_per_seq
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the pinned buffer
        host = self._host_view
        max_rows = self.input_ids.shape[0]
        max_seqs = self.context_lens.shape[0]
        ids = host[:rows].reshape(num_padded, query_per_seq)
        positions = host[max_rows : max_rows + rows].reshape(num_padded, query_per_seq)
        slots = host[2 * max_rows : 2 * max_rows + rows].reshape(num_padded, query_per_seq)
        context_lens = host[3 * max_rows : 3 * max_rows + num_padded]
        query_lens = host[3 * max_rows + max_seqs : 3 * max_rows + max_seqs + num_padded]
        table_end = self._tables_offset + num_padded * self._tables_width
        tables = host[self._tables_offset : table_end].reshape(num_padded, self._tables_width)
        ids.fill(0)
        positions.fill(0)
        slots.fill(-1)
        context_lens.fill(0)
        query_lens.fill(0)
        size = self.block_size
        for b, blocks in enumerate(block_ids):
            tables[b, : len(blocks)] = blocks
        if query_per_seq == 1:  # plain decode: one token per sequence, vectorised
            start_arr = np.asarray(starts, dtype=np.int64)
            ids[:num_seqs, 0] = [tokens[0] for tokens in token_ids]
            positions[:num_seqs, 0] = start_arr
            owning = tables[np.arange(num_seqs), start_arr // size]
            slots[:num_seqs, 0] = owning * size + start_arr % size
            context_lens[:num_seqs] = start_arr + 1
            query_lens[:num_seqs] = 1
        else:
            for b, (tokens, start) in enumerate(zip(token_ids, starts, strict=True)):
                count = len(tokens)
                token_pos = np.arange(start, start + count)
                ids[b, :count] = tokens
                positions[b, :count] = token_pos
                slots[b, :count] = tables[b, token_pos // size] * size + token_pos % size
                context_lens[b] = start + count
                query_lens[b] = count
        self._inputs[:table_end].copy_(self._host_inputs[:table_end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if first_tokens is not None:
            device_ids = self.input_ids[:rows].view(num_padded, query_per_seq)
            device_ids[:num_seqs, 0].copy_(first_tokens)
        if self.use_graphs:
            key = (num_padded, query_per_seq, feature_layers)
            if key not in self.graphs:
                self.graphs[key] = self._capture(num_padded, query_per_seq, feature_layers)
            graph, features = self.graphs[key]
            graph.replay()
        else:
            features = self._forward(num_padded, query_per_seq, feature_layers)
        if stacked and query_per_seq == 1:
            # One view instead of num_seqs: host work each overlapped decode step.
            stacked_features = [] if features is None else [features[:num_seqs]]
            return [self.logits[:num_seqs]], stacked_features
        starts_of_rows = [b * query_per_seq for b in range(num_seqs)]
        logits = [
            self.logits[row : row + len(tokens)]
            for row, tokens in zip(starts_of_rows, token_ids, strict=True)
        ]
        if features is None:
            return logits, []
        return logits, [
            features[row : row + len(tokens)]
            for row, tokens in zip(starts_of_rows, token_ids, strict=True)
        ]
