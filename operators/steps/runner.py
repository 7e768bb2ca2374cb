"""The step runner: a SUCCESS marker is a cache hit (CACHED), FAILED or none runs the step, a
live lease is waited for (WAITED), a stale one taken over (TOOK_OVER)."""

from __future__ import annotations

import enum
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from operators.steps.errors import LeaseLost, StepFailedElsewhere, StepWaitTimeout
from operators.steps.lease import (
    HeldLease,
    Status,
    StatusRecord,
    StepState,
    _Heartbeat,
    current_lease,
    jsonable,
    read_status,
    this_process,
)
from operators.steps.plan import Action, decide
from operators.steps.store import Store, store_for
from operators.steps.version import Step, StepSpec, resolve

log = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    RAN = "RAN"  # this runner executed the step
    CACHED = "CACHED"  # SUCCESS marker found: skipped
    WAITED = "WAITED"  # another owner was running it; it succeeded while we waited
    TOOK_OVER = "TOOK_OVER"  # a stale lease was taken over and the step executed here


@dataclass(frozen=True)
class StepResult:
    outcome: Outcome
    spec: StepSpec
    status: StatusRecord

    @property
    def result(self) -> Any:
        """What the step function returned (JSON), also for cache hits."""
        return self.status.result


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class StepRunner:
    """Runs steps under a root with the SUCCESS / FAILED / RUNNING-lease protocol.

    ``fn(spec)`` does the work and writes into ``spec.output_path``; its return value, if
    JSON-serializable, is kept in the SUCCESS marker (counts, metrics) and handed back on
    cache hits too. Exceptions are recorded as FAILED (error + traceback tail) and re-raised.
    """

    def __init__(
        self,
        root: str,
        *,
        owner: str | None = None,
        lease_seconds: float = 60.0,
        heartbeat_seconds: float | None = None,
        poll_seconds: float = 1.0,
        wait_timeout: float = 24 * 3600.0,
        store: Store | None = None,
    ) -> None:
        self.root = root
        self.owner = owner or default_owner()
        self.lease_seconds = lease_seconds
        # A third of the lease leaves two missed beats before anyone may take over.
        self.heartbeat_seconds = heartbeat_seconds or lease_seconds / 3
        self.poll_seconds = poll_seconds
        self.wait_timeout = wait_timeout
        self.store = store or store_for(root)

    def run(
        self,
        step: Step,
        fn: Callable[[StepSpec], Any],
        *,
        on_lost: Callable[[], None] | None = None,
    ) -> StepResult:
        """Run ``fn`` under the step's lease (or skip, wait or take over, see the class).

        ``on_lost`` stops ``fn``'s work when another runner takes the lease over while it
        runs (this process stalled for longer than the lease): called from the heartbeat's
        thread, it should stop only what this process runs alone (its own subprocesses),
        never shared work the new owner may have adopted. ``fn`` then ends in
        :class:`LeaseLost`, whatever it raised.
        """

        def execute(spec: StepSpec, lease: HeldLease) -> StatusRecord:
            return self._execute(spec, lease, fn, on_lost)

        # This process's heartbeat renews the lease: readers may tell when it is gone.
        return self._run(step, execute, holder=this_process())

    def run_held(self, step: Step, submit: Callable[[StepSpec, HeldLease], Any]) -> StepResult:
        """Like :meth:`run`, for work that outlives this call (a deferred Airflow task).

        SUCCESS is a cache hit, a live lease is waited for and a stale one taken over, as in
        :meth:`run`. When the step runs, ``submit(spec, lease)`` only starts the work: on
        return the step is left RUNNING (the result's record carries what ``submit``
        returned) under ``lease``, which the caller renews and ends
        (:meth:`HeldLease.renew`, :meth:`~HeldLease.succeed`, :meth:`~HeldLease.fail`),
        usually from another process. When ``submit`` raises, the step is FAILED and the
        lease released, as for any step. No heartbeat thread: nobody here outlives the call.
        """
        return self._run(step, lambda spec, lease: self._hold(spec, lease, submit), holder=None)

    def _run(
        self,
        step: Step,
        execute: Callable[[StepSpec, HeldLease], StatusRecord],
        holder: str | None,
    ) -> StepResult:
        spec = resolve(step, self.root)
        out = spec.output_path
        self.store.makedirs(out)
        deadline = time.monotonic() + self.wait_timeout
        # Every runner whose live lease this one waited on: a failure of any of them is the
        # step's (a waiter that checked under its own brief lease is one of them too).
        waited: set[str] = set()
        while True:
            state = StepState(out, read_status(self.store, out), current_lease(self.store, out))
            action, reason = decide(state, time.time())
            if action is Action.SKIP:
                assert state.status is not None
                outcome = Outcome.WAITED if waited else Outcome.CACHED
                log.info("%s: %s (%s)", step.key, outcome, reason)
                return StepResult(outcome, spec, state.status)
            if action is Action.RUN:
                _raise_if_failed_by(step, state.status, waited)
            if action is Action.WAIT:
                assert state.lease is not None
                waited.add(state.lease.owner)
                if time.monotonic() > deadline:
                    raise StepWaitTimeout(f"{step.key}: {reason}; gave up after waiting")
                log.info("%s: waiting (%s)", step.key, reason)
                time.sleep(self.poll_seconds)
                continue
            generation = 0 if state.lease is None else state.lease.generation + 1
            took_over = state.lease is not None and not state.lease.released
            lease = self._held(step, spec, generation, holder)
            if not lease.acquire():
                continue  # another runner won this generation: look again
            # Double-check under the lease: a run may have finished between probe and acquire,
            # or between reading its RUNNING marker and its released lease (the owner writes
            # its final status, then releases).
            status = read_status(self.store, out)
            if status is not None and status.status is Status.SUCCESS:
                lease.release()
                outcome = Outcome.WAITED if waited else Outcome.CACHED
                return StepResult(outcome, spec, status)
            try:
                _raise_if_failed_by(step, status, waited)
            except StepFailedElsewhere:
                lease.release()
                raise
            log.info("%s: running as %s (%s)", step.key, self.owner, reason)
            status = execute(spec, lease)
            return StepResult(Outcome.TOOK_OVER if took_over else Outcome.RAN, spec, status)

    # -- running under a lease (operators.steps.lease.HeldLease owns the protocol) ----------

    def _held(self, step: Step, spec: StepSpec, generation: int, holder: str | None) -> HeldLease:
        return HeldLease(
            output=spec.output_path,
            step=step.name,
            version=spec.version,
            owner=self.owner,
            generation=generation,
            started_at=time.time(),
            lease_seconds=self.lease_seconds,
            holder=holder,
            store=self.store,
        )

    def _execute(
        self,
        spec: StepSpec,
        lease: HeldLease,
        fn: Callable[[StepSpec], Any],
        on_lost: Callable[[], None] | None,
    ) -> StatusRecord:
        lease.renew()  # the RUNNING marker, before the work starts
        heartbeat = _Heartbeat(self.heartbeat_seconds, lease.renew, on_lost)
        heartbeat.start()
        lost = LeaseLost(f"{lease.step}: lease generation {lease.generation} was taken over")
        try:
            value = fn(spec)
        except BaseException as exc:
            heartbeat.stop()
            lease.fail(exc)  # FAILED with the traceback tail, if the lease is still ours
            if heartbeat.lost and isinstance(exc, Exception):
                raise lost from exc  # the work failed because on_lost stopped it
            raise
        heartbeat.stop()
        if heartbeat.lost:
            raise lost
        return lease.succeed(value)

    def _hold(
        self, spec: StepSpec, lease: HeldLease, submit: Callable[[StepSpec, HeldLease], Any]
    ) -> StatusRecord:
        lease.renew()  # the RUNNING marker, before anything is started
        try:
            value = submit(spec, lease)
        except BaseException as exc:
            lease.fail(exc)
            raise
        return lease.record(Status.RUNNING, result=jsonable(value))


def _raise_if_failed_by(step: Step, status: StatusRecord | None, waited: set[str]) -> None:
    """``StepFailedElsewhere`` when a runner this one waited for failed the step: its failure
    is the step's, and would only repeat here. A killed owner (``terminated``) did not fail
    it: the step runs, resuming its work."""
    if (
        status is not None
        and status.status is Status.FAILED
        and status.owner in waited
        and not status.terminated
    ):
        raise StepFailedElsewhere(f"{step.key}: run by {status.owner} failed: {status.error}")
