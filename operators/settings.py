"""Where Slipway keeps things: the storage root, the lineage database and the corpora.

Resolved at task run time, never at DAG parse time (a Variable lookup at parse time would hit
the metadata database on every parse):

* storage root: ``$SLIPWAY_HOME``, else the Airflow Variable ``slipway_home``, else ``./out``
  (made absolute). Step outputs live under ``{root}/steps``, each DAG run's own files under
  ``{root}/runs/<run_id>``; a ``gs://`` root works too.
* lineage database: ``$SLIPWAY_LINEAGE_DB``, else ``sqlite:///<$SLIPWAY_HOME or ./out>/lineage.db``
  (:mod:`operators.lineage.url`, the one resolver: environment only, so the CLI and the
  listener, which cannot read Variables, open the database the tasks write).
* corpora: the run's ``data_dir`` param (at or below a root the platform allows:
  ``$SLIPWAY_ALLOWED_DATA_ROOTS``, the platform data dir and the storage root), else
  ``$SLIPWAY_DATA_DIR``, else ``./data``.

The DAGs' schedules are read at parse time, from the environment only
(:func:`schedule_from_env`: ``$SLIPWAY_PIPELINE_SCHEDULE``, ``$SLIPWAY_SWEEP_SCHEDULE``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HOME_ENV = "SLIPWAY_HOME"
HOME_VARIABLE = "slipway_home"
DATA_ENV = "SLIPWAY_DATA_DIR"
DATA_ROOTS_ENV = "SLIPWAY_ALLOWED_DATA_ROOTS"
LINEAGE_ENV = "SLIPWAY_LINEAGE_DB"
PIPELINE_SCHEDULE_ENV = "SLIPWAY_PIPELINE_SCHEDULE"
SWEEP_SCHEDULE_ENV = "SLIPWAY_SWEEP_SCHEDULE"


def schedule_from_env(variable: str, default: str) -> str | None:
    """A DAG's schedule as the platform sets it: a cron expression or preset in ``variable``
    (unset or empty: ``default``), or ``none``: no schedule, runs from the form and the API
    only (and then no backfills, which need a time-based schedule)."""
    value = os.environ.get(variable, "").strip() or default
    return None if value.lower() == "none" else value


def _variable(key: str) -> str | None:
    """The Airflow Variable ``key`` where Airflow is already loaded (a task, a DAG parse);
    elsewhere (the ``slipway`` command) there is no API server to ask, and importing Airflow
    to find that out costs seconds and writes ``~/airflow``."""
    if "airflow.sdk" not in sys.modules:
        return None
    try:
        from airflow.sdk import Variable

        return Variable.get(key, default=None)
    except Exception:  # outside a task (tests, CLI) there is no API server to ask
        return None


def absolute(path: str) -> str:
    """Local paths made absolute (against the working directory); URLs as given."""
    return path if "://" in path else str(Path(path).absolute())


def storage_root() -> str:
    """The root every step output, run summary and (by default) the lineage DB live under."""
    return absolute(os.environ.get(HOME_ENV) or _variable(HOME_VARIABLE) or "out")


def steps_root() -> str:
    root = storage_root()
    return f"{root.rstrip('/')}/steps" if "://" in root else os.path.join(root, "steps")


def run_file(run_id: str, name: str) -> str:
    """``{run folder}/name``: where a run's own file lives."""
    from operators.steps import join

    return join(run_folder(run_id), name)


def write_run_text(run_id: str, name: str, text: str) -> str:
    """Write ``text`` to ``{run folder}/name`` (local or object store); its path."""
    import fsspec

    path = run_file(run_id, name)
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(p, text.encode("utf-8"))
    return path


def write_run_file(run_id: str, name: str, body: Any) -> str:
    """Write ``body`` as JSON to ``{run folder}/name`` (local or object store); its path."""
    import json

    return write_run_text(run_id, name, json.dumps(body, indent=2, default=str))


def run_folder_name(run_id: str) -> str:
    """The run folder's name: the run id with anything but letters, digits and ``-_.+``
    replaced by ``_``, and a leading dot too (a run id of ``..`` must not name the folder
    above). Not one-to-one (``a:b`` and ``a_b`` share ``a_b``): see :func:`run_folder_twin`."""
    safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_.+" else "_" for c in run_id)
    if not safe or safe.startswith("."):
        safe = "_" + safe
    return safe


def run_folder(run_id: str) -> str:
    """One DAG run's own files (its resolved graph, its summary): ``{root}/runs/<name>``
    (:func:`run_folder_name`)."""
    safe = run_folder_name(run_id)
    root = storage_root()
    return f"{root.rstrip('/')}/runs/{safe}" if "://" in root else os.path.join(root, "runs", safe)


class RunFolderTaken(ValueError):
    """Another recorded run's id names the same run folder as this run's."""


class RunIdNotAllowed(ValueError):
    """A run id outside Airflow's default pattern for the ids a trigger may give."""


# Airflow's default ``allowed_run_id_pattern``, ASCII only and to the last character: Airflow
# lets an id of its own scheduled shape through on a looser check (``\d`` matches any
# script's digits, ``$`` a final newline) before the pattern a deployment sets.
RUN_ID = re.compile(r"[A-Za-z0-9_.~:+-]{1,250}")


def check_run_id(run_id: str) -> None:
    """Raise :class:`RunIdNotAllowed` unless ``run_id`` is plain: it names a run folder, a
    lineage run and a page's address."""
    if not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        raise RunIdNotAllowed(
            f"run id {run_id!r}: only ASCII letters, digits and _.~:+- (at most 250); "
            "trigger this run with another run id"
        )


def runs_sharing_folder(run_id: str, recorded: Iterable[str]) -> list[str]:
    """The recorded run ids, other than ``run_id``, whose run folder is ``run_id``'s, sorted."""
    name = run_folder_name(run_id)
    return sorted(r for r in recorded if r != run_id and run_folder_name(r) == name)


def run_folder_twin(run_id: str, recorded: Iterable[str]) -> str | None:
    """A recorded run id, other than ``run_id``, whose run folder is ``run_id``'s, or None."""
    return next(iter(runs_sharing_folder(run_id, recorded)), None)


def require_own_run_folder(run_id: str, recorded: Iterable[str]) -> None:
    """Raise :class:`RunFolderTaken` when ``run_id`` would write into the folder of a run
    already recorded (``recorded``: lineage's run ids) under another id, e.g. a run id given
    through the REST API as ``scheduled__2026-01-01T02_00_00+00_00`` beside the night
    ``scheduled__2026-01-01T02:00:00+00:00``: its graph, summary and report would overwrite
    that run's."""
    twin = run_folder_twin(run_id, recorded)
    if twin is not None:
        raise RunFolderTaken(
            f"run id {run_id!r} names the run folder {run_folder_name(run_id)!r}, which belongs "
            f"to the recorded run {twin!r}: trigger this run with another run id"
        )


def lineage_url() -> str:
    """The lineage database URL: :func:`operators.lineage.lineage_url`, the one resolver.

    From the environment only (``$SLIPWAY_LINEAGE_DB``, else ``sqlite:///<$SLIPWAY_HOME or
    ./out>/lineage.db``), never from the Airflow Variable, so that the CLI and the listener,
    which cannot read Variables, open the database the operators write.
    """
    from operators.lineage.url import lineage_url as resolve

    return resolve()


class DataDirNotAllowed(ValueError):
    """A run's ``data_dir`` outside every root the platform allows."""


def _normalized(path: str) -> str:
    """Local: absolute with symlinks and ``..`` resolved (a link cannot lead out of a root);
    object stores: as given, without a trailing slash."""
    if "://" in path and not path.startswith("file://"):
        return path.rstrip("/")
    return os.path.realpath(path.removeprefix("file://"))


def platform_data_dir() -> str:
    """The corpora folder when a run names none: ``$SLIPWAY_DATA_DIR``, else ``./data``."""
    return absolute(os.environ.get(DATA_ENV) or "data")


def allowed_data_roots() -> tuple[str, ...]:
    """Where a run's ``data_dir`` may point: at or below one of these. The platform's list in
    ``$SLIPWAY_ALLOWED_DATA_ROOTS`` (comma-separated folders or gs:// prefixes), always with
    the platform data dir and the storage root."""
    listed = [p.strip() for p in os.environ.get(DATA_ROOTS_ENV, "").split(",") if p.strip()]
    return tuple(dict.fromkeys([*map(absolute, listed), platform_data_dir(), storage_root()]))


def data_dir(param: str | None = None) -> str:
    """The run's corpora folder: its ``data_dir`` param, which must lie at or below one of
    :func:`allowed_data_roots` (:class:`DataDirNotAllowed` otherwise), else the platform's."""
    if not param:
        return platform_data_dir()
    path = absolute(param)
    target = _normalized(path)
    for root in allowed_data_roots():
        base = _normalized(root)
        if target == base or target.startswith(base.rstrip("/") + "/"):
            return path
    raise DataDirNotAllowed(
        f"data_dir {param!r} is outside the data roots the platform allows "
        f"({', '.join(allowed_data_roots())}; an operator adds more in {DATA_ROOTS_ENV})"
    )
