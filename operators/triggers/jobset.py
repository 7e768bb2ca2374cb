"""JobSetTrigger: follow a JobSet on GKE to its end in the triggerer, not on a worker.

The training task submits the JobSet and defers; this trigger then

* watches the JobSet (a ``watch`` on its name, so a change is seen at once; a plain GET every
  ``poll_seconds`` at the latest) and reads ``status.terminalState``, ``status.conditions``,
  ``status.restarts``/``restartsCountTowardsMax``;
* reports every restart and every condition that turns True (Suspended by Kueue, ...) as a
  log line, which Airflow shows in the task's log;
* shows the leader pod's (slice 0, worker 0) new log lines every ``log_seconds``, with the
  ``kubectl logs`` command and, on GKE, the Cloud Console link for the rest;
* renews the step's RUNNING lease (:mod:`operators.triggers.lease`) so that no other DAG run
  takes the step over while it trains;
* fires one event: ``terminal`` (with the :class:`~operators.jobset.JobSetStatus`, pod exit
  codes included), ``vanished`` (the JobSet was deleted or replaced from outside),
  ``lease_lost`` or ``error`` (a non-transient API error such as 403).

``serialize()`` holds only plain data -- the handle, the cluster settings (never a token), the
lease reference and the intervals -- so the trigger is rebuilt as it was after a triggerer
restart. Transient API errors (5xx, connection resets) are retried with backoff for as long as
the task's timeout allows: a weeks-long run outlives an API server blip.

``on_kill`` (Airflow 3.3 calls it when a user marks the deferred task failed or success, or
clears it) deletes the JobSet (foreground) and marks the step FAILED: no TPU slice keeps
running for a task nobody waits on. ``cleanup`` only closes the client: it runs on every exit,
triggerer restarts included, and must not stop training.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.hooks.jobset import JobSetAsyncHook
from operators.jobset.backend import (
    JobSetApiError,
    JobSetError,
    JobSetHandle,
    JobSetNotFound,
    JobSetObservation,
)

__all__ = ["JobSetTrigger", "new_lines"]

TERMINAL, VANISHED, LEASE_LOST, ERROR = "terminal", "vanished", "lease_lost", "error"


def new_lines(previous: list[str], tail: list[str]) -> list[str]:
    """The lines of ``tail`` not already shown: after its longest overlap with ``previous``.

    Log tails are read again and again (``tailLines``); this keeps each line shown once. With
    no overlap, more lines were written than the tail holds: a ``...`` marks the gap.
    """
    if not previous:
        return list(tail)
    for k in range(min(len(previous), len(tail)), 0, -1):
        if previous[-k:] == tail[:k]:
            return tail[k:]
    return ["...", *tail] if tail else []


@dataclass
class _Seen:
    """What has been reported already (restarts, conditions, log lines)."""

    restarts: int | None = None
    conditions: dict[str, str] = field(default_factory=dict)
    leader: str | None = None
    tail: list[str] = field(default_factory=list)


def describe_changes(seen: _Seen, observed: JobSetObservation) -> list[str]:
    """Log lines for restarts and conditions not reported yet; updates ``seen``."""
    status = observed.status
    name = status.handle.name
    counted = f"{status.restarts_counted}/{observed.max_restarts} counted toward maxRestarts"
    lines = []
    if seen.restarts is None and status.restarts:
        lines.append(f"JobSet {name} has restarted {status.restarts} time(s) so far ({counted})")
    elif seen.restarts is not None and status.restarts > seen.restarts:
        lines.append(
            f"JobSet {name} restarted: restart {status.restarts} ({counted}); every pod "
            "recreated, the trainer resumes from its last checkpoint"
        )
    seen.restarts = status.restarts
    for kind, text in observed.conditions.items():
        if seen.conditions.get(kind) != text:
            lines.append(f"JobSet {name} condition {kind}: {text}")
    seen.conditions = dict(observed.conditions)
    return lines


class JobSetTrigger(BaseTrigger):
    """Follows one JobSet until it ends (see the module docstring)."""

    def __init__(
        self,
        handle: Mapping[str, str],
        cluster: Mapping[str, Any] | None = None,
        lease: Mapping[str, Any] | None = None,
        poll_seconds: float = 30.0,
        log_seconds: float = 60.0,
        log_lines: int = 20,
        error_backoff: float = 30.0,
        owns_jobset: bool | None = None,
    ) -> None:
        super().__init__()
        self.handle = dict(handle)
        self.lease = dict(lease) if lease else None
        # False for a run following another run's JobSet: it watches, never deletes. Unset (a
        # trigger serialized before the flag): an owner is the one that holds the step's lease.
        self.owns_jobset = self.lease is not None if owns_jobset is None else bool(owns_jobset)
        self.cluster = dict(cluster or {})
        self.poll_seconds = float(poll_seconds)
        self.log_seconds = float(log_seconds)
        self.log_lines = int(log_lines)
        self.error_backoff = float(error_backoff)
        self._hook_obj: JobSetAsyncHook | None = None
        # Renewals and on_kill's fail run in threads that cancelling a coroutine does not stop:
        # one at a time, so a renewal in flight cannot land after the kill and bring the step
        # back to RUNNING.
        self._lease_lock = threading.Lock()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "handle": dict(self.handle),
                "cluster": dict(self.cluster),
                "lease": dict(self.lease) if self.lease else None,
                "poll_seconds": self.poll_seconds,
                "log_seconds": self.log_seconds,
                "log_lines": self.log_lines,
                "error_backoff": self.error_backoff,
                "owns_jobset": self.owns_jobset,
            },
        )

    # -- helpers ------------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        # The triggerer routes a trigger's log into the deferred task's log.
        self.log.info("%s", line)

    def _hook(self) -> JobSetAsyncHook:
        if self._hook_obj is None:
            self._hook_obj = JobSetAsyncHook(
                "gke",
                cluster=self.cluster,
                log_sink=self._say,
                # Short bounded retries per call: the loop below keeps retrying for as long
                # as the run lasts, without blocking a thread for minutes.
                backend_options={
                    "retries": 2,
                    "backoff": min(1.0, self.error_backoff),
                    "max_backoff": 5.0,
                },
            )
        return self._hook_obj

    def _with_lease_lock(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lease_lock:
            return call(*args, **kwargs)

    def _lease_obj(self) -> Any:
        from operators.triggers.lease import DeferredLease

        return DeferredLease.from_dict(self.lease) if self.lease else None

    def _event(self, kind: str, message: str = "", **extra: Any) -> TriggerEvent:
        return TriggerEvent(
            {"event": kind, "handle": dict(self.handle), "message": message, **extra}
        )

    def _console_link(self, pod: str) -> str | None:
        c = self.cluster
        if not (c.get("cluster_name") and c.get("location") and c.get("project_id")):
            return None
        return (
            f"https://console.cloud.google.com/kubernetes/pod/{c['location']}/"
            f"{c['cluster_name']}/{self.handle['namespace']}/{pod}/logs?project={c['project_id']}"
        )

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[TriggerEvent]:
        handle = JobSetHandle.from_dict(self.handle)
        hook = self._hook()
        lease = self._lease_obj()
        seen = _Seen()
        next_renew = next_log = 0.0
        self._say(
            f"following JobSet {handle.namespace}/{handle.name} (uid {handle.uid}) from the "
            "triggerer: the task holds no worker slot until it ends"
        )
        while True:
            if lease is not None and time.monotonic() >= next_renew:
                try:
                    owned = await asyncio.to_thread(self._with_lease_lock, lease.renew)
                except Exception as exc:  # storage blip: the lease has two more renewals
                    self._say(f"could not renew the step lease ({exc}); retrying")
                    next_renew = time.monotonic() + min(lease.renew_every, self.error_backoff)
                else:
                    if not owned:
                        yield self._event(
                            LEASE_LOST,
                            f"step {lease.step}: lease generation {lease.generation} was taken "
                            "over by another run; not following the JobSet any further",
                        )
                        return
                    next_renew = time.monotonic() + lease.renew_every
            try:
                observed = await hook.observe(handle)
            except JobSetNotFound as exc:
                yield self._event(VANISHED, f"{exc}: deleted from outside, or its ttl passed")
                return
            except JobSetApiError as exc:
                if not exc.transient:
                    yield self._event(ERROR, str(exc))
                    return
                self._say(f"Kubernetes API unavailable ({exc}); retrying in {self.error_backoff}s")
                await asyncio.sleep(self.error_backoff)
                continue
            except JobSetError as exc:  # 401 after a refresh, 403, conflicts
                yield self._event(ERROR, str(exc))
                return
            status = observed.status
            for line in describe_changes(seen, observed):
                self._say(line)
            if status.done or time.monotonic() >= next_log:
                await self._show_log(hook, handle, seen)
                next_log = time.monotonic() + self.log_seconds
            if status.done:
                status = await hook.with_exits(status)
                self._say(
                    f"JobSet {handle.name} {status.terminal_state}: {status.reason} "
                    f"{status.message}".rstrip()
                )
                yield self._event(TERMINAL, status=status.to_dict())
                return
            # Until the JobSet changes, the next log tail or the next lease renewal is due.
            due = [next_log] + ([next_renew] if lease is not None else [])
            wait = min(self.poll_seconds, max(0.0, min(due) - time.monotonic()))
            await self._wait_for_change(hook, handle, observed.version, wait)

    async def _wait_for_change(
        self, hook: JobSetAsyncHook, handle: JobSetHandle, version: str | None, timeout: float
    ) -> None:
        """Until the JobSet changes or ``timeout`` passes; a failed watch falls back to sleep."""
        started = time.monotonic()
        try:
            await hook.wait_for_change(handle, version, timeout)
        except JobSetError as exc:  # 410 expired version, watch not allowed, deleted...
            self.log.debug("watch ended (%s); polling", exc)
            await asyncio.sleep(max(0.0, timeout - (time.monotonic() - started)))
        # A JobSet whose status changes constantly must not turn this into a busy loop.
        await asyncio.sleep(min(1.0, self.poll_seconds / 10))

    async def _show_log(self, hook: JobSetAsyncHook, handle: JobSetHandle, seen: _Seen) -> None:
        try:
            pod, tail = await hook.leader_log_tail(handle, self.log_lines)
        except Exception as exc:  # logs are a courtesy: never fail the run over them
            self.log.debug("leader log unavailable: %s", exc)
            return
        if pod is None:
            return
        if pod != seen.leader:
            seen.leader, seen.tail = pod, []
            hint = f"leader pod {pod}: kubectl logs -n {handle.namespace} {pod} -f"
            if link := self._console_link(pod):
                hint += f" | {link}"
            self._say(hint)
        for line in new_lines(seen.tail, tail):
            self._say(f"[{pod}] {line}")
        seen.tail = tail

    # -- ending -------------------------------------------------------------------------------

    async def on_kill(self) -> None:
        """The user killed the deferred task: delete the JobSet, fail the step, free the lease.
        A run that follows another run's JobSet (``owns_jobset`` False) leaves that JobSet, and
        the step its owner is training, alone."""
        if not self.owns_jobset:
            self._say(
                f"killed while following JobSet {self.handle['name']}: not ours, left running"
            )
            return
        name = self.handle["name"]
        outcome = f"deleting JobSet {name} did not finish"  # cancelled (on_kill_timeout)
        try:
            status = await self._hook().cancel(JobSetHandle.from_dict(self.handle))
            outcome = f"JobSet {name} deleted ({status.message})"
        except Exception as exc:
            outcome = f"deleting JobSet {name} failed ({exc}); a rerun adopts or replaces it"
            raise
        finally:
            # The step is ended whatever the delete did: the cleared task's rerun must not
            # wait out the lease, nor follow a JobSet its own kill was deleting.
            lease = self._lease_obj()
            if lease is not None:
                await asyncio.to_thread(
                    self._with_lease_lock,
                    lease.fail,
                    f"task killed while deferred: {outcome}",
                    terminated=True,  # killed, not failed: a run following it runs the step
                )

    async def cleanup(self) -> None:
        # Every exit, triggerer restarts included: release the client, never the JobSet.
        if self._hook_obj is not None:
            self._hook_obj.close()
            self._hook_obj = None
