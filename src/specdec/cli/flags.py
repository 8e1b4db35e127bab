"""Command-line flags derived from the config dataclasses (`EngineConfig`, `SamplingParams`,
`ServerConfig`, the training configs; defaults live there only) by one helper, and the commands'
default speculation. Each field becomes `--field-name` with the dataclass default;
`--speculative-config` takes vLLM's JSON. Parsing only: builds configs, never runs anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from typing import Any

from specdec.drafters.default import default_speculative_config
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.sampling import SamplingParams

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")


def _flag_type(annotation: Any) -> Any:
    """The argparse type of a dataclass field annotation (`int | None` -> int, ...)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing})  # annotations are postponed strings
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _flag_type(args[0]) if len(args) == 1 else str
    return annotation


def add_config_flags(
    group, cls, names: Sequence[str] | None = None, defaults: dict[str, Any] | None = None
) -> None:
    """Adds `--field-name` for each field of dataclass `cls` (only `names` when given) to an
    argparse parser or group, with the field's type and default (or `defaults[name]`): the one
    way the commands derive their flags from the config classes. Booleans become switches."""
    defaults = defaults or {}
    for field in dataclasses.fields(cls):
        if names is not None and field.name not in names:
            continue
        kind = _flag_type(field.type)
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, field.default)
        if kind is bool:
            group.add_argument(flag, action="store_true", help=f"(default: {default})")
        elif kind in (int, float, str):
            group.add_argument(flag, type=kind, default=default, help=f"(default: {default})")
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag for a field of type {kind}")


def config_values(args: argparse.Namespace, cls, names: Sequence[str] | None = None) -> dict:
    """The parsed values of the flags `add_config_flags` added for `cls` (only `names`)."""
    fields = [f.name for f in dataclasses.fields(cls) if names is None or f.name in names]
    return {name: getattr(args, name) for name in fields}


ENGINE_FLAGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the engine's flags and --speculative-config / --no-spec to `parser`."""
    group = parser.add_argument_group("engine")
    add_config_flags(group, EngineConfig, ENGINE_FLAGS)
    group.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='vLLM-style JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Adds the sampling flags; `defaults` overrides SamplingParams' defaults for this command."""
    group = parser.add_argument_group("sampling")
    add_config_flags(group, SamplingParams, SAMPLING_FLAGS, defaults)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed flags (model excluded)."""
    return config_values(args, EngineConfig, ENGINE_FLAGS)


def speculative_config(args: argparse.Namespace, default: dict | None) -> SpeculativeConfig | None:
    """The --speculative-config JSON, or `default` when the flag is absent."""
    values = args.speculative_config if args.speculative_config is not None else default
    return SpeculativeConfig.from_dict(values)


def sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    values = config_values(args, SamplingParams, SAMPLING_FLAGS)
    values.update(overrides)
    return SamplingParams(**values)


# The speculation `generate` and `bench` use when --speculative-config is not given: the shipped
# EAGLE head for the built-in model (`default_spec`), prompt lookup for any other model.
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


def default_spec(model: str | None) -> dict:
    """The default speculation of `generate` and `bench` for `model` (None: the built-in one):
    the library's default (`default_speculative_config`), else prompt lookup."""
    return default_speculative_config(model) or DEFAULT_SPECULATIVE_CONFIG
