"""Print an image's pinned requirements: what pyproject.toml declares for it, at the lock's versions.

    python docker/requirements.py --lock requirements.lock trainer tpu > requirements.txt
    python docker/requirements.py --lock requirements.lock --dependencies gcp > requirements.txt

Each positional argument names an extra of ``[project.optional-dependencies]``;
``--dependencies`` adds ``[project].dependencies``. Every requirement comes out as
``name[extras]==<locked version>`` for this interpreter (the lock is universal: its markers are
evaluated here, in the image's own Python). A requirement the lock does not pin, or pins at a
version the declaration does not allow, stops the build: run ``make lock`` first.

The Dockerfiles then ``pip install --constraint requirements.lock --requirement`` the output
(the constraint pins the transitive dependencies too) and install the slipway wheel with
``--no-deps``, so an image holds exactly its declared set and never the whole project.
Standard library plus ``packaging`` (pip's vendored copy when it is not installed).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare python image: pip carries its own copy
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

# uv's lock lines: "name==version" optionally followed by " ; marker".
_PIN_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;]+)\s*(?:;\s*(?P<marker>.+))?$"
)


class LockError(RuntimeError):
    """The lock does not pin what pyproject declares: regenerate it."""


def declared(
    pyproject: Mapping[str, object], extras: Iterable[str], dependencies: bool = False
) -> list[Requirement]:
    """The requirements pyproject declares for ``extras`` (+ ``dependencies``), in order."""
    project = pyproject["project"]
    assert isinstance(project, Mapping)
    optional = project.get("optional-dependencies", {})
    assert isinstance(optional, Mapping)
    lines: list[str] = list(project.get("dependencies", [])) if dependencies else []
    for extra in extras:
        if extra not in optional:
            raise KeyError(f"pyproject.toml has no extra {extra!r} (has {', '.join(optional)})")
        lines.extend(optional[extra])
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def locked_versions(lock_text: str, environment: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{canonical name: version}`` from a universal lock, markers evaluated for ``environment``
    (default: this interpreter)."""
    pins: dict[str, str] = {}
    for raw in lock_text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "-")):
            continue
        match = _PIN_RE.match(line)
        if match is None:
            raise LockError(f"unexpected lock line: {raw!r}")
        marker = match["marker"]
        if marker and not Marker(marker).evaluate(dict(environment) if environment else None):
            continue
        pins[canonicalize_name(match["name"])] = match["version"]
    return pins


def pinned(requirements: Iterable[Requirement], pins: Mapping[str, str]) -> list[str]:
    """Each requirement as ``name[extras]==version``, merged by name, in first-seen order."""
    out: dict[str, tuple[set[str], str]] = {}
    for req in requirements:
        name = canonicalize_name(req.name)
        version = pins.get(name)
        if version is None:
            raise LockError(f"{req} is declared but requirements.lock does not pin {name}")
        if not req.specifier.contains(version, prereleases=True):
            raise LockError(f"{req} is declared but requirements.lock pins {name}=={version}")
        extras, _ = out.get(name, (set(), version))
        out[name] = (extras | set(req.extras), version)
    return [
        f"{name}[{','.join(sorted(extras))}]=={version}" if extras else f"{name}=={version}"
        for name, (extras, version) in out.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("extras", nargs="*", help="extras of [project.optional-dependencies]")
    parser.add_argument("--dependencies", action="store_true", help="add [project].dependencies")
    parser.add_argument("--pyproject", default="pyproject.toml", type=Path)
    parser.add_argument("--lock", default="requirements.lock", type=Path)
    args = parser.parse_args(argv)
    if not args.extras and not args.dependencies:
        parser.error("name at least one extra, or --dependencies")
    pyproject = tomllib.loads(args.pyproject.read_text())
    try:
        reqs = declared(pyproject, args.extras, args.dependencies)
        lines = pinned(reqs, locked_versions(args.lock.read_text()))
    except KeyError as err:
        print(f"docker/requirements.py: {err.args[0]}", file=sys.stderr)
        return 2
    except LockError as err:
        print(f"docker/requirements.py: {err}; regenerate the lock (make lock)", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
