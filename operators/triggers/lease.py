"""A step's RUNNING lease while its task is deferred.

The step model (:mod:`operators.steps`) keeps a running step's lease alive from a heartbeat
thread in the worker process, renewing a 120 s lease every 40 s. A *deferred* task has no
worker process: the task ends after submitting the JobSet and resumes on some worker when the
trigger fires. Left alone, the lease would expire within two minutes and the next DAG run that
reaches the same step would take it over while the JobSet is still training.

Chosen: **the trigger renews the lease**, and the lease is longer while deferred
(:data:`DEFERRED_LEASE_SECONDS`, renewed every third of it). The trigger is the one process
that is alive exactly while the JobSet is followed, so the lease lives as long as somebody
watches the run and no longer: a lease fixed at "as long as training might take" would block
every rerun for weeks after a crash. The longer lease covers the gaps nobody renews in -- the
submission itself, a triggerer restart or failover, and the queueing between the trigger's
event and ``execute_complete`` on a worker. If the lease is taken over anyway (a triggerer
down for longer than that), the trigger notices (the next generation exists), stops renewing
and ends with ``lease_lost`` without deleting the JobSet: the new owner's submission finds the
same JobSet (same name, same step version) and adopts it, so the training is never run twice.

Built on the step model's storage primitives (lease generations created atomically, status
markers); ownership is the same ``(owner, generation)`` check the heartbeat makes.
"""

from __future__ import annotations

import time
import traceback as tb
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from operators.steps import (
    TRACEBACK_TAIL_CHARS,
    LeaseLost,
    Status,
    StatusRecord,
    Step,
    StepRunner,
    StepSpec,
    _jsonable,
    _lease_bytes,
    _lease_path,
    join,
    store_for,
)

__all__ = ["DEFERRED_LEASE_SECONDS", "DeferredLease", "SubmittingStepRunner"]

DEFERRED_LEASE_SECONDS = 600.0


@dataclass(frozen=True)
class DeferredLease:
    """Generation ``generation`` of the lease on the step whose output is ``output``."""

    output: str
    step: str
    version: str
    owner: str
    generation: int
    started_at: float
    lease_seconds: float = DEFERRED_LEASE_SECONDS

    @property
    def renew_every(self) -> float:
        # As the heartbeat does: two renewals may fail before anyone may take over.
        return self.lease_seconds / 3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeferredLease:
        return cls(**dict(data))

    # -- storage ------------------------------------------------------------------------------

    def _runner(self) -> StepRunner:
        # A StepRunner bound to this owner: its ownership check and release are the ones the
        # heartbeat uses, so a deferred step follows exactly the same protocol.
        return StepRunner(
            self.output,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            store=store_for(self.output),
        )

    def record(self, status: Status, **extra: Any) -> StatusRecord:
        return StatusRecord(
            status=status,
            step=self.step,
            version=self.version,
            owner=self.owner,
            generation=self.generation,
            started_at=self.started_at,
            updated_at=time.time(),
            **extra,
        )

    def owned(self) -> bool:
        return self._runner()._still_owner(self.output, self.generation)

    def renew(self) -> bool:
        """Extend the lease and the RUNNING marker; False once another runner took over."""
        runner = self._runner()
        if not runner._still_owner(self.output, self.generation):
            return False
        lease = runner._lease(self.generation)
        runner.store.write(_lease_path(self.output, self.generation), _lease_bytes(lease))
        runner._write_status(
            self.output, self.record(Status.RUNNING, lease_expires_at=lease.expires_at)
        )
        return True

    def succeed(self, result: Any) -> StatusRecord:
        """SUCCESS marker, lease released. :class:`LeaseLost` if no longer ours."""
        runner = self._runner()
        if not runner._still_owner(self.output, self.generation):
            raise LeaseLost(
                f"{self.step}: lease generation {self.generation} was taken over while deferred"
            )
        final = self.record(Status.SUCCESS, result=_jsonable(result))
        runner._write_status(self.output, final)
        runner._release(self.output, self.generation)
        return final

    def fail(self, error: BaseException | str) -> bool:
        """FAILED marker (error, traceback tail), lease released; False if no longer ours."""
        runner = self._runner()
        if not runner._still_owner(self.output, self.generation):
            return False
        if isinstance(error, BaseException):
            message = f"{type(error).__name__}: {error}"
            trace = "".join(tb.format_exception(error))[-TRACEBACK_TAIL_CHARS:]
        else:
            message, trace = error, None
        runner._write_status(
            self.output, self.record(Status.FAILED, error=message, traceback=trace)
        )
        runner._release(self.output, self.generation)
        return True


class SubmittingStepRunner(StepRunner):
    """A :class:`StepRunner` whose work function only *submits*: the lease stays held.

    Everything else is the step model's: SUCCESS is a cache hit, a live lease is waited for, a
    stale one taken over. When ``fn`` returns, the step is left RUNNING under
    :attr:`lease` (the trigger renews it); when it raises, the step is FAILED and the lease
    released, as for any step.
    """

    def __init__(self, root: str, **kwargs: Any) -> None:
        kwargs.setdefault("lease_seconds", DEFERRED_LEASE_SECONDS)
        super().__init__(root, **kwargs)
        self.lease: DeferredLease | None = None

    def _execute(
        self, step: Step, spec: StepSpec, generation: int, fn: Callable[[StepSpec], Any]
    ) -> StatusRecord:
        lease = DeferredLease(
            output=spec.output_path,
            step=step.name,
            version=spec.version,
            owner=self.owner,
            generation=generation,
            started_at=time.time(),
            lease_seconds=self.lease_seconds,
        )
        lease.renew()
        self.lease = lease
        try:
            value = fn(spec)
        except BaseException as exc:
            lease.fail(exc)
            raise
        return lease.record(Status.RUNNING, result=_jsonable(value))


def handle_file(output: str) -> str:
    """Where a deferred step keeps its JobSet handle (read back after a trigger timeout)."""
    return join(output, "jobset_handle.json")
