"""Slipway's Airflow plugin: the lineage listener (``operators/listener.py``) and the Slipway
pages (``operators/ui.py``: runs, run reports, lineage, sweeps) in the Airflow UI.

Airflow loads it from its plugins folder: point ``AIRFLOW__CORE__PLUGINS_FOLDER`` at this
directory (``make demo`` / ``make airflow`` and the tests do). Plugins load in every Airflow
process (scheduler, API server, dag-processor, task runner), so the pages' app is imported on
its first request (about a second of imports that no task process should pay).

The UI shows the pages through external views: a **Slipway** entry in the navigation, a
"Slipway report" tab on every DAG run and a "Slipway step" tab on every task instance (the run
page, opened at the task's step). Airflow fills ``{DAG_ID}``, ``{RUN_ID}`` and ``{TASK_ID}``
(percent-encoded). The tabs name the DAG too: scheduled run ids are the same in every DAG, and
another DAG's tab must not open a Slipway run of the same id (the page says that DAG records
no Slipway lineage).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from operators import listener
from operators.reports import URL_PREFIX


class _Pages:
    """``operators.ui.app``, imported when the API server first routes a request to it."""

    async def __call__(self, scope, receive, send) -> None:
        from operators.ui import app

        await app(scope, receive, send)


class SlipwayPlugin(AirflowPlugin):
    name = "slipway"
    listeners = [listener]  # noqa: RUF012 (Airflow's plugin attributes are class-level lists)
    fastapi_apps = [{"app": _Pages(), "url_prefix": URL_PREFIX, "name": "Slipway reports"}]  # noqa: RUF012
    external_views = [  # noqa: RUF012
        {
            "name": "Slipway",
            "href": f"{URL_PREFIX}/",
            "destination": "nav",
            "url_route": "slipway",
        },
        {
            "name": "Slipway report",
            "href": f"{URL_PREFIX}/runs/{{RUN_ID}}?dag_id={{DAG_ID}}",
            "destination": "dag_run",
            "url_route": "slipway-run",
        },
        {
            "name": "Slipway step",
            "href": f"{URL_PREFIX}/runs/{{RUN_ID}}?dag_id={{DAG_ID}}#step-{{TASK_ID}}",
            "destination": "task_instance",
            "url_route": "slipway-step",
        },
    ]
