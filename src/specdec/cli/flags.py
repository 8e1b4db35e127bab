"""Command-line flags derived from the config dataclasses (`EngineConfig`, `SamplingParams`,
`ServerConfig`, the training configs; defaults live there only) by one helper, and the commands'
default speculation. Each field becomes `--field-name` with the dataclass default, the field's
description from the class docstring's `Attributes:` section and its allowed values from the
field's `choices` metadata; `--speculative-config` takes vLLM's JSON. Parsing only: builds
configs, never runs anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import types
import typing
from collections.abc import Sequence
from typing import Any

from specdec.drafters.default import complete_speculative_config, default_speculative_config
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.sampling import SamplingParams, StructuredOutputsParams

# The sampling flags of `generate` (every SamplingParams field a command line can spell).
SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "n",
    "stop",
    "logprobs",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "bad_words",
)
# At most this many torch CPU threads by default (more only adds OpenMP spin-waiting for the
# small matrices of a decode step).
MAX_DEFAULT_THREADS = 8


def default_threads() -> int:
    """The default of `--threads`: half the CPU cores this process may use, at least 1 and at
    most MAX_DEFAULT_THREADS. OpenMP threads spin-wait for each other, so on a machine whose
    cores are busy a thread per core makes decoding several times slower (measured 4-14x on a
    loaded 2-core machine); half leaves the host thread and the rest of the machine a core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, cores // 2))


def add_threads_flag(
    parser: argparse.ArgumentParser, default: int | None = None, why: str | None = None
) -> None:
    """Adds `--threads N` (torch CPU threads; the main entry point applies it). The default is
    `default_threads()` unless `default` (and `why`, its reason for the help) is given."""
    if default is None:
        default = default_threads()
        why = (
            f"half the usable CPU cores, at most {MAX_DEFAULT_THREADS}: with a thread per core, "
            "OpenMP spin-waiting makes decoding several times slower on a busy machine"
        )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=default,
        metavar="N",
        help=f"torch CPU threads (default: %(default)s, {why})",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# The model's words in the commands' help.
MODEL_HELP = "HF directory or GGUF file (default: the built-in SmolLM2-135M-Instruct)"


def add_model_arguments(parser: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """Adds the model as vLLM names it: an optional positional MODEL and `--model` (give one;
    the parser refuses both with different values: `choose_model`). `positional=False`: the
    flag only (for a command whose positionals are something else)."""
    if positional:
        parser.add_argument("model", nargs="?", default=None, help=f"{MODEL_HELP}; or --model")
    parser.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        default=None,
        help="the same as the positional model (vLLM's `serve` takes both; give one)"
        if positional
        else MODEL_HELP,
    )


def choose_model(args: argparse.Namespace) -> None:
    """Sets `args.model` from the positional model or --model (the parsers call it after
    parsing; a no-op for a command without them).

    Raises:
        ValueError: both given, naming different models.
    """
    if not hasattr(args, "model_flag"):
        return
    flag = args.model_flag
    del args.model_flag
    given = getattr(args, "model", None)
    if given is not None and flag is not None and given != flag:
        raise ValueError(
            f"the model is given twice, as {given!r} and as --model {flag!r}: give it once"
        )
    args.model = given if given is not None else flag


def json_object(text: str) -> dict:
    """argparse type of a JSON object flag: a message that says JSON when it is not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({err.msg} at character {err.pos}): {text!r}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


def field_docs(cls) -> dict[str, str]:
    """Field name -> its description in the `Attributes:` section of `cls`'s docstring (an
    entry "a / b: text" describes both)."""
    doc = inspect.getdoc(cls) or ""
    docs: dict[str, str] = {}
    names: list[str] = []
    inside = False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            break
        entry = re.match(r"^ {4}(\w+(?:\s*/\s*\w+)*):\s*(.*)$", line)
        if entry:
            names = [name.strip() for name in entry.group(1).split("/")]
            for name in names:
                docs[name] = entry.group(2).strip()
        elif line.strip() and names:
            for name in names:
                docs[name] += " " + line.strip()
    return docs


def _flag_type(annotation: Any) -> Any:
    """The argparse type of a dataclass field annotation (`int | None` -> int, `bool | str` ->
    "switch", `list[str] | None` -> "list", ...)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing})  # annotations are postponed strings
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if set(args) == {bool, str}:
            return "switch"
        if any(typing.get_origin(a) is list for a in args):
            return "list"
        return _flag_type(args[0]) if len(args) == 1 else str
    if origin is list:
        return "list"
    return annotation


def _help(doc: str, default: Any, choices: Sequence[Any] | None) -> str:
    text = doc.rstrip(".") if doc else ""
    parts = [text] if text else []
    if choices:
        parts.append("one of " + ", ".join(str(c) for c in choices))
    parts.append(f"default: {default}")
    return "; ".join(parts).replace("%", "%%")


def add_config_flags(
    group, cls, names: Sequence[str] | None = None, defaults: dict[str, Any] | None = None
) -> None:
    """Adds `--field-name` for each field of dataclass `cls` (only `names` when given) to an
    argparse parser or group, with the field's type, default (or `defaults[name]`), description
    and choices: the one way the commands derive their flags from the config classes.
    Booleans become switches (`--no-name` for one on by default); a `bool | str` field (on /
    off / "auto") becomes the switch pair `--name` / `--no-name`; a list field takes one value
    per use of its flag."""
    defaults = defaults or {}
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        if names is not None and field.name not in names:
            continue
        kind = _flag_type(field.type)
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        choices = field.metadata.get("choices")
        help_text = _help(docs.get(field.name, ""), default, choices)
        if kind is bool and default is True:  # on by default: the flag turns it off
            group.add_argument(
                "--no-" + field.name.replace("_", "-"),
                dest=field.name,
                action="store_false",
                help=f"turn off: {help_text}",
            )
        elif kind is bool:
            group.add_argument(flag, action="store_true", help=help_text)
        elif kind == "switch":
            group.add_argument(
                flag,
                dest=field.name,
                action="store_const",
                const=True,
                default=default,
                help=help_text,
            )
            group.add_argument(
                "--no-" + field.name.replace("_", "-"),
                dest=field.name,
                action="store_const",
                const=False,
                help=f"turn {flag} off",
            )
        elif kind == "list":
            group.add_argument(
                flag, action="append", default=None, metavar="TEXT", help=f"{help_text}; repeatable"
            )
        elif kind in (int, float, str):
            group.add_argument(flag, type=kind, default=default, choices=choices, help=help_text)
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag for a field of type {kind}")


def config_values(args: argparse.Namespace, cls, names: Sequence[str] | None = None) -> dict:
    """The parsed values of the flags `add_config_flags` added for `cls` (only `names`)."""
    fields = [f.name for f in dataclasses.fields(cls) if names is None or f.name in names]
    return {name: getattr(args, name) for name in fields}


# EngineConfig fields with a flag of their own: the model is an argument, and `seed` is the
# request's seed on `generate` / `bench` (`serve` adds the engine's --seed).
ENGINE_FLAGS = tuple(
    f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "seed")
)


def add_engine_arguments(parser: argparse.ArgumentParser, *, seed: bool = False) -> None:
    """Adds the engine's flags and --speculative-config to `parser` (with the engine's --seed
    when `seed`)."""
    group = parser.add_argument_group("engine")
    add_config_flags(group, EngineConfig, ENGINE_FLAGS + (("seed",) if seed else ()))
    group.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help='vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\'; keys: ' + _speculative_keys(),
    )


def _speculative_keys() -> str:
    docs = field_docs(SpeculativeConfig)
    return "; ".join(
        f"{f.name} (default {f.default}): {docs.get(f.name, '').split('. ')[0].rstrip('.')}"
        for f in dataclasses.fields(SpeculativeConfig)
    ).replace("%", "%%")


def add_sampling_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Adds the sampling flags; `defaults` overrides SamplingParams' defaults for this command."""
    group = parser.add_argument_group("sampling")
    add_config_flags(group, SamplingParams, SAMPLING_FLAGS, defaults)


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the structured-output flags (at most one): --json-schema FILE, --regex, --grammar
    FILE."""
    group = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="constrain the output to JSON valid under the JSON schema in FILE",
    )
    group.add_argument(
        "--regex", default=None, help="constrain the output to match this regular expression"
    )
    group.add_argument(
        "--grammar",
        metavar="FILE",
        default=None,
        help="constrain the output to the Lark (or GBNF) grammar in FILE",
    )


def structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The constraint of --json-schema / --regex / --grammar (None: none), checked as far as
    it can be without a model: the file is readable, non-empty text, the schema is a JSON
    object, and llguidance compiles the constraint (`constraint_error`).

    Raises:
        FileNotFoundError: no such schema or grammar file.
        ValueError: anything else wrong with the flag, in one line that names it.
    """
    from specdec.sampling.grammar import constraint_error

    if args.regex is not None:
        flag, shown = "--regex", repr(args.regex)
        if not args.regex:
            raise ValueError("--regex '' is empty: it allows no output")
        fields: dict[str, Any] = {"regex": args.regex}
    elif args.json_schema is not None:
        flag, shown = "--json-schema", args.json_schema
        text = _read_constraint_file(flag, args.json_schema)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"--json-schema {shown} is not valid JSON ({err.msg} at line {err.lineno}, "
                f"column {err.colno})"
            ) from None
        if not isinstance(schema, dict):
            raise ValueError(
                f"--json-schema {shown} holds a JSON {type(schema).__name__}, not a JSON schema "
                "(an object {...})"
            )
        fields = {"json": schema}
    elif args.grammar is not None:
        flag, shown = "--grammar", args.grammar
        fields = {"grammar": _read_constraint_file(flag, args.grammar)}
    else:
        return None
    try:
        params = StructuredOutputsParams(**fields)
    except ValueError as err:
        raise ValueError(f"invalid {flag} {shown}: {err}") from None
    reason = constraint_error(params)
    if reason is not None:
        raise ValueError(f"invalid {flag} {shown}: {reason}")
    return params


def _read_constraint_file(flag: str, path: str) -> str:
    """The text of a --json-schema / --grammar file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a file, unreadable, not UTF-8, or empty.
    """
    from pathlib import Path

    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"{flag}: no such file: {path}")
    if not file.is_file():
        raise ValueError(f"{flag} {path} is not a file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path} is not UTF-8 text") from None
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None
    if not text.strip():
        raise ValueError(f"{flag} {path} is empty")
    return text


def engine_kwargs(args: argparse.Namespace, *, seed: bool = False) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed flags (model excluded; the engine's seed
    with `seed`)."""
    return config_values(args, EngineConfig, ENGINE_FLAGS + (("seed",) if seed else ()))


def speculative_config(args: argparse.Namespace, default: dict | None) -> SpeculativeConfig | None:
    """The --speculative-config JSON (keys it leaves out keep the default speculation's values
    when it keeps the default's drafter: `complete_speculative_config`), or `default` when the
    flag is absent."""
    if args.speculative_config is None:
        return SpeculativeConfig.from_dict(default)
    from specdec.engine.setup import resolve_device

    device_type = resolve_device(args.device).type
    values = complete_speculative_config(args.speculative_config, args.model, device_type)
    return SpeculativeConfig.from_dict(values)


def check_before_loading(config: EngineConfig, spec: SpeculativeConfig | None = None) -> None:
    """The checks of an engine's settings that need no model (run before loading one, which
    takes seconds): the device exists, an FP8 KV cache has CUDA, the model path exists, the
    quantization suits the model file, a tensor-parallel size splits the model's heads (read
    from its config alone) on as many GPUs, and the speculation's drafter can be found.

    Raises:
        ValueError: no CUDA device for device="cuda"; kv_cache_dtype fp8 off CUDA; a
            quantization the model file cannot take; a tensor_parallel_size the model or the
            GPUs cannot take; an EAGLE head asked for on a model with none shipped; a
            malformed "truncated:N".
        FileNotFoundError: no such model path (or draft model path; a Hub id is told that
            nothing is downloaded here).
    """
    from pathlib import Path

    from specdec.engine.setup import check_gpu_count, check_kv_cache_dtype, resolve_device
    from specdec.models.loader import missing_model_message, resolve_quantization

    device = resolve_device(config.device)
    check_kv_cache_dtype(config.kv_cache_dtype, device)
    if config.model is not None:
        if not Path(config.model).exists():
            raise FileNotFoundError(missing_model_message(config.model))
        resolve_quantization(config.model, config.quantization, device)
    if config.tensor_parallel_size > 1:
        from specdec.models import default_model_path
        from specdec.models.loader import read_model_config
        from specdec.models.tensor_parallel import check_tensor_parallel_size

        model_config = read_model_config(config.model or default_model_path())
        check_tensor_parallel_size(model_config, config.tensor_parallel_size)
        check_gpu_count(config.tensor_parallel_size, device)
    if spec is not None:
        _check_drafter(spec, config.model)


def _check_drafter(spec: SpeculativeConfig, model: str | None) -> None:
    """Refuses a drafter that cannot load before the target does: an EAGLE head asked for on a
    model with none shipped, a malformed "truncated:N", a draft model path that is not there."""
    from pathlib import Path

    from specdec.drafters.default import with_shipped_head
    from specdec.drafters.draft_model import TRUNCATED_PREFIX
    from specdec.models.loader import missing_model_message
    from specdec.models.registry import is_builtin_model

    spec = with_shipped_head(spec, is_builtin_model(model))
    if not spec.model:
        return
    if spec.method == "draft_model" and spec.model.startswith(TRUNCATED_PREFIX):
        if not spec.model[len(TRUNCATED_PREFIX) :].isdigit():
            raise ValueError(
                f'speculative_config.model "{spec.model}": expected "truncated:<number of layers>"'
            )
    elif not Path(spec.model).exists():
        raise FileNotFoundError(f"speculative_config.model: {missing_model_message(spec.model)}")


def sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    values = config_values(args, SamplingParams, SAMPLING_FLAGS)
    values.update(overrides)
    return SamplingParams(**values)


# The speculation `generate`, `serve` and `bench` use when --speculative-config is not given:
# the shipped EAGLE head for the built-in model (`default_spec`), prompt lookup for any other.
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


def default_spec_help() -> str:
    """The default speculation in words, from its definitions (for the commands' help)."""
    from specdec.drafters.default import DEFAULT_NUM_SPECULATIVE_TOKENS

    ks = ", ".join(f"K={k} on {device}" for device, k in DEFAULT_NUM_SPECULATIVE_TOKENS.items())
    return (
        f"the shipped EAGLE head ({ks}) for the built-in model, {DEFAULT_SPECULATIVE_CONFIG} "
        "for other models"
    )


def default_spec(model: str | None, device: str) -> dict:
    """The default speculation of the commands for `model` (None: the built-in one) on `device`
    (the --device value): the library's default (`default_speculative_config`), else prompt
    lookup."""
    from specdec.engine.setup import resolve_device

    return (
        default_speculative_config(model, resolve_device(device).type) or DEFAULT_SPECULATIVE_CONFIG
    )
