"""The step model: content-addressed steps with status markers and heartbeat leases.

Marin's executor semantics, independent of Airflow (operators wrap it; tests run it bare):

* A :class:`Step` is a name, a *versioned* config, upstream steps and an *unversioned* config.
  Its version is the sha256 of canonical JSON over its name, versioned config and upstream
  identities (name + version). Unversioned fields (workers, runner...) and the storage root do
  not enter the hash, and upstream outputs are referenced symbolically (:func:`output_of`), so
  the same pipeline has the same versions on a laptop and on ``gs://``.
* Its output lives at ``{root}/{name}-{version[:HASH_LEN]}``, holding ``.status.json``
  (SUCCESS, FAILED with error, RUNNING with the lease) and the lease files ``.lease-NNNNNN``.
* :meth:`StepRunner.run` skips a SUCCESS step (CACHED), reruns a FAILED one, waits for a live
  lease (WAITED) and takes over a stale one (TOOK_OVER). Exclusion rests on one primitive,
  *atomic create* of lease generation ``n``: locally ``O_CREAT|O_EXCL``, on GCS an upload with
  ``ifGenerationMatch=0`` (gcsfs ``mode="create"``). Taking over generation ``n`` means
  creating ``n + 1``, so of several runners that see the same stale lease exactly one wins,
  without compare-and-swap on a mutable file.
* :func:`plan` is the dry run: what each step would do, and why, using the same probe.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import posixpath
import re
import socket
import tempfile
import threading
import time
import traceback as tb
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Protocol

log = logging.getLogger(__name__)

HASH_LEN = 8  # hex digits of the version in the output directory name
STATUS_FILE = ".status.json"
LEASE_PREFIX = ".lease-"
TRACEBACK_TAIL_CHARS = 4000  # enough to see the failing frame, small enough for a marker file

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*")  # fullmatch


# --------------------------------------------------------------------------------------------
# Errors


class StepError(RuntimeError):
    """Base class of step-model errors."""


class StepFailedElsewhere(StepError):
    """The run this runner waited for ended FAILED.

    A waiter does not rerun another owner's failure in the same call: with N concurrent
    waiters a deterministic failure would otherwise run N times. The next invocation (an
    Airflow retry, a backfill) reruns it, as for any FAILED step.
    """


class StepWaitTimeout(StepError):
    """A live lease held by another owner did not end within the wait timeout."""


class LeaseLost(StepError):
    """Another runner took over this runner's lease (ours looked stale): results discarded."""


# --------------------------------------------------------------------------------------------
# Steps and versions


@dataclass(frozen=True)
class OutputRef:
    """A symbolic reference to (a path inside) an upstream step's output.

    It hashes as the upstream's name and version, never as an absolute path, and resolves to
    a real path only against a root (:func:`resolve`).
    """

    step: Step
    subpath: str = ""


def output_of(step: Step, subpath: str = "") -> OutputRef:
    """Reference ``step``'s output directory (or a path below it) inside a config."""
    return OutputRef(step, subpath.strip("/"))


@dataclass(frozen=True, eq=False)
class Step:
    """A unit of work whose output is addressed by its version.

    ``config`` is versioned and may hold :class:`OutputRef` values anywhere (dicts, lists);
    ``deps`` are extra upstream steps that are not referenced from the config; ``unversioned``
    holds execution details that must not change the output (worker count, runner, TPU type).
    Steps compare by identity; two steps with the same :attr:`key` share an output.
    """

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    deps: Sequence[Step] = ()
    unversioned: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"step name {self.name!r}: use letters, digits, '_', '.', '-', '/'")
        # Freeze copies so that mutating the caller's dict cannot change a computed version.
        object.__setattr__(self, "config", _freeze(self.config))
        object.__setattr__(self, "unversioned", _freeze(self.unversioned))
        object.__setattr__(self, "deps", tuple(self.deps))
        # Fail at definition time, not halfway through a run, on non-JSON config values.
        canonical_json(_symbolic(self.config))
        canonical_json(_plain(self.unversioned))

    @property
    def upstream(self) -> tuple[Step, ...]:
        """Direct upstream steps: explicit deps plus every step referenced from the config."""
        seen: dict[int, Step] = {}
        for step in (*self.deps, *(ref.step for ref in _refs(self.config))):
            seen.setdefault(id(step), step)
        return tuple(seen.values())

    @cached_property
    def version(self) -> str:
        # Cached on the instance: config and upstream are frozen, so it cannot go stale.
        return step_version(self)

    @property
    def key(self) -> str:
        """``name-hash``: the output directory name, unique per (name, version)."""
        return f"{self.name}-{self.version[:HASH_LEN]}"


def canonical_json(value: Any) -> str:
    """The one serialization that versions are hashed over: sorted keys, no whitespace."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def step_version(step: Step) -> str:
    """sha256 (hex) of the step's name, versioned config and upstream names + versions.

    The name is hashed too, and upstreams enter as ``name-version``: two steps with equal
    configs but different code (names) must not give their consumers the same version.
    """
    payload = {
        "name": step.name,
        "config": _symbolic(step.config),
        "upstream": sorted(f"{u.name}-{u.version}" for u in step.upstream),
    }
    return hashlib.sha256(canonical_json(payload).encode("utf-8")).hexdigest()


def join(root: str, *parts: str) -> str:
    """Join paths local (``os.path``) or remote (``posixpath``, keeping ``scheme://``)."""
    parts = tuple(p for p in parts if p)
    if "://" in root:
        return posixpath.join(root.rstrip("/") or root, *parts)
    return os.path.join(root, *parts)


def output_path(root: str, step: Step) -> str:
    """Where the step's output lives: ``{root}/{name}-{version[:HASH_LEN]}``."""
    return join(root, step.key)


@dataclass(frozen=True)
class StepSpec:
    """A step bound to a root: what a step function receives.

    ``config`` has every :class:`OutputRef` replaced by the real path, ``upstream`` maps each
    upstream step name to its output path.
    """

    name: str
    version: str
    output_path: str
    config: Mapping[str, Any]
    unversioned: Mapping[str, Any]
    upstream: Mapping[str, str]


def resolve(step: Step, root: str) -> StepSpec:
    return StepSpec(
        name=step.name,
        version=step.version,
        output_path=output_path(root, step),
        config=_resolved(step.config, root),
        unversioned=_plain(step.unversioned),
        upstream={u.name: output_path(root, u) for u in step.upstream},
    )


def topological(steps: Iterable[Step]) -> list[Step]:
    """The steps and all their ancestors, each once (by key), upstream before downstream."""
    order: list[Step] = []
    done: set[str] = set()
    active: set[int] = set()

    def visit(step: Step) -> None:
        if step.key in done:
            return
        if id(step) in active:  # unreachable with frozen steps, but cheap to guard
            raise StepError(f"dependency cycle through {step.name}")
        active.add(id(step))
        for upstream in step.upstream:
            visit(upstream)
        active.discard(id(step))
        done.add(step.key)
        order.append(step)

    for step in steps:
        visit(step)
    return order


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _refs(value: Any) -> Iterator[OutputRef]:
    if isinstance(value, OutputRef):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _refs(v)
    elif isinstance(value, tuple):
        for v in value:
            yield from _refs(v)


def _map(value: Any, on_ref: Callable[[OutputRef], Any]) -> Any:
    if isinstance(value, OutputRef):
        return on_ref(value)
    if isinstance(value, Mapping):
        return {k: _map(v, on_ref) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_map(v, on_ref) for v in value]
    return value


def _symbolic(value: Any) -> Any:
    return _map(
        value,
        lambda ref: {"$output_of": f"{ref.step.name}-{ref.step.version}", "subpath": ref.subpath},
    )


def _resolved(value: Any, root: str) -> Any:
    return _map(value, lambda ref: join(output_path(root, ref.step), ref.subpath))


def _plain(value: Any) -> Any:
    def refuse(ref: OutputRef) -> Any:
        raise TypeError(f"output_of({ref.step.name}) belongs in the versioned config")

    return _map(value, refuse)


# --------------------------------------------------------------------------------------------
# Storage: the three operations the protocol needs, locally and through fsspec


class Store(Protocol):
    def read(self, path: str) -> bytes | None: ...
    def write(self, path: str, data: bytes) -> None: ...
    def create(self, path: str, data: bytes) -> bool: ...
    def makedirs(self, path: str) -> None: ...


class LocalStore:
    """Local files: atomic create with ``O_EXCL``, atomic replace with temp file + rename."""

    def read(self, path: str) -> bytes | None:
        try:
            with open(_local_path(path), "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        path = _local_path(path)
        directory = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)  # readers see the old file or the new one, never half
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def create(self, path: str, data: bytes) -> bool:
        # Write the content to a temp file first and hard-link it into place: link() is as
        # exclusive as O_EXCL, and a reader never sees the lease file empty.
        path = _local_path(path)
        directory = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError:
                # Filesystems without hard links: fall back to O_EXCL (brief empty window).
                try:
                    out = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(out, "wb") as handle:
                    handle.write(data)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def makedirs(self, path: str) -> None:
        os.makedirs(_local_path(path), exist_ok=True)


class FsspecStore:
    """Object stores through fsspec.

    ``create`` uses ``pipe_file(mode="create")``: gcsfs turns it into an upload with
    ``ifGenerationMatch=0``, which GCS applies atomically (a second creator gets HTTP 412,
    raised as FileExistsError), and the memory filesystem into ``open("xb")``. Filesystems
    without a native exclusive create fall back to fsspec's check-then-write, which is *not*
    atomic: two runners can then both win a lease; a warning says so. Single-object writes
    are atomic on GCS and S3, so ``write`` needs no temp file.
    """

    ATOMIC_CREATE = frozenset({"gs", "gcs", "memory"})

    def __init__(self, url: str) -> None:
        import fsspec  # lazily: local runs need no fsspec at import time

        self.fs, _ = fsspec.core.url_to_fs(url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.atomic_create = bool(self.ATOMIC_CREATE.intersection(protocols))
        if not self.atomic_create:
            log.warning(
                "%s: no atomic exclusive create on %s; concurrent runners of one step may "
                "both acquire its lease",
                url,
                protocols,
            )

    def read(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def create(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)


def store_for(root: str) -> Store:
    if "://" not in root or root.startswith("file://"):
        return LocalStore()
    return FsspecStore(root)


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


# --------------------------------------------------------------------------------------------
# Status markers and leases


class Status(enum.StrEnum):
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    RUNNING = "RUNNING"


@dataclass(frozen=True)
class Lease:
    """Generation ``generation`` of a step's lease; the highest existing generation rules."""

    generation: int
    owner: str
    expires_at: float  # wall clock (time.time): runners on several hosts need synced clocks
    released: bool = False

    def live(self, now: float) -> bool:
        return not self.released and now < self.expires_at


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


def _lease_path(out: str, generation: int) -> str:
    return join(out, f"{LEASE_PREFIX}{generation:06d}")


def _lease_bytes(lease: Lease) -> bytes:
    return json.dumps(lease.__dict__, sort_keys=True).encode()


def _read_lease(store: Store, out: str, generation: int) -> Lease | None:
    data = store.read(_lease_path(out, generation))
    if data is None:
        return None
    try:
        return Lease(**json.loads(data))
    except (ValueError, TypeError):
        # A lease file being created without content (O_EXCL fallback): treat it as held.
        return Lease(generation, owner="?", expires_at=float("inf"))


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


# --------------------------------------------------------------------------------------------
# Dry run


class Action(enum.StrEnum):
    RUN = "RUN"
    SKIP = "SKIP"
    WAIT = "WAIT"


@dataclass(frozen=True)
class PlanEntry:
    step: Step
    action: Action
    reason: str
    path: str


def decide(state: StepState, now: float) -> tuple[Action, str]:
    """The runner's decision for one step, with a reason a person can read."""
    status, lease = state.status, state.lease
    if status is not None and status.status is Status.SUCCESS:
        return Action.SKIP, f"SUCCESS at {_when(status.updated_at)}: cache hit"
    if lease is not None and lease.live(now):
        return Action.WAIT, (
            f"RUNNING by {lease.owner}, lease live for {lease.expires_at - now:.0f}s more"
        )
    if lease is not None and not lease.released:
        return Action.RUN, (
            f"stale lease of {lease.owner} expired {now - lease.expires_at:.0f}s ago: take over"
        )
    if status is not None and status.status is Status.FAILED:
        return Action.RUN, f"last attempt FAILED: {status.error}"
    return Action.RUN, "no status marker: never run"


def plan(steps: Iterable[Step], root: str, *, now: float | None = None) -> list[PlanEntry]:
    """Dry run: every step (ancestors included, upstream first) with what a run would do."""
    store = store_for(root)
    now = time.time() if now is None else now
    entries: list[PlanEntry] = []
    actions: dict[str, Action] = {}
    for step in topological(steps):
        state = probe(root, step, store)
        action, reason = decide(state, now)
        if action is Action.RUN:
            pending = [u.name for u in step.upstream if actions.get(u.key) is not Action.SKIP]
            if pending:
                reason += f"; after upstream {', '.join(pending)}"
        actions[step.key] = action
        entries.append(PlanEntry(step, action, reason, state.path))
    return entries


def format_plan(entries: Sequence[PlanEntry]) -> str:
    width = max((len(e.step.key) for e in entries), default=0)
    return "\n".join(f"{e.action:<4}  {e.step.key:<{width}}  {e.reason}" for e in entries)


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


# --------------------------------------------------------------------------------------------
# Running


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

    def run(self, step: Step, fn: Callable[[StepSpec], Any]) -> StepResult:
        return self._run(step, lambda spec, generation: self._execute(step, spec, generation, fn))

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
        return self._run(step, lambda spec, generation: self._hold(step, spec, generation, submit))

    def _run(self, step: Step, execute: Callable[[StepSpec, int], StatusRecord]) -> StepResult:
        spec = resolve(step, self.root)
        out = spec.output_path
        self.store.makedirs(out)
        deadline = time.monotonic() + self.wait_timeout
        waited_for: str | None = None
        while True:
            state = StepState(out, read_status(self.store, out), current_lease(self.store, out))
            action, reason = decide(state, time.time())
            if action is Action.SKIP:
                assert state.status is not None
                outcome = Outcome.WAITED if waited_for else Outcome.CACHED
                log.info("%s: %s (%s)", step.key, outcome, reason)
                return StepResult(outcome, spec, state.status)
            failed = state.status
            if (
                action is Action.RUN
                and waited_for
                and failed is not None
                and failed.status is Status.FAILED
                and failed.owner == waited_for
            ):
                raise StepFailedElsewhere(f"{step.key}: run by {waited_for} failed: {failed.error}")
            if action is Action.WAIT:
                assert state.lease is not None
                waited_for = state.lease.owner
                if time.monotonic() > deadline:
                    raise StepWaitTimeout(f"{step.key}: {reason}; gave up after waiting")
                log.info("%s: waiting (%s)", step.key, reason)
                time.sleep(self.poll_seconds)
                continue
            generation = 0 if state.lease is None else state.lease.generation + 1
            took_over = state.lease is not None and not state.lease.released
            if not self._acquire(out, generation):
                continue  # another runner won this generation: look again
            # Double-check under the lease: a run may have finished between probe and acquire.
            status = read_status(self.store, out)
            if status is not None and status.status is Status.SUCCESS:
                self._release(out, generation)
                outcome = Outcome.WAITED if waited_for else Outcome.CACHED
                return StepResult(outcome, spec, status)
            log.info("%s: running as %s (%s)", step.key, self.owner, reason)
            status = execute(spec, generation)
            return StepResult(Outcome.TOOK_OVER if took_over else Outcome.RAN, spec, status)

    # -- lease handling -----------------------------------------------------------------------

    def _lease(self, generation: int, *, released: bool = False) -> Lease:
        return Lease(generation, self.owner, time.time() + self.lease_seconds, released)

    def _acquire(self, out: str, generation: int) -> bool:
        return self.store.create(
            _lease_path(out, generation), _lease_bytes(self._lease(generation))
        )

    def _still_owner(self, out: str, generation: int) -> bool:
        return _owns(self.store, out, generation, self.owner)

    def _release(self, out: str, generation: int) -> None:
        # Released, not deleted: generations only grow, so a zombie can never recreate one.
        if self._still_owner(out, generation):
            self.store.write(
                _lease_path(out, generation), _lease_bytes(self._lease(generation, released=True))
            )

    def _write_status(self, out: str, record: StatusRecord) -> None:
        self.store.write(join(out, STATUS_FILE), record.to_bytes())

    def _execute(
        self, step: Step, spec: StepSpec, generation: int, fn: Callable[[StepSpec], Any]
    ) -> StatusRecord:
        out = spec.output_path
        started = time.time()

        def record(status: Status, **extra: Any) -> StatusRecord:
            return StatusRecord(
                status=status,
                step=step.name,
                version=spec.version,
                owner=self.owner,
                generation=generation,
                started_at=started,
                updated_at=time.time(),
                **extra,
            )

        def beat() -> None:
            lease = self._lease(generation)
            self.store.write(_lease_path(out, generation), _lease_bytes(lease))
            self._write_status(out, record(Status.RUNNING, lease_expires_at=lease.expires_at))

        beat()
        heartbeat = _Heartbeat(
            self.heartbeat_seconds, beat, lambda: self._still_owner(out, generation)
        )
        heartbeat.start()
        try:
            value = fn(spec)
        except BaseException as exc:
            heartbeat.stop()
            if self._still_owner(out, generation):
                self._write_status(
                    out,
                    record(
                        Status.FAILED,
                        error=f"{type(exc).__name__}: {exc}",
                        traceback="".join(tb.format_exception(exc))[-TRACEBACK_TAIL_CHARS:],
                    ),
                )
                self._release(out, generation)
            raise
        heartbeat.stop()
        if heartbeat.lost or not self._still_owner(out, generation):
            raise LeaseLost(f"{step.key}: lease generation {generation} was taken over")
        final = record(Status.SUCCESS, result=_jsonable(value))
        self._write_status(out, final)
        self._release(out, generation)
        return final

    def _hold(
        self,
        step: Step,
        spec: StepSpec,
        generation: int,
        submit: Callable[[StepSpec, HeldLease], Any],
    ) -> StatusRecord:
        lease = HeldLease(
            output=spec.output_path,
            step=step.name,
            version=spec.version,
            owner=self.owner,
            generation=generation,
            started_at=time.time(),
            lease_seconds=self.lease_seconds,
        )
        lease.renew()  # the RUNNING marker, before anything is started
        try:
            value = submit(spec, lease)
        except BaseException as exc:
            lease.fail(exc)
            raise
        return lease.record(Status.RUNNING, result=_jsonable(value))


def _owns(store: Store, out: str, generation: int, owner: str) -> bool:
    """The ownership check of every lease holder: our generation, and no next one."""
    if _read_lease(store, out, generation + 1) is not None:
        return False  # someone created the next generation: we were taken over
    lease = _read_lease(store, out, generation)
    return lease is not None and lease.owner == owner


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

    @property
    def renew_every(self) -> float:
        # As the heartbeat does: two renewals may fail before anyone may take over.
        return self.lease_seconds / 3

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

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
        return store_for(self.output)

    def owned(self) -> bool:
        return _owns(self._store, self.output, self.generation, self.owner)

    def renew(self) -> bool:
        """Extend the lease and the RUNNING marker; False once another runner took over."""
        store = self._store
        if not _owns(store, self.output, self.generation, self.owner):
            return False
        lease = Lease(self.generation, self.owner, time.time() + self.lease_seconds)
        store.write(_lease_path(self.output, self.generation), _lease_bytes(lease))
        self._write(store, self.record(Status.RUNNING, lease_expires_at=lease.expires_at))
        return True

    def succeed(self, result: Any) -> StatusRecord:
        """SUCCESS marker (``result`` kept if JSON), lease released; :class:`LeaseLost` if
        another runner took over meanwhile (its run wins, ours is discarded)."""
        store = self._store
        if not _owns(store, self.output, self.generation, self.owner):
            raise LeaseLost(
                f"{self.step}: lease generation {self.generation} was taken over while deferred"
            )
        final = self.record(Status.SUCCESS, result=_jsonable(result))
        self._write(store, final)
        self._release(store)
        return final

    def fail(self, error: BaseException | str) -> bool:
        """FAILED marker (error, traceback tail), lease released; False if no longer ours."""
        store = self._store
        if not _owns(store, self.output, self.generation, self.owner):
            return False
        if isinstance(error, BaseException):
            message = f"{type(error).__name__}: {error}"
            trace = "".join(tb.format_exception(error))[-TRACEBACK_TAIL_CHARS:]
        else:
            message, trace = error, None
        self._write(store, self.record(Status.FAILED, error=message, traceback=trace))
        self._release(store)
        return True

    def _write(self, store: Store, record: StatusRecord) -> None:
        store.write(join(self.output, STATUS_FILE), record.to_bytes())

    def _release(self, store: Store) -> None:
        if _owns(store, self.output, self.generation, self.owner):
            released = Lease(
                self.generation, self.owner, time.time() + self.lease_seconds, released=True
            )
            store.write(_lease_path(self.output, self.generation), _lease_bytes(released))


class _Heartbeat:
    """Renews the lease every ``interval`` seconds until stopped or until ownership is lost."""

    def __init__(
        self, interval: float, beat: Callable[[], None], owned: Callable[[], bool]
    ) -> None:
        self.interval, self.beat, self.owned = interval, beat, owned
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
                if not self.owned():
                    self.lost = True
                    log.error("heartbeat: lease taken over by another runner")
                    return
                self.beat()
            except Exception:  # a transient storage error must not kill the heartbeat
                log.exception("heartbeat: could not renew the lease; retrying")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        log.warning("step result %r is not JSON: not kept in the marker", type(value).__name__)
        return None
    return value
