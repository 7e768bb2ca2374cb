"""Slipway nightly scaling sweep: an IsoFLOP grid, scaling-law fits, a pre-registered forecast.

Each night: the pipeline's data plane (the same steps as ``slipway_pipeline``: with the same
inputs, the same token stores, all cache hits), then the recipe's grid of cells -- one run per
budget, model size and seed, as mapped tasks -- each trained and evaluated as a
content-addressed step (a cell trained on an earlier night is a cache hit), then both
Chinchilla fits through the cells that reached a metric (the others listed with why), the
forecast at each forecast budget pre-registered before its run trains, the run, and the
check of the outcome against the prediction.

A failed cell does not stop the fit; the night still fails at the end (``check``) so that a
backfill with ``reprocess_behavior=failed`` reruns it, and only it (every other step is a
cache hit). The schedule is the platform's (``$SLIPWAY_SWEEP_SCHEDULE``, a cron expression;
02:00 daily by default); the form's fields are validated at trigger time and by ``validate``.
See docs/scaling.md.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from operators.beam_stage import BeamStageOperator
from operators.corpora import FetchCorporaOperator
from operators.pipeline import PIPELINE, Role, edges
from operators.pipeline.form import schema_of
from operators.settings import SWEEP_SCHEDULE_ENV, schedule_from_env
from operators.split import HeldoutSplitOperator
from operators.sweep.form import sweep_form_fields
from operators.sweep_tasks import (
    CellEvaluationOperator,
    CellTrainingOperator,
    CheckForecastOperator,
    FitSweepOperator,
    PlanGridOperator,
    ValidateSweepOperator,
)

DATA_PLANE = [t for t in PIPELINE if t.role in (Role.VALIDATE, Role.FETCH, Role.BEAM, Role.SPLIT)]
SCHEDULE = schedule_from_env(SWEEP_SCHEDULE_ENV, "0 2 * * *")
# Cells training at once in one night (each is a JobSet: on a cluster, a slice each).
MAX_ACTIVE_CELLS = int(os.environ.get("SLIPWAY_SWEEP_MAX_ACTIVE_CELLS", "2"))
CELL_LABEL = "{{ task.cell['label'] }}"


def data_plane_task(task_id: str, role: Role, summary: str):
    if role is Role.BEAM:
        return BeamStageOperator(stage_task=task_id, doc_md=summary)
    operator = {
        Role.VALIDATE: ValidateSweepOperator,
        Role.FETCH: FetchCorporaOperator,
        Role.SPLIT: HeldoutSplitOperator,
    }[role]
    return operator(task_id=task_id, doc_md=summary)


with DAG(
    dag_id="slipway_scaling_sweep",
    description="Nightly IsoFLOP sweep: grid, fits, pre-registered forecast, check",
    schedule=SCHEDULE,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    params={
        name: Param(spec["default"], **schema_of(spec))
        for name, spec in sweep_form_fields().items()
    },
    default_args={"retries": 0, "retry_delay": timedelta(minutes=1)},
    tags=["slipway", "sweep", "scaling"],
    doc_md=__doc__,
) as dag:
    tasks = {t.task_id: data_plane_task(t.task_id, t.role, t.summary) for t in DATA_PLANE}
    for upstream, downstream in edges():
        if upstream in tasks and downstream in tasks:
            tasks[upstream] >> tasks[downstream]
    grid = PlanGridOperator(doc_md="the night's cells from the recipe, estimated")
    tasks["tokenize"] >> grid
    train_cells = CellTrainingOperator.partial(
        task_id="train_cell",
        map_index_template=CELL_LABEL,
        max_active_tis_per_dagrun=MAX_ACTIVE_CELLS,
    ).expand_kwargs(grid.output)
    evaluate_cells = CellEvaluationOperator.partial(
        task_id="evaluate_cell",
        map_index_template=CELL_LABEL,
        max_active_tis_per_dagrun=MAX_ACTIVE_CELLS,
        trigger_rule="all_done",  # a failed cell's evaluation fails fast and says why
    ).expand_kwargs(grid.output)
    fit = FitSweepOperator(doc_md="both fits, then the forecasts pre-registered")
    train_forecast = CellTrainingOperator.partial(
        task_id="train_forecast", map_index_template=CELL_LABEL
    ).expand_kwargs(fit.output)
    evaluate_forecast = CellEvaluationOperator.partial(
        task_id="evaluate_forecast", map_index_template=CELL_LABEL, trigger_rule="all_done"
    ).expand_kwargs(fit.output)
    check = CheckForecastOperator(
        doc_md="each forecast against its outcome; fails the night if a cell failed"
    )
    train_cells >> evaluate_cells >> fit
    train_forecast >> evaluate_forecast >> check
