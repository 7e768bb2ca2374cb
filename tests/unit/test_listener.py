"""The lineage listener (operators/listener.py), called with fake task instances and DAG runs.

The hooks are called directly and through a pluggy manager built from Airflow's own hook
specs (what the scheduler, API server and task runner call), and the plugin file is loaded
the way Airflow's plugins folder loads it.
"""

from __future__ import annotations

import importlib.util
import logging
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
    map_index: int = -1  # not mapped


@dataclass
class FakeDagRun:
    run_id: str
    dag_id: str = "slipway_pipeline"


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path, monkeypatch):
    """The store the listener finds through the environment: SQLite under SLIPWAY_HOME, or a
    real PostgreSQL in SLIPWAY_LINEAGE_DB (production)."""
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_url")
        monkeypatch.setenv("SLIPWAY_LINEAGE_DB", url)
    else:
        url = f"sqlite:///{tmp_path / 'lineage.db'}"
        monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    with LineageStore(url) as s:
        yield s


def start(store, name, run_id="r1", task_id=None, try_number=1, map_index=None):
    props = {"try_number": try_number}
    if task_id is not None:
        props["task_id"] = task_id
    if map_index is not None:
        props["map_index"] = map_index
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


def test_a_mapped_task_instance_closes_only_its_own_executions(store):
    """Sweep cells are one task mapped over the grid, two at a time: one cell ending (itself,
    or failed from outside) must not close a sibling that is still running."""
    cells = [start(store, f"sweep/train/c{i}", task_id="train_cell", map_index=i) for i in range(3)]
    store.finish_execution(cells[0])  # cell 0 reported itself, then Airflow calls the hook
    listener.on_task_instance_success(None, FakeTaskInstance("r1", "train_cell", map_index=0))
    listener.on_task_instance_failed(
        None, FakeTaskInstance("r1", "train_cell", map_index=2), MANUAL
    )
    assert state(store, cells[0]) == ExecutionState.COMPLETE
    assert state(store, cells[1]) == ExecutionState.RUNNING  # the sibling still training
    assert state(store, cells[2]) == ExecutionState.FAILED


def test_leftovers_of_killed_mapped_tasks_are_closed_by_their_own_state(store):
    """``record`` (the pipeline) and ``check`` (the sweep) close what killed tasks left
    RUNNING, by Airflow's state of that task instance (``<task>_<map index>`` when mapped)."""
    from operators.record import close_leftovers

    failed = start(store, "sweep/train/c0", task_id="train_cell", map_index=0)
    killed_run = start(store, "sweep/train/c1", task_id="train_cell", map_index=1)
    train = start(store, "train", task_id="train")
    states = {"train_cell_0": "failed", "train_cell_1": "success", "train": "failed"}
    assert close_leftovers(store, "r1", states) == {"FAILED": 2, "CANCELED": 1}
    assert state(store, failed) == ExecutionState.FAILED
    assert state(store, killed_run) == ExecutionState.CANCELED
    assert "Airflow: success" in store.execution(killed_run).error
    assert state(store, train) == ExecutionState.FAILED


def test_step_executions_record_their_map_index(store):
    """What the two tests above rely on: a step of a mapped task records its map index (and a
    step of an unmapped task, map index -1, records none)."""
    from types import SimpleNamespace

    from operators.step_lineage import StepLineageMixin

    owner = SimpleNamespace(task_id="train_cell", dag_id="slipway_scaling_sweep")
    step = SimpleNamespace(name="sweep/train/c3", version="v1")
    spec = SimpleNamespace(output_path="/out/c3", unversioned={})
    recorded = {}
    for index in (3, -1):
        ti = SimpleNamespace(try_number=1, map_index=index)
        ex = StepLineageMixin.start_step_execution(
            owner, store, {"run_id": "r1", "ti": ti}, step, spec, [], "/out"
        )
        recorded[index] = store.execution(ex).properties
    assert recorded[3]["map_index"] == 3 and recorded[3]["task_id"] == "train_cell"
    assert "map_index" not in recorded[-1]


def test_another_dags_run_with_the_same_run_id_closes_nothing(store, caplog):
    """A run id that two DAGs share (schedules firing at one instant) is recorded for the
    first; the other's failing tasks and run end must not close its executions, nor may its
    ``record`` / ``check``."""
    from operators.record import close_leftovers

    train = start(store, "train", task_id="train")  # slipway_pipeline's run r1
    sweep = "slipway_scaling_sweep"
    with caplog.at_level(logging.WARNING, logger="operators.listener"):
        listener.on_task_instance_failed(None, FakeTaskInstance("r1", "train", dag_id=sweep), "x")
        listener.on_dag_run_failed(FakeDagRun("r1", dag_id=sweep), "failed")
    assert state(store, train) == ExecutionState.RUNNING
    assert close_leftovers(store, "r1", {"train": "failed"}, sweep) == {"FAILED": 0, "CANCELED": 0}
    assert state(store, train) == ExecutionState.RUNNING
    assert "recorded for slipway_pipeline" in caplog.text
    listener.on_dag_run_failed(FakeDagRun("r1"), "failed")  # its own DAG's run end does
    assert state(store, train) == ExecutionState.CANCELED


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


def _problems(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_unknown_run_and_missing_database_are_no_ops(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="operators.listener")
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "nowhere"))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    listener.on_task_instance_failed(None, FakeTaskInstance("r1", "train"), MANUAL)
    listener.on_dag_run_failed(FakeDagRun("r1"), "x")
    assert not (tmp_path / "nowhere").exists()  # never creates a store for other DAGs
    # Expected, so not an error: said at DEBUG, once per hook.
    assert _problems(caplog) == []
    ours = [r for r in caplog.records if r.name == "operators.listener"]
    assert [r.levelno for r in ours] == [logging.DEBUG, logging.DEBUG]
    assert all("no lineage database at" in r.getMessage() for r in ours)


def test_unknown_run_in_existing_store(store, caplog):
    caplog.set_level(logging.DEBUG, logger="operators.listener")
    running = start(store, "train", task_id="train")  # run r1: must not be touched
    listener.on_task_instance_failed(None, FakeTaskInstance("nope", "train"), MANUAL)
    listener.on_task_instance_success(None, FakeTaskInstance("nope", "train"))
    listener.on_dag_run_failed(FakeDagRun("nope"), "x")
    assert listener.close_task_executions("nope", "train", 1, "FAILED", "x") == []
    assert state(store, running) == ExecutionState.RUNNING
    assert store.executions("nope") == []  # nothing was recorded for the unknown run
    assert [r.run_id for r in store.runs()] == ["r1"]
    assert _problems(caplog) == []
    assert any("nope/train try 1: no RUNNING execution" in r.getMessage() for r in caplog.records)


def test_errors_never_escape_a_hook(store, monkeypatch, caplog):
    def broken():
        raise RuntimeError("database is down")

    monkeypatch.setattr(listener, "_store", broken)
    listener.on_task_instance_failed(None, FakeTaskInstance("r1", "train", try_number=3), MANUAL)
    listener.on_dag_run_failed(FakeDagRun("r1"), "x")
    task, run = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert task.exc_info is not None and run.exc_info is not None  # with the traceback
    message = task.getMessage()
    assert "on_task_instance_failed for DAG run r1 task train try 3" in message
    assert "RuntimeError: database is down" in message
    assert "on_dag_run_failed for DAG slipway_pipeline run r1" in run.getMessage()


def test_a_broken_database_is_an_error_with_context_not_a_crash(tmp_path, monkeypatch, caplog):
    """Unexpected (a file that is not a database, a server that is down): logged at ERROR
    with the hook, the task and the database (its password masked); the hook returns."""
    (tmp_path / "lineage.db").write_bytes(b"this is not a sqlite database" * 100)
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    listener.on_task_instance_failed(None, FakeTaskInstance("r1", "train"), MANUAL)
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert "on_task_instance_failed for DAG run r1 task train try 1" in message
    assert str(tmp_path / "lineage.db") in message and "DatabaseError" in message
    assert record.exc_info is not None

    caplog.clear()
    monkeypatch.setenv("SLIPWAY_LINEAGE_DB", "postgresql+psycopg://slipway:s3cret@127.0.0.1:1/x")
    listener.on_dag_run_failed(FakeDagRun("r1"), "x")
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "OperationalError" in record.getMessage()
    assert "s3cret" not in caplog.text and "slipway:***@127.0.0.1:1/x" in record.getMessage()


def test_a_step_that_reports_itself_meanwhile_keeps_its_state(store, monkeypatch):
    """The listener read RUNNING, then the step wrote COMPLETE, then the listener writes: the
    step's own report stands (the close is conditional), and nothing counts as closed."""
    ex = start(store, "train", task_id="train")
    read = LineageStore.executions

    def read_then_step_reports(self, run_id, state=None):
        found = read(self, run_id, state)
        store.finish_execution(ex, properties={"outcome": "RAN"})
        return found

    monkeypatch.setattr(LineageStore, "executions", read_then_step_reports)
    assert listener.close_task_executions("r1", "train", 1, "FAILED", "from outside") == []
    rec = store.execution(ex)
    assert rec.state == ExecutionState.COMPLETE and rec.error is None
    assert "closed_by" not in rec.properties


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
