"""Training launch layer: TPU catalogue, JobSet manifests, and the backends that run them.

Airflow-independent (no airflow imports): the Airflow operator wraps it.
"""

from operators.jobset.backend import (
    COMPLETED,
    FAILED,
    Backend,
    JobSetApiError,
    JobSetError,
    JobSetHandle,
    JobSetNotFound,
    JobSetObservation,
    JobSetStatus,
    PodExit,
)
from operators.jobset.catalogue import CATALOGUE, ShapeError, SliceShape, resolve
from operators.jobset.local import LocalBackend, LocalRun, UnsupportedManifest
from operators.jobset.manifest import ManifestError, TrainingLaunch, render

__all__ = [
    "CATALOGUE",
    "COMPLETED",
    "FAILED",
    "Backend",
    "JobSetApiError",
    "JobSetError",
    "JobSetHandle",
    "JobSetNotFound",
    "JobSetObservation",
    "JobSetStatus",
    "LocalBackend",
    "LocalRun",
    "ManifestError",
    "PodExit",
    "ShapeError",
    "SliceShape",
    "TrainingLaunch",
    "UnsupportedManifest",
    "render",
    "resolve",
]
