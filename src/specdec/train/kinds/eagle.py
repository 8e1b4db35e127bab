"""Training the EAGLE / MTP head: distillation of the target's next-token distributions from its
own hidden features, with training-time test (EAGLE-3, Li et al. 2025, section 3.3): the head
is unrolled for `ttt_steps` draft steps, later steps reading its own outputs as at inference.

Options (`--option key=value`): feature_layers (comma-separated target layers; default the last),
draft_vocab_size (0 = the full vocabulary; else the most frequent training tokens), ttt_steps
(default 3), intermediate_size (default the target's), save_dtype (float16 | float32), init_from
(a head directory to start from, see `widen_head_`: its draft vocabulary and feature layers are
kept, its MLP may be widened), format (specdec | eagle; `train-drafter --format`; eagle3 is
refused: EAGLE-3's midlayer is another network than the head trained here).

Formats: "specdec" trains our head (`HeadLayout()`: fc over the normed features, input, layer
and output norms) and saves it as ours; "eagle" trains the EAGLE-1/2 layout (`EAGLE1_LAYOUT`:
the target's last hidden state after its final norm, frozen, joined with the embedding by
`in_proj` into a layer without input norm, no output norm; full vocabulary) and saves it as
an EAGLE-1/2 directory other engines load (`drafters/eagle/export.py`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from specdec.drafters.eagle.export import EAGLE1_LAYOUT, write_eagle1
from specdec.drafters.eagle.export_eagle3 import EAGLE_HEAD_REASON
from specdec.drafters.eagle.head import WEIGHTS_FILE, EagleConfig, EagleHead, load_eagle_head
from specdec.models import LlamaForCausalLM
from specdec.train.dense import causal_layer, chain_layer
from specdec.train.init import init_parameters_
from specdec.train.kind import DrafterKind, TrainBatch, TrainOptions, target_logits

STEP_WEIGHT_DECAY = 0.8  # weight of draft step j is 0.8 ** (j - 1), as in EAGLE-3
# `--format`: the layout trained and the directory written ("eagle3": `--export` only).
HEAD_FORMATS = ("specdec", "eagle", "eagle3")


class EagleTrainable(nn.Module):
    """The head being trained and its draft vocabulary ([V_draft] int64 target ids, or None)."""

    def __init__(self, head: EagleHead, draft_to_target: torch.Tensor | None) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("draft_to_target", draft_to_target, persistent=False)


def pick_draft_vocab(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent ids (ties by id), always including `always`; sorted ascending."""
    order = sorted(range(counts.shape[0]), key=lambda i: (-int(counts[i]), i))
    chosen = list(dict.fromkeys([*always, *order]))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.int64)


@torch.no_grad()
def widen_head_(head: EagleHead, source: EagleHead) -> None:
    """Copies `source`'s parameters into `head`, whose MLP may be wider (same function).

    Every parameter of the same shape is copied. A wider MLP (intermediate I' > I) takes the
    source's gate/up rows and down columns in its first I units; its new units keep `head`'s
    initialisation in gate/up and get zero down columns, so the widened head computes exactly
    what the source computes until training moves them (function-preserving widening, as in
    Net2Net, Chen et al. 2016).

    Raises:
        ValueError: a parameter missing, or of a shape that is neither equal nor a widening.
    Mutates: `head`'s parameters.
    """
    given = dict(source.named_parameters())
    for name, param in head.named_parameters():
        if name not in given:
            raise ValueError(f"init_from: the given head has no {name}")
        old = given[name].to(param.dtype)
        if old.shape == param.shape:
            param.copy_(old)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")) and (
            old.shape[1] == param.shape[1] and old.shape[0] < param.shape[0]
        ):
            param[: old.shape[0]].copy_(old)
        elif name.endswith("down_proj.weight") and (
            old.shape[0] == param.shape[0] and old.shape[1] < param.shape[1]
        ):
            param[:, : old.shape[1]].copy_(old)
            param[:, old.shape[1] :].zero_()
        else:
            raise ValueError(
                f"init_from: {name} is {tuple(old.shape)} in the given head and "
                f"{tuple(param.shape)} here (only the MLP may be widened)"
            )


class EagleKind(DrafterKind):
    name = "eagle"
    option_names = frozenset(
        {
            "feature_layers",
            "draft_vocab_size",
            "ttt_steps",
            "intermediate_size",
            "save_dtype",
            "init_from",
            "format",
        }
    )

    def __init__(self) -> None:
        self._draft_to_target: torch.Tensor | None = None
        self._source: EagleHead | None = None

    def feature_layers(self, target: LlamaForCausalLM, options: TrainOptions) -> tuple[int, ...]:
        text = options.get("feature_layers", "")
        if not text:
            start = _init_config(options)
            if start is not None:
                return tuple(start.feature_layers)
            return (target.config.num_hidden_layers - 1,)
        return tuple(int(part) for part in text.split(","))

    def prepare(self, target: LlamaForCausalLM, token_counts: torch.Tensor, options) -> None:
        size = options.get("draft_vocab_size", 0, int)
        vocab = target.config.vocab_size
        self._source = None
        init_from = options.get("init_from", "")
        if init_from:
            self._source, rows = self._start_from(init_from, target, options)
            self._draft_to_target = rows
            return
        if not 0 < size < vocab:
            self._draft_to_target = None
            return
        always = [i for i in (target.config.bos_token_id, *target.config.eos_token_ids) if i]
        self._draft_to_target = pick_draft_vocab(token_counts, size, always)

    def build(self, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        config = self._config(target, options, self._draft_to_target)
        head = EagleHead(config).to(target.model.embed_tokens.weight.device)
        init_parameters_(head, options.seed, residual_scale=0.5)
        with torch.no_grad():  # each feature part starts normalised as the target's LM head reads
            final_norm = target.model.norm.weight.detach().float()
            head.feature_norm.weight.copy_(final_norm.repeat(len(config.feature_layers)))
        if _format(options) == "eagle":  # EAGLE-1/2 read the target's final norm as it is
            head.feature_norm.weight.requires_grad_(False)
            head.feature_norm.eps = target.model.norm.eps
        if self._source is not None:
            widen_head_(head, self._source)
            self._source = None
        rows = self._draft_to_target
        return EagleTrainable(head, None if rows is None else rows.to(head.in_proj.weight.device))

    def _start_from(self, init_from: str, target: LlamaForCausalLM, options: TrainOptions):
        """The head in `init_from` (float32, on the target's device) and its draft vocabulary,
        after checking that the options do not ask for another vocabulary or other features."""
        device = target.model.embed_tokens.weight.device
        source, rows = load_eagle_head(init_from, target.config, torch.float32, device)
        kept = source.config
        size = options.get("draft_vocab_size", None, int)
        have = kept.draft_vocab_size or 0
        if size is not None and size != have:
            raise ValueError(
                f"init_from: the head in {init_from} drafts over "
                f"{f'{have} tokens' if have else 'the full vocabulary'} "
                f"(draft_vocab_size={have}), not draft_vocab_size={size}"
            )
        if self.feature_layers(target, options) != tuple(kept.feature_layers):
            raise ValueError(
                f"init_from: the head in {init_from} reads feature_layers "
                f"{','.join(map(str, kept.feature_layers))}, not "
                f"{','.join(map(str, self.feature_layers(target, options)))}"
            )
        return source, rows

    def _config(self, target, options, draft_to_target) -> EagleConfig:
        start = _init_config(options)
        intermediate = options.get("intermediate_size", 0, int)
        if not intermediate and start is not None:
            intermediate = start.intermediate_size
        config = EagleConfig.for_target(
            target.config,
            feature_layers=self.feature_layers(target, options),
            draft_vocab_size=None if draft_to_target is None else int(draft_to_target.shape[0]),
            intermediate_size=intermediate or None,
        )
        if _format(options) == "specdec":
            return config
        last = target.config.num_hidden_layers - 1
        refusals = [
            f"{name} ({why})"
            for name, wrong, why in (
                ("init_from", start is not None, "it starts from a head of ours"),
                (
                    "draft_vocab_size",
                    config.draft_vocab_size is not None,
                    "EAGLE-1/2 draft over the whole vocabulary",
                ),
                (
                    "feature_layers",
                    config.feature_layers != (last,),
                    f"EAGLE-1/2 read the target's last layer, {last}, only",
                ),
            )
            if wrong
        ]
        if refusals:
            raise ValueError(f"format=eagle does not take: {'; '.join(refusals)}")
        return dataclasses.replace(config, layout=EAGLE1_LAYOUT)

    def loss(
        self, draft: nn.Module, target: LlamaForCausalLM, batch: TrainBatch, options: TrainOptions
    ) -> tuple[torch.Tensor, dict[str, float]]:
        head: EagleHead = draft.head
        rows = draft.draft_to_target
        steps = options.get("ttt_steps", 3, int)
        device = head.in_proj.weight.device
        tokens = batch.token_ids.to(device)
        length = tokens.shape[1]
        entries = length - 1
        with torch.no_grad():
            labels = target_logits(target, batch.last_hidden.to(device), rows).softmax(-1)
            embeds = target.model.embed_tokens(tokens)  # [B, T, D]
        lm_weight = _lm_weight(target, rows)
        mask = batch.loss_mask.to(device)
        positions = torch.arange(entries, device=device)  # entry t
        hidden = head.project_features(batch.features[:, :entries].to(device))
        prefix = None
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        total = torch.zeros((), device=device)
        figures: dict[str, float] = {}
        for step in range(1, steps + 1):
            if step >= length:
                break
            # Entry t at draft step j embeds the token at t + j and predicts the one after it.
            emb = _shift(embeds, step, entries)
            cos, sin = head.rotary_emb(positions + step)
            x = head.layer_input(hidden, emb)
            if prefix is None:
                out, prefix = causal_layer(head.layer, x, cos, sin)
            else:
                out, kv = chain_layer(head.layer, x, cos, sin, prefix, chain)
                chain.append(kv)
            normed = out if head.norm is None else head.norm(out)
            logits = torch.nn.functional.linear(normed, lm_weight).float()
            step_labels = _shift(labels, step, entries)
            step_mask = _shift(mask, step, entries)
            ce = -(step_labels * logits.log_softmax(-1)).sum(-1)  # [B, N]
            count = step_mask.sum().clamp_min(1)
            step_loss = (ce * step_mask).sum() / count
            total = total + STEP_WEIGHT_DECAY ** (step - 1) * step_loss
            agree = (logits.argmax(-1) == step_labels.argmax(-1)) & step_mask
            figures[f"acc{step}"] = float(agree.sum() / count)
            hidden = out
        return total, figures

    def save(
        self, draft: nn.Module, target: LlamaForCausalLM, out_dir: Path, options: TrainOptions
    ) -> None:
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        rows = draft.draft_to_target
        config = self._config(target, options, rows)
        dtype = getattr(torch, options.get("save_dtype", "float16"))
        if _format(options) == "eagle":
            write_eagle1(draft.head, rows, target, out_dir, dtype)
            return
        tensors = {
            name: t.detach().to("cpu", dtype).contiguous()
            for name, t in draft.head.state_dict().items()
        }
        if rows is not None:
            tensors["draft_to_target"] = rows.to("cpu", torch.int64).contiguous()
        save_file(tensors, str(out_dir / WEIGHTS_FILE))
        (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")

    def load(self, out_dir: Path, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        from specdec.drafters.eagle.public import load_head

        device = target.model.embed_tokens.weight.device
        head, rows = load_head(out_dir, target, torch.float32, device)
        head.requires_grad_(True)
        if _format(options) == "eagle":
            head.feature_norm.weight.requires_grad_(False)
        head.train()
        self._draft_to_target = rows
        return EagleTrainable(head, rows)


def _format(options: TrainOptions) -> str:
    """The `format` option (default "specdec"), checked."""
    value = options.get("format", "specdec")
    if value not in HEAD_FORMATS:
        raise ValueError(f"format={value!r}: one of {list(HEAD_FORMATS)}")
    if value == "eagle3":
        raise ValueError(
            f"format=eagle3 is not trained here: {EAGLE_HEAD_REASON} "
            "(`--export SRC --format eagle3` rewrites an EAGLE-3 checkpoint)"
        )
    return value


def _init_config(options: TrainOptions) -> EagleConfig | None:
    """The config of the `init_from` head, or None without that option."""
    init_from = options.get("init_from", "")
    if not init_from:
        return None
    path = Path(init_from) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"init_from: no config.json in {init_from} (not an EAGLE head)")
    return EagleConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))


def _lm_weight(target: LlamaForCausalLM, rows: torch.Tensor | None) -> torch.Tensor:
    weight = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    return weight if rows is None else weight.index_select(0, rows)


def _shift(values: torch.Tensor, step: int, entries: int) -> torch.Tensor:
    """values[:, step : step + entries] zero-padded at the end to `entries` rows."""
    part = values[:, step : step + entries]
    missing = entries - part.shape[1]
    if missing <= 0:
        return part
    pad = torch.zeros(
        (part.shape[0], missing, *part.shape[2:]), dtype=part.dtype, device=part.device
    )
    return torch.cat([part, pad], dim=1)


class MtpKind(EagleKind):
    """`mtp`: the same head (vLLM's name for a one-module multi-token-prediction drafter)."""

    name = "mtp"
