"""The pipeline's first task: every check of the run form, before any data is read.

Airflow validates each Param against its JSON schema when the run is triggered; what a schema
cannot say is checked here, in seconds (:func:`operators.params.check_run_config`): rules
across fields, non-finite numbers, the data roots, credentials, identities and images the
platform allows, every stage config, the TPU shape. A refused run is recorded in lineage
(``validate`` FAILED, with the list of problems) like any other failure; ``slipway plan
--conf`` runs the same checks from a shell.

It also records the run's settings on the run itself (lineage's run context): the form's
values, and which fields differ from the DAG's defaults. The run page shows them, refused runs
included (what was refused is worth seeing).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from operators.dataflow import GCP_CONN_ID
from operators.hooks.beam import gcp_connection_project
from operators.step_lineage import StepLineageMixin


class ValidateRunOperator(StepLineageMixin, BaseOperator):
    """:param gcp_conn_id: the GCP connection whose project is the Dataflow project's last
    fallback (the Beam stages' connection), asked only for a DataflowRunner run."""

    ui_color = "#ffe0e0"
    template_fields = ("gcp_conn_id",)
    # The form sets the training batch, checked against the launch's mesh (the sweep's
    # recipe sets each cell's instead).
    form_has_batch = True

    def __init__(self, *, gcp_conn_id: str = GCP_CONN_ID, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "validate")
        super().__init__(**kwargs)
        self.gcp_conn_id = gcp_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.settings import check_run_id, require_own_run_folder

        params = self.run_params(context)
        store = self.lineage_store()
        try:
            if context.get("run_id"):  # before anything is recorded under it
                check_run_id(context["run_id"])
                require_own_run_folder(context["run_id"], store.run_ids())
            settings = {"params": params, "changed": self.changed_fields(params)}
            run_type = getattr(context.get("dag_run"), "run_type", None)
            if run_type is not None:  # manual, scheduled, backfill, asset_triggered
                settings["run_type"] = str(getattr(run_type, "value", run_type))
            with store.recording(
                "validate",
                run_id=context.get("run_id"),
                pipeline=self.dag_id,
                run_properties=settings,
            ):
                self.refuse_undeclared(context.get("params") or {})
                self.check(params)
        finally:
            store.close()
        self.log.info("run form valid")
        return {"valid": True}

    def changed_fields(self, params: dict[str, Any]) -> list[str]:
        """The fields of ``params`` not at the DAG form's defaults (without a DAG, the
        pipeline form's)."""
        from operators.pipeline.form import with_defaults

        try:
            defaults = with_defaults(self.dag.params.dump() if self.has_dag() else {})
        except Exception:  # the run's settings are still worth recording, and the check
            self.log.warning("the form's defaults could not be read", exc_info=True)
            return []
        return sorted(k for k, v in params.items() if k not in defaults or defaults[k] != v)

    def refuse_undeclared(self, params: Any) -> None:
        """Airflow turns a trigger's conf keys that the DAG's form does not declare into
        params without a schema: a pipeline field the sweep's form leaves out, or a typo,
        would pass every check unchecked. Refuse them, naming each."""
        from operators.pipeline.form import RunConfigError, unknown_fields

        if not self.has_dag():
            return
        undeclared = unknown_fields(params, self.dag.params, f"{self.dag_id}'s form")
        if undeclared:
            raise RunConfigError("invalid run configuration:\n  " + "\n  ".join(undeclared))

    def check(self, params: dict[str, Any]) -> None:
        """Raise ``RunConfigError`` listing every problem of the form (a DAG with more
        fields adds its own checks)."""
        from operators.pipeline.form import check_run_config

        check_run_config(
            params,
            connection_project=lambda: gcp_connection_project(self.gcp_conn_id),
            batch=self.form_has_batch,
        )
