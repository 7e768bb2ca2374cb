"""Where the lineage database is: the one resolver every Slipway process uses.

The operators (``StepLineageMixin.lineage_store``), the listener (API server, scheduler),
``python -m operators.summary`` and ``slipway lineage`` all call :func:`lineage_url`, so under
the same environment they open the same database. It reads the environment only: the Airflow
Variable ``slipway_home`` (a fallback for the *storage root* in ``operators.settings``) is not
readable from the CLI or from a listener outside a task, so it must not pick the database.
"""

from __future__ import annotations

import os
from pathlib import Path

LINEAGE_ENV = "SLIPWAY_LINEAGE_DB"
HOME_ENV = "SLIPWAY_HOME"
DEFAULT_HOME = "out"


class LineageConfigError(RuntimeError):
    """No database can be derived from the environment (a remote ``SLIPWAY_HOME``)."""


def lineage_url() -> str:
    """``$SLIPWAY_LINEAGE_DB``, else ``sqlite:///<$SLIPWAY_HOME or ./out>/lineage.db`` (absolute).

    A remote ``SLIPWAY_HOME`` (``gs://...``) cannot hold a SQLite file: it needs
    ``SLIPWAY_LINEAGE_DB`` (Postgres / Cloud SQL in production), else
    :class:`LineageConfigError`. ``file://`` homes are local.
    """
    if url := os.environ.get(LINEAGE_ENV):
        return url
    home = os.environ.get(HOME_ENV) or DEFAULT_HOME
    home = home.removeprefix("file://")
    if "://" in home:
        raise LineageConfigError(
            f"{HOME_ENV}={home} is remote: set {LINEAGE_ENV} to a database URL "
            "(Postgres / Cloud SQL in production)"
        )
    return f"sqlite:///{Path(home).absolute() / 'lineage.db'}"


def default_home() -> str:
    """The local folder :func:`lineage_url` puts ``lineage.db`` in when no URL is set."""
    return str(Path((os.environ.get(HOME_ENV) or DEFAULT_HOME).removeprefix("file://")).absolute())


def redacted(url: str) -> str:
    """The URL with any password masked: for logs and messages."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: show no part that might be a secret
        return url.split("@", 1)[-1] if "@" in url else url
