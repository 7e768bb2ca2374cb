"""A run's steps as its summary states them (the pipeline's ``record``, the sweep's ``check``).

For each step: its state in this run (the latest attempt of its execution, or NOT_RUN) and its
marker on storage, which decides what a rerun does: a SUCCESS marker is a cache hit, anything
else runs again. Airflow-free: lineage executions and step markers only.
"""

from __future__ import annotations

from typing import Any


def latest_attempts(executions: list[Any]) -> dict[str, Any]:
    """The last attempt of each execution name (``executions`` in start order)."""
    latest: dict[str, Any] = {}
    for ex in executions:
        latest[ex.name] = ex
    return latest


def stepless_failures(latest: dict[str, Any], step_names: set[str]) -> list[dict[str, Any]]:
    """The failed latest attempts of executions that are no step (validate, fetch)."""
    from operators.lineage import ExecutionState

    return [
        {"step": ex.name, "error": ex.error}
        for ex in latest.values()
        if ex.name not in step_names and ex.state == ExecutionState.FAILED
    ]


def step_states(
    root: str, steps: list[Any], latest: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], list[str]]:
    """Each step's row of a run summary (its state in this run, from ``latest``, and its marker
    on storage), the steps that failed or were canceled, and the keys a rerun would skip (a
    SUCCESS marker: a cache hit) and would run again; all in ``steps``' order."""
    from operators.steps import probe

    rows, failed, skip, rerun = [], [], [], []
    for step in steps:
        ex = latest.get(step.name)
        marker = probe(root, step).status
        marker_status = str(marker.status) if marker else None
        state = str(ex.state) if ex else "NOT_RUN"
        rows.append(
            {
                "step": step.key,
                "state": state,
                "marker": marker_status,
                "error": ex.error if ex else None,
            }
        )
        if state in ("FAILED", "CANCELED"):
            failed.append({"step": step.name, "error": ex.error})
        (skip if marker_status == "SUCCESS" else rerun).append(step.key)
    return rows, failed, skip, rerun


def settle_failures(
    failed: list[dict[str, Any]], task_states: dict[str, str], graph_error: str | None
) -> list[dict[str, Any]]:
    """``failed`` as the summary states it: when no execution said what failed, the first
    task Airflow has failed (or upstream_failed), else why the step graph could not be built
    (the corpora are missing: ``fetch`` failed)."""
    if not failed:
        failed_tasks = sorted(
            t for t, s in task_states.items() if s in ("failed", "upstream_failed")
        )
        if failed_tasks:
            return [{"step": failed_tasks[0], "error": f"task {task_states[failed_tasks[0]]}"}]
        if graph_error:
            return [{"step": "fetch", "error": graph_error}]
    return failed
