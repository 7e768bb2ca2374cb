"""A night's run summary: what the pipeline's ``record`` task writes for a run
(:mod:`operators.record`), for a sweep night.

``check``, the night's last task, writes it whatever happened, as ``{run folder}/summary.json``
and as the ``run_summary`` artifact of its execution, so that the run page says how the night
ended and what a rerun would do, as it does for a pipeline run:

* every step of the night in order -- the data plane's, then each cell's train and evaluate
  steps, the grid's cells first, then the forecast runs' -- with its state in this run and its
  marker on storage;
* what failed, first first: the tasks without steps (``grid``, ``fit``), the steps, then what
  ``check`` found incomplete (a forecast not checked, no forecast at all);
* what a rerun (a backfill with ``reprocess_behavior=failed``, or clearing the failed tasks)
  would skip -- steps with a SUCCESS marker are cache hits -- and run again, and the checkpoint
  each unfinished cell's training resumes from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from operators.pipeline.definition import PIPELINE, Role
from operators.run_steps import settle_failures, step_states, stepless_failures
from operators.steps import Step, output_path
from operators.sweep.grid import cell_steps, cell_train_step

# The pipeline's tasks the sweep runs too (dags/slipway_scaling_sweep.py), those with steps.
DATA_PLANE_ROLES = (Role.BEAM, Role.SPLIT)


def data_plane_steps(graph: Any) -> list[Step]:
    """The data plane's steps of ``graph`` (the pipeline's), in pipeline order."""
    tasks = {t.task_id for t in PIPELINE if t.role in DATA_PLANE_ROLES}
    return [s for task, steps in graph.task_steps().items() if task in tasks for s in steps]


def night_steps(
    graph: Any, params: Mapping[str, Any], cells: Sequence[Mapping[str, Any]]
) -> list[Step]:
    """The night's steps: the data plane's, then each cell's (train, evaluate), once each."""
    steps = data_plane_steps(graph)
    seen = {s.key for s in steps}
    for cell in cells:
        for step in cell_steps(cell, graph, params):
            if step.key not in seen:
                seen.add(step.key)
                steps.append(step)
    return steps


def cells_resume_from(
    root: str, graph: Any, cells: Sequence[Mapping[str, Any]], rerun: Sequence[str]
) -> list[dict[str, Any]]:
    """Each cell whose training a rerun runs again and that committed a checkpoint: the
    cell's label, the step it resumes from and the checkpoint's folder."""
    from trainer.rundir import last_checkpoint

    again = set(rerun)
    resume = []
    for cell in cells:
        train = cell_train_step(cell, graph)
        if train.key not in again:
            continue
        ckpt = last_checkpoint(output_path(root, train))
        if ckpt is not None:
            resume.append({"cell": cell["label"], "step": ckpt[0], "checkpoint": ckpt[1]})
    return resume


def night_summary(
    *,
    run_id: str,
    pipeline: str,
    root: str,
    latest: Mapping[str, Any],
    graph: Any | None,
    steps: Sequence[Step],
    cells: Sequence[Mapping[str, Any]],
    incomplete: str | None,
    task_states: Mapping[str, str],
    closed: Mapping[str, int],
    graph_error: str | None = None,
    order: Sequence[str] = (),
) -> dict[str, Any]:
    """The summary, in the shape of ``record``'s without the gate. ``order``: the DAG's task
    ids, in which the first failed task is named when no step says what failed.

    ``latest``: the last attempt of each execution in the run (``run_steps.latest_attempts``);
    ``graph``: the run's step graph (None when it could not be built: ``graph_error`` says why);
    ``steps``: :func:`night_steps` of ``cells``, the grid's and the forecast runs';
    ``incomplete``: what ``check`` found incomplete, or the error it failed with;
    ``closed``: the leftovers it closed (``record.close_leftovers``).
    """
    rows, step_failed, skip, rerun = step_states(root, list(steps), dict(latest))
    # check is this summary's writer: its own execution is still running.
    failed = stepless_failures(dict(latest), {s.name for s in steps} | {"check"})
    failed += step_failed
    if incomplete:
        failed.append({"step": "check", "error": incomplete})
    failed = settle_failures(failed, dict(task_states), graph_error, order=order, own={"check"})
    return {
        "run_id": run_id,
        "pipeline": pipeline,
        "state": "FAILED" if failed else "SUCCESS",
        "failed": failed,
        "steps": rows,
        "task_states": dict(task_states),
        "canceled_executions": closed.get("CANCELED", 0),
        "failed_unreported_executions": closed.get("FAILED", 0),
        "resume": {
            "skipped_on_rerun": skip,
            "rerun": rerun,
            "training_resumes_from": None,  # the pipeline's one training; the cells': below
            "cells_resume_from": []
            if graph is None
            else cells_resume_from(root, graph, cells, rerun),
        },
    }
