"""Steps and their versions: what a step is, how its version is computed, where it lives.

A :class:`Step` is a name, a *versioned* config, upstream steps and an *unversioned* config.
Its version is the sha256 of canonical JSON over its name, versioned config and upstream
identities (name + version). Unversioned fields (workers, runner...) and the storage root do
not enter the hash, and upstream outputs are referenced symbolically (:func:`output_of`), so the
same pipeline has the same versions on a laptop and on ``gs://``. Its output lives at
``{root}/{name}-{version[:HASH_LEN]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from operators.steps.errors import StepError

HASH_LEN = 8  # hex digits of the version in the output directory name
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*")  # fullmatch


@dataclass(frozen=True)
class OutputRef:
    """A symbolic reference to (a path inside) an upstream step's output.

    It hashes as the upstream's name and version, never as an absolute path, and resolves to
    a real path only against a root (:func:`resolve`).
    """

    step: Step
    subpath: str = ""


def output_of(step: Step, subpath: str = "") -> OutputRef:
    """Reference ``step``'s output directory (or a path below it) inside a config."""
    return OutputRef(step, subpath.strip("/"))


@dataclass(frozen=True, eq=False)
class Step:
    """A unit of work whose output is addressed by its version.

    ``config`` is versioned and may hold :class:`OutputRef` values anywhere (dicts, lists);
    ``deps`` are extra upstream steps that are not referenced from the config; ``unversioned``
    holds execution details that must not change the output (worker count, runner, TPU type).
    Steps compare by identity; two steps with the same :attr:`key` share an output.
    """

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    deps: Sequence[Step] = ()
    unversioned: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"step name {self.name!r}: use letters, digits, '_', '.', '-', '/'")
        # Freeze copies so that mutating the caller's dict cannot change a computed version.
        object.__setattr__(self, "config", _freeze(self.config))
        object.__setattr__(self, "unversioned", _freeze(self.unversioned))
        object.__setattr__(self, "deps", tuple(self.deps))
        # Fail at definition time, not halfway through a run, on non-JSON config values.
        canonical_json(_symbolic(self.config))
        canonical_json(_plain(self.unversioned))

    @property
    def upstream(self) -> tuple[Step, ...]:
        """Direct upstream steps: explicit deps plus every step referenced from the config."""
        seen: dict[int, Step] = {}
        for step in (*self.deps, *(ref.step for ref in _refs(self.config))):
            seen.setdefault(id(step), step)
        return tuple(seen.values())

    @cached_property
    def version(self) -> str:
        # Cached on the instance: config and upstream are frozen, so it cannot go stale.
        return step_version(self)

    @property
    def key(self) -> str:
        """``name-hash``: the output directory name, unique per (name, version)."""
        return f"{self.name}-{self.version[:HASH_LEN]}"


def canonical_json(value: Any) -> str:
    """The one serialization that versions are hashed over: sorted keys, no whitespace."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def step_version(step: Step) -> str:
    """sha256 (hex) of the step's name, versioned config and upstream names + versions.

    The name is hashed too, and upstreams enter as ``name-version``: two steps with equal
    configs but different code (names) must not give their consumers the same version.
    """
    payload = {
        "name": step.name,
        "config": _symbolic(step.config),
        "upstream": sorted(f"{u.name}-{u.version}" for u in step.upstream),
    }
    return hashlib.sha256(canonical_json(payload).encode("utf-8")).hexdigest()


def join(root: str, *parts: str) -> str:
    """Join paths local (``os.path``) or remote (``posixpath``, keeping ``scheme://``)."""
    parts = tuple(p for p in parts if p)
    if "://" in root:
        return posixpath.join(root.rstrip("/") or root, *parts)
    return os.path.join(root, *parts)


def output_path(root: str, step: Step) -> str:
    """Where the step's output lives: ``{root}/{name}-{version[:HASH_LEN]}``."""
    return join(root, step.key)


@dataclass(frozen=True)
class StepSpec:
    """A step bound to a root: what a step function receives.

    ``config`` has every :class:`OutputRef` replaced by the real path, ``upstream`` maps each
    upstream step name to its output path.
    """

    name: str
    version: str
    output_path: str
    config: Mapping[str, Any]
    unversioned: Mapping[str, Any]
    upstream: Mapping[str, str]


def resolve(step: Step, root: str) -> StepSpec:
    return StepSpec(
        name=step.name,
        version=step.version,
        output_path=output_path(root, step),
        config=_resolved(step.config, root),
        unversioned=_plain(step.unversioned),
        upstream={u.name: output_path(root, u) for u in step.upstream},
    )


def topological(steps: Iterable[Step]) -> list[Step]:
    """The steps and all their ancestors, each once (by key), upstream before downstream."""
    order: list[Step] = []
    done: set[str] = set()
    active: set[int] = set()

    def visit(step: Step) -> None:
        if step.key in done:
            return
        if id(step) in active:  # unreachable with frozen steps, but cheap to guard
            raise StepError(f"dependency cycle through {step.name}")
        active.add(id(step))
        for upstream in step.upstream:
            visit(upstream)
        active.discard(id(step))
        done.add(step.key)
        order.append(step)

    for step in steps:
        visit(step)
    return order


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _refs(value: Any) -> Iterator[OutputRef]:
    if isinstance(value, OutputRef):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _refs(v)
    elif isinstance(value, tuple):
        for v in value:
            yield from _refs(v)


def _map(value: Any, on_ref: Callable[[OutputRef], Any]) -> Any:
    if isinstance(value, OutputRef):
        return on_ref(value)
    if isinstance(value, Mapping):
        return {k: _map(v, on_ref) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_map(v, on_ref) for v in value]
    return value


def _symbolic(value: Any) -> Any:
    return _map(
        value,
        lambda ref: {"$output_of": f"{ref.step.name}-{ref.step.version}", "subpath": ref.subpath},
    )


def _resolved(value: Any, root: str) -> Any:
    return _map(value, lambda ref: join(output_path(root, ref.step), ref.subpath))


def _plain(value: Any) -> Any:
    def refuse(ref: OutputRef) -> Any:
        raise TypeError(f"output_of({ref.step.name}) belongs in the versioned config")

    return _map(value, refuse)
