"""Command-line flags derived from `EngineConfig` and `SamplingParams` (defaults live there only).

Each field becomes `--field-name` with the dataclass default; `--speculative-config` takes vLLM's
JSON. Parsing only: builds configs, never runs anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

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


def _add_fields(group, cls, names=None, overrides=None) -> None:
    overrides = overrides or {}
    for field in dataclasses.fields(cls):
        if names is not None and field.name not in names:
            continue
        if field.name == "model":
            continue
        kind = _flag_type(field.type)
        flag = "--" + field.name.replace("_", "-")
        default = overrides.get(field.name, field.default)
        if kind is bool:
            group.add_argument(flag, action="store_true", help=f"(default: {default})")
        elif kind in (int, float, str):
            group.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the engine's flags and --speculative-config / --no-spec to `parser`."""
    group = parser.add_argument_group("engine")
    _add_fields(group, EngineConfig)
    group.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='vLLM-style JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Adds the sampling flags; `defaults` overrides SamplingParams' defaults for this command."""
    group = parser.add_argument_group("sampling")
    _add_fields(group, SamplingParams, SAMPLING_FLAGS, defaults)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed flags (model excluded)."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    return {name: getattr(args, name) for name in names}


def speculative_config(args: argparse.Namespace, default: dict | None) -> SpeculativeConfig | None:
    """The --speculative-config JSON, or `default` when the flag is absent."""
    values = args.speculative_config if args.speculative_config is not None else default
    return SpeculativeConfig.from_dict(values)


def sampling_params(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    values = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    values.update(overrides)
    return SamplingParams(**values)


# The speculation `generate` and `bench` use when --speculative-config is not given: the shipped
# EAGLE head for the built-in model (`default_spec`), prompt lookup for any other model.
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


def default_spec(model: str | None) -> dict:
    """The default speculation of `generate` and `bench` for `model` (None: the built-in one)."""
    if model is None:
        from specdec.drafters.default import default_speculative_config

        shipped = default_speculative_config()
        if shipped is not None:
            return shipped
    return DEFAULT_SPECULATIVE_CONFIG
