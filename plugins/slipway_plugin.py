"""Slipway's Airflow plugin: registers the lineage listener (``operators/listener.py``).

Airflow loads it from its plugins folder: point ``AIRFLOW__CORE__PLUGINS_FOLDER`` at this
directory (``make demo`` / ``make airflow`` and the tests do). Kept to an import and a class:
plugins load in every Airflow process (scheduler, API server, dag-processor, task runner).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from operators import listener


class SlipwayPlugin(AirflowPlugin):
    name = "slipway"
    listeners = [listener]  # noqa: RUF012 (Airflow's plugin attribute is a class-level list)
