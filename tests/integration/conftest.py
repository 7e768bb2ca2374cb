"""Fixtures of the gke tests against FakeKubernetesApiServer (test_gke_trigger.py, the
pipeline's train task; test_gke_sweep.py, the sweep's cells). The server (``fake``) and its
``kubeconfig`` are tests/conftest.py's, shared with the unit tests of the backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.gke import IMAGE, NS


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    return tmp_path / "home"


@pytest.fixture
def gke_platform(kubeconfig, monkeypatch):
    """The platform of these tests: it lets runs use the fake cluster's kubeconfig and the
    namespace, service account and image below (operators/policy.py)."""
    monkeypatch.setenv("SLIPWAY_ALLOWED_KUBECONFIGS", str(kubeconfig))
    monkeypatch.setenv("SLIPWAY_ALLOWED_NAMESPACES", NS)
    monkeypatch.setenv("SLIPWAY_ALLOWED_SERVICE_ACCOUNTS", "trainer")
    monkeypatch.setenv("SLIPWAY_ALLOWED_IMAGES", IMAGE.rsplit(":", 1)[0])
