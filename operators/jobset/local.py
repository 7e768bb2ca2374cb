"""Run a JobSet manifest's pods as local processes: the "one machine" training backend.

Why over 500 lines: it stands in for three controllers (JobSet, Job, GKE's TPU webhook) whose
rules interlock (a retryable pod failure restarts every pod of the JobSet, counted against
``maxRestarts``); kept together so that one reading shows what the cluster would do.

:class:`LocalBackend` plays the parts a cluster would, so that the same manifest and the same
trainer entrypoint run on a laptop and on GKE:

* **JobSet controller** -- one Job per replica, pod labels/annotations (``jobset-name``,
  ``replicatedjob-name``, ``job-index``, ...), ``failurePolicy`` (rules, ``maxRestarts``,
  restart *all* pods on a retryable failure), ``successPolicy``.
* **Job controller** -- Indexed completion, ``JOB_COMPLETION_INDEX``, ``backoffLimit``,
  ``podFailurePolicy`` (``FailJob``/``Count``/``Ignore`` on exit codes).
* **GKE TPU webhook** -- ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES`` when the manifest does
  not set them.
* **kubelet** -- env from values and the downward API (``fieldRef``), ``$(VAR)`` expansion in
  env, command and args, ``terminationGracePeriodSeconds`` (SIGTERM, then SIGKILL).
* **cluster DNS** -- each pod gets a free port on 127.0.0.1 standing in for its IP; every pod
  hostname (``<jobset>-<rjob>-<job>-<index>[.<subdomain>...][:port]``) in an env value becomes
  ``127.0.0.1:<that port>``. ``TPU_WORKER_HOSTNAMES`` therefore lists ``127.0.0.1:<port>``
  entries and the JAX coordinator (worker 0 of slice 0) listens on a port nobody else uses.

The image is ignored; ``python``/``python3`` as the command runs this interpreter. Each pod is
its own process group, so stopping a pod stops everything it started. A pod also gets SIGTERM
when the process that runs the backend dies (Linux ``PR_SET_PDEATHSIG``), as a node's pods do
when the node goes: an Airflow task killed with SIGKILL leaves no trainer behind writing into
the step's output (the trainer checkpoints on SIGTERM, so the retry resumes from there).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from operators.jobset.backend import (
    COMPLETED,
    FAILED,
    JobSetHandle,
    JobSetNotFound,
    JobSetObservation,
    JobSetStatus,
    PodExit,
)
from operators.jobset.manifest import (
    API_VERSION,
    COMPLETION_INDEX_KEY,
    GLOBAL_REPLICAS_KEY,
    JOB_GLOBAL_INDEX_KEY,
    JOB_INDEX_KEY,
    JOB_KEY,
    JOBSET_NAME_KEY,
    KIND,
    REPLICATED_JOB_NAME_KEY,
    REPLICATED_JOB_REPLICAS_KEY,
    RESTART_ATTEMPT_KEY,
)

__all__ = ["LocalBackend", "LocalRun", "UnsupportedManifest", "expand"]

log = logging.getLogger(__name__)

LogSink = Callable[[str], None]
DEFAULT_GRACE = 30.0  # Kubernetes' default terminationGracePeriodSeconds
LOCALHOST = "127.0.0.1"
LEADER_TAIL_LINES = 1000  # what leader_log_tail can show of a local run
# Identity a parent process may carry (e.g. a pod running Airflow): never inherited, since a
# stale TPU_WORKER_ID or MEGASCALE_SLICE_ID would silently give a local pod the wrong identity.
_IDENTITY_PREFIXES = ("TPU_", "MEGASCALE_", "JOB_COMPLETION_INDEX", "JOBSET_", "REPLICATED_JOB_")
_RESTART_ACTIONS = {"RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "FailJobSet"}


class UnsupportedManifest(ValueError):
    """A manifest feature the local backend cannot reproduce faithfully (refused up front)."""


_PR_SET_PDEATHSIG = 1


def _terminate_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGTERM the child when its parent dies (Linux);
    None elsewhere. The signal follows the thread that forks, here the controller thread,
    which lives as long as the pods it watches. A killed owner may send it twice: the kernel
    signals each reparenting, and a pod can pass through another dying thread of the owner."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


# --------------------------------------------------------------------------------------------
# kubelet semantics

_EXPAND_RE = re.compile(r"\$(\$|\(([^)]*)\))")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: ``$$`` is a literal ``$``; an undefined ``$(VAR)`` is
    left as written (as the kubelet does)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        return env.get(m.group(2), m.group(0))

    return _EXPAND_RE.sub(sub, value)


_FIELD_RE = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


@dataclass(frozen=True)
class _Pod:
    """One pod of the plan: where it sits in the JobSet and what it runs."""

    rjob: str
    job_index: int
    job_global_index: int
    index: int  # completion index inside its Job (the TPU worker id)
    hostname: str  # <jobset>-<rjob>-<job>-<index>
    container: Mapping[str, Any]
    labels: Mapping[str, str]
    annotations: Mapping[str, str]

    @property
    def job(self) -> str:
        return f"{self.rjob}-{self.job_index}"

    @property
    def label(self) -> str:
        return f"{self.job}/worker-{self.index}"


@dataclass(frozen=True)
class _Job:
    name: str  # <jobset>-<rjob>-<job>
    rjob: str
    completions: int
    backoff_limit: int
    pod_rules: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class _Plan:
    name: str
    namespace: str
    subdomain: str
    max_restarts: int
    has_failure_policy: bool
    rules: tuple[Mapping[str, Any], ...]
    success_operator: str
    success_targets: tuple[str, ...]
    jobs: tuple[_Job, ...]
    pods: tuple[_Pod, ...]
    grace: float


def _plan(manifest: Mapping[str, Any]) -> _Plan:
    if manifest.get("apiVersion") != API_VERSION or manifest.get("kind") != KIND:
        raise UnsupportedManifest(f"expected {API_VERSION} {KIND}")
    meta = manifest.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise UnsupportedManifest("metadata.name is required")
    namespace = meta.get("namespace", "default")
    spec = manifest.get("spec") or {}
    network = spec.get("network") or {}
    fp = spec.get("failurePolicy")
    rules = tuple((fp or {}).get("rules") or ())
    for rule in rules:
        if rule.get("action") not in _RESTART_ACTIONS:
            raise UnsupportedManifest(f"failurePolicy action {rule.get('action')!r}")
    if (fp or {}).get("restartStrategy", "Recreate") not in ("Recreate", "BlockingRecreate"):
        raise UnsupportedManifest(f"restartStrategy {fp['restartStrategy']!r}")
    sp = spec.get("successPolicy") or {}
    rjobs = spec.get("replicatedJobs") or []
    if not rjobs:
        raise UnsupportedManifest("spec.replicatedJobs is empty")
    global_replicas = sum(int(r.get("replicas", 1)) for r in rjobs)
    jobs: list[_Job] = []
    pods: list[_Pod] = []
    grace = DEFAULT_GRACE
    global_index = 0
    for rj in rjobs:
        rname, replicas = rj["name"], int(rj.get("replicas", 1))
        jspec = rj["template"]["spec"]
        if jspec.get("completionMode") != "Indexed":
            raise UnsupportedManifest(f"replicated job {rname}: only Indexed Jobs are supported")
        completions = int(jspec.get("completions", 1))
        if int(jspec.get("parallelism", completions)) != completions:
            raise UnsupportedManifest(f"replicated job {rname}: parallelism != completions")
        ptemplate = jspec["template"]
        pspec = ptemplate["spec"]
        if pspec.get("restartPolicy", "Never") != "Never":
            raise UnsupportedManifest("only restartPolicy: Never is supported")
        if pspec.get("initContainers") or len(pspec.get("containers") or ()) != 1:
            raise UnsupportedManifest("exactly one container and no initContainers")
        container = pspec["containers"][0]
        if container.get("envFrom"):
            raise UnsupportedManifest("envFrom is not supported")
        grace = float(pspec.get("terminationGracePeriodSeconds", grace))
        pod_rules = tuple((jspec.get("podFailurePolicy") or {}).get("rules") or ())
        for prule in pod_rules:
            if prule.get("action") not in ("FailJob", "Count", "Ignore"):
                raise UnsupportedManifest(f"podFailurePolicy action {prule.get('action')!r}")
        pmeta = ptemplate.get("metadata") or {}
        for j in range(replicas):
            job_name = f"{name}-{rname}-{j}"
            jobs.append(
                _Job(job_name, rname, completions, int(jspec.get("backoffLimit", 6)), pod_rules)
            )
            # JobSet puts these on Jobs and pods both as labels and as annotations.
            jobset_keys = {
                JOBSET_NAME_KEY: name,
                REPLICATED_JOB_NAME_KEY: rname,
                REPLICATED_JOB_REPLICAS_KEY: str(replicas),
                GLOBAL_REPLICAS_KEY: str(global_replicas),
                JOB_INDEX_KEY: str(j),
                JOB_GLOBAL_INDEX_KEY: str(global_index),
                JOB_KEY: hashlib.sha256(f"{namespace}/{job_name}".encode()).hexdigest(),
                "job-name": job_name,
            }
            for i in range(completions):
                keys = {**jobset_keys, COMPLETION_INDEX_KEY: str(i)}
                pods.append(
                    _Pod(
                        rjob=rname,
                        job_index=j,
                        job_global_index=global_index,
                        index=i,
                        hostname=f"{job_name}-{i}",
                        container=container,
                        labels={**(pmeta.get("labels") or {}), **keys},
                        annotations={**(pmeta.get("annotations") or {}), **keys},
                    )
                )
            global_index += 1
    for pod in pods:
        for entry in pod.container.get("env") or ():
            source = entry.get("valueFrom")
            if source is not None and set(source) != {"fieldRef"}:
                raise UnsupportedManifest(f"env {entry['name']}: only fieldRef is supported")
    return _Plan(
        name=name,
        namespace=namespace,
        subdomain=network.get("subdomain") or name,
        max_restarts=int((fp or {}).get("maxRestarts", 0)),
        has_failure_policy=fp is not None,
        rules=rules,
        success_operator=sp.get("operator", "All"),
        success_targets=tuple(sp.get("targetReplicatedJobs") or ()),
        jobs=tuple(jobs),
        pods=tuple(pods),
        grace=grace,
    )


def _free_ports(n: int) -> list[int]:
    # Hold every socket until all are bound, so the n ports are distinct.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((LOCALHOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------------------------
# one run


class _Proc:
    def __init__(
        self, pod: _Pod, attempt: int, popen: subprocess.Popen[bytes], pump: threading.Thread
    ):
        self.pod = pod
        self.attempt = attempt
        self.popen = popen
        self.pump = pump


class LocalRun:
    """A JobSet executing locally. Created by :meth:`LocalBackend.submit`."""

    def __init__(
        self,
        plan: _Plan,
        handle: JobSetHandle,
        *,
        sink: LogSink,
        python: str,
        cwd: str | None,
        base_env: Mapping[str, str],
        grace: float,
        poll_interval: float,
    ) -> None:
        self.plan = plan
        self.handle = handle
        self._sink = sink
        self._python = python
        self._cwd = cwd
        self._base_env = dict(base_env)
        self._grace = grace
        self._poll = poll_interval
        self._sink_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._status = JobSetStatus(handle)
        self._procs: list[_Proc] = []
        self._thread = threading.Thread(target=self._main, name=f"jobset-{plan.name}", daemon=True)
        # Slice 0, worker 0 (the JAX coordinator): its recent lines, for a follower's tail.
        self.leader = next(
            (p.label for p in plan.pods if p.job_global_index == 0 and p.index == 0), None
        )
        self._leader_tail: collections.deque[str] = collections.deque(maxlen=LEADER_TAIL_LINES)

    # -- public ---------------------------------------------------------------------------

    @property
    def status(self) -> JobSetStatus:
        with self._lock:
            return self._status

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: float | None = None) -> JobSetStatus:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"JobSet {self.plan.name} still running after {timeout}s")
        return self.status

    def leader_tail(self, lines: int) -> list[str]:
        with self._sink_lock:
            return list(self._leader_tail)[-lines:] if lines > 0 else []

    def kill(self) -> JobSetStatus:
        """Stop every pod: SIGTERM to each pod's process group, SIGKILL after the grace
        period. Returns once every pod process has exited."""
        self._cancel.set()
        if self._thread.is_alive():
            self._thread.join()
        else:  # never started, or already finished: make sure nothing is left either way
            self._terminate_all()
        return self.status

    # -- logging ---------------------------------------------------------------------------

    def _emit(self, line: str) -> None:
        with self._sink_lock:  # one line at a time: the sink need not be thread-safe
            try:
                self._sink(line)
            except Exception:  # a broken log sink must not orphan the pods
                log.exception("log sink failed")

    def _event(self, message: str) -> None:
        self._emit(f"[jobset/{self.plan.name}] {message}")

    def _pump(self, label: str, stream: Any) -> None:
        prefix = f"[{label}] "
        leader = label == self.leader
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if leader:
                    with self._sink_lock:
                        self._leader_tail.append(line)
                self._emit(prefix + line)

    # -- pods -----------------------------------------------------------------------------

    def _pod_env(
        self, pod: _Pod, attempt: int, addr: Mapping[str, str]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """(process env, container env): the container env is what Kubernetes would give."""
        labels = {**pod.labels, RESTART_ATTEMPT_KEY: str(attempt)}
        annotations = {**pod.annotations, RESTART_ATTEMPT_KEY: str(attempt)}
        fields = {
            "metadata.name": f"{pod.hostname}-{attempt}",
            "metadata.namespace": self.plan.namespace,
            "metadata.uid": str(
                uuid.uuid5(uuid.NAMESPACE_URL, f"{self.handle.uid}/{pod.hostname}/{attempt}")
            ),
            "spec.nodeName": "localhost",
            "spec.serviceAccountName": "default",
            "status.podIP": LOCALHOST,
            "status.hostIP": LOCALHOST,
        }
        env: dict[str, str] = {}
        for entry in pod.container.get("env") or ():
            key = entry["name"]
            if "valueFrom" in entry:
                path = entry["valueFrom"]["fieldRef"]["fieldPath"]
                m = _FIELD_RE.fullmatch(path)
                if m:
                    source = labels if m.group(1) == "labels" else annotations
                    env[key] = source.get(m.group(2), "")
                elif path in fields:
                    env[key] = fields[path]
                else:
                    raise UnsupportedManifest(f"env {key}: fieldPath {path!r}")
            else:
                env[key] = expand(str(entry.get("value", "")), env)
        # The Job controller adds this to every container of an Indexed Job.
        env.setdefault("JOB_COMPLETION_INDEX", str(pod.index))
        # GKE's TPU webhook: worker id and the slice's hostnames, unless already set.
        env.setdefault("TPU_WORKER_ID", str(pod.index))
        if "TPU_WORKER_HOSTNAMES" not in env:
            peers = [
                p.hostname
                for p in self.plan.pods
                if p.rjob == pod.rjob and p.job_index == pod.job_index
            ]
            env["TPU_WORKER_HOSTNAMES"] = ",".join(f"{h}.{self.plan.subdomain}" for h in peers)
        env = {k: self._resolve_hosts(v, addr) for k, v in env.items()}
        return {**self._base_env, **env}, env

    def _resolve_hosts(self, value: str, addr: Mapping[str, str]) -> str:
        """Cluster DNS, locally: a pod hostname (any suffix, any port) -> 127.0.0.1:<its port>."""
        if not addr:
            return value
        hosts = "|".join(re.escape(h) for h in sorted(addr, key=len, reverse=True))
        pattern = rf"(?<![\w.-])({hosts})(?:\.[A-Za-z0-9-]+)*(?::\d+)?(?![\w-])"
        return re.sub(pattern, lambda m: addr[m.group(1)], value)

    def _spawn(self, pod: _Pod, attempt: int, addr: Mapping[str, str]) -> _Proc:
        env, cenv = self._pod_env(pod, attempt, addr)
        argv = [
            expand(str(a), cenv)
            for a in (*pod.container.get("command", ()), *pod.container.get("args", ()))
        ]
        if not argv:
            raise UnsupportedManifest(
                "container has no command (the image's entrypoint is unknown locally)"
            )
        if argv[0] in ("python", "python3"):
            argv[0] = self._python
        popen = subprocess.Popen(
            argv,
            env=env,
            cwd=self._cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream per pod, like `kubectl logs`
            start_new_session=True,  # a process group per pod: signals reach its children
            preexec_fn=_terminate_with_parent(),
        )
        pump = threading.Thread(target=self._pump, args=(pod.label, popen.stdout), daemon=True)
        pump.start()
        return _Proc(pod, attempt, popen, pump)

    def _signal(self, proc: _Proc, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # group already gone
            os.killpg(proc.popen.pid, sig)

    def _terminate(self, procs: list[_Proc]) -> list[PodExit]:
        """SIGTERM every pod's group, SIGKILL what is left after the grace period; also signal
        groups whose leader already exited, since its children may live on."""
        for p in procs:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in procs):
            time.sleep(self._poll)
        for p in procs:
            self._signal(p, signal.SIGKILL)  # the whole group, leader alive or not
        exits = []
        for p in procs:
            code = p.popen.wait()
            p.pump.join(timeout=5)  # a child that left the group may hold the pipe open
            exits.append(PodExit(p.pod.label, p.attempt, _k8s_code(code)))
        return exits

    def _terminate_all(self) -> None:
        with self._lock:
            procs, self._procs = self._procs, []
        if procs:
            self._record(self._terminate(procs))

    def _record(self, exits: list[PodExit], **changes: Any) -> None:
        with self._lock:
            self._status = replace(self._status, exits=self._status.exits + tuple(exits), **changes)

    # -- the controller -------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._control()
        except Exception as e:  # a bug here must still stop the pods and end the run
            log.exception("local JobSet controller failed")
            self._terminate_all()
            self._record(
                [],
                terminal_state=FAILED,
                reason="ControllerError",
                message=f"{type(e).__name__}: {e}",
            )
        finally:
            _ACTIVE.discard(self)

    def _control(self) -> None:
        plan = self.plan
        attempt = counted = 0
        while True:
            verdict, detail = self._attempt(attempt)
            if verdict == "completed":
                self._record(
                    [], terminal_state=COMPLETED, reason="AllJobsCompleted", message=detail
                )
                self._event(f"completed: {detail}")
                return
            if verdict == "cancelled":
                self._record([], terminal_state=FAILED, reason="Cancelled", message=detail)
                self._event(f"cancelled: {detail}")
                return
            if verdict == "fail":
                reason = "FailurePolicyRule"
                self._record([], terminal_state=FAILED, reason=reason, message=detail)
                self._event(f"failed: {detail}")
                return
            # restart (counted or not)
            count = verdict == "restart"
            if count and counted >= plan.max_restarts:
                reason = "ReachedMaxRestarts" if plan.has_failure_policy else "FailedJobs"
                message = f"{detail}; reached maxRestarts={plan.max_restarts}"
                self._record([], terminal_state=FAILED, reason=reason, message=message)
                self._event(f"failed: {message}")
                return
            attempt += 1
            counted += count
            self._record([], restarts=attempt, restarts_counted=counted)
            limit = f"{counted}/{plan.max_restarts}" if count else "not counted"
            self._event(f"{detail}: restarting all pods (restart {attempt}, {limit})")

    def _attempt(self, attempt: int) -> tuple[str, str]:
        """Run every pod once (plus Job-level retries). Verdict: completed | restart |
        restart-uncounted | fail | cancelled, with a message."""
        plan = self.plan
        ports = _free_ports(len(plan.pods))
        addr = {p.hostname: f"{LOCALHOST}:{port}" for p, port in zip(plan.pods, ports, strict=True)}
        jobs = {j.name: j for j in plan.jobs}
        done: dict[str, set[int]] = {j.name: set() for j in plan.jobs}
        failures: dict[str, int] = dict.fromkeys(jobs, 0)
        with self._lock:
            if self._cancel.is_set():
                return "cancelled", "cancelled before start"
            for pod in plan.pods:  # one by one: if a spawn fails, the others are still tracked
                self._procs.append(self._spawn(pod, attempt, addr))
        while True:
            if self._cancel.wait(self._poll):
                self._terminate_all()
                return "cancelled", "kill() requested"
            for proc in list(self._procs):
                raw = proc.popen.poll()
                if raw is None:
                    continue
                code = _k8s_code(raw)
                # The container is gone: so is everything it started (container teardown).
                self._signal(proc, signal.SIGKILL)
                proc.pump.join(timeout=5)  # its last lines belong before what follows
                with self._lock:
                    self._procs.remove(proc)
                self._record([PodExit(proc.pod.label, attempt, code)])
                job = jobs[f"{plan.name}-{proc.pod.job}"]
                if code == 0:
                    done[job.name].add(proc.pod.index)
                    if self._succeeded(done):
                        self._terminate_all()
                        return "completed", "all jobs completed"
                    continue
                action, why = _pod_action(job, proc.pod, code)
                if action == "Ignore" or (
                    action == "Count" and failures[job.name] < job.backoff_limit
                ):
                    failures[job.name] += action == "Count"
                    self._event(f"pod {proc.pod.label} exited {code}: recreating it ({why})")
                    with self._lock:
                        self._procs.append(self._spawn(proc.pod, attempt, addr))
                    continue
                reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
                message = (
                    f"pod {proc.pod.label} exited {code}; job {job.name} failed ({reason}: {why})"
                )
                self._event(message)
                verdict = _jobset_action(plan, job, reason, why)
                self._terminate_all()
                return verdict

    def _succeeded(self, done: Mapping[str, set[int]]) -> bool:
        plan = self.plan
        targets = [
            j for j in plan.jobs if not plan.success_targets or j.rjob in plan.success_targets
        ]
        complete = [len(done[j.name]) == j.completions for j in targets]
        return any(complete) if plan.success_operator == "Any" else all(complete)


def _k8s_code(returncode: int) -> int:
    """Popen reports a signal as -N; the kubelet reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _pod_action(job: _Job, pod: _Pod, code: int) -> tuple[str, str]:
    """The Job's podFailurePolicy for a failed pod: first matching rule wins, else Count."""
    container = pod.container.get("name", "")
    for i, rule in enumerate(job.pod_rules):
        req = rule.get("onExitCodes")
        if not req:
            continue  # onPodConditions (DisruptionTarget...) never happen locally
        if req.get("containerName") not in (None, container):
            continue
        values = set(req.get("values") or ())
        hit = code in values if req.get("operator") == "In" else code not in values
        if hit:
            action = rule["action"]
            return action, f"exit code {code} matching {action} rule at index {i}"
    return "Count", f"exit code {code}, backoffLimit {job.backoff_limit}"


def _jobset_action(plan: _Plan, job: _Job, reason: str, message: str) -> tuple[str, str]:
    """JobSet failurePolicy: the first rule matching the Job failure, else RestartJobSet."""
    for i, rule in enumerate(plan.rules):
        reasons = rule.get("onJobFailureReasons") or ()
        patterns = rule.get("onJobFailureMessagePatterns") or ()
        targets = rule.get("targetReplicatedJobs") or ()
        if reasons and reason not in reasons:
            continue
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        if targets and job.rjob not in targets:
            continue
        name = rule.get("name") or f"failurePolicyRule{i}"
        action = rule["action"]
        detail = f"job {job.name} failed ({reason}), rule {name}: {action}"
        if action == "FailJobSet":
            return "fail", detail
        if action == "RestartJobSetAndIgnoreMaxRestarts":
            return "restart-uncounted", detail
        return "restart", detail
    return "restart", f"job {job.name} failed ({reason})"


# Runs still alive at interpreter exit are killed, so a finished Airflow task leaves no pods.
_ACTIVE: weakref.WeakSet[LocalRun] = weakref.WeakSet()


@atexit.register
def _kill_active() -> None:
    for run in list(_ACTIVE):
        run.kill()


# --------------------------------------------------------------------------------------------
# the backend


class LocalBackend:
    """Runs JobSet manifests as local processes. Implements :class:`~.backend.Backend`.

    ``log`` receives every pod output line, prefixed ``[slice-0/worker-1]``, and the
    controller's own events, prefixed ``[jobset/<name>]`` (default: this module's logger).
    ``grace_period`` overrides the manifest's ``terminationGracePeriodSeconds``. The pods
    inherit this process's environment (minus any JobSet/TPU identity variables) under the
    manifest's env, so PATH, PYTHONPATH, JAX_PLATFORMS and the like carry over.
    """

    name = "local"

    def __init__(
        self,
        log: LogSink | None = None,
        *,
        python: str = sys.executable,
        cwd: str | None = None,
        inherit_env: bool = True,
        extra_env: Mapping[str, str] | None = None,
        grace_period: float | None = None,
        poll_interval: float = 0.05,
    ) -> None:
        self._log = log or (lambda line: logging.getLogger(__name__).info("%s", line))
        self._python = python
        self._cwd = cwd
        base = (
            {k: v for k, v in os.environ.items() if not k.startswith(_IDENTITY_PREFIXES)}
            if inherit_env
            else {}
        )
        self._base_env = {**base, **(extra_env or {})}
        self._grace = grace_period
        self._poll = poll_interval
        self._runs: dict[str, LocalRun] = {}

    def submit(self, manifest: Mapping[str, Any]) -> JobSetHandle:
        plan = _plan(manifest)
        handle = JobSetHandle(self.name, plan.namespace, plan.name, uuid.uuid4().hex)
        run = LocalRun(
            plan,
            handle,
            sink=self._log,
            python=self._python,
            cwd=self._cwd,
            base_env=self._base_env,
            grace=plan.grace if self._grace is None else self._grace,
            poll_interval=self._poll,
        )
        self._runs[handle.uid] = run
        _ACTIVE.add(run)
        run.start()
        return handle

    def run(self, manifest: Mapping[str, Any], timeout: float | None = None) -> JobSetStatus:
        """Submit and wait; on timeout (or any interruption) the pods are killed."""
        handle = self.submit(manifest)
        try:
            return self.wait(handle, timeout)
        except BaseException:
            self.cancel(handle)
            raise

    def get(self, handle: JobSetHandle) -> LocalRun:
        try:
            return self._runs[handle.uid]
        except KeyError:
            raise JobSetNotFound(
                f"no local JobSet {handle.name} ({handle.uid}) in this backend"
            ) from None

    def poll(self, handle: JobSetHandle) -> JobSetStatus:
        return self.get(handle).status

    def wait(self, handle: JobSetHandle, timeout: float | None = None) -> JobSetStatus:
        return self.get(handle).wait(timeout)

    def cancel(self, handle: JobSetHandle) -> JobSetStatus:
        return self.get(handle).kill()

    # -- what a follower uses (the same calls the GKE trigger makes) -----------------------

    def observe(self, handle: JobSetHandle) -> JobSetObservation:
        run = self.get(handle)
        status = run.status
        # No resourceVersion locally: restarts and the end are the changes there are.
        return JobSetObservation(
            status=replace(status, exits=()),
            version=f"{status.restarts}:{status.terminal_state or ''}",
            max_restarts=run.plan.max_restarts,
        )

    def wait_for_change(
        self, handle: JobSetHandle, version: str | None, timeout: float
    ) -> JobSetObservation | None:
        run = self.get(handle)
        deadline = time.monotonic() + max(0.0, timeout)
        while (seen := self.observe(handle)).version == version:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                run.wait(min(self._poll, left))
        return seen

    def leader_log_tail(
        self, handle: JobSetHandle, lines: int = 50
    ) -> tuple[str | None, list[str]]:
        run = self.get(handle)
        return run.leader, run.leader_tail(lines) if run.leader else []

    def with_exits(self, status: JobSetStatus) -> JobSetStatus:
        return replace(status, exits=self.get(status.handle).status.exits)

    def close(self) -> None:
        """Nothing to release: the runs keep going until cancelled or done."""
