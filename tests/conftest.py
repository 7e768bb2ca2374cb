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


@pytest.fixture(autouse=True)
def _data_roots_allow_test_folders(tmp_path_factory, monkeypatch):
    """The test platform's data roots: pytest's temporary folders, where the tests put their
    corpora (a run's data_dir must lie below a root the platform allows). Tests of that rule
    set SLIPWAY_ALLOWED_DATA_ROOTS themselves."""
    monkeypatch.setenv("SLIPWAY_ALLOWED_DATA_ROOTS", str(tmp_path_factory.getbasetemp()))
