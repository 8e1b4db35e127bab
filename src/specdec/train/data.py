"""Training data for drafters: sequences annotated with the target's hidden features.

Two sources: a text corpus (files cut into chunks) and chat prompts (self-distillation: the
target's own answers, decoded by the plain engine). Both become token lists first (small: kept
and pooled between runs), then run through the target in batched prefills that keep the hidden
features of the chosen layers, in float16. Generation noise comes from the engine's keyed
sampler (request seeds), so the set is a pure function of the corpus, the target and the
training seed.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models import LlamaForCausalLM, Tokenizer
from specdec.runner.model_runner import PagedModelRunner, StepInput
from specdec.train.kind import TrainBatch

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")


@dataclass(slots=True)
class AnnotatedSequence:
    """Attributes:
    token_ids: [T] int64.
    layers: [T, num_layers, D] float16 outputs of the set's layers for each token.
    loss_mask: [T] bool, True where the next-token distribution at t is a label.
    prompt_len: tokens of the prompt (the held-out evaluation prompts with these).
    """

    token_ids: torch.Tensor
    layers: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: int


@dataclass(slots=True)
class TrainingSet:
    """Annotated sequences; `layers[i]` is the target layer stored at index i of each sequence."""

    layers: tuple[int, ...]
    sequences: list[AnnotatedSequence]

    @property
    def num_tokens(self) -> int:
        return sum(int(s.token_ids.shape[0]) for s in self.sequences)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "layers": list(self.layers),
                "token_ids": [s.token_ids for s in self.sequences],
                "hidden": [s.layers for s in self.sequences],
                "loss_mask": [s.loss_mask for s in self.sequences],
                "prompt_len": [s.prompt_len for s in self.sequences],
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> TrainingSet:
        data = torch.load(path, weights_only=True)
        sequences = [
            AnnotatedSequence(t, h, m, int(p))
            for t, h, m, p in zip(
                data["token_ids"],
                data["hidden"],
                data["loss_mask"],
                data["prompt_len"],
                strict=True,
            )
        ]
        return cls(tuple(data["layers"]), sequences)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """[V] int64 occurrences of each token id where a label is taken."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for seq in self.sequences:
            counts += torch.bincount(seq.token_ids.cpu(), minlength=vocab_size)
        return counts

    def to(self, device: torch.device) -> TrainingSet:
        """The same set with every tensor on `device` (batches are then built there)."""
        moved = [
            AnnotatedSequence(
                s.token_ids.to(device), s.layers.to(device), s.loss_mask.to(device), s.prompt_len
            )
            for s in self.sequences
        ]
        return TrainingSet(self.layers, moved)

    def split(self, holdout_fraction: float) -> tuple[TrainingSet, TrainingSet]:
        """(train, held-out): every round(1 / fraction)-th sequence is held out, and at least
        one whenever there are two sequences or more (a small corpus still gets its held-out
        evaluation); with one sequence, or a fraction of 0, nothing is."""
        if holdout_fraction <= 0:
            return self, TrainingSet(self.layers, [])
        every = max(2, min(round(1 / holdout_fraction), len(self.sequences)))
        held = [s for i, s in enumerate(self.sequences) if i % every == every - 1]
        kept = [s for i, s in enumerate(self.sequences) if i % every != every - 1]
        return TrainingSet(self.layers, kept), TrainingSet(self.layers, held)

    def chunks(self, seq_len: int) -> list[tuple[int, int]]:
        """(sequence index, start) windows of at most seq_len tokens covering every label."""
        windows = []
        for index, seq in enumerate(self.sequences):
            length = int(seq.token_ids.shape[0])
            start = 0
            while start < length - 1:
                windows.append((index, start))
                start += seq_len - 1  # windows overlap by one token so no label is lost
        return windows

    def batch(
        self, windows: list[tuple[int, int]], seq_len: int, feature_layers: tuple[int, ...]
    ) -> TrainBatch:
        """Right-padded TrainBatch of the given windows."""
        last = self.layers.index(max(self.layers))
        picks = [self.layers.index(layer) for layer in feature_layers]
        parts = []
        for index, start in windows:
            seq = self.sequences[index]
            end = min(start + seq_len, int(seq.token_ids.shape[0]))
            parts.append(
                (seq.token_ids[start:end], seq.layers[start:end], seq.loss_mask[start:end])
            )
        width = max(p[0].shape[0] for p in parts)
        size, dim = len(parts), parts[0][1].shape[-1]
        device = parts[0][0].device
        token_ids = torch.zeros(size, width, dtype=torch.int64, device=device)
        hidden = torch.zeros(size, width, len(self.layers), dim, device=device)
        mask = torch.zeros(size, width, dtype=torch.bool, device=device)
        for b, (tokens, layers, loss_mask) in enumerate(parts):
            n = tokens.shape[0]
            token_ids[b, :n] = tokens
            hidden[b, :n] = layers.float()
            mask[b, :n] = loss_mask
        features = hidden[:, :, picks].flatten(2) if picks else hidden[:, :, :0].flatten(2)
        return TrainBatch(token_ids, features, hidden[:, :, last], mask)


def read_corpus(path: Path) -> tuple[list[str], list[dict]]:
    """(texts, chat prompts) from a file or directory: `.jsonl` lines give prompts
    ({"prompt": str}, {"messages": [...]} or {"prompt_token_ids": [...]}); text files give
    texts."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    texts, prompts = [], []
    for file in files:
        if file.suffix == ".jsonl":
            for line in file.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    prompts.append(json.loads(line))
        elif file.suffix in TEXT_SUFFIXES:
            texts.append(file.read_text(encoding="utf-8", errors="replace"))
    if not texts and not prompts:
        raise ValueError(f"no training data in {path} (.jsonl prompts or {TEXT_SUFFIXES} files)")
    return texts, prompts


def annotate_token_lists(
    target: LlamaForCausalLM,
    token_lists: list[list[int]],
    layers: tuple[int, ...],
    prompt_lens: list[int] | None = None,
    batch_tokens: int = 4096,
    progress: Callable[[int], None] | None = None,
    keep_on: torch.device | str = "cpu",
) -> list[AnnotatedSequence]:
    """Runs each token list through the target (batched prefills of about `batch_tokens`) and
    keeps the outputs of `layers` per token, on `keep_on`, in float16 (3 layers of a 576-wide
    target: 3.5 KB a token). loss_mask is True from position prompt_len - 1 on (0 when None).

    One runner (one KV cache, sized for the largest prefill) serves every prefill, on the eager
    path: a prefill from position 0 writes every slot it reads, so nothing carries over. Each
    kept tensor owns its storage (a copy, never a view of the prefill's features)."""
    block_size = 16
    groups, index = [], 0
    while index < len(token_lists):
        end = index + 1
        total = len(token_lists[index])
        while end < len(token_lists) and total + len(token_lists[end]) <= batch_tokens:
            total += len(token_lists[end])
            end += 1
        groups.append((index, end))
        index = end
    if not groups:
        return []
    runner = PagedModelRunner(
        target,
        max(sum(-(-len(t) // block_size) for t in token_lists[a:b]) for a, b in groups),
        block_size,
        max_num_seqs=max(b - a for a, b in groups),
        decode_path=False,  # prefills only: no fused weights, static buffers or graphs
    )
    out: list[AnnotatedSequence] = []
    for first, end in groups:
        group = token_lists[first:end]
        inputs, next_block = [], 0
        for tokens in group:
            count = -(-len(tokens) // block_size)
            inputs.append(StepInput(tokens, 0, list(range(next_block, next_block + count)), 1))
            next_block += count
        logits, features = runner.run_with_features(inputs, layers)
        del logits
        for offset, (tokens, rows) in enumerate(zip(group, features, strict=True)):
            prompt_len = prompt_lens[first + offset] if prompt_lens is not None else 0
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[max(prompt_len - 1, 0) :] = True
            out.append(
                AnnotatedSequence(
                    torch.tensor(tokens, dtype=torch.int64, device=keep_on),
                    # copy=True: a float16 target's features on `keep_on` would otherwise be
                    # kept as views that pin the whole prefill's [T, F] tensor.
                    rows.view(len(tokens), len(layers), -1).to(keep_on, torch.float16, copy=True),
                    mask.to(keep_on),
                    prompt_len,
                )
            )
        del features, rows
        if progress is not None:
            progress(sum(map(len, group)))
    return out


def text_token_lists(tokenizer: Tokenizer, texts: list[str], seq_len: int, max_tokens: int):
    """Token chunks of seq_len tokens from the texts (in order), up to max_tokens in all."""
    chunks, total = [], 0
    for text in texts:
        ids = tokenizer.encode(text)
        for start in range(0, len(ids) - 1, seq_len):
            chunk = ids[start : start + seq_len]
            if len(chunk) < 8:
                continue
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_tokens:
                return chunks
    return chunks


def generate_answers(
    target: LlamaForCausalLM,
    tokenizer: Tokenizer | None,
    prompts: list[dict],
    *,
    max_tokens: int,
    temperatures: tuple[float, ...],
    seed: int,
    repeats: int = 1,
    max_num_seqs: int = 32,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[list[int], int]]:
    """(prompt + answer tokens, prompt length) of the target's own answers to `prompts`, prompt
    by prompt: answer r of prompt i at temperatures[(i + r) % len], seed + r * len(prompts) + i.
    Decoded by the plain engine (overlapped steps, CUDA graphs on the GPU); features are added
    afterwards by batched prefills (`annotate_token_lists`), so generation runs at plain
    decoding's speed and the generated set is small enough to keep and pool."""
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.sampling import SamplingParams

    config = EngineConfig(
        device=str(target.model.embed_tokens.weight.device.type),
        max_num_seqs=max_num_seqs,
        max_model_len=min(target.config.max_position_embeddings, 2048),
    )
    engine = LLMEngine(config, None, model=target, tokenizer=tokenizer)
    requests = []
    for i, prompt in enumerate(prompts):
        ids = (
            list(prompt["prompt_token_ids"])
            if "prompt_token_ids" in prompt
            else tokenizer.encode_chat(prompt["messages"])
            if "messages" in prompt
            else tokenizer.encode_chat([{"role": "user", "content": prompt["prompt"]}])
            if tokenizer.chat_template
            else tokenizer.encode(prompt["prompt"])
        )
        for r in range(repeats):
            params = SamplingParams(
                temperature=temperatures[(i + r) % len(temperatures)],
                max_tokens=max_tokens,
                seed=seed + r * len(prompts) + i,
            )
            requests.append((f"p{i}" if r == 0 else f"p{i}r{r}", ids, params))
    # In waves of max_num_seqs requests, none waiting: a request that finishes then costs the
    # overlapped loop one bubble, where admitting a waiting one costs a synchronous step with
    # its prefill, and with hundreds of short answers in flight one finishes almost every step.
    answers = {}
    for first in range(0, len(requests), max_num_seqs):
        for request_id, ids, params in requests[first : first + max_num_seqs]:
            engine.add_request(ids, params, request_id=request_id)
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    answers[out.request_id] = out.outputs[0].token_ids
                    if progress is not None:
                        progress(len(out.prompt_token_ids) + len(out.outputs[0].token_ids))
    # The engine's KV cache fills the free GPU memory (gpu_memory_utilization), and the engine
    # sits in reference cycles: collect it now, before the caller allocates anything.
    engine.close()
    del engine
    gc.collect()
    if config.device == "cuda":
        torch.cuda.empty_cache()
    return [(ids + list(answers[rid]), len(ids)) for rid, ids, _ in requests]
