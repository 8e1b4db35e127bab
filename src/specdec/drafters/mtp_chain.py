"""Drafting with a chain of a checkpoint's n > 1 MTP layers (`method: "mtp"`, layers loaded by
`drafters.mtp`), each in its own KV cache: layer k drafts position k of a round, positions
k >= n the last layer fed its own output. One layer drafts through `EagleDrafter`. Never draws
noise itself: every draft goes through `Drafter.draw` (`sample_draft`).

Layer k's entry i (DeepSeek-V3, arXiv:2412.19437, section 2.2, 0-based) joins layer k - 1's
output at entry i (the target's hidden state for k = 0) with the embedding of the token at
i + k + 1 and predicts the token at i + k + 2. At a round with anchor A (tokens 0..A-1 known,
target features of entries 0..A-2):

- history: layer k's entries 0..A-2-k read known tokens only; each round catches them up (as
  layer 0 catches up on the target's features), layer k - 1 first, and keeps layer k - 1's
  outputs that layer k has not read yet (`pending`);
- draft k < n: layer k's entries A-1-k..A-2 read drafts 0..k-1, so they are run at draft step k
  (k entries, over layer k - 1's draft-step outputs) and their K/V are rewritten by the next
  round's catch-up; entry A-2's output gives draft k's logits. This is the published
  definition run on the round's sequence: layer k's attention sees every entry it would see
  in training, not only the entries of the rounds' last positions;
- draft k >= n: the last layer's entry A-2+(k-n+1), fed its own previous output and draft
  k - 1 (as a single layer drafts every position; vLLM's MTP models pick layer
  `spec_step_idx % n`, which would feed layer 0, trained on the target's hidden states, an MTP
  layer's output: we keep the layer trained on MTP outputs).

Every layer's entry i sits at RoPE position i + 1 in cache slot i (one block table per request
for all the layers' caches). Steps run op by op (`EagleHead.forward_paged`): no CUDA graphs,
device rounds or trees yet (`speculative_config` `mtp_layers: 1` has them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.drafters.base import DraftBatch, DrafterSetup, Proposal, ProposalBuffer
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.drafters.eagle.head import (
    EagleHead,
    head_logits,
    head_logits_weight,
    quantize_head_int8,
)
from specdec.drafters.eagle.state import EagleState
from specdec.drafters.formats import DrafterCheckpoint
from specdec.drafters.mtp import count_mtp_layers, load_mtp_heads, recognise_mtp
from specdec.models import AttentionMetadata, LlamaForCausalLM
from specdec.transfer import to_device


@dataclass(slots=True, eq=False)
class _LayerState:
    """Layer k >= 1 of one request: entries 0..num_fed-1 hold history K/V; `pending` holds
    layer k - 1's history outputs ([n, D] each) at entries num_fed.. in order."""

    num_fed: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)


class MtpDrafter(EagleDrafter):
    """vLLM's `mtp` method: `from_config` builds an `EagleDrafter` for one layer (or an EAGLE
    head) and an `MtpChainDrafter` for several."""

    @classmethod
    def from_config(
        cls, spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup
    ) -> EagleDrafter:
        """Raises:
        ValueError: what `EagleDrafter.from_config` raises; `mtp_layers` above the
            checkpoint's layers, or above 1 for an EAGLE head; a tree over several layers
            (each named)."""
        path = None if spec.model is None else Path(spec.model)
        if path is None or not path.is_dir():
            return EagleDrafter.from_config(spec, target, setup)
        checkpoint = DrafterCheckpoint(path)
        found = recognise_mtp(checkpoint)
        wanted = spec.mtp_layers
        if found is None:
            if wanted not in ("all", 1):
                raise ValueError(
                    f"speculative_config mtp_layers {wanted}: {path} holds an EAGLE head (one "
                    "layer), not MTP layers"
                )
            return EagleDrafter.from_config(spec, target, setup)
        num_layers = count_mtp_layers(checkpoint, found[0]) if wanted == "all" else wanted
        if num_layers == 1:
            return EagleDrafter.from_config(spec, target, setup)
        if spec.tree is not None:
            raise ValueError(
                f"speculative_config tree over {num_layers} MTP layers: trees draft with one "
                'layer; set "mtp_layers": 1 (layer 0 drafts every node)'
            )
        heads = load_mtp_heads(
            checkpoint, target, target.dtype, target.device, None if wanted == "all" else wanted
        )
        if target.quantization is not None:
            for head in heads:  # as EagleDrafter's head follows a target kept quantized
                quantize_head_int8(head)
        return MtpChainDrafter(
            heads,
            target,
            setup.num_blocks,
            setup.block_size,
            greedy=spec.draft_sample_method == "greedy",
            max_num_seqs=setup.max_num_seqs,
        )


class MtpChainDrafter(EagleDrafter):
    """A chain of n > 1 MTP layers (the module docstring): layer 0 is `head` (its cache
    `kv_cache`, its catch-up fed by `observe` as `EagleDrafter`'s), layer k `heads[k]`."""

    def __init__(
        self,
        heads: list[EagleHead],
        target: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        greedy: bool = False,
        *,
        max_num_seqs: int,
    ) -> None:
        """Args:
        heads: the MTP layers in order (at least 2).
        target: the target (its embedding and LM head where a layer has none of its own).
        num_blocks, block_size: each layer's own KV cache (one block table for all).
        greedy: propose each layer's argmax instead of sampling.
        max_num_seqs: requests per round.
        """
        if len(heads) < 2:
            raise ValueError("MtpChainDrafter chains at least 2 MTP layers (EagleDrafter: 1)")
        super().__init__(
            heads[0], target, None, num_blocks, block_size, greedy, max_num_seqs=max_num_seqs
        )
        self.heads = heads
        for head in heads[1:]:
            head.layer.self_attn.fuse()
            head.layer.mlp.fuse()
        tables = [head.embed_tokens for head in heads]
        self.embeds = [t if t is not None else target.model.embed_tokens for t in tables]
        self.lm_weights = [head_logits_weight(target, None, head.dtype, head) for head in heads]
        self.kv_caches = [self.kv_cache] + [
            head.allocate_kv_cache(num_blocks, block_size) for head in heads[1:]
        ]
        self._layers: dict[str, list[_LayerState]] = {}

    def device_drafting(self, num_slots, width, max_model_len, device):
        return None  # rounds of several layers run on the host (synchronously)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._layers.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        """Catches every layer up on its history, then drafts position k with layer
        min(k, n - 1) (the module docstring).

        RNG: as `Drafter.draw` (`sample_draft`), one draw per draft; none when greedy.
        Mutates: the layers' caches and the rows' states (fed entries, pending outputs).
        """
        if batch.request_ids is None:
            raise ValueError("the MTP drafter needs request_ids in its DraftBatch")
        size, k = batch.batch_size, batch.max_draft
        out = ProposalBuffer(size, k, self.target_vocab_size, self.device, self.greedy)
        proposed = self.num_draft_with_features(batch)
        num_draft = batch.num_draft.tolist()
        anchors = batch.anchors.tolist()
        live = [b for b in range(size) if anchors[b] >= 2]  # rows with a feature to start from
        if not live:
            return out.proposal(proposed)
        states = {b: self._fed_state(batch, b, anchors[b], max(num_draft[b] - 1, 0)) for b in live}
        layers = {b: self._layers.setdefault(batch.request_ids[b], []) for b in live}
        for b in live:
            layers[b] += [_LayerState() for _ in range(len(self.heads) - 1 - len(layers[b]))]
        last = self._catch_up_all(batch, anchors, live, states, layers)  # [len(live), D]
        logits = head_logits(self.head, last, self.lm_weights[0])
        steps: list[torch.Tensor] = [last.new_zeros(0, last.shape[1])] * len(live)
        for i in range(k):
            rows = torch.tensor(live, dtype=torch.int64)
            index = slice(None) if len(live) == size else to_device(rows, torch.int64, self.device)
            draft_positions = batch.anchors[rows] + i  # Q of the proposed tokens
            chosen = self.draw(logits, rows, draft_positions, batch, out, (index, i))
            keep = [j for j, row in enumerate(live) if i + 1 < num_draft[row]]
            if not keep:
                break
            if len(keep) < len(live):
                kept = to_device(keep, torch.int64, self.device)
                last, chosen = last[kept], chosen.to(self.device)[kept]
                steps = [steps[j] for j in keep]
            live = [live[j] for j in keep]
            layer = i + 1
            if layer < len(self.heads):  # layer i + 1 over its entries that read drafts
                steps = self._draft_entries(layer, anchors, live, states, layers, steps, out)
                last = torch.stack([rows_out[-1] for rows_out in steps])
            else:  # the last layer, fed its own output and the draft just proposed
                layer = len(self.heads) - 1
                entries = [anchors[b] + i - len(self.heads) for b in live]  # A-2+(i+1)-(n-1)
                last = self._run(
                    layer,
                    last,
                    chosen.to(self.device),
                    [e + 1 for e in entries],
                    [1] * len(live),
                    [e + 1 for e in entries],
                    [states[b] for b in live],
                )
            logits = head_logits(self.heads[layer], last, self.lm_weights[layer])
        return out.proposal(proposed)

    def _fed_state(self, batch: DraftBatch, b: int, anchor: int, extra: int) -> EagleState:
        """Row b's layer-0 state, checked to hold the target features of entries 0..A-2, its
        blocks grown for the round's entries (`extra` past A-2)."""
        request_id = batch.request_ids[b]
        state = self._states.get(request_id)
        if state is None or state.feature_end != anchor - 1 or not state.pending:
            have = 0 if state is None else state.feature_end
            raise ValueError(
                f"request {request_id}: the MTP drafter needs target features of positions "
                f"0..{anchor - 2}, has 0..{have - 1} (is it fed through the engine?)"
            )
        self.allocator.grow(state, anchor - 1 + extra)
        return state

    def _catch_up_all(self, batch, anchors, live, states, layers) -> torch.Tensor:
        """Every layer's history entries (layer k: up to A-2-k) for the rows `live` (`anchors`
        the batch's, on the host), layer 0 from the target's pending features, layer k from
        layer k - 1's pending outputs. Returns layer 0's output at entry A-2 of each row
        [len(live), D].

        Mutates: each layer's cache (history slots), the rows' states and `pending` lists."""
        hidden, tokens, starts = [], [], []
        for b in live:
            anchor = anchors[b]
            state = states[b]
            hidden.append(torch.cat(state.pending))  # [n_new, F]: entries num_fed .. A-2
            tokens.append(batch.token_ids[b][state.num_fed + 1 : anchor])
            starts.append(state.num_fed)
            state.pending.clear()
            state.num_fed = anchor - 1
        feed = list(live)
        outs = self._history(
            0,
            self.head.project_features(torch.cat(hidden)),
            tokens,
            starts,
            [states[b] for b in live],
        )
        last = torch.stack([rows[-1] for rows in outs])
        for layer in range(1, len(self.heads)):
            for b, rows in zip(feed, outs, strict=True):
                if rows.shape[0]:
                    layers[b][layer - 1].pending.append(rows)
            feed, hidden, tokens, starts = [], [], [], []
            for b in live:
                own = layers[b][layer - 1]
                count = anchors[b] - 1 - layer - own.num_fed  # entries num_fed .. A-2-layer
                if count <= 0:
                    continue
                pending = torch.cat(own.pending)
                own.pending = [pending[count:].clone()]  # (not a view of the whole catch-up)
                hidden.append(pending[:count])
                first = own.num_fed + layer + 1  # the token at entry i: i + layer + 1
                tokens.append(batch.token_ids[b][first : first + count])
                starts.append(own.num_fed)
                own.num_fed += count
                feed.append(b)
            if feed:
                outs = self._history(
                    layer, torch.cat(hidden), tokens, starts, [states[b] for b in feed]
                )
            else:
                outs = []
        return last

    def _history(self, layer, hidden, tokens, starts, states) -> list[torch.Tensor]:
        """Layer `layer`'s entries starts[j] .. starts[j] + n_j - 1 of request j (`states[j]`):
        hidden [sum n_j, D], tokens[j] a list of n_j token ids. Returns each request's outputs
        [n_j, D].

        Mutates: the layer's cache slots of those entries."""
        counts = [len(t) for t in tokens]
        flat = to_device([t for row in tokens for t in row], torch.int64, self.device)
        positions = [s + 1 + c for s, n in zip(starts, counts, strict=True) for c in range(n)]
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        out = self._run(layer, hidden, flat, positions, counts, ends, states)
        return list(out.split(counts))

    def _draft_entries(
        self, layer, anchors, live, states, layers, steps, out
    ) -> list[torch.Tensor]:
        """Layer `layer` (< n) over its entries max(A-1-layer, 0)..A-2, which read the drafts
        in `out` (entry i: draft i + layer + 1 - A): hidden from layer - 1's history output at
        A-1-layer (its pending row) and its draft-step outputs `steps` ([n_j, D] per row of
        `live`). Returns each row's outputs [n_j', D] (entry A-2 last).

        Mutates: the layer's cache slots of those entries (rewritten by the next catch-up)."""
        hidden, token_index, counts, ends = [], [], [], []
        k = out.draft_token_ids.shape[1]  # [B, K] on the device
        for j, b in enumerate(live):
            anchor = anchors[b]
            first = max(anchor - 1 - layer, 0)
            parts = [steps[j]]
            if anchor - 1 - layer >= 0:  # layer - 1's history output at entry A-1-layer
                own = layers[b][layer - 1]
                parts.insert(0, torch.cat(own.pending)[-1:])
            hidden.append(torch.cat(parts))
            # entry i reads the token at i + layer + 1 >= A: draft i + layer + 1 - A
            token_index += [b * k + i + layer + 1 - anchor for i in range(first, anchor - 1)]
            counts.append(anchor - 1 - first)
            ends.append(anchor - 1)
        tokens = out.draft_token_ids.reshape(-1)[to_device(token_index, torch.int64, self.device)]
        positions = [e - n + 1 + c for e, n in zip(ends, counts, strict=True) for c in range(n)]
        result = self._run(
            layer, torch.cat(hidden), tokens, positions, counts, ends, [states[b] for b in live]
        )
        return list(result.split(counts))

    def _run(self, layer, hidden, tokens, positions, query_lens, context_lens, states):
        """One step of layer `layer` over its cache (`EagleHead.forward_paged`): [T, D] hidden,
        [T] token ids (device tensor), positions (entry + 1, a list), per row its query and
        context length. Returns [T, D] outputs.

        Mutates: the layer's cache slots context_len - query_len .. context_len - 1."""
        attn = AttentionMetadata.build(
            query_lens, context_lens, [s.block_ids for s in states], self.block_size, self.device
        )
        return self.heads[layer].forward_paged(
            hidden,
            self.embeds[layer](tokens.to(device=self.device, dtype=torch.int64)),
            to_device(positions, torch.int64, self.device),
            attn,
            self.kv_caches[layer],
        )
