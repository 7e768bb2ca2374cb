"""The backend contract: submit a JobSet manifest, follow it, cancel it.

Two implementations share it: :class:`~operators.jobset.local.LocalBackend` (the manifest's
pods as local processes) and :class:`~operators.jobset.gke.GkeBackend` (the JobSet object on a
cluster through the Kubernetes API; the training operator defers to
:class:`~operators.triggers.jobset.JobSetTrigger`, which follows it). The handle is plain,
JSON-serialisable data so that a deferrable operator can hand it to a trigger and a retried
task can find its JobSet again. See docs/jobset.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "COMPLETED",
    "FAILED",
    "RETRYABLE",
    "Backend",
    "JobSetApiError",
    "JobSetError",
    "JobSetHandle",
    "JobSetNotFound",
    "JobSetObservation",
    "JobSetStatus",
    "PodExit",
]

# HTTP statuses worth retrying: rate limits and an API server that is (re)starting.
RETRYABLE = frozenset({429, 500, 502, 503, 504})

COMPLETED: Literal["Completed"] = "Completed"
FAILED: Literal["Failed"] = "Failed"
TerminalState = Literal["Completed", "Failed"]


@dataclass(frozen=True)
class JobSetHandle:
    """Names one submitted JobSet. ``uid`` tells two runs with the same name apart."""

    backend: str  # "local" | "gke"
    namespace: str
    name: str
    uid: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> JobSetHandle:
        return cls(**{k: str(data[k]) for k in ("backend", "namespace", "name", "uid")})


@dataclass(frozen=True)
class PodExit:
    """One pod's container ending: ``pod`` is ``<replicated job>-<job index>/worker-<index>``."""

    pod: str
    attempt: int  # the JobSet restart attempt the pod belonged to
    exit_code: int  # 128 + signal for a signalled process, as Kubernetes reports it


@dataclass(frozen=True)
class JobSetStatus:
    """A snapshot of a JobSet, shaped like its ``.status`` (terminalState, restarts)."""

    handle: JobSetHandle
    terminal_state: TerminalState | None = None  # None while running
    restarts: int = 0  # every restart (status.restarts)
    restarts_counted: int = 0  # restarts that count towards maxRestarts
    reason: str = (
        ""  # AllJobsCompleted | FailurePolicyRule | ReachedMaxRestarts | FailedJobs | Cancelled
    )
    message: str = ""
    exits: tuple[PodExit, ...] = field(default=())  # every pod exit, in order

    @property
    def done(self) -> bool:
        return self.terminal_state is not None

    @property
    def succeeded(self) -> bool:
        return self.terminal_state == COMPLETED

    @property
    def exit_codes(self) -> dict[str, int]:
        """Exit codes of the latest attempt's pods, by pod."""
        last = self.restarts
        return {e.pod: e.exit_code for e in self.exits if e.attempt == last}

    def to_dict(self) -> dict[str, Any]:
        return {
            "handle": self.handle.to_dict(),
            "terminal_state": self.terminal_state,
            "restarts": self.restarts,
            "restarts_counted": self.restarts_counted,
            "reason": self.reason,
            "message": self.message,
            "exits": [asdict(e) for e in self.exits],
        }


class JobSetError(RuntimeError):
    """A backend call failed in a way the caller must see."""

    status: int | None = None


class JobSetNotFound(JobSetError):
    """The JobSet (or pod) is not there: deleted, expired (ttl), or never created."""


class JobSetApiError(JobSetError):
    """Any other failure of the backend's API, after the retries for transient ones."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status is None or self.status in RETRYABLE


@dataclass(frozen=True)
class JobSetObservation:
    """One look at a JobSet: what a follower reports and where its next wait starts."""

    status: JobSetStatus  # without pod exits (``with_exits`` adds them once it is done)
    version: str | None = None  # the object's resourceVersion: a watch resumes after it
    conditions: Mapping[str, str] = field(default_factory=dict)  # True ones: kind -> text
    max_restarts: int = 0  # the failure policy's bound on counted restarts


@runtime_checkable
class Backend(Protocol):
    """Where JobSets run. ``submit`` returns at once; ``poll`` and ``observe`` never block.

    The first four are what a task that waits on its JobSet uses; ``observe``,
    ``wait_for_change``, ``leader_log_tail``, ``with_exits`` and ``close`` are what a follower
    that does not hold the task (the GKE trigger) uses. Errors are :class:`JobSetError`s:
    :class:`JobSetNotFound` once the JobSet is gone, :class:`JobSetApiError` (``transient``
    or not) for the rest.
    """

    name: str

    def submit(self, manifest: Mapping[str, Any]) -> JobSetHandle: ...

    def poll(self, handle: JobSetHandle) -> JobSetStatus: ...

    def wait(self, handle: JobSetHandle, timeout: float | None = None) -> JobSetStatus:
        """Block until terminal; raise ``TimeoutError`` if ``timeout`` passes first."""
        ...

    def cancel(self, handle: JobSetHandle) -> JobSetStatus:
        """Stop every pod (SIGTERM, then SIGKILL after the grace period); idempotent."""
        ...

    def observe(self, handle: JobSetHandle) -> JobSetObservation: ...

    def wait_for_change(self, handle: JobSetHandle, version: str | None, timeout: float) -> Any:
        """Once the JobSet changed after ``version``: what changed (not None); None after
        ``timeout`` seconds without a change."""
        ...

    def leader_log_tail(
        self, handle: JobSetHandle, lines: int = 50
    ) -> tuple[str | None, list[str]]:
        """(the leader pod -- slice 0, worker 0 --, its last ``lines`` lines); (None, [])
        before it exists."""
        ...

    def with_exits(self, status: JobSetStatus) -> JobSetStatus:
        """``status`` with every pod's exit code (best effort)."""
        ...

    def close(self) -> None:
        """Release the client (never the JobSet)."""
        ...
