"""Several OS processes writing one lineage database at once, through the real code paths.

Task processes run steps with ``StepLineageMixin.run_step`` (the operators' start / finish
path, the step runner's markers and leases) while two "listener" processes (the API server
and the scheduler) call the listener's hooks for the same runs: tasks failed from outside,
tasks marked success while finishing, DAG runs ending with orphans still RUNNING. On SQLite
and on a real PostgreSQL. Afterwards every execution is there exactly once, in the state its
story gives it, and every artifact version exactly once.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.orm import configure_mappers

from operators import listener
from operators.lineage import ExecutionState, LineageStore, code_version
from operators.lineage.schema import Artifact, Context
from operators.lineage.schema import Event as EventRow
from operators.pipeline.graph import (
    content_id,  # imported before forking, as in a task (pulls in Airflow)
)
from operators.step_lineage import ArtifactRef, StepLineageMixin
from operators.steps import Step, StepRunner, join, resolve

WORKERS = 4
RUNS = ("run-1", "run-2")
PIPELINE = "slipway_pipeline"
KILLED = "task failed (from outside the task): killed by the test"


@dataclass
class FakeTI:
    run_id: str
    task_id: str
    try_number: int = 1
    dag_id: str = PIPELINE


@dataclass
class FakeDagRun:
    run_id: str
    dag_id: str = PIPELINE


class Task(StepLineageMixin):
    """What the mixin needs of an operator: a task id and a DAG id."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.dag_id = PIPELINE


def _steps(worker: int, run_id: str) -> dict[str, Step]:
    return {
        # The same step in every worker and run: one runs it, the others wait or hit the cache.
        "shared": Step("shared", {"what": "one output for everyone"}),
        # This worker's own step: RAN in run-1, CACHED in run-2.
        "own": Step(f"own/w{worker}", {"worker": worker}),
        # Finishes itself while the listener marks its task success from outside.
        "marked": Step(f"marked/w{worker}", {"worker": worker, "run": run_id}),
        # Killed: starts and never reports; the listener fails it from outside.
        "killed": Step(f"killed/w{worker}", {"worker": worker, "run": run_id}),
        # Killed and nobody says so: the end of the DAG run cancels it.
        "orphan": Step(f"orphan/w{worker}", {"worker": worker, "run": run_id}),
    }


def _task_id(kind: str, worker: int) -> str:
    return f"{kind}-w{worker}"


def _warm_up() -> None:
    """What a task process has done before it records anything: the code version is known
    (one git call), and the ORM is configured (with Airflow imported, the first ORM use in a
    process imports all of Airflow's models, as SQLAlchemy's mapper configuration is hooked)."""
    code_version()
    configure_mappers()


def _task_process(root: str, raw: str, worker: int, barrier, hooks) -> None:
    _warm_up()
    barrier.wait(30)
    rng = random.Random(worker)
    runner = StepRunner(root, lease_seconds=30.0, poll_seconds=0.02)
    raw_ref = ArtifactRef(raw, "dataset")
    for run_id in RUNS:
        steps = _steps(worker, run_id)

        def context(kind: str, run_id: str = run_id) -> dict:
            return {"run_id": run_id, "ti": FakeTI(run_id, _task_id(kind, worker)), "params": {}}

        def outputs(spec, result):
            return [
                ArtifactRef(join(spec.output_path, "out"), "dataset", fields={"counts": {"n": 1}})
            ]

        for kind in ("shared", "own"):
            Task(_task_id(kind, worker)).run_step(
                context(kind),
                steps[kind],
                lambda spec: {"n": 1},
                inputs=[raw_ref],
                outputs=outputs,
                runner=runner,
            )

        def marked(spec, run_id=run_id):
            hooks.put(("success", run_id, _task_id("marked", worker)))
            time.sleep(rng.uniform(0, 0.03))  # the listener and this step race to close it
            return {"n": 1}

        Task(_task_id("marked", worker)).run_step(
            context("marked"),
            steps["marked"],
            marked,
            inputs=[raw_ref],
            outputs=outputs,
            runner=runner,
        )
        with LineageStore() as store:  # what a task killed by SIGKILL leaves: RUNNING
            for kind in ("killed", "orphan"):
                step = steps[kind]
                Task(_task_id(kind, worker)).start_step_execution(
                    store, context(kind), step, resolve(step, root), [raw_ref], root
                )
        hooks.put(("failed", run_id, _task_id("killed", worker)))


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def _listener_process(hooks, barrier, ends) -> None:
    """An Airflow process calling the listener's hooks; exits 1 if any hook logged an error."""
    errors = _Errors()
    logging.getLogger("operators.listener").addHandler(errors)
    _warm_up()
    barrier.wait(30)
    while (message := hooks.get(timeout=60)) is not None:
        what, run_id, task_id = message
        if what == "failed":
            listener.on_task_instance_failed(
                "running", FakeTI(run_id, task_id), "killed by the test"
            )
        else:
            listener.on_task_instance_success("running", FakeTI(run_id, task_id))
    ends.wait(30)  # the tasks are done: both processes end the runs at the same time
    for run_id in RUNS:
        listener.on_dag_run_failed(FakeDagRun(run_id), "task failure")
    if errors.seen:
        print("listener errors:", errors.seen, file=sys.stderr)
        sys.exit(1)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path, monkeypatch) -> str:
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_url")
    else:
        url = f"sqlite:///{tmp_path}/lineage.db"
    # Every process (started below) finds the database the way tasks and listeners do.
    monkeypatch.setenv("SLIPWAY_LINEAGE_DB", url)
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "home"))
    return url


def test_tasks_and_listeners_write_at_once_without_losing_or_duplicating(url, tmp_path):
    root = str(tmp_path / "steps")
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"text": "the same raw file for every task"}\n')
    # spawn, not fork: a fork beside the suite's JAX and gRPC threads can deadlock the child
    # (each child imports SQLAlchemy and Airflow again, and warms up before the barrier).
    ctx = multiprocessing.get_context("spawn")
    hooks = ctx.Queue()
    start = ctx.Barrier(WORKERS + 2)
    ends = ctx.Barrier(2)
    tasks = [
        ctx.Process(target=_task_process, args=(root, str(raw), w, start, hooks))
        for w in range(WORKERS)
    ]
    listeners = [ctx.Process(target=_listener_process, args=(hooks, start, ends)) for _ in range(2)]
    for p in tasks + listeners:  # nobody has created the schema yet: they race for that too
        p.start()
    for p in tasks:
        p.join(120)
    for _ in listeners:
        hooks.put(None)
    for p in listeners:
        p.join(120)
    assert [p.exitcode for p in tasks] == [0] * WORKERS
    assert [p.exitcode for p in listeners] == [0, 0]

    with LineageStore(url) as store:
        by_run = {run_id: store.executions(run_id) for run_id in RUNS}
        with store._read() as session:
            versions = Counter(session.query(Artifact.uri, Artifact.version).all())
            shared_out = join(resolve(_steps(0, "run-1")["shared"], root).output_path, "out")
            shared_events = (
                session.query(EventRow)
                .join(Artifact, Artifact.id == EventRow.artifact_id)
                .filter(Artifact.uri == shared_out, EventRow.type == "OUTPUT")
                .count()
            )
            pipelines = session.query(Context).filter_by(type="pipeline").count()
            dag_runs = session.query(Context).filter_by(type="dag_run").count()

    for run_id, executions in by_run.items():
        # No execution lost, none duplicated: each (task, step) exactly once per run.
        names = Counter((e.properties["task_id"], e.name) for e in executions)
        expected = {
            (_task_id(kind, w), step.name)
            for w in range(WORKERS)
            for kind, step in _steps(w, run_id).items()
        }
        assert set(names) == expected and set(names.values()) == {1}, (run_id, names)
        states = {e.properties["task_id"]: e for e in executions}
        shared = Counter(str(states[_task_id("shared", w)].state) for w in range(WORKERS))
        if run_id == "run-1":  # exactly one process computed it; the others waited for it
            assert shared == {"COMPLETE": 1, "CACHED": WORKERS - 1}, shared
        else:
            assert shared == {"CACHED": WORKERS}, shared
        for w in range(WORKERS):
            own = states[_task_id("own", w)]
            assert own.state == (
                ExecutionState.COMPLETE if run_id == "run-1" else ExecutionState.CACHED
            )
            # The step's own report wins over "marked success from outside" in either order.
            marked = states[_task_id("marked", w)]
            assert marked.state == ExecutionState.COMPLETE, marked
            assert marked.properties["outcome"] == "RAN" and marked.error is None
            killed = states[_task_id("killed", w)]
            assert killed.state == ExecutionState.FAILED and killed.error == KILLED, killed
            assert killed.properties["closed_by"] == "listener"
            orphan = states[_task_id("orphan", w)]
            assert orphan.state == ExecutionState.CANCELED, orphan
            assert orphan.error.startswith("DAG run ended (failed: task failure)")

    # Every artifact version exactly once (the unique key guarantees it; the writers must not
    # have failed on it either), and the shared output linked once per execution that made it.
    assert set(versions.values()) == {1}
    assert [v for (uri, v) in versions if uri == str(raw)] == [_content_id(raw)]
    assert [uri for uri, _ in versions].count(shared_out) == 1
    assert shared_events == WORKERS * len(RUNS)
    assert (pipelines, dag_runs) == (1, len(RUNS))


def _content_id(path: Path) -> str:
    return content_id(str(path))


@pytest.mark.parametrize("close", ["cancel_running", "listener"])
def test_a_close_from_outside_waits_for_the_steps_own_report(url, close):
    """The step's own COMPLETE is being committed (its transaction holds the row) when the
    listener or the run's end closes RUNNING executions: the close waits for it, then sees
    COMPLETE and leaves it alone, instead of overwriting what it read before."""
    import threading

    from sqlalchemy import create_engine, text

    with LineageStore(url) as store:
        ex = store.start_execution("train", run_id="r1", properties={"task_id": "train"})
        step = create_engine(url)
        result: list = []
        with step.connect() as conn:
            if url.startswith("sqlite"):
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # what the store's writers take
            conn.execute(
                text("UPDATE executions SET state = 'COMPLETE' WHERE id = :id"), {"id": ex}
            )

            def closer():
                if close == "cancel_running":
                    result.append(store.cancel_running("r1", "run ended"))
                else:
                    result.append(listener.close_task_executions("r1", "train", 1, "FAILED", "x"))

            thread = threading.Thread(target=closer)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive(), "the close did not wait for the step's transaction"
            conn.commit()
        thread.join(30)
        step.dispose()
        assert result == ([0] if close == "cancel_running" else [[]])  # nothing closed
        rec = store.execution(ex)
        assert rec.state == ExecutionState.COMPLETE and rec.error is None


HOLD_A_WRITE = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN IMMEDIATE")
con.execute("CREATE TABLE other_process (x)")
print("holding", flush=True)
sys.stdin.readline()
con.execute("COMMIT")
"""


def test_a_new_sqlite_file_goes_to_wal_while_another_process_writes(tmp_path):
    """Two processes' first connections to a new lineage file: one in a write transaction
    while the other switches the file to WAL. SQLite answers that switch "database is locked"
    at once, without waiting for the busy timeout; a task process died of it in a
    ``make test`` run. The store retries it within the busy timeout."""
    import sqlite3
    import subprocess
    import threading

    path = tmp_path / "lineage.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_WRITE, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().strip() == "holding"
        # What the store meets: the plain pragma fails at once, busy timeout or not.
        plain = sqlite3.connect(path, timeout=30, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            plain.execute("PRAGMA journal_mode=WAL")
        plain.close()

        opened: list[object] = []

        def open_store() -> None:
            try:
                opened.append(LineageStore(f"sqlite:///{path}"))
            except Exception as exc:  # reported below, on the test's thread
                opened.append(exc)

        opening = threading.Thread(target=open_store, daemon=True)
        opening.start()
        opening.join(0.5)
        # It can only wait: switching to WAL needs the lock the other process holds.
        assert opening.is_alive(), f"opening the store ended while the write was held: {opened}"
        writer.stdin.write("\n")
        writer.stdin.flush()
        opening.join(60)
        assert opened and isinstance(opened[0], LineageStore), opened
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait()
    store = opened[0]
    with store.engine.connect() as connection:
        mode = connection.exec_driver_sql("PRAGMA journal_mode").scalar()
        tables = connection.exec_driver_sql("SELECT name FROM sqlite_master").scalars().all()
    assert mode == "wal"
    assert "other_process" in tables  # the other process's write was kept, not clobbered
    store.close()
