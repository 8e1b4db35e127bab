"""Medusa drafting (Cai et al. 2024, "Medusa", section 2.1.1): heads over the target's last hidden
state, head i proposing the token i + 2 positions after that state's own, loaded from
FasterDecoding's checkpoints or vLLM's (`formats.recognise_medusa`).

Head i (FasterDecoding's medusa_model.py; vLLM's medusa.py computes the same):
    x_0 = h, the target's last hidden state AFTER its final norm (`base_model.model(...)[0]`)
    x_{j+1} = x_j + SiLU(W_ij x_j + b_ij)    for each of the head's residual blocks
    draft logits = lm_head_i(x_L)             (its own vocabulary projection)
A round anchored at A (its input token at A - 1 is the target's sample from h at A - 2) reads h
at A - 2: head i proposes the token at Q = A + i. The heads see neither the input token nor each
other's drafts; a round's drafts are the chain of head 0 .. K - 1's proposals, each its top token
(greedy drafting) or drawn from its distribution through `sample_draft` at Q, or with
`speculative_config["tree"]` a tree whose depth-i nodes are head i's top tokens or its draws
without replacement (`medusa_tree.py`).
Never draws noise itself; reads only the target's final norm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.base import (
    DraftBatch,
    Drafter,
    DrafterSetup,
    Proposal,
    ProposalBuffer,
    TargetFeatures,
)
from specdec.drafters.config import SpeculativeConfig, TreeConfig
from specdec.drafters.formats import MEDUSA_VLLM, DrafterCheckpoint, recognise_medusa
from specdec.drafters.medusa_tree import propose_medusa_tree
from specdec.models import LlamaForCausalLM
from specdec.models.config import ModelConfig
from specdec.models.layers import Linear
from specdec.models.weights import CheckpointError, assign_weights
from specdec.transfer import to_device


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    """The shape of a set of Medusa heads.

    Attributes:
        num_heads: heads (the most drafts a round can take).
        num_layers: residual blocks per head (0: the vocabulary projection alone).
        hidden_size: D, the target's hidden size.
        vocab_size: V_draft, rows of each vocabulary projection (the target's V, or fewer
            with vLLM's `token_map`).
        bias: the residual blocks' linears have biases (decided by the stored tensors).
        shared_lm_head: one vocabulary projection for every head (vLLM's `original_lm_head`).
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    bias: bool = True
    shared_lm_head: bool = False


class MedusaHeads(nn.Module):
    """Parameters: `blocks.{i}.{j}` Linear [D, D] (+ bias [D]) for head i's residual block j;
    `lm_heads.{i}` Linear [V_draft, D] (one, `lm_heads.0`, when shared)."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.ModuleList(Linear(dim, dim, config.bias) for _ in range(config.num_layers))
            for _ in range(config.num_heads)
        )
        num_lm_heads = 1 if config.shared_lm_head else config.num_heads
        self.lm_heads = nn.ModuleList(
            Linear(dim, config.vocab_size, bias=False) for _ in range(num_lm_heads)
        )

    def forward(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        """[N, D] normed target hidden states -> [N, V_draft] float32 logits of head `head`."""
        x = hidden
        for linear in self.blocks[head]:
            x = x + F.silu(linear(x))
        lm_head = self.lm_heads[0 if self.config.shared_lm_head else head]
        return lm_head(x).float()

    @property
    def device(self) -> torch.device:
        return self.lm_heads[0].weight.device


_OUR_BLOCK = re.compile(r"^blocks\.(\d+)\.(\d+)\.(weight|bias)$")
_OUR_LM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


def _stored_name(name: str, naming: str, prefix: str, num_layers: int) -> str:
    """The checkpoint name of a `MedusaHeads` parameter in `naming` (`recognise_medusa`)."""
    block = _OUR_BLOCK.match(name)
    if block:
        i, j, kind = block.groups()
        if naming == MEDUSA_VLLM:
            return f"{prefix}blocks.{i}.layers.{j}.{kind}"
        return f"{prefix}{i}.{j}.linear.{kind}"
    (i,) = _OUR_LM_HEAD.match(name).groups()
    if naming == MEDUSA_VLLM:
        return f"{prefix}lm_heads.{i}.weight"
    return f"{prefix}{i}.{num_layers}.weight"


def _config_int(values: dict, key: str, source: Path, default: int | None = None) -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{source}/config.json: {key!r} must be a non-negative integer, got {value!r}"
        )
    return value


def load_medusa(
    path: str | Path, target: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> tuple[MedusaHeads, torch.Tensor | None]:
    """Loads Medusa heads in FasterDecoding's format (config `medusa_num_heads`,
    `medusa_num_layers`) or vLLM's (`num_heads`, `num_hidden_layers`, optional
    `truncated_vocab_size` with a `token_map` tensor, `original_lm_head`).

    Returns:
        (heads in eval mode without grads, draft_to_target [V_draft] int64 or None).

    Raises:
        FileNotFoundError: a missing file.
        CheckpointError: no Medusa tensors; a missing or mis-shaped tensor, or one the format
            does not define (named).
        ValueError: a config key missing or invalid (named); heads of another width or
            vocabulary than the target's.
    """
    checkpoint = DrafterCheckpoint(path)
    naming, prefix = recognise_medusa(checkpoint)
    values, source = checkpoint.config, checkpoint.path
    vllm = naming == MEDUSA_VLLM
    # vLLM's MedusaConfig also reads FasterDecoding's keys; FasterDecoding reads only its own.
    heads_key, layers_key = "medusa_num_heads", "medusa_num_layers"
    if vllm and "num_heads" in values:
        heads_key, layers_key = "num_heads", "num_hidden_layers"
    num_heads = _config_int(values, heads_key, source)
    num_layers = _config_int(values, layers_key, source, default=1)
    if num_heads < 1:
        raise ValueError(f"{source}/config.json: no Medusa heads (num_heads {num_heads})")
    if vllm:
        for key, theirs in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
            if values.get(key, theirs) != theirs:
                raise ValueError(
                    f"{source}: Medusa heads with {key} {values[key]} do not fit the target's "
                    f"{theirs}"
                )
    draft_to_target = None
    vocab_size = target.vocab_size
    truncated = values.get("truncated_vocab_size") if vllm else None
    if truncated is not None and truncated < target.vocab_size:
        token_map = checkpoint.require(prefix + "token_map", (truncated,)).to(torch.int64)
        if int(token_map.min()) < 0 or int(token_map.max()) >= target.vocab_size:
            raise CheckpointError(f"{source}: token_map is not a map into the target vocabulary")
        draft_to_target, vocab_size = token_map, truncated
    first_bias = _stored_name("blocks.0.0.bias", naming, prefix, num_layers)
    config = MedusaConfig(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=target.hidden_size,
        vocab_size=vocab_size,
        bias=num_layers > 0 and first_bias in checkpoint.names,
        shared_lm_head=vllm and bool(values.get("original_lm_head", False)),
    )
    with torch.device("meta"):
        heads = MedusaHeads(config)
    tensors, used = {}, set()
    if draft_to_target is not None:
        used.add(prefix + "token_map")
    for name, param in heads.named_parameters():
        stored = _stored_name(name, naming, prefix, num_layers)
        used.add(stored)
        tensor = checkpoint.read(stored)
        if (
            draft_to_target is not None
            and name.startswith("lm_heads.")
            and tensor is not None
            and tensor.shape[0] == target.vocab_size
        ):
            tensor = tensor.index_select(0, draft_to_target)  # vLLM keeps the token_map rows
        tensors[name] = checkpoint.check(stored, tensor, param.shape)
    if prefix:  # Medusa-2 saves whole models: tensors outside the heads' prefix are the target's
        used |= {n for n in checkpoint.names if not n.startswith(prefix)}
    checkpoint.refuse_unused(used, f"Medusa ({naming})")
    assign_weights(heads, tensors.get, str(source), dtype, device)
    return heads, draft_to_target


class MedusaDrafter(Drafter):
    """vLLM's `medusa` method: one draft per head (chains), or trees from the heads' top-k, from
    the target's last hidden state."""

    def __init__(
        self,
        heads: MedusaHeads,
        target: LlamaForCausalLM,
        draft_to_target: torch.Tensor | None = None,
        greedy: bool = False,
        tree: TreeConfig | None = None,
    ) -> None:
        """Args:
        heads: the loaded heads.
        target: the target (its final norm makes the heads' input from its last layer's
            output; nothing else of it is read).
        draft_to_target: [V_draft] int64 target id of each draft id (vLLM's token_map), or None.
        greedy: propose each head's argmax (one-hot drafts) instead of sampling; in a tree,
            each head's top tokens.
        tree: draft a tree per round (`medusa_tree.propose_medusa_tree`) instead of a chain.
        """
        super().__init__(target.config.vocab_size, draft_to_target, greedy)
        self.heads = heads
        self.tree = tree
        self.final_norm = target.model.norm
        self.feature_layers = (target.config.num_hidden_layers - 1,)
        self.device = heads.device
        # Per request: (positions delivered, [D] the last one's feature, before the final norm).
        self._last: dict[str, tuple[int, torch.Tensor]] = {}

    @classmethod
    def from_config(
        cls, spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup | None = None
    ) -> MedusaDrafter:
        """Loads the heads of a SpeculativeConfig (`model`: their directory). A chain drafts at
        most one token per head (a K above the number of heads drafts that many); a tree is at
        most as deep as the heads."""
        heads, draft_to_target = load_medusa(spec.model, target.config, target.dtype, target.device)
        greedy = spec.draft_sample_method == "greedy"
        return cls(heads, target, draft_to_target, greedy=greedy, tree=spec.tree)

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def observe(self, features: TargetFeatures) -> None:
        for request_id, start, rows in zip(
            features.request_ids, features.starts, features.features, strict=True
        ):
            end = self._last[request_id][0] if request_id in self._last else 0
            if start != end:
                raise ValueError(
                    f"request {request_id}: features start at {start}, expected {end} "
                    "(features must arrive in order)"
                )
            # A copy: the engine's feature tensors may be views of buffers it reuses.
            last = rows[-1].to(self.device, copy=True)
            self._last[request_id] = (start + rows.shape[0], last)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        if batch.request_ids is None:
            raise ValueError("the Medusa drafter needs request_ids in its DraftBatch")
        size, device = batch.batch_size, self.device
        out = ProposalBuffer(size, batch.max_draft, self.target_vocab_size, device, self.greedy)
        num_draft = self.num_draft_with_features(batch)
        if self.tree is None:
            num_draft = num_draft.clamp(max=self.heads.config.num_heads)
        counts, anchors = num_draft.tolist(), batch.anchors.tolist()
        live = [b for b in range(size) if counts[b] > 0]
        if not live:
            return out.proposal(num_draft)
        last = []
        for b in live:
            request_id = batch.request_ids[b]
            end, feature = self._last.get(request_id, (0, None))
            if end != anchors[b] - 1:
                raise ValueError(
                    f"request {request_id}: the Medusa drafter needs the target feature of "
                    f"position {anchors[b] - 2}, has features of 0..{end - 1} (is it fed through "
                    "the engine?)"
                )
            last.append(feature)
        hidden = self.final_norm(torch.stack(last))  # [len(live), D] h at A - 2
        if self.tree is not None:
            parents, num_nodes = propose_medusa_tree(self, batch, self.tree, live, hidden, out)
            return out.proposal(num_nodes, parents)
        for i in range(max(counts[b] for b in live)):
            keep = [j for j, b in enumerate(live) if counts[b] > i]  # rows wanting draft i
            if len(keep) < len(live):
                hidden = hidden[to_device(keep, torch.int64, device)]
                live = [live[j] for j in keep]
            rows = torch.tensor(live, dtype=torch.int64)
            logits = self.heads(hidden, i)  # [len(live), V_draft]
            at = (to_device(rows, torch.int64, device), i)
            self.draw(logits, rows, batch.anchors[rows] + i, batch, out, at)  # Q = A + i
        return out.proposal(num_draft)
