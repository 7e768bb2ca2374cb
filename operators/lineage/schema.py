"""Lineage tables (SQLAlchemy 2 ORM), shaped like ML Metadata.

executions ──events (INPUT/OUTPUT)── artifacts
     │                                   │
 associations                      attributions
     └────────────── contexts ───────────┘   (pipeline ⊃ dag_run ⊃ step, via context_parents)

Portable types only (String, Text, JSON, DateTime), so the same schema runs on SQLite and on
Postgres / Cloud SQL. Times are stored in UTC.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class ExecutionState(enum.StrEnum):
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"
    CACHED = "CACHED"
    CANCELED = "CANCELED"


class EventType(enum.StrEnum):
    INPUT = "INPUT"
    OUTPUT = "OUTPUT"


class ArtifactType(enum.StrEnum):
    """Known artifact types; the column is a free string so new types need no migration."""

    DATASET = "dataset"
    TOKEN_STORE = "token_store"
    TOKENIZER = "tokenizer"
    CHECKPOINT = "checkpoint"
    EVAL_RESULT = "eval_result"
    MODEL = "model"
    METRICS = "metrics"
    CONFIG = "config"
    HF_EXPORT = "hf_export"  # a checkpoint as a Hugging Face folder (trainer/export.py)
    PROMOTED_MODEL = "promoted_model"  # slipway://models/<name>, written by the gate


class ContextType(enum.StrEnum):
    PIPELINE = "pipeline"
    DAG_RUN = "dag_run"
    STEP = "step"


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware in and out: SQLite drops the offset, so store UTC and re-attach it."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class Context(Base):
    __tablename__ = "contexts"
    __table_args__ = (UniqueConstraint("type", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    type: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(512))
    properties: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ContextParent(Base):
    __tablename__ = "context_parents"

    child_id: Mapped[int] = mapped_column(ForeignKey("contexts.id"), primary_key=True)
    parent_id: Mapped[int] = mapped_column(ForeignKey("contexts.id"), primary_key=True)


class Execution(Base):
    __tablename__ = "executions"
    __table_args__ = (Index("ix_executions_run", "run_id", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The step name (a task id in Airflow); the run is the DAG run id, denormalized from the
    # dag_run context because "all executions of a run" is the most common query.
    name: Mapped[str] = mapped_column(String(512))
    run_id: Mapped[str | None] = mapped_column(String(512))
    step_version: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)
    traceback: Mapped[str | None] = mapped_column(Text)
    code_version: Mapped[str | None] = mapped_column(String(128))
    container_image: Mapped[str | None] = mapped_column(String(512))
    properties: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class Artifact(Base):
    """One version of what lives at a URI: ``(uri, version)`` is the artifact's identity.

    The version names the content: a content id (the sha256 of a raw corpus file, the same
    ``content_id`` its step version hashes) or, for a step output, the producing step's version
    (outputs are content-addressed by it). A URI rewritten with new bytes (a refetch) is a new
    artifact; the same content recorded again (a cache hit, a refetch of the same bytes) is the
    same row. Events point at the exact version a consumer read, so a trace follows it and not
    whatever was recorded at that URI later. ``""``: recorded without a version.
    """

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("uri", "version", name="uq_artifacts_uri_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uri: Mapped[str] = mapped_column(String(2048))
    version: Mapped[str] = mapped_column(String(128), default="", server_default="")
    type: Mapped[str] = mapped_column(String(64))
    content_hash: Mapped[str | None] = mapped_column(String(128))
    counts: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    config: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    code_version: Mapped[str | None] = mapped_column(String(128))
    container_image: Mapped[str | None] = mapped_column(String(512))
    properties: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("execution_id", "artifact_id", "type"),
        Index("ix_events_artifact", "artifact_id", "type"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    execution_id: Mapped[int] = mapped_column(ForeignKey("executions.id"))
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id"))
    type: Mapped[str] = mapped_column(String(8))
    role: Mapped[str | None] = mapped_column(String(128))  # e.g. "tokenizer", "train_data"
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Association(Base):
    """Execution ∈ context."""

    __tablename__ = "associations"

    context_id: Mapped[int] = mapped_column(ForeignKey("contexts.id"), primary_key=True)
    execution_id: Mapped[int] = mapped_column(ForeignKey("executions.id"), primary_key=True)


class Attribution(Base):
    """Artifact ∈ context."""

    __tablename__ = "attributions"

    context_id: Mapped[int] = mapped_column(ForeignKey("contexts.id"), primary_key=True)
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id"), primary_key=True)
