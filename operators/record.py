"""The run's last task (``trigger_rule="all_done"``): the run summary, whatever happened.

Callbacks do not fire for tasks killed from outside, and no listener hook fires when a task's
own process is killed while its supervisor lives on (the supervisor only reports the state).
So this task closes the gap: an execution still RUNNING whose task Airflow has marked failed is
closed FAILED ("ended without reporting"), any other RUNNING one CANCELED; then it writes a
summary to lineage (an execution ``record`` with a ``run_summary`` artifact, also
``{root}/runs/<run_id>/summary.json``):

* every step with its state in this run (COMPLETE, CACHED, FAILED, CANCELED, or not run)
  and its marker on storage;
* which step failed and why (the first failure in pipeline order; later ones listed too);
* what a rerun would skip (SUCCESS markers: cache hits), what it would rerun, and where the
  training would resume (its last committed checkpoint);
* the promotion gate's outcome (``gate``): the model promoted and its version, or the table of
  the criteria it failed (a failed gate fails the run; the summary is written first);
* the run's self-contained ``report.html`` beside it (``operators/reports/static.py``).

It then fails if anything upstream failed: as the DAG's only leaf, a success here would
otherwise mark a failed run successful.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from operators.run_steps import (
    latest_attempts,
    settle_failures,
    step_states,
    stepless_failures,
)
from operators.step_lineage import StepLineageMixin, require_own_run

# A training task killed from the UI is closed by the listener at once, but its trainer is
# still checkpointing on SIGTERM; the task records where training can resume when it ends.
KILLED_TRAIN_GRACE_S = 120.0


def run_task_states(context: Any) -> dict[str, str]:
    """Airflow's state of each task instance of this run (mapped ones as ``<task>_<index>``)."""
    ti = context.get("ti")
    try:
        states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id])
    except Exception:  # outside a supervised task (unit tests)
        return {}
    states = states.get(ti.run_id, states) if isinstance(states, dict) else {}
    return {k: str(v) for k, v in states.items() if v is not None}


def close_leftovers(
    store: Any, run_id: str, task_states: dict[str, str], pipeline: str | None = None
) -> dict[str, int]:
    """Close the run's RUNNING executions: FAILED where Airflow says the task failed (its
    process died before it could report), CANCELED otherwise. Counts by new state. Nothing
    when ``pipeline`` (the DAG id) does not own the run id (``RunIdConflict``).

    ``task_states`` as ``get_task_states`` gives them: a mapped task instance (a sweep cell)
    is ``<task_id>_<map_index>``, and its executions record their map index.
    """
    from operators.lineage import ExecutionState

    closed = {"FAILED": 0, "CANCELED": 0}
    if not store.owns_run(run_id, pipeline):
        return closed
    for ex in store.executions(run_id, state=ExecutionState.RUNNING):
        props = ex.properties or {}
        task = props.get("task_id", ex.name.split("/", 1)[0])
        if props.get("map_index") is not None:
            task = f"{task}_{props['map_index']}"
        airflow_state = task_states.get(task)
        if airflow_state == "failed":
            state = ExecutionState.FAILED
            reason = "task failed without reporting its end (its process was killed or died)"
        else:
            state = ExecutionState.CANCELED
            reason = f"task ended without reporting (Airflow: {airflow_state or 'unknown'})"
        if store.finish_execution(
            ex.id,
            state,
            error=reason,
            properties={"closed_by": "record", "record_reason": reason},
            only_if_running=True,
        ):
            closed[str(state)] += 1
    return closed


class RecordRunOperator(StepLineageMixin, BaseOperator):
    ui_color = "#eeeeee"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "record")
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)

    def execute(self, context: Any) -> dict[str, Any]:
        summary = self.summarize(context)
        self.log.info("run summary:\n%s", json.dumps(summary, indent=2, default=str))
        if summary["failed"]:
            first = summary["failed"][0]
            raise AirflowFailException(
                f"run {summary['run_id']} failed at {first['step']}: {first['error']}"
            )
        return summary

    def _task_order(self) -> list[str]:
        """The DAG's task ids in the order it defines them (the pipeline's order)."""
        dag = self.dag if self.has_dag() else None
        return list(dag.task_dict) if dag is not None else []

    def _train_still_ending(self, ex: Any) -> bool:
        """A training task killed from the UI (closed by the listener) whose process is still
        ending: it has not recorded where training resumes, and it still holds the step's
        lease. A task whose process died (its worker killed) will record nothing: where its
        lease names a process of this machine that is gone, only its trainer may still be
        saving the checkpoint it was signalled to save, until it writes its result; elsewhere
        the wait ends when the lease expires, or after the grace."""
        if ex is None or ex.properties.get("closed_by") != "listener":
            return False
        if "resumable" in ex.properties:
            return False
        output = ex.properties.get("output")
        if not output:
            return False
        from operators.steps import current_lease, store_for

        store = store_for(output)
        lease = current_lease(store, output)
        if lease is None or not lease.live(time.time()):
            return False
        if lease.holder_exited():
            return not self._trainer_ended(store, output, ex.started_at)
        return True

    @staticmethod
    def _trainer_ended(store: Any, output: str, since: datetime) -> bool:
        """The trainer wrote its result (after its last checkpoint) since ``since``, when its
        task started: it has ended, whether it finished, failed or saved on a SIGTERM."""
        from operators.steps import join
        from trainer.rundir import RESULT

        written = store.modified(join(output, RESULT))
        return written is not None and written >= since.timestamp()

    def _wait_for_train_ending(self, store: Any, run_id: str, ex: Any) -> Any:
        """Wait (bounded) for a killed training task to record its checkpoint, so that the
        summary's "training resumes from" is the checkpoint its trainer saved on SIGTERM."""
        self.log.info("train was killed; waiting for it to record its last checkpoint")
        deadline = time.monotonic() + KILLED_TRAIN_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(2.0)
            for node in store.run_graph(run_id).steps:
                if node.execution.id == ex.id:
                    ex = node.execution
            if not self._train_still_ending(ex):
                break
        else:
            self.log.warning("train did not record its ending within %.0f s", KILLED_TRAIN_GRACE_S)
        return ex

    @staticmethod
    def _gate(executions: list[Any], task_states: dict[str, str]) -> dict[str, Any]:
        """The promotion gate's outcome: its last execution (promoted, or the table of failed
        criteria), else NOT_RUN with the task's Airflow state (upstream_failed when evaluate
        failed)."""
        from operators.promotion import gate_outcome

        found = gate_outcome(executions)
        if found is None:
            return {"state": "NOT_RUN", "task_state": task_states.get("gate"), "promoted": False}
        return found

    def _write_report(
        self, store: Any, run_id: str, execution: int, started_at: Any = None
    ) -> str | None:
        """The run's self-contained ``report.html`` (operators/reports/static.py), recorded as
        an output of ``record``; ``started_at``: the DAG run's start as Airflow has it (a
        cleared run's rerun's), as the live run page shows it. A report that cannot be written
        is logged, never fatal: the summary and lineage above are the record of the run."""
        from operators.reports.static import write_run_report
        from operators.reports.view import REPORT_ARTIFACT

        try:
            path = write_run_report(store, run_id, started_at=started_at)
        except Exception:
            self.log.exception("the run report was not written")
            return None
        store.record_output(execution, path, REPORT_ARTIFACT)
        self.log.info("run report: %s", path)
        return path

    def summarize(self, context: Any) -> dict[str, Any]:
        from operators.settings import write_run_file
        from trainer.rundir import last_checkpoint

        run_id = context.get("run_id")
        root = self.steps_root()
        store = self.lineage_store()
        try:
            # Before reading or writing anything of the run: record runs all_done, even after
            # validate refused a run id another DAG owns (RunIdConflict) or whose folder
            # another run has (RunFolderTaken).
            require_own_run(store, run_id, self.dag_id)
            task_states = run_task_states(context)
            order = {task: i for i, task in enumerate(self._task_order())}
            # in the pipeline's order: the run page lists what never ran so
            task_states = dict(
                sorted(task_states.items(), key=lambda kv: order.get(kv[0], len(order)))
            )
            closed = close_leftovers(store, run_id, task_states, self.dag_id)
            try:
                graph_run = store.run_graph(run_id)
                executions = [node.execution for node in graph_run.steps]
            except Exception:  # no execution at all in this run (failed before any)
                executions = []
            latest = latest_attempts(executions)
            if self._train_still_ending(latest.get("train")):
                latest["train"] = self._wait_for_train_ending(store, run_id, latest["train"])
            try:
                steps = self.step_graph(context).all_steps()
            except Exception as exc:  # corpora missing: fetch failed
                steps = []
                graph_error = f"{type(exc).__name__}: {exc}"
            else:
                graph_error = None
            # The latest attempt of each task without steps (validate, fetch): one that failed
            # and then succeeded on a retry is no failure of the run. The gate comes last.
            failed = stepless_failures(latest, {s.name for s in steps} | {"gate"})
            rows, step_failed, skip, rerun = step_states(root, steps, latest)
            failed += step_failed
            gate = self._gate(executions, task_states)
            if gate["state"] in ("FAILED", "CANCELED"):
                failed.append({"step": "gate", "error": gate["error"]})
            failed = settle_failures(failed, task_states, graph_error, order=self._task_order())
            train = next((s for s in steps if s.name == "train"), None)
            resume = None
            if train is not None and "train" not in [s.split("-")[0] for s in skip]:
                from operators.steps import output_path

                ckpt = last_checkpoint(output_path(root, train))
                resume = {"step": ckpt[0], "checkpoint": ckpt[1]} if ckpt else None
            summary = {
                "run_id": run_id,
                "pipeline": self.dag_id,
                "state": "FAILED" if failed else "SUCCESS",
                "failed": failed,
                "steps": rows,
                "gate": gate,
                "task_states": task_states,
                "canceled_executions": closed["CANCELED"],
                "failed_unreported_executions": closed["FAILED"],
                "resume": {
                    "skipped_on_rerun": skip,
                    "rerun": rerun,
                    "training_resumes_from": resume,
                },
            }
            path = write_run_file(run_id, "summary.json", summary)
            execution = store.start_execution("record", run_id=run_id, pipeline=self.dag_id)
            store.record_output(execution, path, "run_summary", properties=summary)
            started_at = getattr(context.get("dag_run"), "start_date", None)
            summary["report_path"] = self._write_report(store, run_id, execution, started_at)
            store.finish_execution(execution, properties={"state": summary["state"]})
            summary["summary_path"] = path
            return summary
        finally:
            store.close()
