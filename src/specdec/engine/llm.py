"""`LLM`: the offline API in vLLM's shape (`LLM(model, speculative_config=..., **engine_args)`,
`generate`, `chat`). Runs the engine's step loop until every request is done."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specdec.drafters.default import complete_speculative_config, default_speculative_config
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.outputs import RequestOutput
from specdec.engine.setup import resolve_device
from specdec.sampling import SamplingParams

Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """Loads a model once and generates for batches of prompts.

    Example:
        llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
        out = llm.generate(["The capital of France is"], SamplingParams(seed=0, max_tokens=16))
        print(out[0].outputs[0].text, out[0].seed, out[0].spec_decode_stats)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative_config: dict | SpeculativeConfig | str | None = "auto",
        **engine_args: Any,
    ) -> None:
        """Args:
        model: a Hugging Face directory or GGUF file; None = the built-in SmolLM2-135M-Instruct.
        speculative_config: vLLM's keys (method, model, num_speculative_tokens,
            draft_sample_method, rejection_sample_method, prompt_lookup_min/max); None = no
            speculation; "auto" (the default) = the shipped EAGLE head for the built-in model
            (K = 1 on the CPU, 4 on CUDA: `DEFAULT_NUM_SPECULATIVE_TOKENS`), no speculation for
            any other model. A dict that keeps the default's drafter and sets only some keys
            (`{"rejection_sample_method": "block"}`) keeps the default's values for the rest.
        **engine_args: EngineConfig fields (max_num_seqs, max_model_len, dtype, device, seed,
            tensor_parallel_size (1; N splits the target over N processes), ...); unknown
            ones raise ValueError naming them.
        """
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        if isinstance(speculative_config, str):
            if speculative_config != "auto":
                raise ValueError(
                    f'speculative_config must be a dict, None or "auto", got {speculative_config!r}'
                )
            device_type = resolve_device(config.device).type
            speculative_config = default_speculative_config(model, device_type)
        elif isinstance(speculative_config, dict):
            device_type = resolve_device(config.device).type
            speculative_config = complete_speculative_config(speculative_config, model, device_type)
        self.engine = LLMEngine(config, SpeculativeConfig.from_dict(speculative_config))
        if self.engine.tokenizer is None:
            warnings.warn(
                f"{model} has no tokenizer: pass prompts as token ids, "
                'llm.generate({"prompt_token_ids": [1, 2, 3]})',
                stacklevel=2,
            )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's `Tokenizer` (encode, decode, apply_chat_template), as vLLM's LLM has."""
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        speculative: dict | Sequence[dict | None] | None = None,
        use_tqdm: bool = True,
        on_tokens: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in prompt order.

        Args:
            prompts: a string, a list of token ids, {"prompt_token_ids": [...]}, or a list of
                these.
            sampling_params: one for all prompts, or one per prompt.
            speculative: per-request speculation override(s) ({"enabled", "num_speculative_tokens",
                "method"}), one for all or one per prompt.
            use_tqdm: show a progress bar on stderr (finished requests, prompt and output
                tokens/s), as vLLM does.
            on_tokens: called with a RequestOutput each time a request emits tokens (streaming).

        Raises:
            ValueError: invalid prompts or parameters; nothing is queued then.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list), "sampling_params")
        overrides = _per_prompt(speculative, len(prompt_list), "speculative")
        ids = []
        try:
            for prompt, p, override in zip(prompt_list, params, overrides, strict=True):
                ids.append(
                    self.engine.add_request(
                        _prompt_value(prompt), p or SamplingParams(), speculative=override
                    )
                )
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm, on_tokens)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Renders one conversation (a list of {"role", "content"}) or several with the model's
        chat template (or `chat_template`) and generates the assistant's reply.

        Args:
            add_generation_prompt: open an assistant turn after the messages (vLLM's default).
            continue_final_message: continue the last message instead (it then ends the
                prompt); not with add_generation_prompt.
            **kwargs: as `generate` (speculative, use_tqdm, on_tokens).
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.encode_chat(
                    c,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, **kwargs)

    def get_metrics(self) -> dict:
        """Engine-wide spec-decode counters (vLLM's definitions), and which path served the
        steps ("loop": overlapped plain steps, device rounds, rounds replayed from CUDA graphs,
        synchronous steps, the K the policy chose per device round, and the CUDA graphs
        captured and Triton kernel variants compiled after the warm-up, by kernel: 0 and {} on
        a warmed-up engine, None where compiles are not counted)."""
        loop = self.engine.loop_stats.as_dict()
        loop["graphs_after_warm_up"] = self.engine.graphs_after_warm_up
        loop["triton_compiles_after_warm_up"] = self.engine.triton_compiles_after_warm_up
        return {**self.engine.stats.as_dict(), "loop": loop}

    def _run(self, ids, use_tqdm, on_tokens) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished:
                for output in self.engine.step(only_finished=on_tokens is None):
                    if on_tokens is not None:
                        on_tokens(output)
                    if output.finished:
                        results[output.request_id] = output
                        if bar is not None:
                            bar.finished(output)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids if i in results]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of them")
    return list(prompts)


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError('a prompt dict needs "prompt" or "prompt_token_ids"')
    return prompt if isinstance(prompt, str) else list(prompt)


def _per_prompt(value, count: int, name: str) -> list:
    if value is None or isinstance(value, SamplingParams | Mapping):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries for {count} prompts")
    return values


class _ProgressBar:
    """vLLM's bar on stderr: finished requests of the total, with the prompt and output
    tokens/s so far."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, file=sys.stderr)
        self._prompt_tokens = self._output_tokens = 0

    def finished(self, output: RequestOutput) -> None:
        self._prompt_tokens += len(output.prompt_token_ids)
        self._output_tokens += sum(len(sample.token_ids) for sample in output.outputs)
        elapsed = self._bar.format_dict["elapsed"] or 1e-9
        self._bar.set_postfix_str(
            f"est. speed input: {self._prompt_tokens / elapsed:.2f} toks/s, "
            f"output: {self._output_tokens / elapsed:.2f} toks/s",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
