"""CUDA graphs of the EAGLE head's decode-path steps over static input buffers (`HeadGraphs`):
the catch-up on a round's new entries, the chain steps and the prompt steps of requests entering
device rounds, captured per padded batch size; on the CPU (or enforce_eager) the same padded
steps run op by op on the same buffers."""

from __future__ import annotations

import numpy as np
import torch

from specdec.drafters.base import Drafter
from specdec.drafters.eagle.head import head_logits
from specdec.drafters.eagle.step_inputs import HeadStepInputs
from specdec.models.attention import DecodeMetadata, cache_slots
from specdec.models.attention_tiles import decode_query_bucket
from specdec.runner.cuda_graph import GraphCache, StaticInputs, batch_buckets, bucket_for
from specdec.transfer import to_device


class HeadGraphs:
    """CUDA graphs of the head's steps, over static input buffers, one graph per (kind, padded
    batch size):

    - "catch_up": each request's new entries (at most `width`: the round's K + 1) from target
      features, padded to `width` rows per request; returns each request's last output;
    - "chain": one entry per request over its previous head output and the draft just
      proposed.

    Both end with the head's draft logits. Replaying a step costs one launch where running it
    op by op costs twenty to forty, each paid by the host at batch 1. Without `use_graphs`
    (the CPU, or enforce_eager) the same padded step runs op by op on the same buffers, so both
    modes compute the same shapes and hence the same numbers.

    A third kind, "prompt", feeds the entries of requests joining device rounds (all but the
    last `width`, which their first round feeds): `prompt_width` entries per request a step,
    through the same decode path, with no logits (`prompt`). It replaces the eager general
    step there, about fifty launches whose host time was the admission's cost (s44, H100:
    3.5 ms a join at c = 16, 5.5 ms at c = 64, 17-22% of an engine kept at that load). The
    decode path gives an entry the bits the general step gives it (a request's rounds against
    the synchronous step, whose wide catch-ups take the general step, say so token for token on
    the CPU and in the GPU cases run in s44; one CUDA case, through the eager step, is open:
    `test_eagle_prompt_steps.py`).
    """

    def __init__(
        self,
        drafter: Drafter,  # an `EagleDrafter` (its head, cache and entry inputs)
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
        # "prompt" steps: per padded batch P, `prompt_width` rows a request; one int buffer laid
        # out for P (slots, positions, tokens [P * width] each; context and query lengths [P]),
        # written by one device copy a step from inputs sent once for all the steps.
        attn = head.layer.self_attn
        limit = drafter.MAX_DECODE_ENTRIES
        self.prompt_width = decode_query_bucket(limit, attn.num_heads // attn.num_kv_heads, limit)
        prompt_rows = max_num_seqs * self.prompt_width
        feature_size = head.config.feature_size
        self.prompt_features = torch.zeros(prompt_rows, feature_size, dtype=dtype, device=device)
        self.prompt_ints = torch.zeros(3 * prompt_rows + 2 * max_num_seqs, dtype=torch.int64)
        self.prompt_ints = self.prompt_ints.to(device)
        self.prompt_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int64, device=device)
        self.prompt_ends = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
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

    def prompt(self, features, tokens, first_positions, counts, states) -> None:
        """Feeds request j's counts[j] entries from token position first_positions[j] on (their
        target features rows sum(counts[:j]).. of `features` [sum, F], their tokens tokens[j], a
        list) through the head's decode path, `prompt_width` entries per request a step, each
        step replayed from the graph of its padded batch. Writes the entries' K/V (blocks grown
        by the caller); returns nothing: the requests' first round feeds on from there."""
        drafter, width = self.drafter, self.prompt_width
        num_seqs = len(states)
        padded = bucket_for(self.buckets, num_seqs)
        rows = padded * width
        steps = -(-max(counts) // width)
        size = drafter.block_size
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        ints: list[int] = []  # per step: slots, positions, tokens, context lengths, query lengths
        targets, sources = [], []  # feature rows: (step, row) <- row of `features`
        for step in range(steps):
            slots, positions, step_tokens, context, query = [], [], [], [], []
            for j in range(padded):
                n = min(max(counts[j] - step * width, 0), width) if j < num_seqs else 0
                if n:
                    first = first_positions[j] + step * width
                    entries = range(first - 1, first - 1 + n)
                    slots += cache_slots(states[j].block_ids, entries, size).tolist()
                    positions += [t + 1 for t in entries]
                    step_tokens += tokens[j][step * width : step * width + n]
                    targets += range(step * rows + j * width, step * rows + j * width + n)
                    sources += range(starts[j] + step * width, starts[j] + step * width + n)
                slots += [-1] * (width - n)  # padding rows: no slot written
                positions += [0] * (width - n)
                step_tokens += [0] * (width - n)
                context.append(first - 1 + n if n else 0)  # context 0: an inert request
                query.append(n)
            ints += slots + positions + step_tokens + context + query
        tables = []
        for state in states:
            tables += state.block_ids + [0] * (self.max_blocks - len(state.block_ids))
        device = drafter.device
        per_step = 3 * rows + 2 * padded
        staged = to_device(ints + tables + targets + sources, torch.int64, device)
        staged_ints = staged[: steps * per_step].view(steps, per_step)
        table_rows = staged[steps * per_step : steps * per_step + len(tables)]
        moved = staged[steps * per_step + len(tables) :]
        target_rows, source_rows = moved[: len(targets)], moved[len(targets) :]
        stacked = features.new_zeros(steps * rows, features.shape[-1])
        stacked.index_copy_(0, target_rows, features.index_select(0, source_rows))
        self.prompt_tables[:num_seqs].copy_(table_rows.view(num_seqs, self.max_blocks))
        for step in range(steps):
            self.prompt_ints[:per_step].copy_(staged_ints[step])
            self.prompt_features[:rows].copy_(stacked[step * rows : (step + 1) * rows])
            self._run_prompt(padded)

    def _run_prompt(self, padded: int) -> None:
        self.graph_cache.run(("prompt", padded), lambda: self._prompt_step(padded))

    def _prompt_step(self, padded: int) -> torch.Tensor:
        """A "prompt" step over the first `padded` requests of its buffers (see `prompt`)."""
        drafter, head, width = self.drafter, self.drafter.head, self.prompt_width
        rows = padded * width
        ints = self.prompt_ints
        meta = DecodeMetadata(
            block_tables=self.prompt_tables[:padded],
            context_lens=ints[3 * rows : 3 * rows + padded],
            query_lens=ints[3 * rows + padded : 3 * rows + 2 * padded],
            slot_mapping=ints[:rows],
            query_per_seq=width,
            num_partitions=drafter.num_partitions,
        )
        positions, features = ints[rows : 2 * rows], self.prompt_features[:rows]
        embeds = drafter.embed(ints[2 * rows : 3 * rows])
        if drafter._native is not None and not self.use_graphs:  # the CPU: one C++ call
            return drafter._native(
                features, True, embeds, positions, meta, self.prompt_ends[:padded]
            )
        hidden = head.project_features(features)
        return head.forward_decode(hidden, embeds, positions, meta, drafter.kv_cache)

    def warm_up(self) -> None:
        """Runs every kind of step at every padded batch size over inert rows (context 0, no
        slot written), so that each graph is captured; `_fill` and `prompt` rewrite every input
        a later step reads."""
        inputs = self.inputs
        for padded in self.buckets:
            self.prompt_ints.zero_()
            self.prompt_ints[: padded * self.prompt_width].fill_(-1)
            self.prompt_tables.zero_()
            self._run_prompt(padded)
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
