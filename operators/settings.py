"""Where Slipway keeps things: the storage root, the lineage database and the corpora.

Resolved at task run time, never at DAG parse time (a Variable lookup at parse time would hit
the metadata database on every parse):

* storage root: ``$SLIPWAY_HOME``, else the Airflow Variable ``slipway_home``, else ``./out``
  (made absolute). Step outputs live under ``{root}/steps``; a ``gs://`` root works too.
* lineage database: ``$SLIPWAY_LINEAGE_DB``, else ``sqlite:///{root}/lineage.db`` (local roots).
* corpora: the run's ``data_dir`` param, else ``$SLIPWAY_DATA_DIR``, else ``./data``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

HOME_ENV = "SLIPWAY_HOME"
HOME_VARIABLE = "slipway_home"
DATA_ENV = "SLIPWAY_DATA_DIR"
LINEAGE_ENV = "SLIPWAY_LINEAGE_DB"


def _variable(key: str) -> str | None:
    try:
        from airflow.sdk import Variable

        return Variable.get(key, default=None)
    except Exception:  # outside a task (tests, CLI) there is no API server to ask
        return None


def _absolute(path: str) -> str:
    return path if "://" in path else str(Path(path).absolute())


def storage_root() -> str:
    """The root every step output, run summary and (by default) the lineage DB live under."""
    return _absolute(os.environ.get(HOME_ENV) or _variable(HOME_VARIABLE) or "out")


def steps_root() -> str:
    root = storage_root()
    return f"{root.rstrip('/')}/steps" if "://" in root else os.path.join(root, "steps")


def lineage_url() -> str:
    if url := os.environ.get(LINEAGE_ENV):
        return url
    root = storage_root()
    if "://" in root:
        raise RuntimeError(
            f"storage root {root} is remote: set {LINEAGE_ENV} to a database URL "
            "(Postgres / Cloud SQL in production)"
        )
    return f"sqlite:///{Path(root) / 'lineage.db'}"


def data_dir(param: str | None = None) -> str:
    return _absolute(param or os.environ.get(DATA_ENV) or "data")
