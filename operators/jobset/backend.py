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
    "Backend",
    "JobSetHandle",
    "JobSetStatus",
    "PodExit",
]

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


@runtime_checkable
class Backend(Protocol):
    """Where JobSets run. ``submit`` returns at once; ``poll`` never blocks."""

    name: str

    def submit(self, manifest: Mapping[str, Any]) -> JobSetHandle: ...

    def poll(self, handle: JobSetHandle) -> JobSetStatus: ...

    def wait(self, handle: JobSetHandle, timeout: float | None = None) -> JobSetStatus:
        """Block until terminal; raise ``TimeoutError`` if ``timeout`` passes first."""
        ...

    def cancel(self, handle: JobSetHandle) -> JobSetStatus:
        """Stop every pod (SIGTERM, then SIGKILL after the grace period); idempotent."""
        ...
