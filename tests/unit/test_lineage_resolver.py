"""One lineage database for everyone: the operators write where the CLI, the listener and the
run summary read, under the same environment (``operators.lineage.lineage_url``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from operators import cli, listener, settings, summary
from operators.lineage import ExecutionState, LineageConfigError, LineageStore, lineage_url
from operators.lineage.url import redacted
from operators.step_lineage import StepLineageMixin


@dataclass
class FakeTI:
    run_id: str
    task_id: str
    try_number: int = 1


class Task(StepLineageMixin):
    task_id = "train"
    dag_id = summary.PIPELINE


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A clean environment in a fresh working directory; the Airflow Variable unset."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv("SLIPWAY_HOME", raising=False)
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    monkeypatch.setattr(settings, "_variable", lambda key: None)
    return tmp_path


@pytest.mark.parametrize("where", ["SLIPWAY_HOME", "SLIPWAY_LINEAGE_DB", "./out", "Variable"])
def test_operators_cli_listener_and_summary_open_one_database(
    where, env, monkeypatch, capsys, caplog
):
    if where == "SLIPWAY_HOME":
        monkeypatch.setenv("SLIPWAY_HOME", str(env / "home"))
    elif where == "SLIPWAY_LINEAGE_DB":
        monkeypatch.setenv("SLIPWAY_HOME", str(env / "home"))  # the URL wins over the home
        monkeypatch.setenv("SLIPWAY_LINEAGE_DB", f"sqlite:///{env}/elsewhere/lineage.db")
    elif where == "Variable":
        # The storage root from the Airflow Variable, which only a task can read: the CLI and
        # the listener cannot, so the database must not follow it (they would miss it).
        variable = str(env / "from-variable")
        monkeypatch.setattr(settings, "_variable", lambda key: variable)
        assert settings.storage_root() == variable

    store = Task().lineage_store()  # what every operator opens
    try:
        ex = store.start_execution(
            "train",
            run_id="r1",
            pipeline=summary.PIPELINE,
            properties={"task_id": "train", "try_number": 1},
        )
        written = store.url
    finally:
        store.close()
    assert written == lineage_url() == settings.lineage_url()
    expected = {
        "SLIPWAY_HOME": f"sqlite:///{env}/home/lineage.db",
        "SLIPWAY_LINEAGE_DB": f"sqlite:///{env}/elsewhere/lineage.db",
        "./out": f"sqlite:///{env}/cwd/out/lineage.db",
        "Variable": f"sqlite:///{env}/cwd/out/lineage.db",
    }[where]
    assert written == expected
    if where == "Variable":
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "Airflow Variable slipway_home" in warning.getMessage()

    # `slipway lineage` (no --db) reads that database ...
    assert cli.main(["lineage", "runs"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("r1")
    # ... and so does the run summary ...
    assert summary.main(["r1"]) == 0
    assert f"(lineage: {written})" in capsys.readouterr().out
    # ... and the listener closes the execution there.
    listener.on_task_instance_failed(None, FakeTI("r1", "train"), "marked failed")
    with LineageStore(written, create=False) as store:
        assert store.execution(ex).state == ExecutionState.FAILED


def test_a_remote_home_needs_a_database_url(env, monkeypatch, capsys):
    monkeypatch.setenv("SLIPWAY_HOME", "gs://bucket/slipway")
    with pytest.raises(LineageConfigError, match="SLIPWAY_LINEAGE_DB"):
        Task().lineage_store()
    assert cli.main(["lineage", "runs"]) == 1
    assert "set SLIPWAY_LINEAGE_DB" in capsys.readouterr().err
    assert summary.main([]) == 1
    # A remote root from the Variable alone is refused the same way in a task.
    monkeypatch.delenv("SLIPWAY_HOME")
    monkeypatch.setattr(settings, "_variable", lambda key: "gs://bucket/slipway")
    with pytest.raises(LineageConfigError, match="SLIPWAY_LINEAGE_DB"):
        Task().lineage_store()
    assert not (env / "cwd" / "out").exists()


def test_passwords_stay_out_of_messages():
    assert redacted("postgresql+psycopg://slipway:s3cret@db:5432/lineage") == (
        "postgresql+psycopg://slipway:***@db:5432/lineage"
    )
    assert redacted("sqlite:////tmp/x/lineage.db") == "sqlite:////tmp/x/lineage.db"
