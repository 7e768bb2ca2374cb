"""The lineage store: executions, artifacts, events and contexts in any SQLAlchemy database.

SQLite by default (one file, several writer processes: WAL + busy timeout + ``BEGIN
IMMEDIATE``), Postgres / Cloud SQL in production through the same code. Reads return frozen
records, never live ORM objects, so callers cannot hold sessions open by accident.

Why one long module (over 500 lines): it is the only code that touches the lineage tables, and
its writes share one transaction discipline (``_transact``'s retries, conflict-free inserts,
row locks) that each reader and writer relies on; split across files, a new write could skip
it. Its sections: records, writing, reading, tracing, engine and schema.

Concurrent writers (tasks, the listener in the API server and the scheduler) never lose or
duplicate a record, on either database:

* rows that several writers may create at once (contexts, their parents, attributions, events,
  an artifact version) are inserted with ``INSERT ... ON CONFLICT DO NOTHING`` and then read
  back, so the loser of a race uses the winner's row instead of failing;
* read-modify-write of one row (an execution's properties, an artifact's fields) locks it first
  (``SELECT ... FOR UPDATE`` on Postgres; SQLite's ``BEGIN IMMEDIATE`` serializes writers);
* "close it if it is still RUNNING" (the listener, ``cancel_running``) is one conditional
  ``UPDATE ... WHERE state = 'RUNNING'``, which Postgres re-checks against the row's latest
  version: a step's own COMPLETE committed meanwhile is never overwritten;
* a write conditional on what its writer read (``record_output(..., if_latest=...)``, the
  gate's promotion) checks the URI's latest version under a transaction advisory lock on the
  URI (Postgres) or in its serialized write transaction (SQLite): of two, one wins;
* a transaction that Postgres rolls back as a serialization failure or a deadlock is retried
  whole (a few times, with jittered backoff). Connection errors are not retried: the commit
  may have happened, and a replayed ``start_execution`` would duplicate the execution.

Postgres runs at READ COMMITTED (set on the engine, whatever the server default).

JSON columns (counts, properties, configs) keep non-finite floats: a diverged run's NaN loss
is a result to record, but Postgres refuses JSON's non-standard ``NaN`` token, so both
databases store such a float as ``{"$float": "NaN"}`` and read it back as the float
(:func:`_json_dumps`, :func:`_json_loads`). So an object of that one key holding ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` is reserved: it reads back as the float.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import random
import time
import traceback as tb
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    case,
    create_engine,
    event,
    func,
    inspect,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from operators.lineage import version as _version
from operators.lineage.schema import (
    Artifact,
    Association,
    Attribution,
    Base,
    Context,
    ContextParent,
    ContextType,
    EventType,
    Execution,
    ExecutionState,
    utcnow,
)
from operators.lineage.schema import Event as EventRow
from operators.lineage.url import lineage_url, redacted

log = logging.getLogger(__name__)

T = TypeVar("T")

TRACEBACK_TAIL_CHARS = 8000  # the failing frames, not a megabyte of recursion
SQLITE_BUSY_TIMEOUT_MS = 30_000
# SQLSTATEs with which Postgres rolls back a transaction that lost a race it could not order:
# serialization_failure, deadlock_detected. The whole transaction is safe to run again.
RETRY_SQLSTATES = frozenset({"40001", "40P01"})
WRITE_ATTEMPTS = 6
_RETRY_FIRST_DELAY_S = 0.02
# pg_advisory_xact_lock key: one process at a time creates or upgrades the schema.
_SCHEMA_LOCK_KEY = 0x51_1F_3A_7E

# Whichever state wins when the latest attempts of a run's steps disagree: a run is as bad as
# its worst step. An earlier attempt that a rerun (a cleared task, a backfill) replaced does
# not count: a run repaired that way reads COMPLETE, as its summary does.
_RUN_STATE_PRECEDENCE = (
    ExecutionState.RUNNING,
    ExecutionState.FAILED,
    ExecutionState.CANCELED,
    ExecutionState.COMPLETE,
    ExecutionState.CACHED,
)
# Which producer of an artifact to trace through: the one that really made it.
_PRODUCER_PREFERENCE = {
    ExecutionState.COMPLETE: 0,
    ExecutionState.CACHED: 1,
    ExecutionState.RUNNING: 2,
    ExecutionState.FAILED: 3,
    ExecutionState.CANCELED: 4,
}


class LineageError(RuntimeError):
    pass


class NotFound(LineageError, KeyError):
    pass


class Superseded(LineageError):
    """A conditional write (``record_output(..., if_latest=...)``) found that the URI's latest
    version is no longer the one its writer read: another writer got there first. Nothing was
    recorded."""

    def __init__(self, uri: str, expected: str | None, found: str | None) -> None:
        super().__init__(
            f"{uri} changed meanwhile: its latest version is {found or 'none'},"
            f" not {expected or 'none'}"
        )
        self.uri, self.expected, self.found = uri, expected, found


class Unchecked(enum.Enum):
    """``record_output``'s default ``if_latest``: write whatever the latest version is."""

    UNCHECKED = "unchecked"


UNCHECKED = Unchecked.UNCHECKED


class RunIdConflict(LineageError):
    """A DAG run id already recorded for another pipeline. Lineage runs (and run folders) are
    keyed by the Airflow run id alone, which Airflow keeps unique per DAG only: two DAGs whose
    schedules fire at one instant, or backfills of one date, get the same id."""

    run_id: str
    owner: str  # the pipeline(s) that recorded it, comma-separated
    pipeline: str  # the one refused

    @classmethod
    def check(cls, run_id: str, owners: set[str], pipeline: str | None) -> None:
        """Raise when ``pipeline`` may not write under ``run_id``, whose ``owners`` are the
        pipelines that recorded it (none yet, or ``pipeline`` among them: it may; a writer
        that names no pipeline always may)."""
        if owners and pipeline is not None and pipeline not in owners:
            raise cls.of(run_id, ", ".join(sorted(owners)), pipeline)

    @classmethod
    def of(cls, run_id: str, owner: str, pipeline: str) -> RunIdConflict:
        conflict = cls(
            f"run id {run_id!r} is already recorded for pipeline {owner!r}, not {pipeline!r}:"
            " Slipway's lineage and run folders are keyed by the Airflow run id alone, so two"
            " DAGs' runs must not share one. Give the DAGs schedules that never fire at the same"
            " instant ($SLIPWAY_PIPELINE_SCHEDULE, $SLIPWAY_SWEEP_SCHEDULE), or trigger this one"
            " with another run id"
        )
        conflict.run_id, conflict.owner, conflict.pipeline = run_id, owner, pipeline
        return conflict


def sqlite_path(url: str) -> Path | None:
    """The file behind a ``sqlite:///`` URL (None for other databases and ``:memory:``)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


# -- records returned to callers ---------------------------------------------------------------


@dataclass(frozen=True)
class ArtifactRecord:
    id: int
    uri: str
    version: str  # what content this is ("" when recorded without one): see schema.Artifact
    type: str
    content_hash: str | None
    counts: Mapping[str, Any] | None
    config: Mapping[str, Any] | None
    code_version: str | None
    container_image: str | None
    properties: Mapping[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class ExecutionRecord:
    id: int
    name: str
    run_id: str | None
    step_version: str | None
    state: ExecutionState
    started_at: datetime
    ended_at: datetime | None
    error: str | None
    traceback: str | None
    code_version: str | None
    container_image: str | None
    properties: Mapping[str, Any]

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else (self.ended_at - self.started_at).total_seconds()


@dataclass(frozen=True)
class Linked:
    artifact: ArtifactRecord
    role: str | None


@dataclass(frozen=True)
class StepNode:
    execution: ExecutionRecord
    inputs: tuple[Linked, ...]
    outputs: tuple[Linked, ...]


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    pipeline: str | None
    state: ExecutionState
    started_at: datetime
    ended_at: datetime | None
    counts: Mapping[str, int]  # executions by state
    # What the run's first task recorded about the run as a whole: ``params`` (the form's
    # values the run was triggered with) and ``changed`` (the fields not at their defaults).
    properties: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunOutput:
    """One output of one execution of a run, as :meth:`LineageStore.run_outputs` lists them."""

    run_id: str
    execution_id: int
    step: str  # the execution's name
    role: str | None
    type: str
    uri: str
    version: str
    counts: Mapping[str, Any]


@dataclass(frozen=True)
class RunFailure:
    """A run's latest attempt of a step that FAILED or was CANCELED, as
    :meth:`LineageStore.run_failures` lists them."""

    run_id: str
    execution_id: int
    step: str  # the execution's name
    properties: Mapping[str, Any]


@dataclass(frozen=True)
class RunGraph:
    run: RunSummary
    steps: tuple[StepNode, ...]  # in start order, which is a topological order of the run


@dataclass(frozen=True)
class TraceNode:
    """An artifact, the execution that produced it and, recursively, that execution's inputs."""

    artifact: ArtifactRecord
    producer: ExecutionRecord | None
    inputs: tuple[TraceNode, ...]

    def raw_inputs(self) -> list[ArtifactRecord]:
        """Leaves: artifacts that no recorded execution produced from recorded inputs: raw
        data (the ``fetch`` task records the corpora it found as its outputs, from nothing
        recorded), external models."""
        leaves: dict[int, ArtifactRecord] = {}
        visited: set[int] = set()

        def visit(node: TraceNode) -> None:
            if id(node) in visited:  # shared: a node reached along several paths
                return
            visited.add(id(node))
            if node.producer is None or not node.inputs:
                leaves.setdefault(node.artifact.id, node.artifact)
            for child in node.inputs:  # none without a producer
                visit(child)

        visit(self)
        return list(leaves.values())


def _artifact_record(row: Artifact) -> ArtifactRecord:
    return ArtifactRecord(
        id=row.id,
        uri=row.uri,
        version=row.version or "",
        type=row.type,
        content_hash=row.content_hash,
        counts=row.counts,
        config=row.config,
        code_version=row.code_version,
        container_image=row.container_image,
        properties=row.properties or {},
        created_at=row.created_at,
    )


def _execution_record(row: Execution) -> ExecutionRecord:
    return ExecutionRecord(
        id=row.id,
        name=row.name,
        run_id=row.run_id,
        step_version=row.step_version,
        state=ExecutionState(row.state),
        started_at=row.started_at,
        ended_at=row.ended_at,
        error=row.error,
        traceback=row.traceback,
        code_version=row.code_version,
        container_image=row.container_image,
        properties=row.properties or {},
    )


# -- the store ------------------------------------------------------------------------------------


def open_for_reading(url: str) -> LineageStore:
    """The existing store at ``url`` (``create=False``: ``NotFound`` where there is none), or
    :class:`~operators.lineage.url.LineageConfigError` saying in one line why it cannot be
    opened: no database URL, a driver not installed, a file that is no database, a server
    out of reach (the password masked). What the command-line readers print."""
    from sqlalchemy.exc import ArgumentError, DatabaseError

    from operators.lineage.url import LineageConfigError

    try:
        return LineageStore(url, create=False)
    except ArgumentError as exc:
        raise LineageConfigError(f"{redacted(url)} is not a database URL: {exc}") from None
    except ImportError as exc:
        raise LineageConfigError(
            f"cannot open {redacted(url)}: its driver {exc.name or exc} is not installed"
        ) from None
    except DatabaseError as exc:  # unreachable server, bad credentials, not a database
        raise LineageConfigError(f"cannot open {redacted(url)}: {exc.orig}") from None


class LineageStore:
    """``LineageStore(url)``; the schema is created on first use unless ``create=False``.

    ``url`` defaults to :func:`operators.lineage.url.lineage_url`. With ``create=False`` (the
    CLI, the listener) a missing database (no SQLite file, no lineage tables) raises
    :class:`NotFound` instead of creating one.
    """

    def __init__(self, url: str | None = None, *, create: bool = True) -> None:
        self.url = url or lineage_url()
        path = sqlite_path(self.url)
        if path is not None:
            if not create and not path.exists():
                raise NotFound(f"no lineage database at {path}")
            path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = _make_engine(self.url)
        # Reads use a plain (deferred) BEGIN so that they never queue behind writers.
        self._read_engine = self.engine.execution_options(slipway_begin="DEFERRED")
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self._read_engine, expire_on_commit=False)
        try:
            if create:
                _create_schema(self.engine, self._read_engine)
            else:
                _open_schema(self.engine, self._read_engine, self.url)
        except BaseException:
            self.engine.dispose()
            raise

    @property
    def display_url(self) -> str:
        """The URL with its password masked (for logs)."""
        return redacted(self.url)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> LineageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _transact(self, work: Callable[[Session], T]) -> T:
        """Run ``work`` in one write transaction, again if Postgres rolled it back in a race."""
        delay = _RETRY_FIRST_DELAY_S
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            try:
                with self._sessions.begin() as session:
                    return work(session)
            except DBAPIError as exc:
                code = _sqlstate(exc)
                if attempt == WRITE_ATTEMPTS or code not in RETRY_SQLSTATES:
                    raise
                log.info(
                    "lineage: transaction rolled back (SQLSTATE %s), retry %d of %d",
                    code,
                    attempt,
                    WRITE_ATTEMPTS - 1,
                )
                time.sleep(delay * (1 + random.random()))
                delay *= 2
        raise AssertionError("unreachable")

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._read_sessions() as session:
            yield session

    # -- writing ----------------------------------------------------------------------------------

    def start_execution(
        self,
        name: str,
        *,
        run_id: str | None = None,
        pipeline: str | None = None,
        step_version: str | None = None,
        properties: Mapping[str, Any] | None = None,
        run_properties: Mapping[str, Any] | None = None,
        code_version: str | None = None,
        container_image: str | None = None,
        started_at: datetime | None = None,
        state: ExecutionState = ExecutionState.RUNNING,
    ) -> int:
        """Record that step ``name`` started (in DAG run ``run_id`` of ``pipeline``).

        The execution joins the contexts pipeline, dag_run and step (``name`` + version), which
        are created on first sight. Returns the execution id.
        """
        values = {
            "name": name,
            "run_id": run_id,
            "step_version": step_version,
            "state": str(state),
            "started_at": started_at or utcnow(),
            "code_version": code_version or _version.code_version(),
            "container_image": container_image or _version.container_image(),
            "properties": dict(properties or {}),
        }

        def work(session: Session) -> int:
            row = Execution(**values)
            session.add(row)
            session.flush()
            contexts = self._contexts_for(
                session, name, run_id, pipeline, step_version, run_properties
            )
            for context_id in dict.fromkeys(contexts):
                session.add(Association(context_id=context_id, execution_id=row.id))
            return row.id

        return self._transact(work)

    def finish_execution(
        self,
        execution_id: int,
        state: ExecutionState | str = ExecutionState.COMPLETE,
        *,
        error: str | BaseException | None = None,
        traceback: str | None = None,
        properties: Mapping[str, Any] | None = None,
        ended_at: datetime | None = None,
        only_if_running: bool = False,
    ) -> bool:
        """Close an execution. ``error`` may be the exception: its traceback tail is kept.

        ``only_if_running``: leave an execution that has already ended alone (someone who
        closes executions from outside, like the listener, must not overwrite the step's own
        report). Returns whether the execution was changed.
        """
        state = ExecutionState(state)
        if state is ExecutionState.RUNNING:
            raise ValueError("finish_execution needs a terminal state")
        if isinstance(error, BaseException):
            traceback = traceback or "".join(tb.format_exception(error))
            error = f"{type(error).__name__}: {error}"
        ended = ended_at or utcnow()

        def work(session: Session) -> bool:
            # Locked: the properties merge below must not lose a concurrent writer's keys.
            row = session.get(Execution, execution_id, with_for_update=True)
            if row is None:
                raise NotFound(f"no execution {execution_id}")
            if only_if_running and row.state != ExecutionState.RUNNING:
                return False
            row.state = str(state)
            row.ended_at = ended
            row.error = error
            row.traceback = traceback[-TRACEBACK_TAIL_CHARS:] if traceback else None
            if properties:
                row.properties = {**(row.properties or {}), **properties}
            return True

        return self._transact(work)

    @contextmanager
    def recording(self, name: str, **start: Any) -> Iterator[int]:
        """An execution around a block: started (``start`` as for :meth:`start_execution`),
        its id given to the block, then closed COMPLETE, or FAILED with the exception the
        block raised (re-raised). For tasks that are no content-addressed step."""
        execution = self.start_execution(name, **start)
        try:
            yield execution
        except BaseException as exc:
            self.finish_execution(execution, ExecutionState.FAILED, error=exc)
            raise
        self.finish_execution(execution)

    def cancel_running(self, run_id: str, reason: str = "run ended with this step running") -> int:
        """Mark every still-RUNNING execution of a run CANCELED.

        For the gap that callbacks leave: a task killed from outside never reports. The DAG's
        final ``all_done`` task (or a listener) calls this. Returns how many were closed; an
        execution that ends itself meanwhile keeps its own state.
        """
        now = utcnow()

        def work(session: Session) -> int:
            result = session.execute(
                update(Execution)
                .where(Execution.run_id == run_id, Execution.state == str(ExecutionState.RUNNING))
                .values(state=str(ExecutionState.CANCELED), ended_at=now, error=reason)
                .execution_options(synchronize_session=False)
            )
            return int(result.rowcount or 0)

        return self._transact(work)

    def record_artifact(
        self,
        uri: str,
        type: str,
        *,
        version: str | None = None,
        content_hash: str | None = None,
        counts: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        code_version: str | None = None,
        container_image: str | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> int:
        """Create or update one version of the artifact at ``uri``. Returns its id.

        The version is ``version``, else ``content_hash``: the same content recorded again is
        the same artifact (fields given as None are kept), new content at the same URI is a new
        one. With neither, the latest recorded version of ``uri`` is updated (or an unversioned
        one created).
        """
        fields = _artifact_fields(
            type, content_hash, counts, config, code_version, container_image, properties
        )
        key = version if version is not None else content_hash
        return self._transact(lambda session: _upsert_artifact(session, uri, key, fields).id)

    def link(
        self,
        execution_id: int,
        artifact: int | str,
        type: EventType | str,
        *,
        role: str | None = None,
        version: str | None = None,
    ) -> None:
        """An INPUT or OUTPUT event; the artifact also joins the execution's contexts.

        ``artifact``: an id, or a URI (its ``version``, else its latest recorded version).
        """
        kind = EventType(type)

        def work(session: Session) -> None:
            artifact_id = self._artifact_id(session, artifact, version)
            _link(session, execution_id, artifact_id, kind, role)

        self._transact(work)

    def record_input(
        self,
        execution_id: int,
        uri: str,
        type: str,
        *,
        role: str | None = None,
        version: str | None = None,
        **fields: Any,
    ) -> int:
        """The execution read this version of ``uri`` (artifact and INPUT event, one transaction).

        Give the version it read (``version``, or ``content_hash``: a content id); without one
        it links to the latest version recorded so far, which is what was there when it read.
        """
        return self._record_io(execution_id, uri, type, EventType.INPUT, role, version, fields)

    def record_output(
        self,
        execution_id: int,
        uri: str,
        type: str,
        *,
        role: str | None = None,
        version: str | None = None,
        if_latest: str | Unchecked | None = UNCHECKED,
        **fields: Any,
    ) -> int:
        """Record an artifact the execution produced; it inherits the execution's code
        version and container image unless given. ``version`` as in :meth:`record_artifact`
        (step outputs: the step's version).

        ``if_latest``: record it only if ``uri``'s latest version is still this one (None: it
        has none yet), else raise :class:`Superseded` and record nothing. A compare-and-set
        for a writer that decided on what it read (the gate, on the promoted model): of two
        such writers that read the same version, one wins. Writers of one URI are serialized
        for the check (Postgres: a transaction-scoped advisory lock on the URI; SQLite's
        ``BEGIN IMMEDIATE`` serializes every writer).
        """
        return self._record_io(
            execution_id, uri, type, EventType.OUTPUT, role, version, fields, if_latest
        )

    def _record_io(
        self,
        execution_id: int,
        uri: str,
        type: str,
        kind: EventType,
        role: str | None,
        version: str | None,
        fields: Mapping[str, Any],
        if_latest: str | Unchecked | None = UNCHECKED,
    ) -> int:
        given = {"content_hash": None, "counts": None, "config": None, **fields}
        unknown = set(given) - {
            "content_hash",
            "counts",
            "config",
            "code_version",
            "container_image",
            "properties",
        }
        if unknown:
            raise TypeError(f"unknown artifact fields: {sorted(unknown)}")
        key = version if version is not None else given["content_hash"]

        def work(session: Session) -> int:
            if if_latest is not UNCHECKED:
                _check_latest(session, uri, if_latest)
            values = dict(given)
            if kind is EventType.OUTPUT:
                producer = session.get(Execution, execution_id)
                if producer is None:
                    raise NotFound(f"no execution {execution_id}")
                if values.get("code_version") is None:
                    values["code_version"] = producer.code_version
                if values.get("container_image") is None:
                    values["container_image"] = producer.container_image
            artifact = _upsert_artifact(
                session,
                uri,
                key,
                _artifact_fields(
                    type,
                    values["content_hash"],
                    values["counts"],
                    values["config"],
                    values.get("code_version"),
                    values.get("container_image"),
                    values.get("properties"),
                ),
            )
            _link(session, execution_id, artifact.id, kind, role)
            return artifact.id

        return self._transact(work)

    # -- reading ----------------------------------------------------------------------------------

    def execution(self, execution_id: int) -> ExecutionRecord:
        with self._read() as session:
            row = session.get(Execution, execution_id)
            if row is None:
                raise NotFound(f"no execution {execution_id}")
            return _execution_record(row)

    def executions(
        self, run_id: str, state: ExecutionState | str | None = None
    ) -> list[ExecutionRecord]:
        """The run's executions in start order (those in ``state`` only); [] for an unknown run."""
        query = select(Execution).where(Execution.run_id == run_id)
        if state is not None:
            query = query.where(Execution.state == str(ExecutionState(state)))
        with self._read() as session:
            rows = session.scalars(query.order_by(Execution.started_at, Execution.id)).all()
            return [_execution_record(r) for r in rows]

    def artifact(self, uri: str, version: str | None = None) -> ArtifactRecord:
        """The artifact at ``uri``: that ``version``, else the latest recorded one."""
        with self._read() as session:
            row = _find_artifact(session, uri, version)
            if row is None:
                raise NotFound(_no_artifact(uri, version))
            return _artifact_record(row)

    def artifact_versions(self, uri: str) -> list[ArtifactRecord]:
        """Every recorded version of ``uri``, oldest first."""
        with self._read() as session:
            rows = session.scalars(
                select(Artifact).where(Artifact.uri == uri).order_by(Artifact.id)
            ).all()
            return [_artifact_record(r) for r in rows]

    def runs(self) -> list[RunSummary]:
        """Every DAG run with executions, newest first."""
        with self._read() as session:
            grouped = session.execute(
                select(
                    Execution.run_id,
                    Execution.state,
                    func.count(),
                    func.min(Execution.started_at),
                    func.max(Execution.ended_at),
                )
                .where(Execution.run_id.is_not(None))
                .group_by(Execution.run_id, Execution.state)
            ).all()
            latest = session.execute(
                select(Execution.run_id, Execution.state)
                .where(Execution.id.in_(_latest_attempts()))
                .distinct()
            ).all()
            pipelines = self._pipelines_by_run(session)
            properties = self._run_properties(session)
        by_run: dict[str, list[tuple[str, int, datetime, datetime | None]]] = {}
        for run_id, state, count, started, ended in grouped:
            by_run.setdefault(run_id, []).append((state, count, started, ended))
        latest_states: dict[str, set[str]] = {}
        for run_id, state in latest:
            latest_states.setdefault(run_id, set()).add(str(state))
        summaries = [
            _summary(
                run_id, pipelines.get(run_id), rows, properties.get(run_id), latest_states[run_id]
            )
            for run_id, rows in by_run.items()
        ]
        return sorted(summaries, key=lambda s: (s.started_at, s.run_id), reverse=True)

    def run_outputs(self, steps: Iterable[str], types: Iterable[str]) -> list[RunOutput]:
        """Every run's outputs of these artifact ``types`` from the latest attempt of each of
        these ``steps`` (by execution name), in one query: what a page that lists many runs
        reads of their results, not a graph per run. A latest attempt that wrote nothing (it
        failed, or runs still) gives nothing: never an earlier attempt's results."""
        with self._read() as session:
            latest = _latest_attempts(steps)
            rows = session.execute(
                select(
                    Execution.run_id,
                    Execution.id,
                    Execution.name,
                    EventRow.role,
                    Artifact.type,
                    Artifact.uri,
                    Artifact.version,
                    Artifact.counts,
                )
                .join(EventRow, EventRow.execution_id == Execution.id)
                .join(Artifact, Artifact.id == EventRow.artifact_id)
                .where(
                    Execution.id.in_(latest),
                    EventRow.type == str(EventType.OUTPUT),
                    Artifact.type.in_([str(t) for t in types]),
                )
                .order_by(Execution.id, EventRow.id)
            ).all()
        return [
            RunOutput(run_id, ex_id, name, role, kind, uri, version or "", counts or {})
            for run_id, ex_id, name, role, kind, uri, version, counts in rows
        ]

    def run_failures(self, steps: Iterable[str]) -> list[RunFailure]:
        """Every run whose latest attempt of one of these ``steps`` (by execution name) FAILED
        or was CANCELED (killed), with that attempt's properties, in one query:
        :meth:`run_outputs`' counterpart for the attempts that wrote nothing."""
        with self._read() as session:
            latest = _latest_attempts(steps)
            rows = session.execute(
                select(Execution.run_id, Execution.id, Execution.name, Execution.properties)
                .where(
                    Execution.id.in_(latest),
                    Execution.state.in_([str(ExecutionState.FAILED), str(ExecutionState.CANCELED)]),
                )
                .order_by(Execution.id)
            ).all()
        return [
            RunFailure(run_id, ex_id, name, properties or {})
            for run_id, ex_id, name, properties in rows
        ]

    def version_writers(self, uri: str) -> list[tuple[str, set[str]]]:
        """Every recorded version of ``uri``, newest first, with the runs whose executions
        output it (none for a version recorded outside a run): which versions a user may
        be shown, without reading every version's full row."""
        with self._read() as session:
            rows = session.execute(
                select(Artifact.id, Artifact.version, Execution.run_id)
                .outerjoin(
                    EventRow,
                    (EventRow.artifact_id == Artifact.id)
                    & (EventRow.type == str(EventType.OUTPUT)),
                )
                .outerjoin(Execution, Execution.id == EventRow.execution_id)
                .where(Artifact.uri == uri)
                .order_by(Artifact.id.desc())
            ).all()
        writers: dict[int, tuple[str, set[str]]] = {}
        for artifact_id, version, run_id in rows:
            _, runs = writers.setdefault(artifact_id, (version or "", set()))
            if run_id is not None:
                runs.add(run_id)
        return list(writers.values())

    def run_graph(self, run_id: str) -> RunGraph:
        """The run's executions in start order, each with its input and output artifacts."""
        with self._read() as session:
            executions = session.scalars(
                select(Execution)
                .where(Execution.run_id == run_id)
                .order_by(Execution.started_at, Execution.id)
            ).all()
            if not executions:
                raise NotFound(f"no run {run_id!r}")
            ids = [e.id for e in executions]
            links = session.execute(
                select(EventRow, Artifact)
                .join(Artifact, Artifact.id == EventRow.artifact_id)
                .where(EventRow.execution_id.in_(ids))
                .order_by(EventRow.id)
            ).all()
            pipeline = self._pipelines_by_run(session, run_id).get(run_id)
            properties = self._run_properties(session, run_id).get(run_id)
        inputs: dict[int, list[Linked]] = {i: [] for i in ids}
        outputs: dict[int, list[Linked]] = {i: [] for i in ids}
        for ev, art in links:
            target = inputs if ev.type == EventType.INPUT else outputs
            target[ev.execution_id].append(Linked(_artifact_record(art), ev.role))
        records = [_execution_record(e) for e in executions]
        rows = [(str(r.state), 1, r.started_at, r.ended_at) for r in records]
        latest = {e.name: e for e in sorted(executions, key=lambda e: e.id)}
        latest_states = {str(e.state) for e in latest.values()}
        return RunGraph(
            run=_summary(run_id, pipeline, rows, properties, latest_states),
            steps=tuple(StepNode(r, tuple(inputs[r.id]), tuple(outputs[r.id])) for r in records),
        )

    def trace(self, uri: str, version: str | None = None) -> TraceNode:
        """Walk back from an artifact (that ``version``, else the latest) to its raw inputs.

        Each step goes from an artifact to its producer, then to the exact versions that
        producer read (its INPUT events). The producer of an artifact read by a consumer is
        one whose OUTPUT event was recorded *before* the consumer's INPUT event: what was
        there when it read, never a later run that re-recorded the same content. Among those
        (and for the starting artifact, among all) a COMPLETE producer beats a cache hit, then
        the most recent one wins. Event ids, not clocks, order the events.
        """
        with self._read() as session:
            row = _find_artifact(session, uri, version)
            if row is None:
                raise NotFound(_no_artifact(uri, version))
            return self._trace(session, row, None, frozenset(), {})

    def _trace(
        self,
        session: Session,
        artifact: Artifact,
        read_event: int | None,
        path: frozenset[int],
        seen: dict[tuple[int, int], TraceNode],
    ) -> TraceNode:
        """``seen``: the nodes traced so far by (artifact, producer). An artifact reached along
        several paths (a token store read by train and evaluate, every step behind a
        promotion chain) is traced once and shared: the trace is a graph, walked in time
        linear in its size, not once per path."""
        record = _artifact_record(artifact)
        if artifact.id in path:  # a cycle in recorded events: stop rather than recurse forever
            return TraceNode(record, None, ())
        query = (
            select(Execution, EventRow.id)
            .join(EventRow, EventRow.execution_id == Execution.id)
            .where(EventRow.artifact_id == artifact.id, EventRow.type == str(EventType.OUTPUT))
        )
        if read_event is not None:
            query = query.where(EventRow.id < read_event)
        # The preferred producer, chosen by the database: a corpus every run's fetch recorded
        # has as many producers as runs, and only one is needed.
        preference = case(
            {str(state): rank for state, rank in _PRODUCER_PREFERENCE.items()},
            value=Execution.state,
            else_=len(_PRODUCER_PREFERENCE),
        )
        found = session.execute(query.order_by(preference, EventRow.id.desc()).limit(1)).first()
        if found is None:
            return TraceNode(record, None, ())
        producer = found[0]
        if (artifact.id, producer.id) in seen:
            return seen[artifact.id, producer.id]
        inputs = session.execute(
            select(Artifact, EventRow.id)
            .join(EventRow, EventRow.artifact_id == Artifact.id)
            .where(EventRow.execution_id == producer.id, EventRow.type == str(EventType.INPUT))
            .order_by(EventRow.id)
        ).all()
        nested = path | {artifact.id}
        node = TraceNode(
            record,
            _execution_record(producer),
            tuple(self._trace(session, a, event_id, nested, seen) for a, event_id in inputs),
        )
        seen[artifact.id, producer.id] = node
        return node

    # -- helpers --------------------------------------------------------------------------------

    def _artifact_id(self, session: Session, artifact: int | str, version: str | None) -> int:
        if isinstance(artifact, int):
            return artifact
        found = _find_artifact(session, artifact, version)
        if found is None:
            raise NotFound(f"{_no_artifact(artifact, version)}: record_artifact() it first")
        return found.id

    def _contexts_for(
        self,
        session: Session,
        name: str,
        run_id: str | None,
        pipeline: str | None,
        step_version: str | None,
        run_properties: Mapping[str, Any] | None,
    ) -> list[int]:
        # Always in this order (pipeline, run, step): concurrent creators wait, never deadlock.
        ids: list[int] = []
        pipeline_id = None
        if pipeline:
            pipeline_id = _context(session, ContextType.PIPELINE, pipeline)
            ids.append(pipeline_id)
        if run_id:
            run = _context(session, ContextType.DAG_RUN, run_id, None, run_properties)
            if pipeline_id is not None:
                # The run's row locked before its owners are read: of two DAGs starting under
                # one fresh id at once, the second waits for the first's link and is refused.
                session.execute(select(Context.id).where(Context.id == run).with_for_update())
                RunIdConflict.check(run_id, _run_owners(session, run_id), pipeline)
                _insert_ignore(
                    session,
                    ContextParent,
                    {"child_id": run, "parent_id": pipeline_id},
                    ("child_id", "parent_id"),
                )
            ids.append(run)
        # A step context spans runs: every execution (ran, cached, failed) of one step version.
        step_name = f"{name}-{step_version[:8]}" if step_version else name
        ids.append(_context(session, ContextType.STEP, step_name, pipeline_id))
        return ids

    def run_owners(self, run_id: str) -> set[str]:
        """The pipelines (DAG ids) that recorded run ``run_id``: one, or none for a run not
        recorded (or recorded without one); several only for runs merged before
        ``RunIdConflict`` existed."""
        with self._read() as session:
            return _run_owners(session, run_id)

    def owners_of(self, run_ids: Iterable[str]) -> dict[str, set[str]]:
        """:meth:`run_owners` of many runs, a query per ``_IN_CHUNK`` of them (a run without
        one is left out)."""
        wanted = sorted(set(run_ids))
        owners: dict[str, set[str]] = {}
        with self._read() as session:
            for at in range(0, len(wanted), _IN_CHUNK):
                query = _run_pipelines().where(_RUN_CONTEXT.c.name.in_(wanted[at : at + _IN_CHUNK]))
                for run_id, pipeline in session.execute(query).tuples():
                    owners.setdefault(run_id, set()).add(pipeline)
        return owners

    def run_ids(self) -> set[str]:
        """Every run id with an execution recorded (executions recorded without one are no
        run's, as in :meth:`runs`)."""
        query = select(Execution.run_id).where(Execution.run_id.is_not(None)).distinct()
        with self._read() as session:
            return set(session.execute(query).scalars())

    def require_owner(self, run_id: str, pipeline: str | None) -> None:
        """``RunIdConflict`` unless ``pipeline``'s run ``run_id`` may act on the executions
        recorded under that id: none recorded yet, or recorded by this pipeline (or without
        one)."""
        RunIdConflict.check(run_id, self.run_owners(run_id), pipeline)

    def owns_run(self, run_id: str, pipeline: str | None) -> bool:
        """:meth:`require_owner` as a boolean."""
        try:
            self.require_owner(run_id, pipeline)
        except RunIdConflict:
            return False
        return True

    def _pipelines_by_run(self, session: Session, run_id: str | None = None) -> dict[str, str]:
        return dict(session.execute(_run_pipelines(run_id)).tuples().all())

    def _run_properties(
        self, session: Session, run_id: str | None = None
    ) -> dict[str, Mapping[str, Any]]:
        """The run contexts' properties (``start_execution``'s ``run_properties``), by run id."""
        query = select(Context.name, Context.properties).where(
            Context.type == str(ContextType.DAG_RUN)
        )
        if run_id is not None:
            query = query.where(Context.name == run_id)
        return {name: props for name, props in session.execute(query).tuples() if props}


_RUN_CONTEXT = Context.__table__.alias("run")  # _run_pipelines' run side, for callers' filters
_PIPELINE_CONTEXT = Context.__table__.alias("pipe")
_IN_CHUNK = 500  # values per IN (...): SQLite caps a statement's parameters


def _run_pipelines(run_id: str | None = None) -> Any:
    """(run id, pipeline) of every link from a run context to its pipeline (one run's with
    ``run_id``; filter on ``_RUN_CONTEXT.c.name`` for others)."""
    run, pipe = _RUN_CONTEXT, _PIPELINE_CONTEXT
    query = (
        select(run.c.name, pipe.c.name)
        .join(ContextParent, ContextParent.child_id == run.c.id)
        .join(pipe, pipe.c.id == ContextParent.parent_id)
        .where(run.c.type == str(ContextType.DAG_RUN), pipe.c.type == str(ContextType.PIPELINE))
    )
    return query if run_id is None else query.where(run.c.name == run_id)


def _run_owners(session: Session, run_id: str) -> set[str]:
    """The pipelines linked to run ``run_id``'s context."""
    return {pipeline for _, pipeline in session.execute(_run_pipelines(run_id))}


# -- writing helpers (inside a transaction) ---------------------------------------------------------


def _insert_ignore(
    session: Session, model: type[Base], values: Mapping[str, Any], keys: Iterable[str]
) -> None:
    """``INSERT ... ON CONFLICT (keys) DO NOTHING``: the row exists afterwards, whoever made it.

    Postgres waits for a concurrent inserter of the same key to commit (then does nothing) or
    roll back (then inserts). Other databases get a savepoint that swallows the conflict.
    """
    table = model.__table__
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        session.execute(
            insert(table).values(**values).on_conflict_do_nothing(index_elements=list(keys))
        )
        return
    try:  # pragma: no cover - neither SQLite nor Postgres
        with session.begin_nested():
            session.execute(table.insert().values(**values))
    except IntegrityError:  # pragma: no cover
        pass


def _artifact_fields(
    type: str,
    content_hash: str | None,
    counts: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
    code_version: str | None,
    container_image: str | None,
    properties: Mapping[str, Any] | None,
) -> dict[str, Any]:
    return {
        "type": str(type),
        "content_hash": content_hash,
        "counts": dict(counts) if counts is not None else None,
        "config": dict(config) if config is not None else None,
        "code_version": code_version,
        "container_image": container_image,
        "properties": dict(properties) if properties is not None else None,
    }


def _upsert_artifact(
    session: Session, uri: str, version: str | None, fields: Mapping[str, Any]
) -> Artifact:
    """The ``(uri, version)`` row, created if new, with the non-None ``fields`` set (locked).

    ``version`` None: the latest version of ``uri``, or a new unversioned (``""``) one.
    """
    row = None
    if version is None:
        row = session.scalar(
            select(Artifact)
            .where(Artifact.uri == uri)
            .order_by(Artifact.id.desc())
            .limit(1)
            .with_for_update()
        )
        version = ""
    if row is None:
        _insert_ignore(
            session,
            Artifact,
            {"uri": uri, "version": version, "type": fields["type"], "properties": {}},
            ("uri", "version"),
        )
        row = session.scalar(
            select(Artifact)
            .where(Artifact.uri == uri, Artifact.version == version)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
        if row is None:  # pragma: no cover - the insert above guarantees the row
            raise LineageError(f"artifact {uri} version {version!r} vanished")
    for key, value in fields.items():
        if value is not None:
            setattr(row, key, value)
    row.updated_at = utcnow()
    session.flush()
    return row


def _link(
    session: Session, execution_id: int, artifact_id: int, kind: EventType, role: str | None
) -> None:
    _insert_ignore(
        session,
        EventRow,
        {"execution_id": execution_id, "artifact_id": artifact_id, "type": str(kind), "role": role},
        ("execution_id", "artifact_id", "type"),
    )
    contexts = session.scalars(
        select(Association.context_id).where(Association.execution_id == execution_id)
    ).all()
    # Sorted: two writers attributing one artifact to the same contexts never deadlock.
    for context_id in sorted(set(contexts)):
        _insert_ignore(
            session,
            Attribution,
            {"context_id": context_id, "artifact_id": artifact_id},
            ("context_id", "artifact_id"),
        )


def _check_latest(session: Session, uri: str, expected: str | None) -> None:
    """Raise :class:`Superseded` unless ``uri``'s latest version is ``expected``; on Postgres
    first take ``uri``'s advisory lock, held to the end of the transaction, so that no other
    conditional writer of ``uri`` checks until this one has committed or rolled back (at READ
    COMMITTED, its check then sees this one's version)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(_uri_lock_key(uri))))
    latest = _find_artifact(session, uri, None)
    found = None if latest is None else latest.version
    if found != expected:
        raise Superseded(uri, expected, found)


def _uri_lock_key(uri: str) -> int:
    """A URI's advisory lock key: a signed 64-bit hash (Postgres' bigint)."""
    digest = hashlib.blake2b(uri.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _find_artifact(session: Session, uri: str, version: str | None) -> Artifact | None:
    query = select(Artifact).where(Artifact.uri == uri)
    if version is not None:
        query = query.where(Artifact.version == version)
    return session.scalar(query.order_by(Artifact.id.desc()).limit(1))


def _no_artifact(uri: str, version: str | None) -> str:
    return f"no artifact {uri}" + (f" version {version}" if version is not None else "")


def _context(
    session: Session,
    type: ContextType,
    name: str,
    parent_id: int | None = None,
    properties: Mapping[str, Any] | None = None,
) -> int:
    _insert_ignore(
        session,
        Context,
        {"type": str(type), "name": name, "properties": dict(properties or {})},
        ("type", "name"),
    )
    query = select(Context).where(Context.type == str(type), Context.name == name)
    if properties:  # merged below: lock the row
        query = query.with_for_update()
    found = session.scalar(query.execution_options(populate_existing=True))
    if found is None:  # pragma: no cover - the insert above guarantees the row
        raise LineageError(f"context {type} {name} vanished")
    if properties:
        merged = {**(found.properties or {}), **properties}
        if merged != found.properties:
            found.properties = merged
    if parent_id is not None:
        _insert_ignore(
            session,
            ContextParent,
            {"child_id": found.id, "parent_id": parent_id},
            ("child_id", "parent_id"),
        )
    return found.id


def _sqlstate(exc: DBAPIError) -> str | None:
    orig = exc.orig
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


# -- reading helpers ------------------------------------------------------------------------------


def _summary(
    run_id: str,
    pipeline: str | None,
    rows: Iterable[tuple[str, int, datetime, datetime | None]],
    properties: Mapping[str, Any] | None,
    latest_states: set[str],
) -> RunSummary:
    """``rows``: (state, executions, first start, last end) of every execution of the run;
    ``latest_states``: the states of each step's latest attempt, which decide the run's."""
    rows = list(rows)
    counts: dict[str, int] = {}
    for state, count, _, _ in rows:
        counts[state] = counts.get(state, 0) + count
    state = next(s for s in _RUN_STATE_PRECEDENCE if str(s) in latest_states)
    started = min(r[2] for r in rows)
    running = counts.get(str(ExecutionState.RUNNING), 0)
    ends = [r[3] for r in rows if r[3] is not None]
    ended = max(ends) if ends and not running else None
    return RunSummary(
        run_id, pipeline, state, _utc(started), _utc(ended), counts, dict(properties or {})
    )


def _utc(value: datetime | None) -> datetime | None:
    # Aggregates (min/max) bypass the column type, so SQLite and Postgres hand back naive ones.
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


# -- engine and schema ------------------------------------------------------------------------------


_FLOAT_KEY = "$float"  # the one key of a non-finite float's JSON object


def _finite_json(value: Any) -> Any:
    """``value`` with every non-finite float as ``{"$float": "NaN" | "Infinity" | "-Infinity"}``."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_KEY: json.dumps(value)}
    if isinstance(value, Mapping):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


def _json_dumps(value: Any) -> str:
    """Standard JSON, which Postgres accepts: see the module docstring."""
    return json.dumps(_finite_json(value), allow_nan=False)


_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float_hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and obj.get(_FLOAT_KEY) in _NON_FINITE:
        return _NON_FINITE[obj[_FLOAT_KEY]]
    return obj


def _json_loads(text: str | bytes) -> Any:
    """The inverse of :func:`_json_dumps`; also reads bare ``NaN`` tokens (SQLite files written
    before the codec)."""
    key = _FLOAT_KEY if isinstance(text, str) else _FLOAT_KEY.encode()
    if key not in text:
        return json.loads(text)  # no Python hook on every object: the usual case
    return json.loads(text, object_hook=_float_hook)


def _latest_attempts(steps: Iterable[str] | None = None) -> Any:
    """The ids of each run's latest execution of each of ``steps`` (by name; None: of every
    step): a subquery."""
    query = select(func.max(Execution.id)).where(Execution.run_id.is_not(None))
    if steps is not None:
        query = query.where(Execution.name.in_(list(steps)))
    return query.group_by(Execution.run_id, Execution.name)


def _journal_in_wal(cursor: Any) -> None:
    """WAL: readers never block the writer and vice versa; several processes may write.

    Switching a new file to WAL takes an exclusive lock, and while other processes' first
    connections race for it SQLite can answer "database is locked" at once, without its busy
    handler: so retry, within the busy timeout. A file once in WAL stays so, and the pragma
    is then a no-op."""
    import sqlite3

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05 + random.random() * 0.05)


def _make_engine(url: str) -> Engine:
    codec = {"json_serializer": _json_dumps, "json_deserializer": _json_loads}
    if not url.startswith("sqlite"):
        if url.startswith("postgresql"):
            # The ON CONFLICT / FOR UPDATE / conditional UPDATE design assumes READ COMMITTED.
            return create_engine(url, pool_pre_ping=True, isolation_level="READ COMMITTED", **codec)
        return create_engine(url, pool_pre_ping=True, **codec)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **codec)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, emit BEGIN (see _on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        _journal_in_wal(cursor)
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # Writers take the write lock up front: a deferred transaction that reads and then
        # writes gets SQLITE_BUSY at once (no busy wait) if another process wrote in between.
        mode = connection.get_execution_options().get("slipway_begin", "IMMEDIATE")
        connection.exec_driver_sql(f"BEGIN {mode}")

    return engine


def _create_schema(engine: Engine, read_engine: Engine) -> None:
    """Create missing tables and upgrade an older schema, one process at a time.

    A current schema (the usual case: every task opens the store) is seen with a read and
    takes no lock. Otherwise, SQLite: the write transaction (``BEGIN IMMEDIATE``) serializes
    creators. Postgres: a transaction-scoped advisory lock (two concurrent ``CREATE TABLE`` of
    one name would fail with a unique violation in ``pg_type``). Elsewhere the loser's error is
    followed by a second pass that finds the tables.
    """
    with read_engine.connect() as conn:
        if _schema_is_current(conn):
            return
    dialect = engine.dialect.name
    if dialect not in ("sqlite", "postgresql"):  # pragma: no cover
        try:
            Base.metadata.create_all(engine)
        except (OperationalError, IntegrityError, ProgrammingError):
            Base.metadata.create_all(engine)
        return
    with engine.begin() as conn:
        if dialect == "postgresql":
            conn.execute(select(func.pg_advisory_xact_lock(_SCHEMA_LOCK_KEY)))
            Base.metadata.create_all(conn)
            _upgrade_postgres(conn)
        else:
            Base.metadata.create_all(conn)
    if dialect == "sqlite":
        _upgrade_sqlite(engine)


def _open_schema(engine: Engine, read_engine: Engine, url: str) -> None:
    """An existing schema (upgraded if older), else NotFound: never create one."""
    with read_engine.connect() as conn:  # a deferred BEGIN: no write lock for a reader
        present = inspect(conn).has_table(Execution.__tablename__)
        old = present and _needs_upgrade(conn)
    if not present:
        raise NotFound(f"no lineage database at {redacted(url)} (no lineage tables)")
    if not old:
        return
    if engine.dialect.name == "sqlite":
        _upgrade_sqlite(engine)
    elif engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.execute(select(func.pg_advisory_xact_lock(_SCHEMA_LOCK_KEY)))
            _upgrade_postgres(conn)
    else:  # pragma: no cover
        raise LineageError(
            f"the lineage schema in this {engine.dialect.name} database predates artifact "
            "versions: add artifacts.version (unique with uri) by hand"
        )


def _schema_is_current(conn: Connection) -> bool:
    tables = set(inspect(conn).get_table_names())
    return set(Base.metadata.tables) <= tables and not _needs_upgrade(conn)


def _needs_upgrade(conn: Connection) -> bool:
    columns = {c["name"] for c in inspect(conn).get_columns(Artifact.__tablename__)}
    return "version" not in columns


# Schema 1 -> 2: ``artifacts`` keyed by ``(uri, version)`` instead of ``uri``. Rows recorded
# before keep their ids (events still point at them) with version "". Each upgrade runs under
# the schema lock and checks again under it: of two processes upgrading at once, the second
# finds nothing to do.


def _upgrade_postgres(conn: Connection) -> None:
    """Inside the caller's transaction, which holds the schema advisory lock."""
    if not _needs_upgrade(conn):
        return
    table = Artifact.__tablename__
    old = [
        uc["name"]
        for uc in inspect(conn).get_unique_constraints(table)
        if uc["column_names"] == ["uri"]
    ]
    conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN version VARCHAR(128) NOT NULL DEFAULT ''")
    for name in old:
        conn.exec_driver_sql(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
    conn.exec_driver_sql(
        f"ALTER TABLE {table} ADD CONSTRAINT uq_artifacts_uri_version UNIQUE (uri, version)"
    )
    log.warning("lineage: upgraded the artifacts table to (uri, version) identity")


def _upgrade_sqlite(engine: Engine) -> None:
    """SQLite cannot drop the old UNIQUE(uri): rebuild the table, keeping its ids.

    SQLite's own procedure: foreign keys off (only possible outside a transaction, hence a
    raw connection), one ``BEGIN IMMEDIATE`` transaction that creates, copies, drops and
    renames, ``PRAGMA foreign_key_check``, commit, foreign keys back on.
    """
    from sqlalchemy.schema import CreateTable

    table = Artifact.__tablename__
    columns = [c.name for c in Artifact.__table__.columns]
    copied = ", ".join("''" if c == "version" else c for c in columns)
    rebuilt = Artifact.__table__.to_metadata(MetaData(), name=f"{table}_v2")
    ddl = str(CreateTable(rebuilt).compile(dialect=engine.dialect))
    raw = engine.raw_connection()  # autocommit mode (see _on_connect): we issue BEGIN
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA foreign_keys=OFF")
        try:
            cursor.execute("BEGIN IMMEDIATE")
            try:
                names = {row[1] for row in cursor.execute(f"PRAGMA table_info({table})")}
                if "version" not in names:
                    cursor.execute(ddl)
                    cursor.execute(
                        f"INSERT INTO {table}_v2 ({', '.join(columns)}) "
                        f"SELECT {copied} FROM {table}"
                    )
                    cursor.execute(f"DROP TABLE {table}")
                    cursor.execute(f"ALTER TABLE {table}_v2 RENAME TO {table}")
                    broken = cursor.execute("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise LineageError(f"artifacts upgrade broke foreign keys: {broken[:5]}")
                    log.warning("lineage: upgraded the artifacts table to (uri, version) identity")
                cursor.execute("COMMIT")
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
        finally:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
    finally:
        raw.close()
