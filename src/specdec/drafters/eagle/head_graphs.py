"""CUDA graphs of the EAGLE head's decode-path steps over static input buffers (`HeadGraphs`):
the catch-up on a round's new entries and the chain steps, captured per padded batch size; on the
CPU (or enforce_eager) the same padded steps run op by op on the same buffers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.drafters.eagle.head import head_logits
from specdec.drafters.eagle.step_inputs import HeadStepInputs
from specdec.models.attention import DecodeMetadata
from specdec.runner.cuda_graph import GraphCache, StaticInputs, batch_buckets, bucket_for
from specdec.transfer import to_device

if TYPE_CHECKING:
    from specdec.drafters.eagle.drafter import EagleDrafter


class HeadGraphs:
    """CUDA graphs of the head's two kinds of step, over static input buffers, one graph per
    (kind, padded batch size):

    - "catch_up": each request's new entries (at most `width`: the round's K + 1) from target
      features, padded to `width` rows per request; returns each request's last output;
    - "chain": one entry per request over its previous head output and the draft just
      proposed.

    Both end with the head's draft logits. Replaying a step costs one launch where running it
    op by op costs twenty to forty, each paid by the host at batch 1. Without `use_graphs`
    (the CPU, or enforce_eager) the same padded step runs op by op on the same buffers, so both
    modes compute the same shapes and hence the same numbers.
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        max_num_seqs: int,
        width: int,
        max_blocks: int,
        use_graphs: bool,
    ) -> None:
        self.drafter = drafter
        self.buckets = batch_buckets(max_num_seqs)
        self.width = width
        self.max_blocks = max_blocks
        head = drafter.head
        device, dtype = drafter.device, head.dtype
        rows = max_num_seqs * width
        self.features = torch.zeros(rows, head.config.feature_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(max_num_seqs, head.config.hidden_size, dtype=dtype, device=device)
        # Every integer input in one buffer (block tables last), sent with one copy per step.
        self.inputs = StaticInputs(
            {
                "slots": rows,
                "positions": rows,
                "tokens": rows,
                "context_lens": max_num_seqs,
                "query_lens": max_num_seqs,
                "ends": max_num_seqs,
                "tables": max_num_seqs * max_blocks,
            },
            device,
        )
        self.slots, self.positions, self.tokens = (
            self.inputs[name] for name in ("slots", "positions", "tokens")
        )
        self.context_lens, self.query_lens, self.ends = (
            self.inputs[name] for name in ("context_lens", "query_lens", "ends")
        )
        self.tables = self.inputs["tables"].view(max_num_seqs, max_blocks)
        self.graph_cache = GraphCache(use_graphs)

    @property
    def use_graphs(self) -> bool:
        return self.graph_cache.use_graphs

    @property
    def graphs(self) -> dict:
        """(step kind, padded batch) -> (graph, its outputs)."""
        return self.graph_cache.graphs

    def forward(
        self, kind: str, num_seqs: int, step: HeadStepInputs | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A head step of `kind` over the first `num_seqs` requests' rows of the static buffers,
        as they are (device work only: what `_run` replays), or, inside a device round, over
        `step`'s tensors instead (the same values without copying them into the buffers
        first). Returns (head outputs [num_seqs, D], draft logits [num_seqs, V_draft])."""
        drafter, head = self.drafter, self.drafter.head
        width = self.width if kind == "catch_up" else 1
        rows = num_seqs * width
        if step is None:
            step = HeadStepInputs(
                slots=self.slots[:rows],
                positions=self.positions[:rows],
                context_lens=self.context_lens[:num_seqs],
                query_lens=self.query_lens[:num_seqs],
                tokens=self.tokens[:rows],
                tables=self.tables[:num_seqs],
                hidden=self.hidden[:num_seqs],
                features=self.features[:rows],
                ends=self.ends[:num_seqs],
            )
        meta = DecodeMetadata(
            block_tables=step.tables,
            context_lens=step.context_lens,
            query_lens=step.query_lens,
            slot_mapping=step.slots,
            query_per_seq=width,
            num_partitions=drafter.num_partitions,  # (split-KV at long contexts)
        )
        embeds = drafter.embed(step.tokens)
        if drafter._native is not None and not self.use_graphs:  # the CPU: one C++ call
            catch_up = kind == "catch_up"
            out = drafter._native(
                step.features if catch_up else step.hidden,
                catch_up,
                embeds,
                step.positions,
                meta,
                step.ends if catch_up else None,
            )
            return out, head_logits(head, out, drafter.lm_weight)
        hidden = head.project_features(step.features) if kind == "catch_up" else step.hidden
        out = head.forward_decode(hidden, embeds, step.positions, meta, drafter.kv_cache)
        if kind == "catch_up":
            out = out.index_select(0, step.ends)  # each request's last entry
        return out, head_logits(head, out, drafter.lm_weight)

    def catch_up(self, features, tokens, first_positions, query_lens, states):
        """The round's first head step: request j feeds its query_lens[j] (<= width) new
        entries, whose features are rows sum(query_lens[:j]) .. of `features` [sum, F] and whose
        tokens are tokens[j] (a list). Returns views (valid until the next call) of each
        request's last head output [n, D] and draft logits [n, V_draft] float32."""
        num_seqs, width = len(states), self.width
        padded = self._fill(first_positions, query_lens, states, width, tokens)
        if len(set(query_lens)) == 1 and query_lens[0] == width:
            self.features[: num_seqs * width].copy_(features)
        elif num_seqs == 1:
            self.features[: query_lens[0]].copy_(features)
        else:
            rows = [j * width + i for j, n in enumerate(query_lens) for i in range(n)]
            index = to_device(rows, torch.int64, self.drafter.device)
            self.features.index_copy_(0, index, features)
        return self._run("catch_up", padded, num_seqs)

    def chain(self, hidden, tokens, positions, states):
        """One draft step for len(states) requests: hidden [n, D] (their previous head outputs),
        tokens [n] (the drafts just proposed, target ids on the device), positions (each
        draft's position). Returns views (valid until the next call) of the [n, D] head outputs
        and the [n, V_draft] float32 draft logits."""
        num_seqs = len(states)
        padded = self._fill(positions, [1] * num_seqs, states, 1, None)
        self.hidden[:num_seqs].copy_(hidden)
        self.tokens[:num_seqs].copy_(tokens)
        return self._run("chain", padded, num_seqs)

    def _fill(self, first_positions, query_lens, states, width, tokens) -> int:
        """Writes a step's integer inputs (padded to a bucket of requests, `width` rows each)
        and sends them in one copy. Returns the padded number of requests."""
        num_seqs = len(states)
        padded = bucket_for(self.buckets, num_seqs)
        slots, positions, context_lens, tables = self.drafter._entry_inputs(
            first_positions, query_lens, states, width, self.max_blocks
        )
        inputs = self.inputs
        inputs.begin()  # the last step's copy has left the host buffer
        rows, pad = padded * width, padded - num_seqs
        inputs.host("slots", rows)[:] = slots + [-1] * (pad * width)
        inputs.host("positions", rows)[:] = positions + [0] * (pad * width)
        if tokens is not None:
            flat = inputs.host("tokens", rows)
            flat[:] = 0
            for j, row_tokens in enumerate(tokens):
                flat[j * width : j * width + len(row_tokens)] = row_tokens
        inputs.host("context_lens", padded)[:] = context_lens + [0] * pad  # padding: inert
        inputs.host("query_lens", padded)[:] = list(query_lens) + [0] * pad
        ends = [j * width + n - 1 for j, n in enumerate(query_lens)]
        inputs.host("ends", padded)[:] = ends + [0] * pad
        table_rows = inputs.host("tables").reshape(-1, self.max_blocks)
        table_rows[:num_seqs] = np.asarray(tables, dtype=np.int64).reshape(num_seqs, -1)
        inputs.send("tables", padded * self.max_blocks)  # the tables of the requests in use
        return padded

    def warm_up(self) -> None:
        """Runs both kinds of step at every padded batch size over inert rows (context 0, no
        slot written), so that each graph is captured; `_fill` rewrites every input a later
        step reads."""
        inputs = self.inputs
        for padded in self.buckets:
            for kind in ("catch_up", "chain"):
                rows = padded * (self.width if kind == "catch_up" else 1)
                inputs.begin()
                inputs.host("slots", rows).fill(-1)
                for name in ("positions", "tokens"):
                    inputs.host(name, rows).fill(0)
                for name in ("context_lens", "query_lens", "ends"):
                    inputs.host(name, padded).fill(0)
                inputs.host("tables", padded * self.max_blocks).fill(0)
                inputs.send("tables", padded * self.max_blocks)
                self._run(kind, padded, 0)

    def _run(self, kind: str, padded: int, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        out, logits = self.graph_cache.run((kind, padded), lambda: self.forward(kind, padded))
        return out[:num_seqs], logits[:num_seqs]
