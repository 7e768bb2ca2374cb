"""The lineage listener (operators/listener.py), called with fake task instances and DAG runs.

The hooks are called directly and through a pluggy manager built from Airflow's own hook
specs (what the scheduler, API server and task runner call), and the plugin file is loaded
the way Airflow's plugins folder loads it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

from operators import listener
from operators.lineage import ExecutionState, LineageStore

REPO = Path(__file__).resolve().parents[2]
MANUAL = "TaskInstance's state was manually set to `failed`."


@dataclass
class FakeTaskInstance:
    """What the hooks read of a TaskInstance / RuntimeTaskInstance."""

    run_id: str
    task_id: str
    try_number: int = 1
    dag_id: str = "slipway_pipeline"


@dataclass
class FakeDagRun:
    run_id: str
    dag_id: str = "slipway_pipeline"


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as s:
        yield s


def start(store, name, run_id="r1", task_id=None, try_number=1):
    props = {"try_number": try_number}
    if task_id is not None:
        props["task_id"] = task_id
    return store.start_execution(name, run_id=run_id, pipeline="slipway_pipeline", properties=props)


def state(store, ex):
    return store.execution(ex).state


def test_task_failed_from_outside_fails_only_its_running_executions(store):
    train = start(store, "train", task_id="train")
    tok_a = start(store, "tokens/train/brown", task_id="tokenize")
    tok_b = start(store, "tokens/train/fortunes", task_id="tokenize")
    done = start(store, "tokens/eval/lambada", task_id="tokenize")
    store.finish_execution(done)
    other_run = start(store, "tokens/train/brown", run_id="r2", task_id="tokenize")
    newer_try = start(store, "tokens/heldout/brown", task_id="tokenize", try_number=2)

    listener.on_task_instance_failed(None, FakeTaskInstance("r1", "tokenize"), MANUAL)

    for ex in (tok_a, tok_b):
        rec = store.execution(ex)
        assert rec.state == ExecutionState.FAILED
        assert rec.error == f"task failed (from outside the task): {MANUAL}"
        assert rec.properties["closed_by"] == "listener" and rec.ended_at is not None
        assert rec.properties["listener_reason"] == rec.error
    assert state(store, done) == ExecutionState.COMPLETE  # reported itself: untouched
    assert state(store, train) == ExecutionState.RUNNING  # another task
    assert state(store, other_run) == ExecutionState.RUNNING  # another run
    assert state(store, newer_try) == ExecutionState.RUNNING  # another try


def test_exception_error_and_executions_without_task_id_match_by_name(store):
    fetch = start(store, "fetch")  # fetch and record record no task_id
    listener.on_task_instance_failed(
        "running", FakeTaskInstance("r1", "fetch"), TimeoutError("heartbeat timeout")
    )
    rec = store.execution(fetch)
    assert rec.state == ExecutionState.FAILED
    assert rec.error.endswith("TimeoutError: heartbeat timeout")


def test_marked_success_or_skipped_while_running_cancels(store):
    train = start(store, "train", task_id="train")
    evaluate = start(store, "evaluate", task_id="evaluate")
    listener.on_task_instance_success(None, FakeTaskInstance("r1", "train"))
    listener.on_task_instance_skipped(None, FakeTaskInstance("r1", "evaluate"))
    assert state(store, train) == ExecutionState.CANCELED
    assert "marked success from outside" in store.execution(train).error
    assert state(store, evaluate) == ExecutionState.CANCELED


def test_a_task_that_reported_itself_is_left_alone(store):
    ex = start(store, "train", task_id="train")
    store.finish_execution(ex, ExecutionState.FAILED, error="RuntimeError: NaN loss")
    listener.on_task_instance_failed("running", FakeTaskInstance("r1", "train"), "NaN loss")
    rec = store.execution(ex)
    assert rec.error == "RuntimeError: NaN loss" and "closed_by" not in rec.properties


def test_dag_run_end_cancels_whatever_is_still_running(store):
    a = start(store, "train", task_id="train")
    b = start(store, "evaluate", task_id="evaluate")
    other = start(store, "train", run_id="r2", task_id="train")
    listener.on_dag_run_failed(FakeDagRun("r1"), "task failure")
    for ex in (a, b):
        rec = store.execution(ex)
        assert rec.state == ExecutionState.CANCELED
        assert "DAG run ended (failed: task failure)" in rec.error
    assert state(store, other) == ExecutionState.RUNNING
    listener.on_dag_run_success(FakeDagRun("r2"), "success")
    assert state(store, other) == ExecutionState.CANCELED


def test_unknown_run_and_missing_database_are_no_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "nowhere"))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    listener.on_task_instance_failed(None, FakeTaskInstance("r1", "train"), MANUAL)
    listener.on_dag_run_failed(FakeDagRun("r1"), "x")
    assert not (tmp_path / "nowhere").exists()  # never creates a store for other DAGs


def test_unknown_run_in_existing_store(store):
    listener.on_task_instance_failed(None, FakeTaskInstance("nope", "train"), MANUAL)
    listener.on_dag_run_failed(FakeDagRun("nope"), "x")


def test_errors_never_escape_a_hook(store, monkeypatch, caplog):
    def broken():
        raise RuntimeError("database is down")

    monkeypatch.setattr(listener, "_store", broken)
    listener.on_task_instance_failed(None, FakeTaskInstance("r1", "train"), MANUAL)
    listener.on_dag_run_failed(FakeDagRun("r1"), "x")
    assert "on_task_instance_failed failed" in caplog.text


def test_airflow_dispatches_to_the_hooks_through_its_specs(store):
    """A manager built from Airflow's hook specs: signatures match, ``error`` is passed."""
    from airflow._shared.listeners.listener import ListenerManager
    from airflow._shared.listeners.spec import taskinstance
    from airflow.listeners.spec import dagrun

    manager = ListenerManager()
    manager.add_hookspecs(taskinstance)
    manager.add_hookspecs(dagrun)
    manager.add_listener(listener)
    train = start(store, "train", task_id="train")
    manager.hook.on_task_instance_failed(
        previous_state=None, task_instance=FakeTaskInstance("r1", "train"), error=MANUAL
    )
    assert store.execution(train).error.endswith(MANUAL)
    evaluate = start(store, "evaluate", task_id="evaluate")
    manager.hook.on_dag_run_failed(dag_run=FakeDagRun("r1"), msg="failed")
    assert state(store, evaluate) == ExecutionState.CANCELED


def test_plugin_file_registers_the_listener():
    spec = importlib.util.spec_from_file_location(
        "slipway_plugin", REPO / "plugins" / "slipway_plugin.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SlipwayPlugin.name == "slipway"
    assert module.SlipwayPlugin.listeners == [listener]
