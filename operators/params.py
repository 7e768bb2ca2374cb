"""The run form as Airflow Params: each field of :mod:`operators.pipeline.form` (its default
and JSON schema) wrapped in a ``Param``, which Airflow checks when a run is triggered and the
UI renders as the trigger form.

Importable at DAG parse time: Airflow's ``Param`` and the Airflow-free form only.
"""

from __future__ import annotations

from collections.abc import Mapping

from airflow.sdk import Param

from operators.pipeline.form import form_fields, schema_of


def pipeline_params(environ: Mapping[str, str] | None = None) -> dict[str, Param]:
    """The ``slipway_pipeline`` DAG's params (platform defaults from ``environ``, else the
    process environment; refused at parse time, naming the variable, if the schema refuses
    one)."""
    return {
        name: Param(spec["default"], **schema_of(spec))
        for name, spec in form_fields(environ).items()
    }
