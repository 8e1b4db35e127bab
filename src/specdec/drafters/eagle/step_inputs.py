"""The inputs of the EAGLE head's steps inside a device round, as device tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HeadStepInputs:
    """A head step's inputs as device tensors over S slots (a device round's), W entries a slot
    (the catch-up: the round's width; a chain step: 1), handed to the head directly instead of
    being copied into its static buffers (a round is one graph, so its steps need no static
    inputs of their own).

    Attributes:
        slots: [S * W] cache slot of each entry (-1 for entries that are not fed).
        positions: [S * W] each entry's RoPE position t + 1 (entry t; 0 when not fed).
        context_lens: [S] the head cache's length after the step (0 for inert slots).
        query_lens: [S] entries fed per slot.
        tokens: [S * W] the token at each entry's position.
        tables: [S, max_blocks] the head's block tables.
        hidden: [S, D] the previous head outputs (a chain step), or None.
        features: [S * W, F] the target features of the entries (the catch-up), or None.
        ends: [S] row of each slot's last fed entry (the catch-up), or None.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    tokens: torch.Tensor
    tables: torch.Tensor
    hidden: torch.Tensor | None = None
    features: torch.Tensor | None = None
    ends: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class HeadRoundInputs:
    """Where `head_round_inputs` writes, for S slots of W entries and K - 1 chain steps.

    Attributes:
        catch_slots, catch_positions, catch_tokens: [S * W] the catch-up's entries (slot b's
            row b * W + c: entry t = anchor - 1 - count + c, fed when c < count on a live slot;
            cache slot (-1 when not fed), position t + 1 (0), token (0)).
        catch_context_lens, catch_query_lens, catch_ends: [S] anchor - 1 and count (0 on
            inert slots), and b * W + max(count - 1, 0).
        chain_slots, chain_positions: [K - 1, S] chain step i's entry t = anchor - 1 + i: its
            cache slot (-1 on inert slots) and position t + 1 (0 on inert slots).
        chain_query_lens: [S] 1 on live slots, 0 on inert ones.
        draft_positions: [K, S] the position of draft i: anchor + i (every slot).
    """

    catch_slots: torch.Tensor
    catch_positions: torch.Tensor
    catch_tokens: torch.Tensor
    catch_context_lens: torch.Tensor
    catch_query_lens: torch.Tensor
    catch_ends: torch.Tensor
    chain_slots: torch.Tensor
    chain_positions: torch.Tensor
    chain_query_lens: torch.Tensor
    draft_positions: torch.Tensor
