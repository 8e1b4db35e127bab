"""EAGLE / MTP drafting: a one-layer head over [target feature, next token embedding] proposes K
tokens autoregressively on its own paged cache (an `EagleHead`, or an EAGLE-3 checkpoint's
`Eagle3Head`: the same interface).

Position convention (head entry t = feature of the token at t + embedding of the token at t + 1,
predicting the token at t + 2): at a round with anchor A the engine has delivered the features of
positions 0 .. A-2 (`observe`), so the head first catches up on the entries it lacks, the last one
(t = A-2, with the round's input token x_{A-1}) proposing the draft at Q = A; draft i > 0 comes from
the entry t = A-2+i fed with the head's own previous output and the previous draft. Entries fed
with draft tokens are overwritten next round. Draft noise comes only from `sample_draft` at Q.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import (
    DraftBatch,
    Drafter,
    DrafterSetup,
    Proposal,
    ProposalBuffer,
    TargetFeatures,
)
from specdec.drafters.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig, TreeConfig
from specdec.drafters.device import DeviceDrafting
from specdec.drafters.eagle.eagle3 import Eagle3Head
from specdec.drafters.eagle.head import EagleHead, head_logits, head_logits_weight
from specdec.drafters.eagle.head_graphs import HeadGraphs
from specdec.drafters.eagle.head_native import native_head_step
from specdec.drafters.eagle.public import load_head
from specdec.drafters.eagle.state import EagleState
from specdec.drafters.eagle.tree_drafting import propose_tree
from specdec.models import AttentionMetadata, LlamaForCausalLM
from specdec.models.attention import DecodeMetadata, cache_slots
from specdec.models.attention_tiles import decode_query_bucket
from specdec.models.fused import paged_decode_attention
from specdec.models.row_classes import LINEAR_ROW_TIERS, eager_row_counts
from specdec.models.split_kv import split_when_unseen, step_partitions
from specdec.runner.kv_cache import BlockAllocator
from specdec.transfer import to_device


class EagleDrafter(Drafter):
    """vLLM's `eagle` / `eagle3` / `mtp` methods (one head; chains, trees, device rounds)."""

    # Rounds in which every request brings at most this many new entries run the fused decode
    # path; a request's first round (its whole prompt) runs the general one.
    MAX_DECODE_ENTRIES = 16

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        target: LlamaForCausalLM,
        draft_to_target: torch.Tensor | None,
        num_blocks: int,
        block_size: int,
        greedy: bool = False,
        *,
        max_num_seqs: int,
        max_entries: int | None = None,
        max_width: int = 1,
        enforce_eager: bool = False,
        tree: TreeConfig | None = None,
    ) -> None:
        """Args:
        head: the loaded head.
        target: the target (its embedding and LM head are shared, not copied, when the
            vocabulary is full; an EAGLE-3 head scores with its own LM head).
        draft_to_target: [V_draft] int64 target id of each draft id, or None.
        num_blocks, block_size: the head's own KV cache.
        greedy: propose the head's argmax (one-hot drafts) instead of sampling.
        max_num_seqs: requests per round (sizes the draft-step graphs).
        max_entries: most head entries a request can hold (max_model_len + K); None: no
            head-step graphs.
        max_width: most new entries per request that a round's first head step takes through
            its graphs (K + 1); more (a request's first round) take the general path.
        enforce_eager: never capture CUDA graphs.
        tree: draft a tree per round (`tree_drafting.propose_tree`) instead of a chain.
        """
        super().__init__(target.config.vocab_size, draft_to_target, greedy)
        self.tree = tree
        self.head = head
        head.layer.self_attn.fuse()  # one q/k/v and one gate/up matrix for the decode path
        head.layer.mlp.fuse()
        self.feature_layers = tuple(head.config.feature_layers)
        own = head.embed_tokens  # a public checkpoint's own table (`HeadLayout.own_embedding`)
        self.embed = own if own is not None else target.model.embed_tokens
        self.lm_weight = head_logits_weight(target, draft_to_target, head.dtype, head)
        self.kv_cache = head.allocate_kv_cache(num_blocks, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.device = head.device
        self.max_entries = max_entries
        self._states: dict[str, EagleState] = {}
        self._graphs: HeadGraphs | None = None
        # The head's attention over long contexts, as the target's rounds take it: split-KV on
        # CUDA when the head holds long contexts (max_entries), in its eager steps and its
        # graphs alike (one rule for both paths, so both give the same bits; a fixed count, as a
        # count per step would compile a kernel variant per count).
        long = max_entries is not None and split_when_unseen(max_entries, self.device)
        self.num_partitions = step_partitions(max_entries, self.device) if long else 0
        # On the CPU the head's decode step in one C++ call (the same operations, the same bits;
        # None: the Python path).
        cpu = self.device.type == "cpu" and not self.num_partitions
        self._native = native_head_step(head, self.kv_cache) if cpu else None
        if max_entries is not None:  # (on the CPU: the same static buffers, run op by op)
            use_graphs = self.device.type == "cuda" and not enforce_eager
            max_blocks = -(-max_entries // block_size)
            self._graphs = HeadGraphs(self, max_num_seqs, max_width, max_blocks, use_graphs)
        if self.device.type == "cuda":
            self.compile_catch_up_variants()

    @classmethod
    def from_config(
        cls, spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup
    ) -> EagleDrafter:
        """Builds the drafter of a SpeculativeConfig whose `model` is a head directory (one
        trained here, an EAGLE-1/2 or an EAGLE-3 checkpoint: `eagle.public.load_head` tells
        them apart; method "eagle3" takes EAGLE-3 heads only), with graphs (CUDA graphs on the
        GPU, the same static buffers op by op elsewhere) for its draft steps.

        Raises:
            ValueError: what `load_head` raises; "mtp" without a `model` (the engine sets the
                target's directory; a target handed in loaded has none)."""
        if spec.model is None:
            raise ValueError(
                f'speculative_config method "{spec.method}" needs "model": the directory of a '
                "head or of a target checkpoint with MTP layers"
            )
        # The head follows a target kept quantized on the CPU: int8 weight-only linears.
        head, draft_to_target = load_head(
            spec.model,
            target,
            dtype=target.dtype,
            device=target.device,
            method=spec.method,
            int8_linears=target.quantization is not None,
        )
        return cls(
            head,
            target,
            draft_to_target,
            setup.num_blocks,
            setup.block_size,
            greedy=spec.draft_sample_method == "greedy",
            max_num_seqs=setup.max_num_seqs,
            # A request may ask for more drafts a round than the configured K.
            max_entries=setup.max_model_len + MAX_NUM_SPECULATIVE_TOKENS,
            max_width=spec.num_speculative_tokens + 1,
            enforce_eager=setup.enforce_eager,
            tree=spec.tree,
        )

    def device_drafting(
        self, num_slots: int, width: int, max_model_len: int, device: torch.device
    ) -> DeviceDrafting | None:
        if self._graphs is None or self._graphs.width != width or self.tree is not None:
            return None  # trees draft on the host path only
        from specdec.drafters.eagle.device import EagleDeviceDrafting

        return EagleDeviceDrafting(self, num_slots)

    def num_graphs(self) -> int:
        return 0 if self._graphs is None else len(self._graphs.graphs)

    @torch.inference_mode()  # as `propose`, whose steps these are
    def warm_up(self) -> int:
        self._warm_up_catch_up()
        if self._graphs is None:
            return 0
        before = len(self._graphs.graphs)
        self._graphs.warm_up()
        return len(self._graphs.graphs) - before

    def _warm_up_catch_up(self) -> None:
        """The eager prompt catch-up (`_catch_up`, which a round's entry runs for the requests
        that joined) at a sample of every row tier and value class (`models.row_classes`), for
        one request and for two: its Triton variants compile at start-up rather than in the
        first round that catches up on prompts of a new size (the server's first c = 16 level
        stalled on three, s28). Writes head K/V into block 0 only: the engine is idle, so every
        block is free, and a request reads only slots it wrote. Keeps no state; no draw."""
        limit = self.max_entries if self.max_entries is not None else LINEAR_ROW_TIERS[-1] + 16
        size, dtype = self.head.config.feature_size, self.head.dtype
        for count in eager_row_counts(limit - 1):
            groups = [[count]]
            if count // 2 > self.MAX_DECODE_ENTRIES:  # two requests on the general path
                groups.append([count - count // 2, count // 2])
            for group in groups:
                blocks = [-(-(n + 1) // self.block_size) for n in group]
                states = [EagleState(block_ids=[0] * b) for b in blocks]
                features = [torch.zeros(n, size, dtype=dtype, device=self.device) for n in group]
                tokens = [[0] * n for n in group]
                self._catch_up(features, tokens, [1] * len(group), list(group), states)

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.allocator.free(state)

    def observe(self, features: TargetFeatures) -> None:
        if not features.request_ids:
            return
        dtype = self.head.dtype
        # A copy: the engine's feature tensors may be views of buffers it reuses. One copy for
        # every request (their rows joined), then a view per request.
        if len(features.features) == 1:
            copies = [features.features[0].to(self.device, dtype, copy=True)]
        else:
            joined = torch.cat(features.features).to(self.device, dtype)
            copies = joined.split([rows.shape[0] for rows in features.features])
        for request_id, start, rows in zip(
            features.request_ids, features.starts, copies, strict=True
        ):
            state = self._states.setdefault(request_id, EagleState())
            if start != state.feature_end:
                raise ValueError(
                    f"request {request_id}: features start at {start}, expected "
                    f"{state.feature_end} (features must arrive in order)"
                )
            state.pending.append(rows)
            state.feature_end += rows.shape[0]

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        if batch.request_ids is None:
            raise ValueError("the EAGLE drafter needs request_ids in its DraftBatch")
        size, k = batch.batch_size, batch.max_draft
        device = self.device
        out = ProposalBuffer(size, k, self.target_vocab_size, device, self.greedy)
        proposed = self.num_draft_with_features(batch)
        num_draft = batch.num_draft.tolist()
        anchors = batch.anchors.tolist()
        live = [b for b in range(size) if anchors[b] >= 2]  # rows with a feature to start from
        if not live:
            return out.proposal(proposed)
        states: list[EagleState | None] = [None] * size
        features, tokens, first_positions, query_lens = [], [], [], []
        for b in live:
            request_id, token_ids, anchor = batch.request_ids[b], batch.token_ids[b], anchors[b]
            state = self._states.get(request_id)
            if state is None or state.feature_end != anchor - 1 or not state.pending:
                have = 0 if state is None else state.feature_end
                raise ValueError(
                    f"request {request_id}: the EAGLE drafter needs target features of positions "
                    f"0..{anchor - 2}, has 0..{have - 1} (is it fed through the engine?)"
                )
            # Chain draft i > 0 is entry A-2+i; tree node n's entry is stored at A-1+n.
            extra = self.tree.nodes if self.tree is not None else max(num_draft[b] - 1, 0)
            self.allocator.grow(state, anchor - 1 + extra)
            new = torch.cat(state.pending)  # [n_new, F]: entries num_fed .. anchor-2
            features.append(new)
            tokens.append(token_ids[state.num_fed + 1 : anchor])
            first_positions.append(state.num_fed + 1)
            query_lens.append(new.shape[0])
            state.pending.clear()
            state.num_fed = anchor - 1
            states[b] = state
        live_states = [states[b] for b in live]
        width = max(query_lens)
        if self._graphs is not None and width <= self._graphs.width:
            last, logits = self._graphs.catch_up(
                torch.cat(features), tokens, first_positions, query_lens, live_states
            )
        else:
            last = self._catch_up(features, tokens, first_positions, query_lens, live_states)
            logits = head_logits(self.head, last, self.lm_weight)  # [len(live), V_draft]
        if self.tree is not None:
            parents, num_nodes = propose_tree(
                self, batch, self.tree, live, states, last, logits, out
            )
            return out.proposal(num_nodes, parents)
        for i in range(k):
            rows = torch.tensor(live, dtype=torch.int64)
            # Every row live: a slice; else one (pinned, asynchronous) copy of the row indices.
            index = slice(None) if len(live) == size else to_device(rows, torch.int64, device)
            draft_positions = batch.anchors[rows] + i  # Q of the proposed tokens
            chosen = self.draw(logits, rows, draft_positions, batch, out, (index, i))
            keep = [j for j, row in enumerate(live) if i + 1 < num_draft[row]]
            if not keep:
                break
            if len(keep) < len(live):  # drafts stay on the device: no read-back per step
                kept = to_device(keep, torch.int64, device)
                last, chosen = last[kept], chosen.to(device)[kept]
            live = [live[j] for j in keep]
            # Entry t = A-2+(i+1): the previous head output and the draft just proposed (at A+i).
            entry_positions = [anchors[row] + i for row in live]
            live_states = [states[row] for row in live]
            if self._graphs is not None:
                last, logits = self._graphs.chain(last, chosen, entry_positions, live_states)
            else:
                ones = [1] * len(live)
                last = self._decode_step(
                    last, chosen.to(device), entry_positions, ones, live_states, 1
                )
                logits = head_logits(self.head, last, self.lm_weight)
        return out.proposal(proposed)

    def compile_catch_up_variants(self) -> None:
        """Compiles the decode attention's variants for the eager catch-up's widths (one per
        `decode_query_bucket` of 1..MAX_DECODE_ENTRIES; see `_catch_up`) at set-up, each
        through one inert launch (no key read or written): otherwise a width's variant
        compiles (0.3-0.7 s on the H200) inside the first round that resumes after a plain-arm
        visit of that length. The launch passes what `_decode_step` passes (the head's cache,
        its activation dtype, int64 metadata, the drafter's partitions)."""
        attn = self.head.layer.self_attn
        group = attn.num_heads // attn.num_kv_heads
        limit = self.MAX_DECODE_ENTRIES
        widths = sorted({decode_query_bucket(w, group, limit) for w in range(1, limit + 1)})
        device, dtype = self.device, self.head.dtype
        k_cache, v_cache = self.kv_cache.k_cache[0], self.kv_cache.v_cache[0]
        inert = torch.zeros(1, dtype=torch.int64, device=device)  # context 0: nothing to read
        for width in widths:
            meta = DecodeMetadata(
                block_tables=inert.view(1, 1),
                context_lens=inert,
                query_lens=inert,
                slot_mapping=torch.full((width,), -1, dtype=torch.int64, device=device),
                query_per_seq=width,
                num_partitions=self.num_partitions,
            )
            query = torch.zeros(width, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
            paged_decode_attention(query, k_cache, v_cache, meta, attn.scale)

    def _catch_up(self, features, tokens, first_positions, query_lens, live_states):
        """The round's first head step without graphs: request j feeds the entries whose target
        features are features[j] ([query_lens[j], F]) and tokens tokens[j]. Returns each
        request's last head output [len(live_states), D]."""
        device = self.device
        projected = self.head.project_features(torch.cat(features))  # [sum(query_lens), D]
        width = max(query_lens)
        if width <= self.MAX_DECODE_ENTRIES:
            # The usual round: a few new entries per request, through the fused decode path in
            # the padded layout (request j's entries at rows j * width ..). The width follows
            # the data (after plain-arm steps: how many ran), and the decode kernel compiles a
            # variant per width (a constexpr), mid-run; padded to its bucket it takes one of a
            # few, each with the tile (so the attention's bits) of the unpadded width.
            attn = self.head.layer.self_attn
            group = attn.num_heads // attn.num_kv_heads
            width = decode_query_bucket(width, group, self.MAX_DECODE_ENTRIES)
            if width > 1 and min(query_lens) < width:
                rows = [j * width + i for j, n in enumerate(query_lens) for i in range(n)]
                padded = projected.new_zeros(len(live_states) * width, projected.shape[1])
                projected = padded.index_copy_(0, to_device(rows, torch.int64, device), projected)
            padded_tokens = [0] * (len(live_states) * width)
            for j, row_tokens in enumerate(tokens):
                padded_tokens[j * width : j * width + len(row_tokens)] = row_tokens
            out = self._decode_step(
                projected, padded_tokens, first_positions, query_lens, live_states, width
            )
            if width == 1:
                last = out
            else:
                ends = [j * width + n - 1 for j, n in enumerate(query_lens)]
                last = out[to_device(ends, torch.int64, device)]  # [len(live_states), D]
        else:  # a request's first round catches up on its whole prompt: the general path
            positions = [
                pos
                for first, n in zip(first_positions, query_lens, strict=True)
                for pos in range(first, first + n)
            ]
            out = self._step(
                projected,
                [t for row_tokens in tokens for t in row_tokens],
                positions,
                query_lens,
                [first - 1 + n for first, n in zip(first_positions, query_lens, strict=True)],
                live_states,
            )
            last = out[to_device(query_lens, torch.int64, device).cumsum(0) - 1]  # [len(live), D]
        return last

    def _decode_step(self, hidden, tokens, first_positions, query_lens, states, width):
        """Head entries through the fused decode path: request j brings query_lens[j] <= width
        entries at token positions first_positions[j] .., in rows j * width .. of `hidden`
        ([len(states) * width, D]) and `tokens` (a list, or a device tensor, of that length;
        padding rows anything). Entry t (token position t + 1) goes to cache slot t. Returns the
        [len(states) * width, D] head outputs (padding rows garbage)."""
        device = self.device
        num_seqs = len(states)
        max_blocks = max(len(state.block_ids) for state in states)
        slots, positions, context_lens, tables = self._entry_inputs(
            first_positions, query_lens, states, width, max_blocks
        )
        host = slots + positions + context_lens + list(query_lens) + tables
        if not isinstance(tokens, torch.Tensor):
            host += tokens
        packed = to_device(host, torch.int64, device)  # one copy
        rows = num_seqs * width
        sizes = [rows, rows, num_seqs, num_seqs, num_seqs * max_blocks]
        slots_t, positions_t, context_t, query_t, tables_t = packed[: sum(sizes)].split(sizes)
        if isinstance(tokens, torch.Tensor):
            token_ids = tokens.to(device=device, dtype=torch.int64)
        else:
            token_ids = packed[sum(sizes) :]
        meta = DecodeMetadata(
            block_tables=tables_t.view(num_seqs, max_blocks),
            context_lens=context_t,
            query_lens=query_t,
            slot_mapping=slots_t,
            query_per_seq=width,
            num_partitions=self.num_partitions,
        )
        if self._native is not None:
            return self._native(hidden, False, self.embed(token_ids), positions_t, meta)
        return self.head.forward_decode(
            hidden, self.embed(token_ids), positions_t, meta, self.kv_cache
        )

    def _entry_inputs(self, first_positions, query_lens, states, width, max_blocks):
        """Host lists of a decode-path step (see `_decode_step`): cache slots and token positions
        ([len(states) * width], padding rows -1 and 0), context lengths [len(states)], and the
        block tables [len(states) * max_blocks] (padded with 0)."""
        size = self.block_size
        slots, positions, tables, context_lens = [], [], [], []
        for state, first, count in zip(states, first_positions, query_lens, strict=True):
            entries = range(first - 1, first - 1 + count)
            blocks = state.block_ids
            if len(blocks) > max_blocks:
                raise RuntimeError(f"a head entry table of {len(blocks)} blocks (> {max_blocks})")
            slots += cache_slots(blocks, entries, size).tolist() + [-1] * (width - count)
            positions += [t + 1 for t in entries] + [0] * (width - count)
            tables += blocks + [0] * (max_blocks - len(blocks))
            context_lens.append(first - 1 + count)
        return slots, positions, context_lens, tables

    def _step(self, hidden, tokens, positions, query_lens, context_lens, states) -> torch.Tensor:
        """Runs head entries: [T, D] hidden, T token ids (a list, or a device tensor) and
        positions -> [T, D] head outputs. Entry t (token position t + 1) is written to cache
        slot t."""
        device = self.device
        attn = AttentionMetadata.build(
            query_lens, context_lens, [s.block_ids for s in states], self.block_size, device
        )
        if isinstance(tokens, torch.Tensor):
            token_ids = tokens.to(device=device, dtype=torch.int64)
        else:
            token_ids = to_device(tokens, torch.int64, device)
        return self.head.forward_paged(
            hidden,
            self.embed(token_ids),
            to_device(positions, torch.int64, device),
            attn,
            self.kv_cache,
        )
