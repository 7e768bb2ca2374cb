"""Shared test helpers."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

# Keep JAX and BLAS from fighting over the two cores with Beam workers.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file below root, by relative path: equal digests mean identical trees."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def digest():
    return tree_digest
