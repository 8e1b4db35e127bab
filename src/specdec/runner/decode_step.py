"""The decode/verify step on static buffers, replayed from CUDA graphs.

A step of B sequences with at most Q query tokens each runs on a batch padded to a bucket size
(verify steps also padded to the largest Q). Padded sequences are inert (context 0: no K/V read or
written, their logits ignored) and padded query tokens of a live sequence have slot -1 (no K/V
written). A tree verify step (`draft_tree`) also sends a [B, Q, Q] tree mask over the last Q keys
of each context. One graph is captured per (bucket, Q, tree or not) on first use; all share one
memory pool and one logits buffer (last-row steps, graphed prefill chunks, one of their own).
Never samples or draws randomness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.draft_tree import region_rows, verify_step_mask, verify_step_positions
from specdec.models.attention import DecodeMetadata, KVCache, cache_slots
from specdec.models.llama import LlamaForCausalLM
from specdec.models.split_kv import split_when_seen, split_when_unseen, step_partitions
from specdec.runner.cuda_graph import GraphCache, StaticInputs, batch_buckets, bucket_for


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
        prefill_width: int = 0,
    ) -> None:
        """Args:
        model, kv_cache: the model and its cache.
        max_num_seqs, max_query_len: the largest step (sizes the static buffers).
        max_blocks_per_seq: width of the block tables.
        block_size: tokens per cache block.
        use_graphs: capture and replay CUDA graphs (else run the same step eagerly).
        pad_batches: pad each step to a bucket size (None: exactly when capturing graphs).
        prefill_width: query tokens per sequence of the last-row steps (graphed prefill
            chunks, `run(last_rows=True)`); 0: none.
        """
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_query_len = max_query_len
        self.prefill_width = prefill_width
        self.pad_batches = use_graphs if pad_batches is None else pad_batches
        self.buckets = batch_buckets(max_num_seqs)
        device = model.device
        max_rows = max_num_seqs * max_query_len
        # (last-row steps are wider, and want one row of logits a sequence)
        input_rows = max_num_seqs * max(max_query_len, prefill_width)
        # Every per-step input in one int64 buffer (block tables last), sent with one copy; two
        # host twins, since a runner step may run two graphs (decode rows, prompt chunks). Each
        # step writes every entry it reads (block tables: up to each sequence's context).
        self.inputs = StaticInputs(
            {
                "input_ids": input_rows,
                "positions": input_rows,
                "slot_mapping": input_rows,
                "context_lens": max_num_seqs,
                "query_lens": max_num_seqs,
                "block_tables": max_num_seqs * max_blocks_per_seq,
            },
            device,
            twins=2,
        )
        # A tree step's mask, sent with a copy of its own (chain and decode steps send none):
        # int64 like every static input, turned into a bool mask once per step.
        self.tree_inputs = StaticInputs({"tree_mask": max_rows * max_query_len}, device)
        self._tables_width = max_blocks_per_seq
        self.input_ids, self.positions, self.slot_mapping = (
            self.inputs[name] for name in ("input_ids", "positions", "slot_mapping")
        )
        self.context_lens, self.query_lens = self.inputs["context_lens"], self.inputs["query_lens"]
        self.block_tables = self.inputs["block_tables"].view(max_num_seqs, max_blocks_per_seq)
        vocab = model.config.vocab_size
        self.logits = torch.empty(max_rows, vocab, dtype=torch.float32, device=device)
        # Last-row steps write a buffer of their own, so that one runner step can run decode
        # rows and prompt chunks as two graphs whose logits both stay valid until the next step
        # (`PagedModelRunner.run_with_features`).
        self.last_logits = (
            torch.empty(max_num_seqs, vocab, dtype=torch.float32, device=device)
            if prefill_width
            else None
        )
        # (padded batch, Q, feature layers, tree, last rows, split) -> (graph, features it
        # writes or None)
        self.graph_cache = GraphCache(use_graphs)
        # Split-KV attention on CUDA: partitions covering the longest context, the same for
        # every graph. `run` picks it when a step's longest context spans more than one
        # partition (below that both kernels give the same bits, so the choice never changes
        # a request's tokens); callers that fill the buffers on the device (device rounds)
        # cannot see the contexts and take it when max_model_len is long.
        max_context = max_blocks_per_seq * block_size
        self.num_partitions = step_partitions(max_context, device)
        self.split_by_default = split_when_unseen(max_context, device)
        # Under tensor parallelism: broadcasts a tensor from rank 0 in place (for steps whose
        # inputs are filled on the driver's device); None in a single process.
        self.broadcast: Callable[[torch.Tensor], None] | None = None

    def forward(
        self,
        num_seqs: int,
        query_per_seq: int,
        feature_layers: tuple[int, ...],
        split_kv: bool | None = None,
        tree: bool = False,
        broadcast_inputs: bool = False,
        last_rows: bool = False,
    ) -> torch.Tensor | None:
        """The step over the first num_seqs x query_per_seq rows of the static buffers, as
        they are (device work only: what `run` replays, and what a caller that fills the
        buffers on the device runs inside its own graph); writes `self.logits[:rows]` and
        returns the [rows, F] features of `feature_layers` (or None). `split_kv`: attend with
        the split-KV kernels (None: `split_by_default`). `tree`: attend under the tree mask
        in the static [num_seqs, Q, Q] buffer (either kernel). `broadcast_inputs`: first take
        the step's inputs from rank 0 (`broadcast`, set under tensor parallelism: a step filled
        on the driver's device, which the workers run beside it). `last_rows`: logits of each
        sequence's last query row only, in `self.last_logits[:num_seqs]` (graphed prefill)."""
        rows = num_seqs * query_per_seq
        if broadcast_inputs and self.broadcast is not None:
            for inputs in (
                self.input_ids[:rows], self.positions[:rows], self.slot_mapping[:rows],
                self.context_lens[:num_seqs], self.query_lens[:num_seqs],
                self.block_tables[:num_seqs],
            ):  # fmt: skip
                self.broadcast(inputs)
        split_kv = self.split_by_default if split_kv is None else split_kv
        tree_mask = None
        if tree:
            flat = self.tree_inputs["tree_mask"][: rows * query_per_seq]
            # bool once per step (the layers' kernels then read the int8 bytes, as in eager
            # tree steps: one kernel variant, so graphed and eager steps give the same bits).
            tree_mask = flat.view(num_seqs, query_per_seq, query_per_seq) != 0
        meta = DecodeMetadata(
            block_tables=self.block_tables[:num_seqs],
            context_lens=self.context_lens[:num_seqs],
            query_lens=self.query_lens[:num_seqs],
            slot_mapping=self.slot_mapping[:rows],
            query_per_seq=query_per_seq,
            num_partitions=self.num_partitions if split_kv else 0,
            tree_mask=tree_mask,
        )
        hidden, layers = self.model.model(
            self.input_ids[:rows], self.positions[:rows], meta, self.kv_cache, feature_layers
        )
        out = self.logits[:rows]
        if last_rows:
            ends = (self.query_lens[:num_seqs] - 1).clamp_min(0)
            ends += torch.arange(num_seqs, device=ends.device) * query_per_seq
            hidden, out = hidden.index_select(0, ends), self.last_logits[:num_seqs]
        # Every row's logits as the row alone would get them (`compute_logits` through
        # `batch_invariant_linear`: a bare cuBLAS product here gave the LM head of a model
        # whose head shape fails the start-up check other bits at other batch buckets).
        self.model.compute_logits(hidden, out=out)
        return torch.cat(layers, dim=-1) if layers else None

    @property
    def use_graphs(self) -> bool:
        return self.graph_cache.use_graphs

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        self.graph_cache.use_graphs = value

    @property
    def graphs(self) -> dict:
        """(padded batch, Q, feature layers, tree, last rows, split) -> (graph, features it
        writes or None)."""
        return self.graph_cache.graphs

    def run(
        self,
        token_ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        feature_layers: tuple[int, ...] = (),
        first_tokens: torch.Tensor | None = None,
        stacked: bool = False,
        min_rows: int = 0,
        tree_parents: Sequence[Sequence[int] | None] | None = None,
        last_rows: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One decode/verify step (or, with `last_rows`, a step of prefill chunks of at most
        `prefill_width` tokens: the logits of each sequence's last token only).

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
            min_rows: pad the batch to at least this bucket (a batch bucket, <= max_num_seqs),
                so that a batch that lost requests keeps the graph it had.
            tree_parents: per sequence, None (a causal step) or its draft tree's parents for a
                tree verify step over [input token, node 0, ...] (`runner.StepInput`): node n
                is rotated as position start + 1 + depth[n] and sees the cached prefix and its
                ancestors only; its K/V go to slot start + 1 + n.

            last_rows: each sequence's last row's logits only ([1, V] each), the step padded
                to `prefill_width` rows a sequence.

        Returns:
            (per sequence [len(token_ids[b]), V] float32 logits, per sequence
            [len(token_ids[b]), F] features, or [] when no layers are asked): views of static
            buffers, valid until the next `run`.

        Mutates: the K/V cache slots of the query tokens.
        """
        num_seqs = len(token_ids)
        query_per_seq = max(len(tokens) for tokens in token_ids)
        if last_rows:
            if query_per_seq > self.prefill_width or tree_parents is not None:
                raise ValueError(f"a last-row step takes <= {self.prefill_width} causal tokens")
            if self.pad_batches:
                query_per_seq = self.prefill_width
        elif self.pad_batches and query_per_seq > 1:
            # Verify steps always use the widest layout: the number of drafts varies from
            # round to round, and one graph per width would mean many captures for little gain.
            query_per_seq = self.max_query_len
        num_padded = num_seqs
        if self.pad_batches:
            num_padded = bucket_for(self.buckets, max(num_seqs, min_rows))
        rows = num_padded * query_per_seq
        inputs = self.inputs
        inputs.begin()
        ids = inputs.host("input_ids", rows).reshape(num_padded, query_per_seq)
        positions = inputs.host("positions", rows).reshape(num_padded, query_per_seq)
        slots = inputs.host("slot_mapping", rows).reshape(num_padded, query_per_seq)
        context_lens = inputs.host("context_lens", num_padded)
        query_lens = inputs.host("query_lens", num_padded)
        width = self._tables_width
        tables = inputs.host("block_tables", num_padded * width).reshape(num_padded, width)
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
            slots[:num_seqs] = cache_slots(tables[:num_seqs], start_arr[:, None], size)
            context_lens[:num_seqs] = start_arr + 1
            query_lens[:num_seqs] = 1
        else:
            for b, (tokens, start) in enumerate(zip(token_ids, starts, strict=True)):
                count = len(tokens)
                token_pos = np.arange(start, start + count)
                ids[b, :count] = tokens
                positions[b, :count] = token_pos
                slots[b, :count] = cache_slots(tables[b], token_pos, size)
                context_lens[b] = start + count
                query_lens[b] = count
        tree = tree_parents is not None and any(p is not None for p in tree_parents)
        if tree:
            self._fill_tree(token_ids, starts, tree_parents, positions, num_padded, query_per_seq)
        inputs.send("block_tables", num_padded * width)
        if first_tokens is not None:
            device_ids = self.input_ids[:rows].view(num_padded, query_per_seq)
            device_ids[:num_seqs, 0].copy_(first_tokens)
        longest = max(start + len(tokens) for start, tokens in zip(starts, token_ids, strict=True))
        # Tree steps take split-KV by the same rule (the split-KV kernels' tree mask passed its
        # GPU parity test, `test_split_kv_tree_kernels_match_the_twins`, on the H200 in s12).
        split_kv = split_when_seen(longest, self.num_partitions)
        features = self.graph_cache.run(
            (num_padded, query_per_seq, feature_layers, tree, last_rows, split_kv),
            lambda: self.forward(
                num_padded, query_per_seq, feature_layers, split_kv, tree, last_rows=last_rows
            ),
        )
        if stacked and query_per_seq == 1:
            # One view instead of num_seqs: host work each overlapped decode step.
            stacked_features = [] if features is None else [features[:num_seqs]]
            return [self.logits[:num_seqs]], stacked_features
        starts_of_rows = [b * query_per_seq for b in range(num_seqs)]
        if last_rows:
            logits = [self.last_logits[b : b + 1] for b in range(num_seqs)]
        else:
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

    def _fill_tree(
        self,
        token_ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        tree_parents: Sequence[Sequence[int] | None],
        positions: np.ndarray,
        num_padded: int,
        query_per_seq: int,
    ) -> None:
        """Writes a tree step's RoPE positions (over the causal ones in `positions`) and sends
        its [num_padded, Q, Q] tree mask: a tree's rows see the prefix and their ancestors, a
        chain's rows the causal rule, padding rows every key (never a row with nothing to see)."""
        if len(tree_parents) != len(token_ids):
            raise ValueError("tree_parents must have one entry (or None) per sequence")
        q = query_per_seq
        tree_inputs = self.tree_inputs
        tree_inputs.begin()
        mask = tree_inputs.host("tree_mask", num_padded * q * q).reshape(num_padded, q, q)
        mask.fill(1)
        for b, (tokens, start, parents) in enumerate(
            zip(token_ids, starts, tree_parents, strict=True)
        ):
            count = len(tokens)
            step_mask = None
            if parents is not None:
                if len(parents) != count - 1:
                    raise ValueError(
                        f"a tree step feeds its input token and one token per node: got "
                        f"{count} tokens for {len(parents)} nodes"
                    )
                table = torch.tensor([list(parents)], dtype=torch.int64)
                anchor = torch.tensor([start + 1], dtype=torch.int64)
                positions[b, :count] = verify_step_positions(table, anchor)[0].numpy()
                step_mask = verify_step_mask(table)[0]
            mask[b, :count] = region_rows(step_mask, count, q).numpy()
        tree_inputs.send("tree_mask", num_padded * q * q)
