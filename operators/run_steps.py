"""A run's steps as its summary states them (the pipeline's ``record``, the sweep's ``check``).

For each step: its state in this run (the latest attempt of its execution, or NOT_RUN) and its
marker on storage, which decides what a rerun does: a SUCCESS marker is a cache hit, anything
else runs again. Airflow-free: lineage executions and step markers only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
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
    failed: list[dict[str, Any]],
    task_states: dict[str, str],
    graph_error: str | None,
    *,
    order: Sequence[str] = (),
    own: Collection[str] = (),
) -> list[dict[str, Any]]:
    """``failed`` as the summary states it. When no execution said what failed (none, or only
    the summary's writer ``own``, e.g. the sweep's ``check`` saying the night is incomplete),
    the first task Airflow has failed comes first: a task that ``failed`` before any that is
    only ``upstream_failed``, then in the DAG's ``order`` (its task ids), mapped instances by
    index; else why the step graph could not be built (the corpora are missing: ``fetch``
    failed)."""
    if any(f["step"] not in own for f in failed):
        return failed
    first = first_failed_task(task_states, order)
    if first is not None:
        return [{"step": first, "error": f"task {task_states[first]}"}, *failed]
    if graph_error:
        return [{"step": "fetch", "error": graph_error}, *failed]
    return failed


def first_failed_task(task_states: Mapping[str, str], order: Sequence[str] = ()) -> str | None:
    """The task instance (``<task>`` or a mapped ``<task>_<index>``) that failed first in the
    DAG's ``order``, preferring ``failed`` to ``upstream_failed`` (never the cause)."""
    position = {task: i for i, task in enumerate(order)}

    def rank(name: str) -> tuple[int, int, int, str]:
        base, _, index = name.rpartition("_")
        mapped = bool(base) and index.isascii() and index.isdigit() and base in position
        task = base if mapped else name
        return (
            0 if task_states[name] == "failed" else 1,
            position.get(task, len(position)),
            int(index) if mapped else -1,
            name,
        )

    candidates = [t for t, s in task_states.items() if s in ("failed", "upstream_failed")]
    return min(candidates, key=rank) if candidates else None
