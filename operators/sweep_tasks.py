"""The scaling sweep's Airflow tasks (the DAG is ``dags/slipway_scaling_sweep.py``).

* :class:`ValidateSweepOperator` -- the pipeline's checks and the sweep's
  (:func:`operators.sweep.form.check_sweep_config`), before anything is read;
* :class:`PlanGridOperator` (``grid``) -- the night's cells from the recipe, with each one's
  FLOPs (and accelerator time, where the accelerator's peak is known) estimated before launch;
  returns them for the mapped tasks (``expand_kwargs``);
* :class:`CellTrainingOperator` / :class:`CellEvaluationOperator` -- one cell's train and
  evaluate steps: the pipeline's training and evaluation operators (the same JobSet launch,
  local or GKE) on the cell's content-addressed steps, so a cell trained on an earlier night
  is a cache hit;
* :class:`FitSweepOperator` (``fit``, whatever the cells did) -- both fits through the cells
  that reached a metric, the others listed with their reason, then the forecasts
  pre-registered (immutable, hashed) before the forecast runs train;
* :class:`CheckForecastOperator` (``check``) -- each forecast run's outcome against its
  pre-registration.

``fit`` and ``check`` each write the night's report (:mod:`operators.sweep.figures`: the
IsoFLOP and scaling-law plots, PNG and SVG, and ``report.json``) under
``{run folder}/report/`` and record its files as the execution's outputs; ``check``'s adds
the outcomes.

Each records its execution in lineage (pipeline = the DAG id).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.evaluation import EvaluationOperator
from operators.step_lineage import StepLineageMixin
from operators.steps import Step, join
from operators.training import TrainingOperator
from operators.validate import ValidateRunOperator

GRID_TASK, FIT_TASK = "grid", "fit"
SWEEP_RESULT = "sweep.json"  # in the run's folder: the night's grid, fits and forecasts


def tokenizer_vocab(graph: Any, root: str) -> int:
    """The trained tokenizer's vocabulary (its stage manifest), what the recipe counts with."""
    from operators.pipeline.graph import STAGE_OUT
    from operators.steps import output_path
    from pipelines.manifest import read_manifest

    (tok,) = graph.stages["train_tokenizer"]
    manifest = read_manifest(join(output_path(root, tok.step), STAGE_OUT))
    return int(manifest.extra["vocab_size"])


def form_vocab(params: Mapping[str, Any]) -> int:
    """The vocabulary the form asks the tokenizer for (before it is trained): the stage's
    config default where the form's train_tokenizer config leaves it out."""
    from pipelines.configs import TrainTokenizerConfig

    config = (params.get("stage_configs") or {}).get("train_tokenizer") or {}
    return int(config.get("vocab_size", TrainTokenizerConfig().vocab_size))


class ValidateSweepOperator(ValidateRunOperator):
    # Every cell's batch is the recipe's, a multiple of the data-parallel size (recipe_for).
    form_has_batch = False

    def check(self, params: dict[str, Any]) -> None:
        from operators.pipeline.form import RunConfigError
        from operators.sweep.form import check_sweep_config

        problems = []
        for check in (super().check, lambda p: check_sweep_config(p, form_vocab(p))):
            try:
                check(params)
            except RunConfigError as exc:
                problems.append(str(exc))
        if problems:
            raise RunConfigError("\n".join(problems))


class PlanGridOperator(StepLineageMixin, BaseOperator):
    """The grid and the forecast runs, as cells (see the module docstring)."""

    ui_color = "#e0e0ff"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", GRID_TASK)
        super().__init__(**kwargs)

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from operators.sweep.form import check_sweep_config
        from operators.sweep.grid import add_estimates, grid_for

        params = self.run_params(context)
        graph = self.step_graph(context)
        vocab = tokenizer_vocab(graph, self.steps_root())
        # validate checked with the vocabulary the form asked for; this is the trained one.
        check_sweep_config(params, vocab)
        cells = grid_for(params, vocab)
        add_estimates(cells, params)
        total = sum(c["plan"]["flops"] for c in cells)
        self.log.info(
            "%d cells (%s, vocab %d), %.3g training FLOPs in all:\n%s",
            len(cells),
            params["recipe"],
            vocab,
            total,
            "\n".join(
                f"  [{c['index']}] {c['label']}: hidden {c['plan']['model']['hidden_dim']} x "
                f"{c['plan']['model']['num_layers']} layers, {c['plan']['steps']} steps of "
                f"{c['plan']['batch_size']} x {c['plan']['seq_len']}"
                + (f", ~{c['estimate']['seconds']:.3g} s" if "seconds" in c["estimate"] else "")
                for c in cells
            ),
        )
        store = self.lineage_store()
        try:
            with store.recording(
                "grid",
                run_id=context.get("run_id"),
                pipeline=self.dag_id,
                properties={"cells": cells, "flops": total, "vocab_size": vocab},
            ):
                pass
        finally:
            store.close()
        return [{"cell": cell} for cell in cells]


class _CellMixin:
    """A mapped task's cell (``expand_kwargs``): what its label and steps come from."""

    def __init__(self, *, cell: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = dict(cell or {})

    def cell_steps(self, context: Mapping[str, Any]) -> tuple[Step, Step]:
        from operators.sweep.grid import cell_steps

        return cell_steps(
            self.cell,
            self.step_graph(context),  # type: ignore[attr-defined]
            self.run_params(context),  # type: ignore[attr-defined]
        )


class CellTrainingOperator(_CellMixin, TrainingOperator):
    """One cell's training (``cell``: a grid or forecast cell)."""

    template_fields = ()

    def train_step(self, context: Mapping[str, Any]) -> Step:
        return self.cell_steps(context)[0]


class CellEvaluationOperator(_CellMixin, EvaluationOperator):
    """One cell's evaluation on the metric's stores."""

    template_fields = ()

    def evaluate_step(self, context: Mapping[str, Any]) -> Step:
        return self.cell_steps(context)[1]

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.steps import Status, probe

        train = self.cell_steps(context)[0]
        trained = probe(self.steps_root(), train).status
        if trained is None or trained.status is not Status.SUCCESS:
            # A pre-empted cell leaves a checkpoint: scoring it would pass off a partial run.
            from operators.launching import TrainingFailed

            state = "never ran" if trained is None else f"{trained.status}: {trained.error}"
            raise TrainingFailed(f"cell {self.cell['label']}: training {state}; not evaluated")
        return super().execute(context)


def _outcomes(
    operator: StepLineageMixin, context: Mapping[str, Any], cells: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    from operators.sweep.grid import cell_steps, metric_stores
    from operators.sweep.outcomes import cell_outcome

    params = operator.run_params(context)
    graph = operator.step_graph(context)
    stores = metric_stores(params, list(graph.eval_stores))
    return [
        cell_outcome(
            operator.steps_root(), cell, *cell_steps(cell, graph, params), stores, params["metric"]
        )
        for cell in cells
    ]


class FitSweepOperator(StepLineageMixin, BaseOperator):
    """Fit the night's cells, then pre-register the forecasts (module docstring)."""

    ui_color = "#ffe8c0"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", FIT_TASK)
        kwargs.setdefault("trigger_rule", "all_done")  # failed cells must not stop the fit
        super().__init__(**kwargs)

    def execute(self, context: Any) -> list[dict[str, Any]]:
        """Returns the forecast runs' cells, for the mapped forecast tasks."""
        from airflow.sdk.exceptions import AirflowFailException

        from operators.settings import write_run_file
        from operators.steps import Status, probe
        from operators.sweep.grid import add_estimates, cell_steps, forecast_cells
        from operators.sweep.outcomes import (
            find_registration,
            fit_record,
            forecast_body,
            forecast_from,
            preregister,
            registration_key,
        )
        from operators.sweep.report import interval_text

        self.require_run_owned(context)  # all_done: runs even after validate refused the run
        params = self.run_params(context)
        graph = self.step_graph(context)
        root = self.steps_root()
        planned = context["ti"].xcom_pull(task_ids=GRID_TASK)
        if not planned:
            raise AirflowFailException("no grid to fit: the grid task did not run or planned none")
        cells = [c["cell"] for c in planned]
        outcomes = _outcomes(self, context, cells)
        for o in outcomes:
            if o["reason"]:
                self.log.warning("cell [%d] %s left out: %s", o["index"], o["label"], o["reason"])
        vocab = tokenizer_vocab(graph, root)
        runs = forecast_cells(params, vocab)
        add_estimates(runs, params)
        record = fit_record(
            outcomes,
            {c["budget"]: (c["plan"]["non_embedding_params"], c["plan"]["tokens"]) for c in runs},
            seed=int(params["seeds"][0]),
        )
        forecasts = []
        for cell in runs:
            train, evaluate = cell_steps(cell, graph, params)
            key = registration_key(train, evaluate, params["metric"])
            earlier = find_registration(root, key)
            if earlier is not None:
                # Forecast before, on an earlier night (or try): that registration stands.
                path, body = earlier
                digest = path.rsplit("/", 1)[-1].removesuffix(".json")
                forecasts.append({"cell": cell, "path": path, "sha256": digest, "new": False})
                self.log.info(
                    "forecast at %.3g FLOPs pre-registered by run %s (%s): kept",
                    cell["budget"],
                    body.get("run_id"),
                    path,
                )
                continue
            prediction = forecast_from(record, cell["budget"])
            if prediction is None:
                continue
            trained = probe(root, train).status
            body = forecast_body(context.get("run_id"), cell, key, prediction, record)
            if trained is not None and trained.status is Status.SUCCESS:
                body["post_hoc"] = True  # its run trained before any forecast: not a test
            path, digest, created = preregister(root, body)
            forecasts.append({"cell": cell, "path": path, "sha256": digest, "new": created})
            m = prediction["metric"]
            self.log.info(
                "forecast at %.3g FLOPs (%s fit): %s %.4f %s, pre-registered %s%s",
                cell["budget"],
                prediction["fit"],
                params["metric"],
                m["estimate"],
                interval_text(m),
                path,
                "".join(f"; warning: {w}" for w in prediction["warnings"]),
            )
        record["forecasts"] = forecasts
        write_run_file(context.get("run_id"), SWEEP_RESULT, record)
        report = _write_report(context, record, [], params["metric"])
        self._record(context, record, forecasts, report)
        for name, fit in record["fits"].items():
            if "error" in fit:
                self.log.warning("%s fit: %s", name, fit["error"])
        if not forecasts:
            errors = "; ".join(f"{n}: {f['error']}" for n, f in record["fits"].items())
            raise AirflowFailException(f"no fit could be made: {errors}")
        return [{"cell": f["cell"]} for f in forecasts]

    def _record(
        self,
        context: Any,
        record: Mapping[str, Any],
        forecasts: list[dict[str, Any]],
        report: list[tuple[str, str]],
    ) -> None:
        store = self.lineage_store()
        try:
            with store.recording(
                "fit",
                run_id=context.get("run_id"),
                pipeline=self.dag_id,
                properties={
                    "fits": {
                        k: {kk: vv for kk, vv in v.items() if kk != "optima"}
                        for k, v in record["fits"].items()
                    },
                    "left_out": [
                        {"label": o["label"], "reason": o["reason"]}
                        for o in record["cells"]
                        if o["reason"]
                    ],
                    # each cell's time beside its estimate before launch
                    "times": [
                        {"label": o["label"], "estimate": o["estimate"], "actual": o["actual"]}
                        for o in record["cells"]
                    ],
                },
            ) as execution:
                for f in forecasts:
                    store.record_output(
                        execution,
                        f["path"],
                        "forecast",
                        role=f"forecast:{f['cell']['budget']:.3g}",
                        content_hash=f["sha256"],
                    )
                _record_report(store, execution, report)
        finally:
            store.close()


def _write_report(
    context: Mapping[str, Any],
    record: Mapping[str, Any],
    checks: list[dict[str, Any]],
    metric: str,
) -> list[tuple[str, str]]:
    """The night's plots and summary (:mod:`operators.sweep.figures`): (path, sha256) each."""
    from operators.settings import run_folder
    from operators.sweep.figures import write_report
    from trainer.rundir import read_json

    registrations = {f["sha256"]: read_json(f["path"]) or {} for f in record.get("forecasts") or []}
    run_id = context.get("run_id")
    return write_report(run_folder(run_id), run_id, record, registrations, checks, metric)


def _record_report(store: Any, execution: int, report: list[tuple[str, str]]) -> None:
    for path, digest in report:
        name = path.rsplit("/", 1)[-1]
        store.record_output(execution, path, "report", role=f"report:{name}", content_hash=digest)


class CheckForecastOperator(StepLineageMixin, BaseOperator):
    """Each forecast run's outcome against its pre-registered prediction; first, the run's
    executions left RUNNING by killed tasks are closed (``operators.record.close_leftovers``)."""

    ui_color = "#c0ffc8"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "check")
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from airflow.sdk.exceptions import AirflowFailException

        from operators.record import close_leftovers, run_task_states
        from operators.settings import run_folder
        from trainer.rundir import read_json

        self.require_run_owned(context)  # all_done: runs even after validate refused the run

        run_id = context.get("run_id")
        record = read_json(join(run_folder(run_id), SWEEP_RESULT)) or {}
        checks: list[dict[str, Any]] = []
        grid: list[dict[str, Any]] = []
        store = self.lineage_store()
        try:
            # The night's last task: the executions of cells whose process was killed without
            # reporting (OOM, SIGKILL) are closed here, as the pipeline's ``record`` closes its
            # run's; sibling cells are told apart by their map index.
            task_states = run_task_states(context)
            closed = close_leftovers(store, run_id, task_states, self.dag_id)
            if any(closed.values()):
                self.log.warning("closed executions that never reported their end: %s", closed)
            execution = store.start_execution("check", run_id=run_id, pipeline=self.dag_id)
            try:
                grid = [c["cell"] for c in context["ti"].xcom_pull(task_ids=GRID_TASK) or []]
                checks = self._check_forecasts(context, store, execution, record)
                incomplete = self._incomplete(context, record, grid, checks, task_states)
            except BaseException as exc:
                error = f"{type(exc).__name__}: {exc}"
                try:
                    self._write_summary(
                        context, store, execution, record, grid, task_states, closed, error
                    )
                except Exception:  # the error above is the one to report
                    self.log.exception("the night summary was not written")
                store.finish_execution(
                    execution, "FAILED", error=exc, properties={"checks": checks}
                )
                raise
            try:
                state = self._write_summary(
                    context, store, execution, record, grid, task_states, closed, incomplete
                )["state"]
            except Exception as exc:  # the night's outcome below still stands
                self.log.exception("the night summary was not written")
                if not incomplete:
                    store.finish_execution(execution, "FAILED", error=exc)
                    raise
                state = "FAILED"
            if incomplete:
                failure = AirflowFailException(incomplete)
                store.finish_execution(
                    execution, "FAILED", error=failure, properties={"checks": checks}
                )
                raise failure
            store.finish_execution(execution, properties={"checks": checks, "state": state})
        finally:
            store.close()
        return checks

    def _check_forecasts(
        self, context: Any, store: Any, execution: int, record: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """Each forecast's outcome against its registration (``forecast_checks.json``), and
        the night's report redrawn with the outcomes."""
        from operators.settings import write_run_file
        from operators.sweep.outcomes import check_forecast
        from trainer.rundir import read_json

        forecasts = record.get("forecasts") or []
        outcomes = _outcomes(self, context, [f["cell"] for f in forecasts])
        metric = self.run_params(context)["metric"]
        checks: list[dict[str, Any]] = []
        for forecast, outcome in zip(forecasts, outcomes, strict=True):
            registered = read_json(forecast["path"])
            check = {
                "budget": forecast["cell"]["budget"],
                "forecast": forecast["path"],
                "sha256": forecast["sha256"],
                **check_forecast(registered, outcome["metric"], metric),
            }
            check["estimate"], check["actual"] = outcome["estimate"], outcome["actual"]
            if outcome["reason"]:
                check["reason"] = outcome["reason"]
            checks.append(check)
            self.log.info("forecast check: %s", json.dumps(check, default=str))
            store.record_input(
                execution, forecast["path"], "forecast", content_hash=forecast["sha256"]
            )
        write_run_file(context.get("run_id"), "forecast_checks.json", checks)
        _record_report(store, execution, _write_report(context, record, checks, metric))
        return checks

    def _write_summary(
        self,
        context: Any,
        store: Any,
        execution: int,
        record: Mapping[str, Any],
        grid: list[dict[str, Any]],
        task_states: dict[str, str],
        closed: dict[str, int],
        incomplete: str | None,
    ) -> dict[str, Any]:
        """The night's run summary (:mod:`operators.sweep.summary`) of the ``grid``'s cells and
        the forecast runs, written before the night fails: ``summary.json`` in its folder and
        the ``run_summary`` artifact of ``check``."""
        from operators.run_steps import latest_attempts
        from operators.settings import write_run_file
        from operators.sweep.summary import night_steps, night_summary

        run_id = context.get("run_id")
        cells = [*grid, *(f["cell"] for f in record.get("forecasts") or [])]
        graph, steps, graph_error = None, [], None
        try:
            graph = self.step_graph(context)
            steps = night_steps(graph, self.run_params(context), cells)
        except Exception as exc:  # corpora missing: fetch failed
            graph_error = f"{type(exc).__name__}: {exc}"
        try:
            executions = [node.execution for node in store.run_graph(run_id).steps]
        except Exception:  # no execution in the run but check's own
            executions = []
        summary = night_summary(
            run_id=run_id,
            pipeline=self.dag_id,
            root=self.steps_root(),
            latest=latest_attempts(executions),
            graph=graph,
            steps=steps,
            cells=cells,
            incomplete=incomplete,
            task_states=task_states,
            closed=closed,
            graph_error=graph_error,
            order=list(self.dag.task_dict) if self.has_dag() else [],
        )
        path = write_run_file(run_id, "summary.json", summary)
        store.record_output(execution, path, "run_summary", properties=summary)
        self.log.info("night summary (%s): %s", summary["state"], path)
        return summary

    def _incomplete(
        self,
        context: Any,
        record: Mapping[str, Any],
        grid: list[dict[str, Any]],
        checks: list[dict[str, Any]],
        task_states: Mapping[str, str] | None = None,
    ) -> str | None:
        """What makes the night incomplete: a task up to the grid (the data plane, ``grid``)
        that did not succeed this try (``task_states``: Airflow's; the cells and the fit
        would have read an earlier try's grid), a failed cell of the ``grid`` (read again
        here: a cleared and repaired cell counts as repaired), no forecast, or a forecast
        left unchecked. As the DAG's leaf, ``check`` then fails the night, so that a backfill
        with ``reprocess_behavior=failed`` completes it."""
        order = list(self.dag.task_dict) if self.has_dag() else []
        before_cells = order[: order.index(GRID_TASK) + 1] if GRID_TASK in order else []
        broken = [
            f"{t} {task_states[t]}"
            for t in before_cells
            if (task_states or {}).get(t) in ("failed", "upstream_failed")
        ]
        if broken:
            return "the night's data plane or grid did not succeed: " + ", ".join(broken)
        if not record.get("forecasts"):
            fits = record.get("fits") or {}
            return "no forecast this night: " + (
                "; ".join(f"{n}: {f.get('error')}" for n, f in fits.items()) or "fit failed"
            )
        outcomes = _outcomes(self, context, grid)
        problems = [f"[{o['index']}] {o['label']}: {o['reason']}" for o in outcomes if o["reason"]]
        problems += [
            f"forecast at {c['budget']:.3g}: {c.get('reason') or 'not checked'}"
            for c in checks
            if not c.get("checked")
        ]
        if not problems:
            return None
        return (
            f"{len(problems)} cell(s) or forecast(s) incomplete: "
            + "; ".join(problems)
            + " -- clear their tasks with their downstream (Airflow's Clear with Downstream; "
            "Only failed would leave the fit as it was), or backfill a scheduled night with "
            "reprocess_behavior=failed: every other step is a cache hit"
        )
