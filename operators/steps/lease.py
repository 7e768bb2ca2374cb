"""The lease protocol: status markers, lease generations, and the one lease holder.

A step's output directory holds ``.status.json`` (SUCCESS, FAILED with error, RUNNING with the
lease) and the lease files ``.lease-NNNNNN``. Exclusion rests on one primitive, *atomic
create* of lease generation ``n`` (:meth:`~operators.steps.store.Store.create`); taking over
generation ``n`` means creating ``n + 1``, so of several runners that see the same stale lease
exactly one wins. :class:`HeldLease` is the only code that renews a lease and ends a step:
the runner's heartbeat thread renews it in-process, a deferred Airflow task from its trigger.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import threading
import time
import traceback as tb
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from operators.steps.errors import LeaseLost
from operators.steps.store import Store, store_for
from operators.steps.version import Step, join, output_path

log = logging.getLogger(__name__)

STATUS_FILE = ".status.json"
LEASE_PREFIX = ".lease-"
TRACEBACK_TAIL_CHARS = 4000  # enough to see the failing frame, small enough for a marker file


class Status(enum.StrEnum):
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    RUNNING = "RUNNING"


# How long an unreadable lease file counts as held (its creator writes it within moments).
UNREADABLE_LEASE_S = 600.0


def this_process() -> str | None:
    """This process, as :attr:`Lease.holder` names it: ``<boot id>:<pid namespace>:<pid>``.

    The kernel's boot id and the pid namespace make the pid mean one process on one machine
    (a host name does not: containers and pods share them). None where Linux's ``/proc``
    cannot tell.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}:{namespace}:{os.getpid()}"


def process_exited(process: str) -> bool:
    """Whether ``process`` (:func:`this_process` of some process) is known to have exited:
    it ran under this kernel and pid namespace, and its pid is gone. False when that cannot
    be told (another machine or container) or the pid is in use (perhaps reused)."""
    here = this_process()
    if here is None:
        return False
    machine, _, pid = process.rpartition(":")
    if machine != here.rpartition(":")[0] or not (pid.isascii() and pid.isdigit()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists, as another user's process
        return False
    return False


@dataclass(frozen=True)
class Lease:
    """Generation ``generation`` of a step's lease; the highest existing generation rules."""

    generation: int
    owner: str
    expires_at: float  # wall clock (time.time): runners on several hosts need synced clocks
    released: bool = False
    # The process whose heartbeat thread renews the lease (this_process()); None when another
    # process may renew it (a deferred task's trigger) or nobody can tell.
    holder: str | None = None

    def live(self, now: float) -> bool:
        return not self.released and now < self.expires_at

    def holder_exited(self) -> bool:
        """Nobody will renew it again: its heartbeat's process is known to be gone (killed
        with its worker). It still counts as held until it expires: the lease protocol
        takes nothing over early; a reader that only waits for the holder may stop."""
        return isinstance(self.holder, str) and process_exited(self.holder)


@dataclass(frozen=True)
class StatusRecord:
    """The content of ``.status.json``."""

    status: Status
    step: str
    version: str
    owner: str
    generation: int
    updated_at: float
    started_at: float | None = None
    lease_expires_at: float | None = None
    error: str | None = None
    traceback: str | None = None
    result: Any = None
    # FAILED because its task was killed (SIGTERM from the UI, a timeout, Ctrl-C): not a
    # failure of the step, so a runner that waited on it runs the step instead of failing too.
    terminated: bool | None = None

    def to_bytes(self) -> bytes:
        body = {k: v for k, v in self.__dict__.items() if v is not None}
        body["status"] = str(self.status)
        return (json.dumps(body, indent=2, sort_keys=True, default=str) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StatusRecord:
        body = json.loads(data)
        body["status"] = Status(body["status"])
        return cls(**body)


@dataclass(frozen=True)
class StepState:
    """What is on storage for one step: its status marker and its current lease."""

    path: str
    status: StatusRecord | None
    lease: Lease | None


_LEASE_FIELDS = frozenset(f.name for f in fields(Lease))


def _lease_path(out: str, generation: int) -> str:
    return join(out, f"{LEASE_PREFIX}{generation:06d}")


def _without_no_holder(fields: dict[str, Any]) -> dict[str, Any]:
    """No holder, no key: a lease file or a trigger's kwargs without one read the same to
    code from before holders."""
    return {k: v for k, v in fields.items() if k != "holder" or v is not None}


def _lease_bytes(lease: Lease) -> bytes:
    return json.dumps(_without_no_holder(lease.__dict__), sort_keys=True).encode()


def _read_lease(store: Store, out: str, generation: int) -> Lease | None:
    data = store.read(_lease_path(out, generation))
    if data is None:
        return None
    try:
        body = json.loads(data)
        # Fields a later version may add are ignored, not an unreadable lease.
        return Lease(**{k: v for k, v in body.items() if k in _LEASE_FIELDS})
    except (ValueError, TypeError, AttributeError):
        # A lease file being created without content (the O_EXCL fallback): held while its
        # creator may still be writing it; one killed in between left it empty for good, so
        # after UNREADABLE_LEASE_S it is stale and the next generation takes over.
        modified = store.modified(_lease_path(out, generation))
        expires = float("inf") if modified is None else modified + UNREADABLE_LEASE_S
        return Lease(generation, owner="?", expires_at=expires)


def current_lease(store: Store, out: str) -> Lease | None:
    """The highest existing lease generation (probed upward: takeovers are rare)."""
    found: Lease | None = None
    generation = 0
    while (lease := _read_lease(store, out, generation)) is not None:
        found, generation = lease, generation + 1
    return found


def read_status(store: Store, out: str) -> StatusRecord | None:
    data = store.read(join(out, STATUS_FILE))
    if data is None:
        return None
    try:
        return StatusRecord.from_bytes(data)
    except (ValueError, TypeError, KeyError) as exc:
        # A corrupt marker must not be mistaken for SUCCESS: treat it as absent (rerun).
        log.warning("%s: unreadable status marker (%s); treating the step as not run", out, exc)
        return None


def probe(root: str, step: Step, store: Store | None = None) -> StepState:
    out = output_path(root, step)
    store = store or store_for(root)
    return StepState(out, read_status(store, out), current_lease(store, out))


def _owns(store: Store, out: str, generation: int, owner: str) -> bool:
    """The ownership check of every lease holder: our generation, not released, and no next
    one. A released lease is ended: a late renew (a trigger's in-flight renewal racing its
    ``on_kill``, a duplicate trigger after a triggerer failover) must not bring it back and
    turn a SUCCESS or FAILED marker into RUNNING."""
    if _read_lease(store, out, generation + 1) is not None:
        return False  # someone created the next generation: we were taken over
    lease = _read_lease(store, out, generation)
    return lease is not None and lease.owner == owner and not lease.released


@dataclass(frozen=True)
class HeldLease:
    """Generation ``generation`` of the lease on the step whose output is ``output``, held by
    ``owner`` without a heartbeat thread (:meth:`StepRunner.run_held`).

    Plain, JSON-able data (:meth:`to_dict`), so it can travel in an Airflow trigger's kwargs
    and be renewed and ended by another process. Its operations are the heartbeat's own
    protocol: ownership is ``(owner, generation)`` with no next generation, and ending the
    step writes the marker and marks the lease released (never deleted).
    """

    output: str
    step: str
    version: str
    owner: str
    generation: int
    started_at: float
    lease_seconds: float
    # Lease.holder: this_process() where the heartbeat thread renews it; None for a deferred
    # task's lease, which the trigger renews from another process.
    holder: str | None = None
    # The runner's store (tests inject one); not part of the JSON form: elsewhere the output's.
    store: Store | None = field(default=None, compare=False, repr=False)

    @property
    def renew_every(self) -> float:
        # As the heartbeat does: two renewals may fail before anyone may take over.
        return self.lease_seconds / 3

    def to_dict(self) -> dict[str, Any]:
        return _without_no_holder({k: v for k, v in self.__dict__.items() if k != "store"})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeldLease:
        return cls(**dict(data))

    def record(self, status: Status, **extra: Any) -> StatusRecord:
        """A status marker of this lease's run (``extra``: error, result, lease expiry...)."""
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

    @property
    def _store(self) -> Store:
        return self.store or store_for(self.output)

    def acquire(self) -> bool:
        """Create this generation's lease file, atomically; False if another runner did."""
        lease = self._lease()
        return self._store.create(_lease_path(self.output, self.generation), _lease_bytes(lease))

    def release(self) -> None:
        """Mark the lease released (never deleted: generations only grow, so a zombie can
        never recreate one), if it is still ours."""
        self._release(self._store)

    def owned(self) -> bool:
        return _owns(self._store, self.output, self.generation, self.owner)

    def renew(self) -> bool:
        """Extend the lease and the RUNNING marker; False once another runner took over."""
        store = self._store
        if not _owns(store, self.output, self.generation, self.owner):
            return False
        lease = self._lease()
        store.write(_lease_path(self.output, self.generation), _lease_bytes(lease))
        self._write(store, self.record(Status.RUNNING, lease_expires_at=lease.expires_at))
        return True

    def succeed(self, result: Any) -> StatusRecord:
        """SUCCESS marker (``result`` kept if JSON), lease released; :class:`LeaseLost` if
        another runner took over meanwhile (its run wins, ours is discarded)."""
        store = self._store
        if not _owns(store, self.output, self.generation, self.owner):
            raise LeaseLost(f"{self.step}: lease generation {self.generation} was taken over")
        final = self.record(Status.SUCCESS, result=jsonable(result))
        self._write(store, final)
        self._release(store)
        return final

    def fail(self, error: BaseException | str, *, terminated: bool | None = None) -> bool:
        """FAILED marker (error, traceback tail), lease released; False if no longer ours.
        ``terminated``: the task was killed (see :attr:`StatusRecord.terminated`); by default,
        when ``error`` is a BaseException that is no Exception."""
        store = self._store
        if not _owns(store, self.output, self.generation, self.owner):
            return False
        if isinstance(error, BaseException):
            message = f"{type(error).__name__}: {error}"
            trace = "".join(tb.format_exception(error))[-TRACEBACK_TAIL_CHARS:]
            # Airflow's AirflowTaskTerminated, KeyboardInterrupt, SystemExit: BaseExceptions
            # that end a process, never raised by the step's own work.
            if terminated is None and not isinstance(error, Exception):
                terminated = True
        else:
            message, trace = error, None
        record = self.record(Status.FAILED, error=message, traceback=trace, terminated=terminated)
        self._write(store, record)
        self._release(store)
        return True

    def _lease(self, released: bool = False) -> Lease:
        expires = time.time() + self.lease_seconds
        return Lease(self.generation, self.owner, expires, released, self.holder)

    def _write(self, store: Store, record: StatusRecord) -> None:
        store.write(join(self.output, STATUS_FILE), record.to_bytes())

    def _release(self, store: Store) -> None:
        if _owns(store, self.output, self.generation, self.owner):
            released = self._lease(released=True)
            store.write(_lease_path(self.output, self.generation), _lease_bytes(released))


class _Heartbeat:
    """Calls ``renew`` every ``interval`` seconds until stopped or until it returns False
    (the lease was taken over: ``lost``), and then ``on_lost``: a runner taken over (its
    process stalled past its lease, and another took the step) must stop writing into the
    output that the new owner now writes."""

    def __init__(
        self,
        interval: float,
        renew: Callable[[], bool],
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.interval, self.renew, self.on_lost = interval, renew, on_lost
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="step-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.renew():
                    self.lost = True
                    log.error("heartbeat: lease taken over by another runner; stopping the work")
                    self._stop_work()
                    return
            except Exception:  # a transient storage error must not kill the heartbeat
                log.exception("heartbeat: could not renew the lease; retrying")

    def _stop_work(self) -> None:
        if self.on_lost is None:
            return
        try:
            self.on_lost()
        except Exception:  # the step still ends in LeaseLost: never SUCCESS from this runner
            log.exception("heartbeat: could not stop the work after losing the lease")


def without_non_finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float, in dicts, lists and tuples at any depth,
    replaced by None: JSON has no such numbers (a diverged model's loss is one)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: without_non_finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_non_finite(v) for v in value]
    return value


def jsonable(value: Any) -> Any:
    """The step result as its marker keeps it: non-finite numbers become None (the rest of
    the result is kept); a result that is still not JSON is not kept at all."""
    for candidate in (value, without_non_finite(value)):
        try:
            json.dumps(candidate, allow_nan=False)
        except (TypeError, ValueError):
            continue
        if candidate is not value:
            log.warning("step result has NaN or infinite numbers: kept as null")
        return candidate
    log.warning("step result %r is not JSON: not kept in the marker", type(value).__name__)
    return None
