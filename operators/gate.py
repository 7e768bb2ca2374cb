"""The ``gate`` task: promote the run's model if its evaluation meets the form's criteria.

After ``evaluate``, it reads the evaluation (the task's XCom, else the evaluate step's status
marker, which holds the same result), checks the criteria against it and against the currently
promoted model of the form's ``model_name`` (:mod:`operators.promotion`), and then

* **passes**: records the promotion in lineage (the gate execution's output: an artifact at
  ``slipway://models/<name>``, a new version per promotion, with the trained run, checkpoint,
  metrics and DAG run) and emits an Airflow Asset event for ``Asset("slipway://models/<name>")``
  through the task's outlet alias (:data:`~operators.promotion.MODELS_ALIAS`): the asset's
  name is only known at run time, and an alias is how Airflow 3 lets a task name it then.
  Downstream DAGs can schedule on the asset. With no criterion set it passes and promotes;
* **fails**: fails the task (no retry: the same numbers fail again) with the table of failed
  criteria and by how much, recorded in lineage as the gate execution FAILED with the table.
  ``record`` (``all_done``) still writes the run's summary, which says the gate failed and why.

Two gates of one model name deciding at once: the promotion is a compare-and-set on the
model's latest version in lineage (``record_promotion``'s ``if_latest``), so the second to
record finds that the model it judged against is no longer the current one, promotes
nothing, and fails, saying so; cleared, it decides again against the new promotion.

Not a content-addressed step: whether a model passes depends on what is promoted now, so a
cached answer could be wrong. It is recorded in lineage like every task, whatever its outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from airflow.sdk import AssetAlias, BaseOperator

from operators.promotion import MODELS_ALIAS
from operators.step_lineage import (
    ArtifactRef,
    StepLineageMixin,
    input_fields,
    resolve_uri,
    trained_model_input,
)


class GateFailed(RuntimeError):
    """The gate did not get to promote: nothing to judge, or another gate promoted a model of
    the name between this one's reading and its record. Unlike failed criteria, a rerun may
    pass."""


class GateOperator(StepLineageMixin, BaseOperator):
    """:param evaluate_task_id: the task whose result the gate judges."""

    ui_color = "#fff2b3"

    def __init__(self, *, evaluate_task_id: str = "evaluate", **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "gate")
        kwargs.setdefault("outlets", [AssetAlias(MODELS_ALIAS)])
        super().__init__(**kwargs)
        self.evaluate_task_id = evaluate_task_id

    # -- what it judges -----------------------------------------------------------------------

    def evaluation(self, context: Mapping[str, Any]) -> dict[str, Any]:
        """The evaluate task's result: its XCom, else its step's SUCCESS marker (a gate run
        where the XCom is gone, e.g. a cleared run whose evaluate was not rerun)."""
        from operators.steps import Status, probe

        ti = context.get("ti")
        pulled = None
        if ti is not None:
            pulled = ti.xcom_pull(task_ids=self.evaluate_task_id)
        if isinstance(pulled, Mapping) and "results" in pulled:
            return dict(pulled)
        state = probe(self.steps_root(), self.step_graph(context).evaluate)
        if state.status is None or state.status.status is not Status.SUCCESS:
            raise GateFailed(
                f"no evaluation to judge: no {self.evaluate_task_id} result in XCom and its "
                f"step {state.path} is not SUCCESS"
            )
        result = dict(state.status.result or {})
        if "results" not in result:
            raise GateFailed(
                f"no evaluation to judge: the {self.evaluate_task_id} step {state.path} kept no "
                "results in its SUCCESS marker"
            )
        return {"output": state.path, **result}

    def export_folder(self, context: Mapping[str, Any]) -> str | None:
        """The Hugging Face folder the ``export`` task wrote (its XCom), None without one."""
        ti = context.get("ti")
        pulled = ti.xcom_pull(task_ids="export") if ti is not None else None
        return pulled.get("hf_dir") if isinstance(pulled, Mapping) else None

    def _inputs(self, context: Mapping[str, Any], evaluation: Mapping[str, Any]) -> list[Any]:
        """What the gate read, for lineage: the trained run and the eval results it judged."""
        from operators.evaluation import BENCHMARK_PREFIX
        from operators.lineage import ArtifactType
        from operators.steps import join

        step = self.step_graph(context).evaluate
        refs = [trained_model_input(step.config["train"], self.steps_root())]
        output = evaluation.get("output")
        if output:
            # The evaluate step's result files, as it records them (versioned by its step).
            names = sorted(evaluation.get("results") or {})
            names += [f"{BENCHMARK_PREFIX}{t}" for t in sorted(evaluation.get("benchmarks") or {})]
            refs += [
                ArtifactRef(
                    join(output, "results", f"{name}.json"),
                    ArtifactType.EVAL_RESULT,
                    role=f"eval:{name}",
                    fields={"version": step.version},
                )
                for name in names
            ]
        return refs

    # -- running ------------------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow.sdk import Asset
        from airflow.sdk.exceptions import AirflowFailException

        from operators import promotion as p
        from operators.lineage import EventType, ExecutionState, Superseded

        params = self.run_params(context)
        name = params["model_name"]
        criteria = p.Criteria.from_params(params)
        run_id = context.get("run_id")
        root = self.steps_root()
        store = self.lineage_store()
        try:
            execution = store.start_execution(
                "gate",
                run_id=run_id,
                pipeline=self.dag_id,
                properties={
                    "task_id": self.task_id,
                    "try_number": getattr(context.get("ti"), "try_number", None),
                    "model_name": name,
                    "criteria": criteria.to_dict(),
                },
            )
            try:
                evaluation = self.evaluation(context)
                trained = self._inputs(context, evaluation)
                for ref in trained:
                    store.record_input(
                        execution,
                        resolve_uri(ref.uri, root),
                        ref.type,
                        role=ref.role,
                        **input_fields(ref),
                    )
                # For the OpenLineage events: what it read, and the model it may promote.
                self._remember_io(
                    [resolve_uri(ref.uri, root) for ref in trained], [p.model_uri(name)]
                )
                metrics = dataclasses.replace(
                    p.Metrics.from_evaluation(evaluation),
                    measured=p.measurements(self.step_graph(context).evaluate.config),
                )
                # Read first: a promotion recorded after it, even one the baseline below
                # already sees, makes record_promotion refuse (never the other way round).
                latest = p.latest_version(store, name)
                baseline = p.current_promotion(store, name, exclude_run=run_id)
                if baseline is not None:
                    store.link(
                        execution,
                        baseline.uri,
                        EventType.INPUT,
                        role="promoted_before",
                        version=baseline.version,
                    )
                decision = p.decide(criteria, metrics, baseline)
            except BaseException as exc:
                self.fail_step_execution(store, execution, exc)
                raise
            self.log.info("gate for %s: %s\n%s", name, decision.summary(), decision.table())
            if decision.warning:
                self.log.warning("gate for %s: %s", name, decision.warning)
            if not decision.passed:
                message = (
                    f"model {name} not promoted: gate {decision.summary()}\n{decision.table()}"
                )
                _not_promoted(store, execution, decision, message)
                raise AirflowFailException(message)
            try:
                # the trained run's folder (its checkpoints, metrics, config), not a checkpoint
                model = resolve_uri(self.step_graph(context).evaluate.config["train"], root)
                promoted = p.record_promotion(
                    store,
                    execution,
                    name,
                    metrics,
                    run_id=run_id,
                    pipeline=self.dag_id,
                    model=model,
                    checkpoint=evaluation.get("checkpoint"),
                    step=evaluation.get("step"),
                    decision=decision,
                    if_latest=latest,
                    export=self.export_folder(context),
                )
            except Superseded as exc:
                reason = (
                    f"another gate promoted {name} while this one decided ({exc}). Clear this"
                    " gate to decide again, against that model"
                )
                _not_promoted(store, execution, decision, reason)
                raise GateFailed(f"model {name} not promoted: {reason}") from exc
            except BaseException as exc:
                self.fail_step_execution(store, execution, exc)
                raise
            store.finish_execution(
                execution,
                ExecutionState.COMPLETE,
                properties={
                    "gate": decision.to_dict(),
                    "promoted": {"uri": promoted.uri, "version": promoted.version},
                },
            )
        finally:
            store.close()
        # After lineage holds the promotion: a consumer woken by the event finds its record.
        extra = {
            "name": name,
            "version": promoted.version,
            "run_id": run_id,
            "model": model,
            "checkpoint": promoted.checkpoint,
            "export": promoted.export,
            "heldout_bits_per_byte": metrics.mean_bits_per_byte,
        }
        context["outlet_events"][AssetAlias(MODELS_ALIAS)].add(Asset(promoted.uri), extra=extra)
        self.log.info("promoted %s as %s @%s", model, promoted.uri, promoted.version)
        return {"promoted": True, "uri": promoted.uri, **extra, "gate": decision.to_dict()}


def _not_promoted(store: Any, execution: int, decision: Any, message: str) -> None:
    """The gate execution ends FAILED with ``message`` and its decision, promoting nothing."""
    from operators.lineage import ExecutionState

    store.finish_execution(
        execution,
        ExecutionState.FAILED,
        error=message,
        properties={"gate": decision.to_dict(), "promoted": None},
    )
