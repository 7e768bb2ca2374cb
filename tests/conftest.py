"""Shared test helpers."""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Keep JAX and BLAS from fighting over the two cores with Beam workers.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
# No test reaches the Hugging Face Hub: set before anything imports huggingface_hub, datasets
# or transformers, which read these once, at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Airflow, imported in-process by many tests, makes its home (logs/, airflow.cfg) on import, in
# ~/airflow unless told: a throwaway home keeps the suite inside its temporary folders, and no
# test can lean on a developer's own Airflow. Tests that run Airflow give it their own home.
_AIRFLOW_HOME = tempfile.mkdtemp(prefix="slipway-tests-airflow-")
atexit.register(shutil.rmtree, _AIRFLOW_HOME, ignore_errors=True)
os.environ["AIRFLOW_HOME"] = _AIRFLOW_HOME


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


@pytest.fixture(autouse=True, scope="session")
def _data_roots_allow_test_folders(tmp_path_factory):
    """The test platform's data roots: pytest's temporary folders, where the tests put their
    corpora (a run's data_dir must lie below a root the platform allows). Session-wide, so the
    environments module fixtures copy for subprocesses have it too; tests of that rule set
    SLIPWAY_ALLOWED_DATA_ROOTS themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIPWAY_ALLOWED_DATA_ROOTS", str(tmp_path_factory.getbasetemp()))
        yield


@pytest.fixture(autouse=True)
def _empty_memory_filesystem():
    """fsspec's ``memory://`` filesystem is one store per process: emptied after each test, so
    that what one test wrote (a step's marker, a metrics file) is never another's input."""
    yield
    from fsspec.implementations.memory import MemoryFileSystem

    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


# -- the fake Kubernetes API server (tests/fakes/k8s_api.py) and a kubeconfig for it --------


@pytest.fixture
def fake():
    from tests.fakes.k8s_api import FakeKubernetesApiServer

    with FakeKubernetesApiServer() as server:
        yield server


@pytest.fixture
def kubeconfig(tmp_path, fake) -> Path:
    return fake.write_kubeconfig(tmp_path / "kubeconfig")


# -- a real PostgreSQL server for the lineage store (pgserver: binaries in the wheel) ---------


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL 16 server per test session, in a temporary folder, stopped at the end.

    Never skipped: ``pgserver`` is a dev dependency, and production lineage is Postgres. A
    server that cannot start fails the test that asked for it, with the reason and its log.
    """
    import atexit
    import shutil
    import tempfile
    import warnings

    try:
        with warnings.catch_warnings():  # platformdirs: no XDG_RUNTIME_DIR in containers
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError as exc:  # pragma: no cover - a broken dev environment
        pytest.fail(f"pgserver is a dev dependency (the Postgres lineage tests need it): {exc}")
    # A short path: the server's unix socket lives in it (sun_path holds ~107 bytes).
    pgdata = tempfile.mkdtemp(prefix="slipway-pg-")
    try:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
    except Exception as exc:
        log = Path(pgdata, "log")
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no server log)"
        shutil.rmtree(pgdata, ignore_errors=True)
        pytest.fail(
            f"could not start PostgreSQL with pgserver in {pgdata}: "
            f"{type(exc).__name__}: {exc}\n{tail}",
            pytrace=False,
        )
    try:
        yield server
    finally:
        server.cleanup()
        atexit.unregister(server._cleanup)  # done: it would log to pytest's closed streams
        shutil.rmtree(pgdata, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server, request):
    """A fresh, empty database on the session's server, as a SQLAlchemy (psycopg 3) URL.

    Dropped afterwards (``WITH (FORCE)``: connections a failed test left open do not block it).
    """
    import re
    import uuid

    import psycopg

    name = "t_" + re.sub(r"\W", "_", request.node.name.lower())[:40] + "_" + uuid.uuid4().hex[:8]
    admin = postgres_server.get_uri()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    uri = postgres_server.get_uri(database=name)
    yield uri.replace("postgresql://", "postgresql+psycopg://", 1)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
