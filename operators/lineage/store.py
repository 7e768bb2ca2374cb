"""The lineage store: executions, artifacts, events and contexts in any SQLAlchemy database.

SQLite by default (one file, several writer processes: WAL + busy timeout + ``BEGIN
IMMEDIATE``), Postgres / Cloud SQL in production through the same code. Reads return frozen
records, never live ORM objects, so callers cannot hold sessions open by accident.
"""

from __future__ import annotations

import os
import traceback as tb
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, select
from sqlalchemy.exc import IntegrityError, OperationalError
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

TRACEBACK_TAIL_CHARS = 8000  # the failing frames, not a megabyte of recursion
SQLITE_BUSY_TIMEOUT_MS = 30_000

# Whichever state wins when a run's executions disagree: a run is as bad as its worst step.
_RUN_STATE_PRECEDENCE = (
    ExecutionState.RUNNING,
    ExecutionState.FAILED,
    ExecutionState.CANCELED,
    ExecutionState.COMPLETE,
    ExecutionState.CACHED,
)
# Which producer of an artifact to trace through: the one that really made it first.
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


def default_url() -> str:
    """``SLIPWAY_LINEAGE_DB``, else ``sqlite:///<SLIPWAY_HOME or ./out>/lineage.db``."""
    if url := os.environ.get("SLIPWAY_LINEAGE_DB"):
        return url
    home = Path(os.environ.get("SLIPWAY_HOME") or "out").absolute()
    return f"sqlite:///{home / 'lineage.db'}"


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
        """Leaves: artifacts that no recorded execution produced (raw data, external models)."""
        if self.producer is None:
            return [self.artifact]
        seen: dict[int, ArtifactRecord] = {}
        for node in self.inputs:
            for leaf in node.raw_inputs():
                seen.setdefault(leaf.id, leaf)
        return list(seen.values())


def _artifact_record(row: Artifact) -> ArtifactRecord:
    return ArtifactRecord(
        id=row.id,
        uri=row.uri,
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


class LineageStore:
    """``LineageStore(url)``; the schema is created on first use unless ``create=False``."""

    def __init__(self, url: str | None = None, *, create: bool = True) -> None:
        self.url = url or default_url()
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
        if create:
            _create_schema(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> LineageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

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
        with self._write() as session:
            row = Execution(
                name=name,
                run_id=run_id,
                step_version=step_version,
                state=str(state),
                started_at=started_at or utcnow(),
                code_version=code_version or _version.code_version(),
                container_image=container_image or _version.container_image(),
                properties=dict(properties or {}),
            )
            session.add(row)
            session.flush()
            for context_id in self._contexts_for(
                session, name, run_id, pipeline, step_version, run_properties
            ):
                session.add(Association(context_id=context_id, execution_id=row.id))
            return row.id

    def finish_execution(
        self,
        execution_id: int,
        state: ExecutionState | str = ExecutionState.COMPLETE,
        *,
        error: str | BaseException | None = None,
        traceback: str | None = None,
        properties: Mapping[str, Any] | None = None,
        ended_at: datetime | None = None,
    ) -> None:
        """Close an execution. ``error`` may be the exception: its traceback tail is kept."""
        state = ExecutionState(state)
        if state is ExecutionState.RUNNING:
            raise ValueError("finish_execution needs a terminal state")
        if isinstance(error, BaseException):
            traceback = traceback or "".join(tb.format_exception(error))
            error = f"{type(error).__name__}: {error}"
        with self._write() as session:
            row = session.get(Execution, execution_id)
            if row is None:
                raise NotFound(f"no execution {execution_id}")
            row.state = str(state)
            row.ended_at = ended_at or utcnow()
            row.error = error
            row.traceback = traceback[-TRACEBACK_TAIL_CHARS:] if traceback else None
            if properties:
                row.properties = {**(row.properties or {}), **properties}

    def cancel_running(self, run_id: str, reason: str = "run ended with this step running") -> int:
        """Mark every still-RUNNING execution of a run CANCELED.

        For the gap that callbacks leave: a task killed from outside never reports. The DAG's
        final ``all_done`` task (or a listener) calls this. Returns how many were closed.
        """
        with self._write() as session:
            rows = session.scalars(
                select(Execution).where(
                    Execution.run_id == run_id, Execution.state == str(ExecutionState.RUNNING)
                )
            ).all()
            for row in rows:
                row.state, row.ended_at, row.error = str(ExecutionState.CANCELED), utcnow(), reason
            return len(rows)

    def record_artifact(
        self,
        uri: str,
        type: str,
        *,
        content_hash: str | None = None,
        counts: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        code_version: str | None = None,
        container_image: str | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> int:
        """Create or update the artifact at ``uri`` (fields given as None are kept). Returns its id."""
        fields = {
            "type": str(type),
            "content_hash": content_hash,
            "counts": dict(counts) if counts is not None else None,
            "config": dict(config) if config is not None else None,
            "code_version": code_version,
            "container_image": container_image,
            "properties": dict(properties) if properties is not None else None,
        }
        for attempt in range(2):
            try:
                with self._write() as session:
                    row = session.scalar(select(Artifact).where(Artifact.uri == uri))
                    if row is None:
                        row = Artifact(uri=uri, properties={})
                        session.add(row)
                    for key, value in fields.items():
                        if value is not None:
                            setattr(row, key, value)
                    row.updated_at = utcnow()
                    session.flush()
                    return row.id
            except IntegrityError:
                # Another writer inserted the same URI between our select and insert (possible
                # on Postgres; SQLite's BEGIN IMMEDIATE serializes): update its row instead.
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def link(
        self,
        execution_id: int,
        artifact: int | str,
        type: EventType | str,
        *,
        role: str | None = None,
    ) -> None:
        """An INPUT or OUTPUT event; the artifact also joins the execution's contexts."""
        kind = EventType(type)
        with self._write() as session:
            artifact_id = self._artifact_id(session, artifact)
            exists = session.scalar(
                select(EventRow.id).where(
                    EventRow.execution_id == execution_id,
                    EventRow.artifact_id == artifact_id,
                    EventRow.type == str(kind),
                )
            )
            if exists is None:
                session.add(
                    EventRow(
                        execution_id=execution_id,
                        artifact_id=artifact_id,
                        type=str(kind),
                        role=role,
                    )
                )
            contexts = session.scalars(
                select(Association.context_id).where(Association.execution_id == execution_id)
            ).all()
            attributed = set(
                session.scalars(
                    select(Attribution.context_id).where(Attribution.artifact_id == artifact_id)
                ).all()
            )
            for context_id in set(contexts) - attributed:
                session.add(Attribution(context_id=context_id, artifact_id=artifact_id))

    def record_input(self, execution_id: int, uri: str, type: str, **fields: Any) -> int:
        artifact_id = self.record_artifact(uri, type, **_without(fields, "role"))
        self.link(execution_id, artifact_id, EventType.INPUT, role=fields.get("role"))
        return artifact_id

    def record_output(self, execution_id: int, uri: str, type: str, **fields: Any) -> int:
        """Record an artifact the execution produced; it inherits the execution's code
        version and container image unless given."""
        producer = self.execution(execution_id)
        fields.setdefault("code_version", producer.code_version)
        fields.setdefault("container_image", producer.container_image)
        artifact_id = self.record_artifact(uri, type, **_without(fields, "role"))
        self.link(execution_id, artifact_id, EventType.OUTPUT, role=fields.get("role"))
        return artifact_id

    # -- reading ----------------------------------------------------------------------------------

    def execution(self, execution_id: int) -> ExecutionRecord:
        with self._read() as session:
            row = session.get(Execution, execution_id)
            if row is None:
                raise NotFound(f"no execution {execution_id}")
            return _execution_record(row)

    def artifact(self, uri: str) -> ArtifactRecord:
        with self._read() as session:
            row = session.scalar(select(Artifact).where(Artifact.uri == uri))
            if row is None:
                raise NotFound(f"no artifact {uri}")
            return _artifact_record(row)

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
            pipelines = self._pipelines_by_run(session)
        by_run: dict[str, list[tuple[str, int, datetime, datetime | None]]] = {}
        for run_id, state, count, started, ended in grouped:
            by_run.setdefault(run_id, []).append((state, count, started, ended))
        summaries = [
            _summary(run_id, pipelines.get(run_id), rows) for run_id, rows in by_run.items()
        ]
        return sorted(summaries, key=lambda s: (s.started_at, s.run_id), reverse=True)

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
        inputs: dict[int, list[Linked]] = {i: [] for i in ids}
        outputs: dict[int, list[Linked]] = {i: [] for i in ids}
        for ev, art in links:
            target = inputs if ev.type == EventType.INPUT else outputs
            target[ev.execution_id].append(Linked(_artifact_record(art), ev.role))
        records = [_execution_record(e) for e in executions]
        rows = [(str(r.state), 1, r.started_at, r.ended_at) for r in records]
        return RunGraph(
            run=_summary(run_id, pipeline, rows),
            steps=tuple(StepNode(r, tuple(inputs[r.id]), tuple(outputs[r.id])) for r in records),
        )

    def trace(self, uri: str) -> TraceNode:
        """Walk OUTPUT events back to producers and their INPUT events, down to raw inputs."""
        with self._read() as session:
            row = session.scalar(select(Artifact).where(Artifact.uri == uri))
            if row is None:
                raise NotFound(f"no artifact {uri}")
            return self._trace(session, row, frozenset())

    def _trace(self, session: Session, artifact: Artifact, path: frozenset[int]) -> TraceNode:
        record = _artifact_record(artifact)
        if artifact.id in path:  # a cycle in recorded events: stop rather than recurse forever
            return TraceNode(record, None, ())
        producers = session.scalars(
            select(Execution)
            .join(EventRow, EventRow.execution_id == Execution.id)
            .where(EventRow.artifact_id == artifact.id, EventRow.type == str(EventType.OUTPUT))
        ).all()
        if not producers:
            return TraceNode(record, None, ())
        producer = min(
            producers,
            key=lambda e: (
                _PRODUCER_PREFERENCE[ExecutionState(e.state)],
                -(e.ended_at or e.started_at).timestamp(),
            ),
        )
        inputs = session.scalars(
            select(Artifact)
            .join(EventRow, EventRow.artifact_id == Artifact.id)
            .where(EventRow.execution_id == producer.id, EventRow.type == str(EventType.INPUT))
            .order_by(EventRow.id)
        ).all()
        nested = path | {artifact.id}
        return TraceNode(
            record,
            _execution_record(producer),
            tuple(self._trace(session, a, nested) for a in inputs),
        )

    # -- helpers --------------------------------------------------------------------------------

    def _artifact_id(self, session: Session, artifact: int | str) -> int:
        if isinstance(artifact, int):
            return artifact
        found = session.scalar(select(Artifact.id).where(Artifact.uri == artifact))
        if found is None:
            raise NotFound(f"no artifact {artifact}: record_artifact() it first")
        return found

    def _contexts_for(
        self,
        session: Session,
        name: str,
        run_id: str | None,
        pipeline: str | None,
        step_version: str | None,
        run_properties: Mapping[str, Any] | None,
    ) -> list[int]:
        ids: list[int] = []
        pipeline_id = None
        if pipeline:
            pipeline_id = _context(session, ContextType.PIPELINE, pipeline)
            ids.append(pipeline_id)
        if run_id:
            ids.append(_context(session, ContextType.DAG_RUN, run_id, pipeline_id, run_properties))
        # A step context spans runs: every execution (ran, cached, failed) of one step version.
        step_name = f"{name}-{step_version[:8]}" if step_version else name
        ids.append(_context(session, ContextType.STEP, step_name, pipeline_id))
        return ids

    def _pipelines_by_run(self, session: Session, run_id: str | None = None) -> dict[str, str]:
        run = Context.__table__.alias("run")
        pipe = Context.__table__.alias("pipe")
        query = (
            select(run.c.name, pipe.c.name)
            .join(ContextParent, ContextParent.child_id == run.c.id)
            .join(pipe, pipe.c.id == ContextParent.parent_id)
            .where(run.c.type == str(ContextType.DAG_RUN), pipe.c.type == str(ContextType.PIPELINE))
        )
        if run_id is not None:
            query = query.where(run.c.name == run_id)
        return dict(session.execute(query).tuples().all())


def _context(
    session: Session,
    type: ContextType,
    name: str,
    parent_id: int | None = None,
    properties: Mapping[str, Any] | None = None,
) -> int:
    found = session.scalar(select(Context).where(Context.type == str(type), Context.name == name))
    if found is None:
        found = Context(type=str(type), name=name, properties=dict(properties or {}))
        session.add(found)
        session.flush()
    elif properties:
        found.properties = {**(found.properties or {}), **properties}
    if parent_id is not None and session.get(ContextParent, (found.id, parent_id)) is None:
        session.add(ContextParent(child_id=found.id, parent_id=parent_id))
    return found.id


def _summary(
    run_id: str, pipeline: str | None, rows: Iterable[tuple[str, int, datetime, datetime | None]]
) -> RunSummary:
    rows = list(rows)
    counts: dict[str, int] = {}
    for state, count, _, _ in rows:
        counts[state] = counts.get(state, 0) + count
    state = next(s for s in _RUN_STATE_PRECEDENCE if counts.get(str(s)))
    started = min(r[2] for r in rows)
    running = counts.get(str(ExecutionState.RUNNING), 0)
    ends = [r[3] for r in rows if r[3] is not None]
    ended = max(ends) if ends and not running else None
    return RunSummary(run_id, pipeline, state, _utc(started), _utc(ended), counts)


def _utc(value: datetime | None) -> datetime | None:
    # Aggregates (min/max) bypass the column type, so SQLite hands back naive datetimes.
    from datetime import UTC

    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _without(fields: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k not in keys}


# -- engine -------------------------------------------------------------------------------------


def _make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, emit BEGIN (see _on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # WAL: readers never block the writer and vice versa; several processes may write.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
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


def _create_schema(engine: Engine) -> None:
    # Two processes may create the schema at once; on SQLite BEGIN IMMEDIATE serializes them,
    # elsewhere the loser sees "already exists" and the second checkfirst pass finds the tables.
    try:
        Base.metadata.create_all(engine)
    except (OperationalError, IntegrityError):
        Base.metadata.create_all(engine)
