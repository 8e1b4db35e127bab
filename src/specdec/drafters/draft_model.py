"""Draft-model drafting: a smaller model with the target's tokenizer proposes K tokens
autoregressively on its own paged KV cache (or, with `speculative_config["tree"]`, a draft tree:
`draft_model_tree.py`).

Each round the drafter first catches up on the tokens its cache lacks (the last round's recovered
or bonus token, and any accepted draft it had not fed), then drafts. Draft noise comes only from
the base class's `sample_draft`, keyed by the position Q of the proposed token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from specdec.drafters.base import DraftBatch, Drafter, DrafterSetup, Proposal, ProposalBuffer
from specdec.drafters.config import SpeculativeConfig, TreeConfig, round_drafts
from specdec.drafters.device import DeviceDrafting
from specdec.drafters.draft_model_tree import propose_draft_model_tree
from specdec.models import LlamaForCausalLM, default_quantization, load_model
from specdec.runner import BlockAllocator, PagedModelRunner, StepInput
from specdec.transfer import to_device

TRUNCATED_PREFIX = "truncated:"


@dataclass(slots=True, eq=False)
class _DraftState:
    """What the draft cache holds for one request: the tokens with valid K/V, and its blocks."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


def truncated_copy(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A draft sharing the target's embeddings, first `num_layers` layers, final norm and head
    (no copy of the weights)."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"a truncated draft needs 1 <= layers < {total}, got {num_layers}")
    config = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    with torch.device("meta"):
        draft = LlamaForCausalLM(config)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = nn.ModuleList(list(model.model.layers[:num_layers]))
    draft.model.norm = model.model.norm
    draft.model.rotary_emb = model.model.rotary_emb
    draft.lm_head = model.lm_head
    draft.tied_head = model.tied_head  # a quantized tied head, shared too
    draft.quantization = model.quantization
    return draft.eval()


class DraftModelDrafter(Drafter):
    """vLLM's `draft_model` method."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        target_vocab_size: int,
        num_blocks: int,
        block_size: int,
        greedy: bool = False,
        *,
        max_num_seqs: int,
        max_query_len: int = 1,
        decode_path: bool | None = None,
        max_model_len: int | None = None,
        tree: TreeConfig | None = None,
    ) -> None:
        """Args:
        model: the draft model (its vocabulary must be the target's).
        target_vocab_size: V of the target.
        num_blocks, block_size: the draft's own KV cache.
        greedy: propose the draft's argmax (one-hot drafts) instead of sampling.
        max_num_seqs: most requests in one round.
        max_query_len, decode_path, max_model_len: the draft runner's decode path (see
            `PagedModelRunner`); device rounds need it at width K + 1.
        tree: draft a tree per round instead of a chain (synchronous engine path only).
        """
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                f"target's ({target_vocab_size}); a draft model must share the target's tokenizer"
            )
        super().__init__(target_vocab_size, greedy=greedy)
        self.runner = PagedModelRunner(
            model,
            num_blocks,
            block_size,
            max_num_seqs=max_num_seqs,
            max_query_len=max_query_len,
            decode_path=decode_path,
            max_model_len=max_model_len,
        )
        self.allocator = BlockAllocator(num_blocks, block_size)
        self._states: dict[str, _DraftState] = {}
        self.tree = tree

    @classmethod
    def from_config(
        cls, spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup
    ) -> DraftModelDrafter:
        """Builds the drafter of a SpeculativeConfig ("truncated:N" or a model path)."""
        if spec.model.startswith(TRUNCATED_PREFIX):
            layers = spec.model[len(TRUNCATED_PREFIX) :]
            if not layers.isdigit():
                raise ValueError(f'"{spec.model}": expected "truncated:<number of layers>"')
            draft = truncated_copy(target, int(layers))
        else:
            draft = load_model(
                spec.model,
                dtype=target.dtype,
                device=target.device,
                quantization=default_quantization(spec.model, target.quantization),
            ).model
        return cls(
            draft,
            target.config.vocab_size,
            setup.num_blocks,
            setup.block_size,
            greedy=spec.draft_sample_method == "greedy",
            max_num_seqs=setup.max_num_seqs,
            max_query_len=spec.num_speculative_tokens + 1 if setup.device_rounds else 1,
            decode_path=True if setup.device_rounds else None,
            # The draft cache holds up to K - 1 drafts (a tree: its N nodes) past the last
            # committed token.
            max_model_len=setup.max_model_len + round_drafts(spec),
            tree=spec.tree,
        )

    def device_drafting(
        self, num_slots: int, width: int, max_model_len: int, device: torch.device
    ) -> DeviceDrafting | None:
        graphs = self.runner.graphs
        if self.tree is not None or graphs is None or graphs.max_query_len != width:
            return None
        from specdec.drafters.draft_model_device import DraftModelDeviceDrafting

        return DraftModelDeviceDrafting(self, num_slots, width)

    def num_graphs(self) -> int:
        graphs = self.runner.graphs
        return 0 if graphs is None else len(graphs.graphs)

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.allocator.free(state)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        if batch.request_ids is None:
            raise ValueError("the draft-model drafter needs request_ids in its DraftBatch")
        size, k = batch.batch_size, batch.max_draft
        vocab = self.target_vocab_size
        device = self.runner.device
        out = ProposalBuffer(size, k, vocab, device, self.greedy)
        states = [
            self._sync(rid, tokens)
            for rid, tokens in zip(batch.request_ids, batch.token_ids, strict=False)
        ]
        inputs = []
        for state, tokens, n in zip(
            states, batch.token_ids, batch.num_draft.tolist(), strict=False
        ):
            start = len(state.token_ids)
            # A chain's drafts 1..n-1 are fed back; a tree's n nodes take n slots.
            ahead = n if self.tree is not None else max(n - 1, 0)
            self.allocator.grow(state, len(tokens) + ahead)
            inputs.append(StepInput(tokens[start:], start, state.block_ids, 1))
            state.token_ids = list(tokens)
        if self.tree is not None:
            logits = torch.cat(self.runner.run(inputs))  # [B, V]: the token at each anchor
            parents, num_nodes = propose_draft_model_tree(
                self, batch, self.tree, states, logits, out
            )
            return out.proposal(num_nodes, parents)
        # Each draft step feeds the previous step's drafts straight from the device
        # (`first_tokens`); the host reads every draft once, after the loop.
        lengths = [len(state.token_ids) for state in states]
        live = list(range(size))
        first_tokens = None
        for i in range(k):
            if first_tokens is None:
                logits = torch.cat(self.runner.run(inputs))  # [len(live), V]
            else:
                logits = self.runner.run_rows(inputs, first_tokens)
            rows = torch.tensor(live, dtype=torch.int64)
            index = slice(None) if len(live) == size else to_device(rows, torch.int64, device)
            positions = batch.anchors[rows] + i  # Q of the proposed tokens
            tokens = self.draw(logits, rows, positions, batch, out, (index, i))
            keep = [j for j, row in enumerate(live) if i + 1 < int(batch.num_draft[row])]
            if not keep:
                break
            inputs = []
            for j in keep:
                state = states[live[j]]
                inputs.append(StepInput([0], len(state.token_ids), state.block_ids, 1))
                state.token_ids.append(-1)  # this step's draft, filled in after the loop
            if len(keep) < len(live):
                tokens = tokens[to_device(keep, torch.int64, tokens.device)]
            first_tokens = tokens
            live = [live[j] for j in keep]
        if k > 1:
            host_ids = out.draft_token_ids.tolist()
            for state, length, ids in zip(states, lengths, host_ids, strict=True):
                fed = len(state.token_ids) - length
                state.token_ids[length:] = ids[:fed]
        return out.proposal(batch.num_draft.clone())

    def _sync(self, request_id: str, tokens: list[int]) -> _DraftState:
        """The request's draft state, rolled back to the longest prefix it shares with `tokens`
        (never the whole of it: the last token is always fed again so it yields logits)."""
        state = self._states.setdefault(request_id, _DraftState())
        common = 0
        limit = min(len(state.token_ids), len(tokens) - 1)
        while common < limit and state.token_ids[common] == tokens[common]:
            common += 1
        del state.token_ids[common:]
        self.allocator.rollback(state, common)
        return state
