"""Airflow listener: task state changes made from outside a task, recorded in lineage.

A step's own code records its outcome (``operators/step_lineage.py``), but a task marked
failed or success from the UI or the REST API, or failed by the scheduler (heartbeat timeout,
a killed worker), may never get to report: its lineage execution would stay RUNNING forever.
Airflow calls these hooks wherever the state change happens (API server, scheduler, or the
task's own process), and each closes this task's RUNNING executions in the run:

* ``on_task_instance_failed`` -> FAILED, error ``task failed (from outside the task): <why>``;
* ``on_task_instance_success`` / ``on_task_instance_skipped`` with executions still RUNNING
  (marked from outside while running) -> CANCELED with the reason;
* ``on_dag_run_success`` / ``on_dag_run_failed`` -> every execution of the run still RUNNING
  is CANCELED (tasks killed with the run; the ``record`` task does the same at its end).

When the task reported itself (the usual case) nothing is RUNNING any more and the hooks change
nothing. If the task's own process is still alive it may record its own ending afterwards
(e.g. FAILED "JobSet cancelled"); ``properties.closed_by = "listener"`` and
``properties.listener_reason`` keep what happened from outside. A hook only closes an
execution that is still RUNNING when it writes (a conditional update): a step that reported
itself a moment earlier keeps its own state.

A listener must never break Airflow, so no hook raises into its dispatch. What it meets is
sorted into:

* expected, logged at DEBUG: no lineage database yet (a DAG that records none, a fresh
  install), a run or task with nothing recorded or nothing RUNNING;
* unexpected, logged at ERROR with a traceback and the context (hook, DAG run, task, try,
  database without password): the database is unreachable, a misconfiguration (a remote
  ``SLIPWAY_HOME`` without ``SLIPWAY_LINEAGE_DB``), a bug. The executions concerned stay as
  they were; the DAG's ``record`` task still closes the run's RUNNING ones at its end.

Registered by ``plugins/slipway_plugin.py`` (``AirflowPlugin.listeners``); Airflow loads it
from ``AIRFLOW__CORE__PLUGINS_FOLDER`` (see docs/orchestration.md, "Listener").
Imports neither Airflow nor SQLAlchemy at module level: plugins load in every Airflow process.
"""

from __future__ import annotations

import logging
from typing import Any

from pluggy import HookimplMarker

# The marker Airflow's listener manager uses (``airflow.listeners.hookimpl`` is this object).
hookimpl = HookimplMarker("airflow")

log = logging.getLogger(__name__)


def _store() -> Any:
    """The lineage store, or None where there is none yet: never create one for other DAGs."""
    from operators.lineage import LineageStore, NotFound, lineage_url

    try:
        return LineageStore(lineage_url(), create=False)
    except NotFound as exc:  # expected: nothing has recorded lineage here yet
        log.debug("slipway listener: %s: nothing to close", exc)
        return None


def _belongs_to(
    execution: Any, task_id: str, try_number: int | None, map_index: int | None = None
) -> bool:
    """An execution is the task's when ``properties.task_id`` (else its name) is the task id.

    Steps record the task's try number: an execution of another try (a newer one, already
    running after a clear) is left alone. Steps of a mapped task record its map index: a
    sibling's execution (another sweep cell, still running) is left alone too.
    """
    props = execution.properties or {}
    if props.get("task_id", execution.name) != task_id:
        return False
    recorded_map = props.get("map_index")
    if recorded_map is not None and map_index is not None and recorded_map != map_index:
        return False
    recorded = props.get("try_number")
    return recorded is None or try_number is None or recorded == try_number


def _another_dags_run(store: Any, run_id: str, dag_id: str | None) -> bool:
    """True (and a warning) when ``run_id`` is recorded for another DAG than ``dag_id``
    (``RunIdConflict``): its executions are not this DAG's to close."""
    from operators.lineage import RunIdConflict

    try:
        store.require_owner(run_id, dag_id)
    except RunIdConflict as conflict:
        log.warning(
            "slipway listener: run id %s of DAG %s is recorded for %s: its executions are not"
            " this DAG's to close",
            run_id,
            dag_id,
            conflict.owner,
        )
        return True
    return False


def close_task_executions(
    run_id: str | None,
    task_id: str | None,
    try_number: int | None,
    state: str,
    reason: str,
    map_index: int | None = None,
    dag_id: str | None = None,
) -> list[int]:
    """Close the task's RUNNING executions in ``run_id`` with ``state`` (of one mapped task
    instance when ``map_index`` is given); returns their ids. Nothing when the run id is
    recorded for another DAG than ``dag_id`` (``RunIdConflict``: not this run's executions).

    An execution that ends itself between the read and the write keeps its own state.
    """
    from operators.lineage import ExecutionState

    if not run_id or not task_id:
        log.debug("slipway listener: no run or task id (%r, %r): nothing to close", run_id, task_id)
        return []
    store = _store()
    if store is None:
        return []
    try:
        if _another_dags_run(store, run_id, dag_id):
            return []
        closed = []
        running = store.executions(run_id, state=ExecutionState.RUNNING)
        for ex in running:
            if _belongs_to(ex, task_id, try_number, map_index) and store.finish_execution(
                ex.id,
                state,
                error=reason,
                properties={"closed_by": "listener", "listener_reason": reason},
                only_if_running=True,
            ):
                closed.append(ex.id)
        if closed:
            log.info(
                "slipway listener: %s %s/%s -> %s (%s)", closed, run_id, task_id, state, reason
            )
        else:  # expected: the task reported itself, or the run recorded nothing
            log.debug(
                "slipway listener: %s/%s try %s: no RUNNING execution to close (%d in the run)",
                run_id,
                task_id,
                try_number,
                len(running),
            )
        return closed
    finally:
        store.close()


def _ti_fields(
    task_instance: Any,
) -> tuple[str | None, str | None, int | None, int | None]:
    """Run id, task id, try number, and map index (None for a task that is not mapped)."""
    try_number = getattr(task_instance, "try_number", None)
    map_index = getattr(task_instance, "map_index", None)
    return (
        getattr(task_instance, "run_id", None),
        getattr(task_instance, "task_id", None),
        try_number if isinstance(try_number, int) else None,
        map_index if isinstance(map_index, int) and map_index >= 0 else None,
    )


def _database() -> str:
    """The lineage database, password masked, for a log line (never raises)."""
    try:
        from operators.lineage.url import lineage_url, redacted

        return redacted(lineage_url())
    except Exception as exc:
        return f"<unresolved: {exc}>"


def _safely(hook: str, context: str, fn: Any, *args: Any) -> None:
    """Run a hook's work; an unexpected error is logged with its context, never raised."""
    try:
        fn(*args)
    except Exception as exc:  # a listener must never fail the scheduler, the API or the task
        log.exception(
            "slipway listener: %s for %s could not update lineage in %s (%s: %s); "
            "its executions stay as they were",
            hook,
            context,
            _database(),
            type(exc).__name__,
            exc,
        )


def _ti_context(
    run_id: str | None, task_id: str | None, try_number: int | None, map_index: int | None
) -> str:
    mapped = "" if map_index is None else f"[{map_index}]"
    return f"DAG run {run_id} task {task_id}{mapped} try {try_number}"


def _describe(error: Any) -> str:
    if error is None:
        return "no reason given"
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"
    return str(error)


@hookimpl
def on_task_instance_failed(previous_state: Any, task_instance: Any, error: Any) -> None:
    from operators.lineage import ExecutionState

    run_id, task_id, try_number, map_index = _ti_fields(task_instance)
    reason = f"task failed (from outside the task): {_describe(error)}"
    _safely(
        "on_task_instance_failed",
        _ti_context(run_id, task_id, try_number, map_index),
        close_task_executions,
        run_id,
        task_id,
        try_number,
        ExecutionState.FAILED,
        reason,
        map_index,
        getattr(task_instance, "dag_id", None),
    )


@hookimpl
def on_task_instance_success(previous_state: Any, task_instance: Any) -> None:
    from operators.lineage import ExecutionState

    run_id, task_id, try_number, map_index = _ti_fields(task_instance)
    _safely(
        "on_task_instance_success",
        _ti_context(run_id, task_id, try_number, map_index),
        close_task_executions,
        run_id,
        task_id,
        try_number,
        ExecutionState.CANCELED,
        "task marked success from outside while this step was running",
        map_index,
        getattr(task_instance, "dag_id", None),
    )


@hookimpl
def on_task_instance_skipped(previous_state: Any, task_instance: Any) -> None:
    from operators.lineage import ExecutionState

    run_id, task_id, try_number, map_index = _ti_fields(task_instance)
    _safely(
        "on_task_instance_skipped",
        _ti_context(run_id, task_id, try_number, map_index),
        close_task_executions,
        run_id,
        task_id,
        try_number,
        ExecutionState.CANCELED,
        "task skipped while this step was running",
        map_index,
        getattr(task_instance, "dag_id", None),
    )


def _close_run(dag_run: Any, outcome: str, msg: Any) -> None:
    run_id = getattr(dag_run, "run_id", None)
    if not run_id:
        log.debug("slipway listener: DAG run without a run id: nothing to close")
        return
    store = _store()
    if store is None:
        return
    try:
        if _another_dags_run(store, run_id, getattr(dag_run, "dag_id", None)):
            return
        n = store.cancel_running(run_id, f"DAG run ended ({outcome}: {msg}) with this step running")
        if n:
            log.info(
                "slipway listener: run %s ended %s, %d execution(s) CANCELED", run_id, outcome, n
            )
        else:
            log.debug("slipway listener: run %s ended %s, nothing RUNNING", run_id, outcome)
    finally:
        store.close()


def _run_context(dag_run: Any) -> str:
    return f"DAG {getattr(dag_run, 'dag_id', None)} run {getattr(dag_run, 'run_id', None)}"


@hookimpl
def on_dag_run_success(dag_run: Any, msg: Any) -> None:
    _safely("on_dag_run_success", _run_context(dag_run), _close_run, dag_run, "success", msg)


@hookimpl
def on_dag_run_failed(dag_run: Any, msg: Any) -> None:
    _safely("on_dag_run_failed", _run_context(dag_run), _close_run, dag_run, "failed", msg)
