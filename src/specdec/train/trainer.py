"""`specdec train-drafter`: collect target-annotated data, train one drafter kind, checkpoint,
resume, and measure held-out acceptance through the engine.

Output directory: config.json + model.safetensors (what `speculative_config={"method": kind,
"model": DIR}` loads), checkpoint.pt (resume state), train-tokens.pt (the data's token lists:
reused by --resume, and poolable into another run's --data; features are recomputed from them),
acceptance.json (the held-out evaluation). Randomness: weight init and example order come from
`specdec.train.init` (keyed by the training seed); generation noise from the engine.
"""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.models import LlamaForCausalLM, Tokenizer, default_model_path, load_model
from specdec.train.data import (
    TrainingSet,
    annotate_token_lists,
    generate_answers,
    read_corpus,
    text_token_lists,
)
from specdec.train.init import permutation
from specdec.train.kind import DrafterKind, TrainOptions
from specdec.train.registry import get_kind

CHECKPOINT_FILE = "checkpoint.pt"
DATA_FILE = "train-tokens.pt"
ACCEPTANCE_FILE = "acceptance.json"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """One `train-drafter` run.

    Attributes:
        kind: the drafter kind ("eagle", "draft_model", ...).
        data: corpus paths (`.jsonl` chat prompts for self-distillation, text files or folders).
        out: output directory.
        target: the target (HF directory or GGUF file); None = the built-in default model.
        options: optimisation and kind settings.
        resume: continue from out/checkpoint.pt (and reuse out/train-tokens.pt).
        max_text_tokens: tokens taken from text files at most.
        max_prompts: chat prompts taken at most (0 = all).
        gen_max_tokens: answer length when self-distilling from prompts.
        gen_temperatures: answer r of prompt i is at gen_temperatures[(i + r) % len].
        gen_repeats: answers per prompt (each with its own seed).
        gen_batch: requests decoded together when self-distilling (the engine's max_num_seqs).
        holdout_fraction: share of sequences held out for evaluation.
        eval_prompts: held-out prompts the acceptance evaluation runs (0 = skip it).
        eval_max_tokens: tokens generated per evaluation prompt.
        eval_k: drafts per round in the evaluation.
        device: "auto", "cpu" or "cuda".
        time_limit_s: stop training (checkpointing first) after this many seconds of it
            (0 = no limit).
    """

    kind: str
    data: tuple[str, ...]
    out: str
    target: str | None = None
    options: TrainOptions = field(default_factory=TrainOptions)
    resume: bool = False
    max_text_tokens: int = 200_000
    max_prompts: int = 0
    gen_max_tokens: int = 192
    gen_temperatures: tuple[float, ...] = (0.0, 1.0)
    gen_repeats: int = 1
    gen_batch: int = 32
    holdout_fraction: float = 0.05
    eval_prompts: int = 16
    eval_max_tokens: int = 64
    eval_k: int = 4
    device: str = "auto"
    time_limit_s: float = 0.0


def _progress(total: int, desc: str, unit: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True)


def collect_data(
    config: TrainConfig,
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    layers: tuple[int, ...],
    device: torch.device | None = None,
) -> TrainingSet:
    """The corpus as token lists (reused from out/train-tokens.pt on resume; `.pt` token files
    among `config.data` are pooled in), kept in out/train-tokens.pt, then annotated with the
    outputs of `layers` by batched prefills (features kept on `device`, default the CPU)."""
    cache = Path(config.out) / DATA_FILE
    if config.resume and cache.is_file():
        token_lists, prompt_lens = load_token_lists(cache)
    else:
        decoder = target
        if target.model.embed_tokens.weight.is_cuda:
            # On the GPU the answers are decoded in bfloat16, the dtype the GPU engine serves
            # in (several times faster than float32); their features come from `target`.
            path = config.target or str(default_model_path())
            decoder = load_model(path, dtype=torch.bfloat16, device="cuda").model
        token_lists, prompt_lens = gather_token_lists(config, decoder, tokenizer)
        del decoder  # (the bfloat16 copy; `generate_answers` already freed its engine)
        save_token_lists(cache, token_lists, prompt_lens)
    if target.model.embed_tokens.weight.is_cuda:
        gc.collect()
        torch.cuda.empty_cache()
    keep_on = device if device is not None else torch.device("cpu")
    bar = _progress(sum(map(len, token_lists)), "annotating", "tok")
    sequences = annotate_token_lists(
        target,
        token_lists,
        layers,
        prompt_lens,
        batch_tokens=16384 if keep_on.type == "cuda" else 4096,
        progress=lambda n: bar.update(n),
        keep_on=keep_on,
    )
    bar.close()
    return TrainingSet(layers, sequences)


def gather_token_lists(
    config: TrainConfig, target: LlamaForCausalLM, tokenizer: Tokenizer
) -> tuple[list[list[int]], list[int]]:
    """(token lists, prompt lengths) of the corpus: pooled `.pt` token files, the target's
    answers to the chat prompts, text chunks (prompt length 0)."""
    texts, prompts = [], []
    token_lists: list[list[int]] = []
    prompt_lens: list[int] = []
    for path in config.data:
        if Path(path).suffix == ".pt":
            more_lists, more_lens = load_token_lists(Path(path))
            token_lists += more_lists
            prompt_lens += more_lens
            continue
        more_texts, more_prompts = read_corpus(Path(path))
        texts += more_texts
        prompts += more_prompts
    if config.max_prompts:
        prompts = prompts[: config.max_prompts]
    if prompts:
        total = len(prompts) * config.gen_repeats * config.gen_max_tokens
        bar = _progress(total, "self-distilling", "tok")
        answers = generate_answers(
            target,
            tokenizer,
            prompts,
            max_tokens=config.gen_max_tokens,
            temperatures=config.gen_temperatures,
            seed=config.options.seed,
            repeats=config.gen_repeats,
            max_num_seqs=config.gen_batch,
            progress=lambda n: bar.update(n),
        )
        bar.close()
        token_lists += [tokens for tokens, _ in answers]
        prompt_lens += [n for _, n in answers]
    if texts:
        chunks = text_token_lists(tokenizer, texts, config.options.seq_len, config.max_text_tokens)
        token_lists += chunks
        prompt_lens += [0] * len(chunks)
    return token_lists, prompt_lens


def save_token_lists(path: Path, token_lists: list[list[int]], prompt_lens: list[int]) -> None:
    """One int32 tensor of every token and the lengths: 4 bytes a token."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int32)
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)
    torch.save({"tokens": flat, "lengths": lengths, "prompt_lens": prompt_lens}, path)


def load_token_lists(path: Path) -> tuple[list[list[int]], list[int]]:
    try:
        data = torch.load(path, weights_only=True)
        flat, lengths, prompt_lens = data["tokens"], data["lengths"], data["prompt_lens"]
    except Exception as error:  # any unreadable file gets the same message
        raise ValueError(f"{path}: not a token file written by train-drafter ({error})") from None
    token_lists = [part.tolist() for part in flat.split(lengths.tolist())]
    return token_lists, [int(n) for n in prompt_lens]


def learning_rate(step: int, options: TrainOptions) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    span = max(options.max_steps - options.warmup_steps, 1)
    progress = min((step - options.warmup_steps) / span, 1.0)
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_drafter(config: TrainConfig, log=print) -> dict:
    """Runs the whole training; returns the acceptance evaluation (also in acceptance.json)."""
    from specdec.engine.setup import resolve_device

    kind = get_kind(config.kind)
    options = config.options
    kind.check_options(options)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(config.device)
    target_path = config.target or str(default_model_path())
    target, _, tokenizer = load_model(target_path, dtype=torch.float32, device=device)
    feature_layers = kind.feature_layers(target, options)
    layers = tuple(sorted({*feature_layers, target.config.num_hidden_layers - 1}))
    data = collect_data(config, target, tokenizer, layers, device)
    train_set, held_out = data.split(config.holdout_fraction)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda":
        # The whole set lives on the GPU (float16): batches are gathered there, not on the host;
        # matrix products of the float32 draft run in TF32 while training.
        train_set = train_set.to(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    log(
        f"data: {len(train_set.sequences)} training sequences ({train_set.num_tokens} tokens), "
        f"{len(held_out.sequences)} held out"
    )
    if not held_out.sequences:
        why = (
            "--holdout-fraction is 0"
            if config.holdout_fraction <= 0
            else f"the data has {len(data.sequences)} sequence(s), too few to hold one out"
        )
        log(
            f"WARNING: nothing is held out ({why}): no held-out loss and no acceptance "
            "evaluation will be reported; give more prompts or text to get them"
        )
    kind.prepare(target, train_set.token_counts(target.config.vocab_size), options)
    draft = kind.build(target, options)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay
    )
    start = 0
    checkpoint = out / CHECKPOINT_FILE
    if config.resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=True)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        log(f"resumed from {checkpoint} at step {start}")
    windows = train_set.chunks(options.seq_len)
    if not windows:
        raise ValueError("no training windows: the data is too short")
    log(
        f"training {kind.name}: {sum(p.numel() for p in params):,} parameters, "
        f"{len(windows)} windows of <= {options.seq_len} tokens"
    )
    bar = _progress(options.max_steps, f"train {kind.name}", "step", initial=start)
    smoothed, tokens_seen, started = None, 0, time.perf_counter()
    draft.train()
    for step in range(start, options.max_steps):
        batch = train_set.batch(
            _windows_of_step(windows, step, options), options.seq_len, feature_layers
        )
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, options)
        loss, figures = kind.loss(draft, target, batch, options)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, options.grad_clip)
        optimizer.step()
        value = float(loss.detach())
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        tokens_seen += batch.num_tokens
        rate = tokens_seen / max(time.perf_counter() - started, 1e-9)
        bar.set_postfix(
            loss=f"{smoothed:.3f}",
            **{k: f"{v:.2f}" for k, v in figures.items()},
            tok_s=f"{rate:.0f}",
        )
        bar.update(1)
        done = step + 1
        out_of_time = 0 < config.time_limit_s < time.perf_counter() - started
        if done % options.checkpoint_every == 0 or done == options.max_steps or out_of_time:
            _save_checkpoint(kind, draft, target, optimizer, done, out, options)
        if out_of_time:
            log(f"time limit reached after {done} steps")
            break
    else:
        done = options.max_steps
    bar.close()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if start >= options.max_steps:
        _save_checkpoint(kind, draft, target, optimizer, start, out, options)
        done = start
    result = {
        "kind": kind.name,
        "steps": done,
        "train_tokens": train_set.num_tokens,
        "options": asdict(options),
    }
    if held_out.sequences:
        result["held_out_loss"] = held_out_loss(
            kind, draft, target, held_out, options, feature_layers
        )
        log(f"held-out loss {result['held_out_loss']:.4f}")
    if config.eval_prompts > 0 and held_out.sequences:
        result["acceptance"] = evaluate_acceptance(
            target_path, target, tokenizer, kind.name, out, held_out, config
        )
        for temperature, figures in result["acceptance"].items():
            log(
                f"held-out acceptance at K={config.eval_k}, temperature {temperature}: mean "
                f"acceptance length {figures['mean_acceptance_length']:.3f}, per position "
                + ", ".join(f"{r:.2f}" for r in figures["acceptance_per_position"])
            )
    (out / ACCEPTANCE_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _windows_of_step(windows, step: int, options: TrainOptions) -> list[tuple[int, int]]:
    """The batch of `step`: consecutive slots of a per-epoch permutation (a pure function of the
    step, so a resumed run sees the same batches)."""
    picked = []
    for slot in range(step * options.batch_size, (step + 1) * options.batch_size):
        epoch, index = divmod(slot, len(windows))
        picked.append(windows[_epoch_order(options.seed, epoch, len(windows))[index]])
    return picked


_ORDER_CACHE: dict[tuple[int, int, int], list[int]] = {}


def _epoch_order(seed: int, epoch: int, count: int) -> list[int]:
    key = (seed, epoch, count)
    if key not in _ORDER_CACHE:
        _ORDER_CACHE.clear()
        _ORDER_CACHE[key] = permutation(seed, epoch, count)
    return _ORDER_CACHE[key]


def _save_checkpoint(kind: DrafterKind, draft, target, optimizer, step, out: Path, options):
    kind.save(draft, target, out, options)
    state = {"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    torch.save(state, out / (CHECKPOINT_FILE + ".tmp"))
    (out / (CHECKPOINT_FILE + ".tmp")).replace(out / CHECKPOINT_FILE)


@torch.no_grad()
def held_out_loss(kind, draft, target, held_out: TrainingSet, options, feature_layers) -> float:
    draft.eval()
    windows = held_out.chunks(options.seq_len)
    total, count = 0.0, 0
    for i in range(0, len(windows), options.batch_size):
        batch = held_out.batch(windows[i : i + options.batch_size], options.seq_len, feature_layers)
        loss, _ = kind.loss(draft, target, batch, options)
        total += float(loss) * batch.num_tokens
        count += batch.num_tokens
    draft.train()
    return total / max(count, 1)


def evaluate_acceptance(
    target_path: str,
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    method: str,
    out: Path,
    held_out: TrainingSet,
    config: TrainConfig,
) -> dict[str, dict]:
    """Mean acceptance length and acceptance per position of the saved drafter at K = eval_k on
    held-out prompts, at temperatures 0 and 1 (standard verification), through the engine."""
    from specdec.engine.config import EngineConfig, SpeculativeConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.sampling import SamplingParams

    prompts = []
    for seq in held_out.sequences[: config.eval_prompts]:
        length = seq.prompt_len or min(32, int(seq.token_ids.shape[0]) // 2)
        prompts.append(seq.token_ids[:length].tolist())
    target.eval()
    results = {}
    for temperature in (0.0, 1.0):
        engine = LLMEngine(
            EngineConfig(
                model=target_path,
                device=target.model.embed_tokens.weight.device.type,
                max_num_seqs=len(prompts),
                max_model_len=min(target.config.max_position_embeddings, 2048),
            ),
            # K pinned: the acceptance reported is at eval_k, every round
            SpeculativeConfig(
                method=method, model=str(out), num_speculative_tokens=config.eval_k, adaptive=False
            ),
            model=target,
            tokenizer=tokenizer,
        )
        for i, prompt in enumerate(prompts):
            params = SamplingParams(
                temperature=temperature,
                max_tokens=config.eval_max_tokens,
                ignore_eos=True,
                seed=config.options.seed + 1_000_000 + i,
            )
            engine.add_request(prompt, params)
        while engine.has_unfinished:
            engine.step()
        stats = engine.stats.as_dict()
        del engine  # its KV cache is freed before the next engine sizes its own
        results[str(temperature)] = {
            "mean_acceptance_length": stats["mean_acceptance_length"],
            "acceptance_per_position": stats["acceptance_per_position"],
            "num_prompts": len(prompts),
            "max_tokens": config.eval_max_tokens,
            "k": config.eval_k,
        }
    return results
