"""Lineage: an ML-Metadata-like record of every step, whatever its outcome.

Importable without Airflow: the store is plain SQLAlchemy. See docs/steps_and_lineage.md.
"""

from operators.lineage.schema import ArtifactType, ContextType, EventType, ExecutionState
from operators.lineage.store import (
    ArtifactRecord,
    ExecutionRecord,
    LineageError,
    LineageStore,
    Linked,
    NotFound,
    RunFailure,
    RunGraph,
    RunIdConflict,
    RunOutput,
    RunSummary,
    StepNode,
    Superseded,
    TraceNode,
)
from operators.lineage.url import LineageConfigError, lineage_url
from operators.lineage.version import code_version, container_image

__all__ = [
    "ArtifactRecord",
    "ArtifactType",
    "ContextType",
    "EventType",
    "ExecutionRecord",
    "ExecutionState",
    "LineageConfigError",
    "LineageError",
    "LineageStore",
    "Linked",
    "NotFound",
    "RunFailure",
    "RunGraph",
    "RunIdConflict",
    "RunOutput",
    "RunSummary",
    "StepNode",
    "Superseded",
    "TraceNode",
    "code_version",
    "container_image",
    "lineage_url",
]
