"""EAGLE / MTP drafting inside a device round: the head's catch-up on the entries the last round
committed (target features of its input token and accepted drafts, with the tokens after them)
and its K - 1 chained steps, through the same static buffers and head steps as the host path
(`HeadGraphs`), with every input computed on the device. Draft noise only through
`Drafter.draw_on_device`.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, ProposalBuffer
from specdec.drafters.device import BlockTables, DeviceDrafting, DeviceSlot, RoundView
from specdec.drafters.eagle.round_inputs import head_round_inputs
from specdec.drafters.eagle.step_inputs import HeadRoundInputs, HeadStepInputs
from specdec.transfer import to_device

# The most "prompt" graph steps an admission replays (of `HeadGraphs.prompt_width` entries per
# request each, 16): past that, one eager step over every entry (about fifty launches) costs the
# host less than the replays (three launches each).
PROMPT_GRAPH_STEPS = 8


class EagleDeviceDrafting(DeviceDrafting):
    """Per slot: the head entries the next round feeds first (`entry_*`: at most `width`, the
    features and tokens of what the last round committed), and the head's block table."""

    def __init__(self, drafter: Drafter, num_slots: int) -> None:
        graphs = drafter._graphs
        self.drafter, self.graphs = drafter, graphs
        self.width = width = graphs.width
        device, dtype = drafter.device, drafter.head.dtype
        feature_size = drafter.head.config.feature_size
        self.entry_features = torch.zeros(
            num_slots, width, feature_size, dtype=dtype, device=device
        )
        self.entry_tokens = torch.zeros(num_slots, width, dtype=torch.int64, device=device)
        self.entry_count = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.max_blocks = graphs.max_blocks
        self.tables = BlockTables(num_slots, self.max_blocks, device)
        # The round's head inputs (`head_round_inputs` writes them at its start).
        steps = max(width - 2, 0)  # chain steps of the widest round

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.inputs = HeadRoundInputs(
            catch_slots=ints(num_slots * width),
            catch_positions=ints(num_slots * width),
            catch_tokens=ints(num_slots * width),
            catch_context_lens=ints(num_slots),
            catch_query_lens=ints(num_slots),
            catch_ends=ints(num_slots),
            chain_slots=ints(steps, num_slots),
            chain_positions=ints(steps, num_slots),
            chain_query_lens=ints(num_slots),
            draft_positions=ints(width - 1, num_slots),
        )
        self.out = ProposalBuffer(
            num_slots,
            width - 1,
            drafter.target_vocab_size,
            device,
            drafter.greedy,
            reduced_vocab=drafter.draft_to_target is not None,
        )

    admits = True

    def begin(self, slots: list[DeviceSlot], num_rows: int) -> None:
        self.entry_count.zero_()
        self.admit(slots, num_rows)

    def admit(self, slots: list[DeviceSlot], num_rows: int) -> None:
        drafter, width = self.drafter, self.width
        if not slots:
            return
        # Every slot's pending features joined (one copy), then per slot: all but its last
        # `width` entries caught up on the host (one head pass for all), the last ones written
        # to the slot's entry rows (one copy for all).
        pieces, spans = [], []
        for slot in slots:
            state = drafter._states.get(slot.request_id)
            anchor = len(slot.token_ids)
            if state is None or state.feature_end != anchor - 1 or not state.pending:
                raise ValueError(f"request {slot.request_id}: no target features to draft from")
            count = sum(rows.shape[0] for rows in state.pending)  # entries num_fed .. anchor - 2
            spans.append((state, count))
            pieces.extend(state.pending)
            state.pending.clear()
        joined = torch.cat(pieces)
        behind = []  # (features, tokens, first position, count, state) caught up on the host
        sources, targets, tokens, counts = [], [], [], []
        offset = 0
        for slot, (state, count) in zip(slots, spans, strict=True):
            anchor = len(slot.token_ids)
            head = max(count - width, 0)
            if head:
                drafter.allocator.grow(state, state.num_fed + head)
                first = state.num_fed + 1
                rows = joined[offset : offset + head]
                behind.append((rows, slot.token_ids[first : first + head], first, head, state))
                state.num_fed += head
            n = count - head
            sources.extend(range(offset + head, offset + count))
            targets.extend(range(slot.slot * width, slot.slot * width + n))
            tokens.extend(slot.token_ids[anchor - n : anchor])
            counts.append(n)
            offset += count
        device = self.entry_features.device
        targets_on = to_device(targets, torch.int64, device)
        features = self.entry_features.view(-1, self.entry_features.shape[-1])
        features.index_copy_(0, targets_on, joined[to_device(sources, torch.int64, device)])
        self.entry_tokens.view(-1).index_copy_(
            0, targets_on, to_device(tokens, torch.int64, device)
        )
        self.entry_count.index_copy_(
            0,
            to_device([slot.slot for slot in slots], torch.int64, device),
            to_device(counts, torch.int64, device),
        )
        if behind:  # the entries before those: their prompts, through the "prompt" graphs
            features_behind, tokens_behind, firsts, heads, states = map(
                list, zip(*behind, strict=True)
            )
            if -(-max(heads) // self.graphs.prompt_width) <= PROMPT_GRAPH_STEPS:
                self.graphs.prompt(torch.cat(features_behind), tokens_behind, firsts, heads, states)
            else:  # long prompts: one eager general step costs the host less than many replays
                drafter._catch_up(features_behind, tokens_behind, firsts, heads, states)

    def prepare(self, slots: list[DeviceSlot], last_positions: list[int]) -> None:
        # A round whose target writes up to position P (= anchor - 1 + k) writes head entries
        # up to P - 2 (the last chained draft's entry, t = anchor - 2 + (k - 1)).
        drafter, tables = self.drafter, []
        for slot, last in zip(slots, last_positions, strict=True):
            state = drafter._states[slot.request_id]
            drafter.allocator.grow(state, max(last - 1, 1))
            tables.append((slot.slot, state.block_ids))
        self.tables.send(tables)

    def propose(self, view: RoundView) -> tuple:
        graphs, drafter = self.graphs, self.drafter
        rows, width, k = view.num_rows, self.width, view.k
        tables = self.tables.rows(rows)
        inputs = self._round_inputs(view, tables)
        # The round's first head step: entries t = anchor - 1 - n .. anchor - 2 (token t + 1).
        catch_up = HeadStepInputs(
            slots=inputs.catch_slots,
            positions=inputs.catch_positions,
            context_lens=inputs.catch_context_lens,
            query_lens=inputs.catch_query_lens,
            tokens=inputs.catch_tokens,
            tables=tables,
            features=self.entry_features[:rows].view(rows * width, -1),
            ends=inputs.catch_ends,
        )
        last, logits = graphs.forward("catch_up", rows, catch_up)
        out = self.out
        for i in range(k):
            tokens = drafter.draw_on_device(logits, inputs.draft_positions[i], view, out, i)
            if i + 1 == k:
                break
            # Entry t = anchor - 1 + i: the previous head output and draft i (at anchor + i).
            positions = inputs.chain_positions[i]
            step = HeadStepInputs(
                slots=inputs.chain_slots[i],
                positions=positions,
                context_lens=positions,  # entry t sits at t + 1 and is the context's last
                query_lens=inputs.chain_query_lens,
                tokens=tokens,
                tables=tables,
                hidden=last,
            )
            last, logits = graphs.forward("chain", rows, step)
        if k == 0:
            return out.draft_token_ids[:rows, :0], None, None, None
        draft_logits = None if out.draft_logits is None else out.draft_logits[:rows, :k]
        draft_lse = None if out.draft_logsumexp is None else out.draft_logsumexp[:rows, :k]
        return out.draft_token_ids[:rows, :k], draft_logits, draft_lse, None

    def _round_inputs(self, view: RoundView, tables: torch.Tensor) -> HeadRoundInputs:
        """The round's head inputs (the catch-up's and its K - 1 chain steps'), written at once
        (one kernel on CUDA) into views of the first `view.num_rows` slots' buffers."""
        rows, width, steps = view.num_rows, self.width, max(view.k - 1, 0)
        buffers = self.inputs
        inputs = HeadRoundInputs(
            catch_slots=buffers.catch_slots[: rows * width],
            catch_positions=buffers.catch_positions[: rows * width],
            catch_tokens=buffers.catch_tokens[: rows * width],
            catch_context_lens=buffers.catch_context_lens[:rows],
            catch_query_lens=buffers.catch_query_lens[:rows],
            catch_ends=buffers.catch_ends[:rows],
            chain_slots=buffers.chain_slots[:steps, :rows],
            chain_positions=buffers.chain_positions[:steps, :rows],
            chain_query_lens=buffers.chain_query_lens[:rows],
            draft_positions=buffers.draft_positions[: view.k, :rows],
        )
        head_round_inputs(
            view.anchors,
            view.live,
            self.entry_count[:rows],
            self.entry_tokens[:rows],
            tables,
            self.drafter.block_size,
            inputs,
        )
        return inputs

    def observe(self, view, features, token_ids, num_accepted) -> None:
        rows, query = view.num_rows, view.k + 1
        # Entries past num_accepted + 1 (<= Q) are never read: `propose` masks by entry_count.
        self.entry_features[:rows, :query].copy_(features.view(rows, query, -1))
        self.entry_tokens[:rows].copy_(token_ids.clamp_min(0))
        self.entry_count[:rows].copy_(num_accepted + 1)

    def state(self) -> list[torch.Tensor]:
        return [self.entry_features, self.entry_tokens, self.entry_count]

    def end(self, slots: list[DeviceSlot]) -> None:
        counts = self.entry_count.tolist()
        for slot in slots:
            state = self.drafter._states[slot.request_id]
            anchor, n = len(slot.token_ids), counts[slot.slot]
            state.num_fed = anchor - 1 - n
            state.pending = [self.entry_features[slot.slot, :n].clone()]
            state.feature_end = anchor - 1
