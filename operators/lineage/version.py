"""What code and which container produced an artifact."""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=1)
def code_version() -> str:
    """``SLIPWAY_CODE_VERSION``, else the git commit (``-dirty`` if tracked files changed),
    else ``slipway==<package version>``, else ``unknown``.

    Images carry no ``.git``: their build sets ``SLIPWAY_CODE_VERSION`` to the commit.
    """
    if env := os.environ.get("SLIPWAY_CODE_VERSION"):
        return env
    commit = _git("rev-parse", "HEAD")
    if commit:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return f"{commit}-dirty" if dirty else commit
    try:
        return f"slipway=={metadata.version('slipway')}"
    except metadata.PackageNotFoundError:
        return "unknown"


def container_image() -> str | None:
    """The image this process runs in, as the deployment declares it (``SLIPWAY_IMAGE``)."""
    return os.environ.get("SLIPWAY_IMAGE") or None


def _git(*args: str) -> str | None:
    # None when git or the repository is missing (an installed wheel, a container).
    try:
        done = subprocess.run(
            ["git", "-C", str(_REPO), *args],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
