"""Stage configs from JSON: one check for every stage, on the command line and in the DAG.

Each stage's config is a frozen dataclass in its module (:data:`STAGE_CONFIGS`). A JSON object
becomes one through :func:`build_config`, which refuses unknown keys and values of the wrong
type (by the dataclass's annotations: ``int``, ``float``, ``bool``, ``str``, ``X | None``,
tuples, mappings, nested config dataclasses), then lets the dataclass's ``__post_init__``
check ranges. Every error names the field. The stage harness (``--config``) and the DAG's
``validate`` task both call it, so a typo in a stage config fails before any data is read.

Importing this module imports no Beam; :func:`config_type` imports the stage's module.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")

# stage name -> "module:ConfigClass"
STAGE_CONFIGS = {
    "ingest": "pipelines.ingest:IngestConfig",
    "quality": "pipelines.quality:QualityConfig",
    "exact_dedup": "pipelines.exact_dedup:ExactDedupConfig",
    "fuzzy_dedup": "pipelines.fuzzy_dedup:FuzzyDedupConfig",
    "decontaminate": "pipelines.decontaminate:DecontaminateConfig",
    "train_tokenizer": "pipelines.train_tokenizer:TrainTokenizerConfig",
    "tokenize": "pipelines.tokenize:TokenizeConfig",
}


class ConfigError(ValueError):
    """A stage config that cannot be built; ``field`` names the offending key ('' for all)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def config_type(stage: str) -> type:
    """The config dataclass of ``stage`` (imports the stage module, and with it Beam)."""
    if stage not in STAGE_CONFIGS:
        raise ConfigError(f"unknown stage {stage!r} (known: {', '.join(STAGE_CONFIGS)})")
    module, _, name = STAGE_CONFIGS[stage].partition(":")
    return getattr(importlib.import_module(module), name)


def _describe(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        nullable = type(None) in typing.get_args(tp)
        return " or ".join(parts) + (" or null" if nullable else "")
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        return "a list"
    if origin in (dict, Mapping) or tp in (dict, Mapping) or dataclasses.is_dataclass(tp):
        return "an object"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return str(tp)


def _fits(tp: Any, value: Any) -> bool:
    """Whether a JSON value fits an annotation (unknown annotations: left to the dataclass)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if tp is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (tuple, list, Sequence):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            return False
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return not args or all(_fits(args[0], v) for v in value)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping | tp)
    return True


def build_config(config_type: type[ConfigT], values: Any) -> ConfigT:
    """``config_type(**values)``, after refusing unknown keys and mistyped values by name."""
    name = config_type.__name__
    if not isinstance(values, Mapping):
        raise ConfigError(f"{name}: the config must be a JSON object, not {values!r}")
    fields = {f.name: f for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config field(s) for {name}: {', '.join(unknown)}"
            f" (known: {', '.join(sorted(fields))})",
            unknown[0],
        )
    hints = typing.get_type_hints(config_type)
    for key, value in values.items():
        if not _fits(hints[key], value):
            raise ConfigError(
                f"{key}: expected {_describe(hints[key])}, got {value!r} ({name})", key
            )
    try:
        return config_type(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid {name}: {err}") from None


def check_stage_configs(configs: Mapping[str, Any]) -> list[str]:
    """Every problem of a DAG run's ``stage_configs``, as ``stage_configs.<stage>: why``."""
    problems = []
    for stage, values in configs.items():
        try:
            build_config(config_type(stage), values)
        except ConfigError as exc:
            problems.append(f"stage_configs.{stage}: {exc}")
    return problems
