"""The ``gke`` JobSet backend: the manifest as a ``jobset.x-k8s.io/v1alpha2`` object on a cluster.

:class:`GkeBackend` implements :class:`~operators.jobset.backend.Backend` on the ``kubernetes``
client: ``submit`` creates the custom object, ``poll`` reads ``status.terminalState``,
``status.conditions``, ``status.restarts`` and ``status.restartsCountTowardsMax``, ``cancel``
deletes it with ``propagationPolicy: Foreground`` (the Jobs and pods go first, so no TPU slice
outlives its JobSet). Leader pod logs come from the core API.

Why over 500 lines: the backend, its client factories and the Kubernetes object mapping are
one protocol (the :class:`~operators.jobset.backend.Backend` calls) against one API; the
clients are small but each needs its refresh and error handling here. Moving the client
into the hook (issue 14 section 2) is what will shrink it.

Credentials come from a *client factory*: anything that builds a fresh ``ApiClient``. This
module has the kubeconfig and in-cluster factories and :func:`bearer_client` (a host, a CA and a
token source, refreshed before each request once it expires); the Airflow hook
(:mod:`operators.hooks.jobset`) adds the GKE one on top of the google provider's credentials,
so this module stays free of Airflow imports. A weeks-long run outlives any token: besides the
proactive refresh, a 401 rebuilds the client from its factory (re-reading the kubeconfig,
re-running its exec plugin, re-fetching the GKE credentials) and retries once.

Errors: 401/403 raise :class:`JobSetAuthError` naming the credentials source; 404
:class:`JobSetNotFound`; a 409 on create is resolved (adopt our own JobSet, replace our own
failed one, else :class:`JobSetConflict`); 429/5xx and connection errors are retried a bounded
number of times with exponential backoff, then :class:`JobSetApiError`.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypeVar

from operators import naming
from operators.jobset.backend import (
    COMPLETED,
    FAILED,
    RETRYABLE,
    JobSetApiError,
    JobSetError,
    JobSetHandle,
    JobSetNotFound,
    JobSetObservation,
    JobSetStatus,
    PodExit,
)
from operators.jobset.manifest import (
    API_VERSION,
    COMPLETION_INDEX_KEY,
    JOB_INDEX_KEY,
    JOBSET_NAME_KEY,
    MANAGED_BY,
    REPLICATED_JOB_NAME_KEY,
    RESTART_ATTEMPT_KEY,
)
from operators.jobset.names import ManifestError, check_dns1123_label

__all__ = [
    "STEP_LABEL",
    "STEP_VERSION_LABEL",
    "ClusterSettings",
    "CredentialsUnavailable",
    "GkeBackend",
    "JobSetApiError",
    "JobSetAuthError",
    "JobSetConflict",
    "JobSetError",
    "JobSetNotFound",
    "bearer_client",
    "status_from_dict",
    "status_from_object",
]

log = logging.getLogger(__name__)

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "jobsets"
MANAGED_BY_KEY = "app.kubernetes.io/managed-by"
# Who owns a JobSet of a given name: the step (name + version) it runs. Label values are at
# most 63 characters, so the 64-hex-digit version is cut to 63: still collision-free in practice.
STEP_LABEL = "slipway/step"
STEP_VERSION_LABEL = "slipway/step-version"

T = TypeVar("T")
LogSink = Callable[[str], None]
ClientFactory = Callable[[], Any]  # () -> kubernetes.client.ApiClient


# --------------------------------------------------------------------------------------------
# errors


class JobSetAuthError(JobSetError):
    """401 after a credentials refresh, or 403: names the credentials source."""


class JobSetConflict(JobSetError):
    """A JobSet with this name exists and is not this step's."""


class CredentialsUnavailable(JobSetApiError):
    """The client could not be built (kubeconfig unreadable, GKE API unreachable...).

    Counted as transient: the GKE API or a rotated kubeconfig may be back in a minute, and a
    trigger following a weeks-long run should retry rather than give up.
    """


# --------------------------------------------------------------------------------------------
# where the cluster is, and whose credentials


@dataclass(frozen=True)
class ClusterSettings:
    """Where JobSets go and which credentials reach the cluster: plain, JSON-able settings.

    Exactly one credentials source: ``cluster_name`` (GKE through a GCP connection, with
    ``location`` and optionally ``project_id``), ``kubeconfig``/``context``, or ``in_cluster``.
    With none, ``auto``: in-cluster config inside a pod, else the default kubeconfig. Never a
    token or a key: these settings travel in trigger kwargs and appear in logs.
    """

    namespace: str = "default"
    kubeconfig: str | None = None
    context: str | None = None
    in_cluster: bool = False
    gcp_conn_id: str | None = None
    project_id: str | None = None
    location: str | None = None
    cluster_name: str | None = None
    use_internal_ip: bool = False
    # The TPU node pools' zone, for the availability preflight only: kubeconfig and in-cluster
    # settings name no location, and a regional cluster's location is not a zone.
    tpu_zone: str | None = None

    @property
    def source(self) -> str:
        if self.cluster_name:
            return "gke"
        if self.kubeconfig or self.context:
            return "kubeconfig"
        if self.in_cluster:
            return "in-cluster"
        return "auto"

    def describe(self) -> str:
        """The credentials source, for error messages (no secrets in here)."""
        if self.source == "gke":
            project = self.project_id or "<the connection's project>"
            return (
                f"GKE cluster {self.cluster_name} in {self.location} (project {project}) "
                f"via Airflow connection {self.gcp_conn_id or 'google_cloud_default'}"
            )
        if self.source == "kubeconfig":
            path = self.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            return f"kubeconfig {path}" + (f" context {self.context}" if self.context else "")
        if self.source == "in-cluster":
            return "in-cluster service account (/var/run/secrets/kubernetes.io/serviceaccount)"
        return "auto (in-cluster service account inside a pod, else the default kubeconfig)"

    def problems(self) -> list[str]:
        """What is wrong with these settings, as sentences (empty when usable)."""
        out: list[str] = []
        try:
            check_dns1123_label(self.namespace, "namespace")
        except ManifestError as exc:
            out.append(str(exc))
        sources = [
            s
            for s, on in (
                ("cluster_name", bool(self.cluster_name)),
                ("kubeconfig/context", bool(self.kubeconfig or self.context)),
                ("in_cluster", self.in_cluster),
            )
            if on
        ]
        if len(sources) > 1:
            out.append(f"credentials: choose one source, not {' and '.join(sources)}")
        if self.cluster_name and not self.location:
            out.append("location: a GKE cluster_name needs its location (region or zone)")
        if self.tpu_zone and not naming.full(naming.ZONE, self.tpu_zone):
            out.append(f"tpu_zone: {self.tpu_zone!r} is not a zone (e.g. us-central2-b)")
        gcp_only = self.location or self.project_id or self.gcp_conn_id or self.use_internal_ip
        if gcp_only and not self.cluster_name:
            out.append(
                "cluster_name: location/project_id/gcp_conn_id/use_internal_ip are for a GKE "
                "cluster_name"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ClusterSettings:
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cluster settings {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if v not in (None, "")})


def kubeconfig_client(settings: ClusterSettings) -> Any:
    """A fresh client from the kubeconfig (re-read each time: rotated tokens are picked up)."""
    from kubernetes import config

    return config.new_client_from_config(
        config_file=settings.kubeconfig, context=settings.context, persist_config=False
    )


def in_cluster_client() -> Any:
    """The pod's service account; its projected token file is re-read as the kubelet rotates it."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def default_client_factory(settings: ClusterSettings) -> ClientFactory:
    """Factories this module can build alone (GKE's needs the Airflow hook)."""
    if settings.source == "gke":
        raise JobSetError(
            "GKE credentials need the google provider: build the backend through "
            "operators.hooks.jobset.JobSetHook('gke', cluster=...)"
        )
    if settings.source == "kubeconfig":
        return lambda: kubeconfig_client(settings)
    if settings.source == "in-cluster":
        return in_cluster_client
    # auto: inside a pod the service account, else ~/.kube/config (or $KUBECONFIG)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_client
    return lambda: kubeconfig_client(settings)


def bearer_client(host: str, token: Callable[[], str], ca_cert_pem: bytes | None = None) -> Any:
    """A client for ``host`` authenticating with ``token()``.

    ``token`` returns a *currently valid* token (refreshing it when expired, as google-auth
    credentials do); the client asks for it before every request, so an hour-long GKE access
    token never goes stale inside a weeks-long run.
    """
    from kubernetes import client

    configuration = client.Configuration(host=host)
    configuration.api_key_prefix["BearerToken"] = "Bearer"
    if ca_cert_pem is not None:
        with tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False) as f:
            f.write(ca_cert_pem)
        configuration.ssl_ca_cert = f.name

    def refresh(c: Any) -> None:
        c.api_key["BearerToken"] = token()

    refresh(configuration)
    configuration.refresh_api_key_hook = refresh
    return client.ApiClient(configuration)


def decode_ca(b64: str) -> bytes:
    """GKE's ``masterAuth.clusterCaCertificate`` is base64 PEM."""
    return base64.b64decode(b64)


# --------------------------------------------------------------------------------------------
# JobSet objects -> JobSetStatus


def _conditions(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(((obj.get("status") or {}).get("conditions")) or ())


def status_from_object(handle: JobSetHandle, obj: Mapping[str, Any]) -> JobSetStatus:
    """``.status`` of a JobSet object as a :class:`JobSetStatus` (no pod exits)."""
    st = obj.get("status") or {}
    terminal = st.get("terminalState") or None
    true = {c.get("type"): c for c in _conditions(obj) if c.get("status") == "True"}
    if terminal is None:  # JobSet releases before terminalState: the conditions say it
        terminal = next((t for t in (FAILED, COMPLETED) if t in true), None)
    reason = message = ""
    if terminal in true:
        reason = str(true[terminal].get("reason") or "")
        message = str(true[terminal].get("message") or "")
    restarts = int(st.get("restarts") or 0)
    counted = st.get("restartsCountTowardsMax")
    return JobSetStatus(
        handle=handle,
        terminal_state=terminal if terminal in (COMPLETED, FAILED) else None,
        restarts=restarts,
        restarts_counted=restarts if counted is None else int(counted),
        reason=reason,
        message=message,
    )


def status_from_dict(data: Mapping[str, Any]) -> JobSetStatus:
    """The inverse of :meth:`JobSetStatus.to_dict` (a trigger event's payload)."""
    return JobSetStatus(
        handle=JobSetHandle.from_dict(data["handle"]),
        terminal_state=data.get("terminal_state"),
        restarts=int(data.get("restarts") or 0),
        restarts_counted=int(data.get("restarts_counted") or 0),
        reason=str(data.get("reason") or ""),
        message=str(data.get("message") or ""),
        exits=tuple(PodExit(**e) for e in data.get("exits") or ()),
    )


def active_conditions(obj: Mapping[str, Any]) -> dict[str, str]:
    """``{type: "reason: message"}`` of the conditions that are True (Suspended, StartupPolicy...)."""
    return {
        str(c.get("type")): f"{c.get('reason', '')}: {c.get('message', '')}"
        for c in _conditions(obj)
        if c.get("status") == "True"
    }


def pod_label(pod: Mapping[str, Any]) -> str:
    """``<replicated job>-<job index>/worker-<completion index>``, as the local backend names pods."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    rjob = labels.get(REPLICATED_JOB_NAME_KEY, "?")
    return f"{rjob}-{labels.get(JOB_INDEX_KEY, '?')}/worker-{labels.get(COMPLETION_INDEX_KEY, '?')}"


def pod_exits(pods: list[Mapping[str, Any]]) -> tuple[PodExit, ...]:
    """Terminated containers of the pods still there (older attempts' pods may be gone)."""
    exits = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        attempt = int(labels.get(RESTART_ATTEMPT_KEY) or 0)
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            done = (cs.get("state") or {}).get("terminated")
            if done is not None:
                exits.append(PodExit(pod_label(pod), attempt, int(done.get("exitCode", 0))))
    return tuple(sorted(exits, key=lambda e: (e.attempt, e.pod)))


def _owned_by_step(obj: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
    """The existing object is ours: Slipway-managed and running the same step version."""
    want = (manifest.get("metadata") or {}).get("labels") or {}
    have = (obj.get("metadata") or {}).get("labels") or {}
    version = want.get(STEP_VERSION_LABEL)
    return (
        bool(version)
        and have.get(STEP_VERSION_LABEL) == version
        and have.get(MANAGED_BY_KEY) == MANAGED_BY
    )


def _status_message(exc: Any) -> str:
    """The ``message`` of the Status object an ApiException carries (never its headers)."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return str(getattr(exc, "reason", "") or "no message")
    return str(body.get("message") or body.get("reason") or exc.reason)


# --------------------------------------------------------------------------------------------
# the backend


class GkeBackend:
    """JobSets on a Kubernetes cluster (GKE in production). Implements ``Backend``.

    ``retries``/``backoff`` bound the retries of 429, 5xx and connection errors (exponential,
    capped at ``max_backoff``); ``request_timeout`` bounds each call; ``sleep`` is injectable
    so tests need not wait.
    """

    name = "gke"

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        client_factory: ClientFactory | None = None,
        log: LogSink | None = None,
        retries: int = 4,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        request_timeout: float = 60.0,
        poll_interval: float = 10.0,
        delete_wait: float = 300.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.settings = settings
        self._factory = client_factory or default_client_factory(settings)
        self._log = log or (lambda line: logging.getLogger(__name__).info("%s", line))
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.request_timeout = request_timeout
        self.poll_interval = poll_interval
        self.delete_wait = delete_wait
        self._sleep = sleep
        self._lock = threading.Lock()
        self._api: Any = None
        self.refreshes = 0  # how often the credentials were rebuilt (after a 401)

    # -- the client and its credentials -------------------------------------------------------

    def _client(self) -> Any:
        with self._lock:
            if self._api is None:
                try:
                    self._api = self._factory()
                except Exception as exc:
                    raise CredentialsUnavailable(
                        f"cannot load Kubernetes credentials from {self.settings.describe()}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
            return self._api

    def refresh_credentials(self) -> None:
        """Drop the client: the next call rebuilds it from the factory (fresh token)."""
        with self._lock:
            old, self._api = self._api, None
            self.refreshes += 1
        if old is not None:
            old.close()

    def close(self) -> None:
        with self._lock:
            old, self._api = self._api, None
        if old is not None:
            old.close()

    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._client())

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._client())

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        """``fn()`` with one credentials refresh on 401 and bounded retries of transient errors."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        refreshed = False
        attempt = 0
        while True:
            try:
                return fn()
            except ApiException as exc:
                if exc.status == 401 and not refreshed:
                    # Expired token (weeks-long runs outlive every token): rebuild, retry once.
                    self._log(f"[gke] 401 on {action}: refreshing credentials and retrying")
                    self.refresh_credentials()
                    refreshed = True
                    continue
                if exc.status in RETRYABLE and attempt < self.retries:
                    attempt += 1
                    self._wait_retry(action, f"HTTP {exc.status} {_status_message(exc)}", attempt)
                    continue
                raise self._error(action, exc) from exc
            except (HTTPError, OSError) as exc:  # connection refused/reset, timeouts
                if attempt < self.retries:
                    attempt += 1
                    self._wait_retry(action, f"{type(exc).__name__}: {exc}", attempt)
                    continue
                raise JobSetApiError(
                    f"{action}: cannot reach the Kubernetes API ({self.settings.describe()}) "
                    f"after {attempt + 1} attempts: {type(exc).__name__}: {exc}"
                ) from exc

    def _wait_retry(self, action: str, why: str, attempt: int) -> None:
        delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        self._log(f"[gke] {action}: {why}; retry {attempt}/{self.retries} in {delay:.1f}s")
        self._sleep(delay)

    def _error(self, action: str, exc: Any) -> JobSetError:
        message = _status_message(exc)
        where = self.settings.describe()
        if exc.status == 401:
            return JobSetAuthError(
                f"{action}: unauthorized (401) even after refreshing the credentials from "
                f"{where}: the token is invalid or expired ({message})"
            )
        if exc.status == 403:
            return JobSetAuthError(
                f"{action}: forbidden (403) for the identity from {where}: {message}. It needs "
                f"RBAC for jobsets.{GROUP} (create, get, list, watch, delete) and pods, pods/log "
                f"(get, list) in namespace {self.settings.namespace}"
            )
        if exc.status == 404:
            return JobSetNotFound(f"{action}: not found ({message})")
        if exc.status == 409:
            return JobSetConflict(f"{action}: conflict ({message})")
        return JobSetApiError(f"{action}: HTTP {exc.status} {message}", exc.status)

    # -- JobSet objects -----------------------------------------------------------------------

    def get(self, handle: JobSetHandle) -> dict[str, Any]:
        """The JobSet object. :class:`JobSetNotFound` if gone or replaced (another uid)."""
        obj = self._get(handle.namespace, handle.name)
        uid = (obj.get("metadata") or {}).get("uid")
        if handle.uid and uid != handle.uid:
            raise JobSetNotFound(
                f"JobSet {handle.namespace}/{handle.name} was replaced (uid {uid}, "
                f"ours {handle.uid})"
            )
        return obj

    def _get(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call(
            f"get JobSet {namespace}/{name}",
            lambda: self._custom().get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=self.request_timeout
            ),
        )

    def submit(self, manifest: Mapping[str, Any]) -> JobSetHandle:
        """Create the JobSet as rendered; a 409 is resolved (see the module docstring)."""
        meta = manifest.get("metadata") or {}
        name = meta["name"]
        namespace = meta.get("namespace") or self.settings.namespace
        try:
            obj = self._create(namespace, manifest)
        except JobSetConflict:
            try:
                obj = self._resolve_conflict(namespace, name, manifest)
            except JobSetNotFound:
                # Gone between the 409 and the read (a delete finishing just then, as a
                # cleared task resubmits): the name is free now, so create it.
                obj = self._create(namespace, manifest)
        return JobSetHandle(self.name, namespace, name, obj["metadata"]["uid"])

    def _create(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        name = manifest["metadata"]["name"]
        obj = self._call(
            f"create JobSet {namespace}/{name}",
            lambda: self._custom().create_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                dict(manifest),
                _request_timeout=self.request_timeout,
            ),
        )
        self._log(f"[jobset/{name}] created in {namespace} (uid {obj['metadata']['uid']})")
        return obj

    def _resolve_conflict(
        self, namespace: str, name: str, manifest: Mapping[str, Any]
    ) -> dict[str, Any]:
        existing = self._get(namespace, name)
        labels = (existing.get("metadata") or {}).get("labels") or {}
        if not _owned_by_step(existing, manifest):
            raise JobSetConflict(
                f"JobSet {namespace}/{name} already exists and is not this step's (its "
                f"{STEP_VERSION_LABEL}={labels.get(STEP_VERSION_LABEL)!r}, "
                f"{MANAGED_BY_KEY}={labels.get(MANAGED_BY_KEY)!r}): delete it or rename the run"
            )
        handle = JobSetHandle(self.name, namespace, name, existing["metadata"]["uid"])
        status = status_from_object(handle, existing)
        if existing["metadata"].get("deletionTimestamp") or status.terminal_state == FAILED:
            # A failed attempt of this step (kept for ttlSecondsAfterFinished) or one being
            # deleted: a rerun must start afresh (it resumes from the checkpoint), not adopt it.
            why = "being deleted" if existing["metadata"].get("deletionTimestamp") else "failed"
            self._log(f"[jobset/{name}] an earlier attempt {why}: replacing it")
            self.cancel(handle)
            if not self.wait_deleted(handle, self.delete_wait):
                raise JobSetApiError(
                    f"JobSet {namespace}/{name}: the earlier attempt was not gone after "
                    f"{self.delete_wait:.0f}s of foreground deletion"
                )
            return self._create(namespace, manifest)
        # Running or Completed, same step version: the same work, so follow it instead of
        # starting a second copy (e.g. after a worker died between submit and defer).
        self._log(
            f"[jobset/{name}] already exists for this step version (uid "
            f"{handle.uid}, restarts {status.restarts}, state "
            f"{status.terminal_state or 'running'}): adopting it"
        )
        return existing

    def poll(self, handle: JobSetHandle) -> JobSetStatus:
        status = status_from_object(handle, self.get(handle))
        return self.with_exits(status) if status.done else status

    def observe(self, handle: JobSetHandle) -> JobSetObservation:
        obj = self.get(handle)
        policy = (obj.get("spec") or {}).get("failurePolicy") or {}
        return JobSetObservation(
            status=status_from_object(handle, obj),
            version=(obj.get("metadata") or {}).get("resourceVersion"),
            conditions=active_conditions(obj),
            max_restarts=int(policy.get("maxRestarts") or 0),
        )

    def with_exits(self, status: JobSetStatus) -> JobSetStatus:
        """Add the pods' exit codes (best effort: a failure here must not hide the status)."""
        try:
            return replace(status, exits=pod_exits(self.pods(status.handle)))
        except Exception as exc:  # e.g. an API error, or a pod the client's models reject
            self._log(f"[jobset/{status.handle.name}] could not read pod exit codes: {exc}")
            return status

    def wait(self, handle: JobSetHandle, timeout: float | None = None) -> JobSetStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.poll(handle)
            if status.done:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"JobSet {handle.name} still running after {timeout}s")
            self._sleep(self.poll_interval)

    def cancel(self, handle: JobSetHandle) -> JobSetStatus:
        """Delete with foreground propagation (Jobs and pods first); idempotent on 404.

        The ``uid`` precondition protects a newer JobSet of the same name (another attempt's).
        Returns at once; :meth:`wait_deleted` waits for the pods' grace period to pass.
        """
        from kubernetes import client

        options = client.V1DeleteOptions(
            propagation_policy="Foreground",
            preconditions=client.V1Preconditions(uid=handle.uid) if handle.uid else None,
        )
        action = f"delete JobSet {handle.namespace}/{handle.name}"
        try:
            self._call(
                action,
                lambda: self._custom().delete_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    handle.namespace,
                    PLURAL,
                    handle.name,
                    body=options,
                    _request_timeout=self.request_timeout,
                ),
            )
            message = "deleted (propagationPolicy=Foreground)"
        except JobSetNotFound:
            message = "already gone"
        except JobSetConflict as exc:  # uid precondition: the name now belongs to another run
            message = f"not deleted: {exc}"
        self._log(f"[jobset/{handle.name}] cancel: {message}")
        return JobSetStatus(handle, terminal_state=FAILED, reason="Cancelled", message=message)

    def wait_deleted(self, handle: JobSetHandle, timeout: float) -> bool:
        """True once the JobSet (this uid) is gone; False if still there after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.get(handle)
            except JobSetNotFound:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._sleep(min(self.poll_interval, left))

    def wait_for_change(
        self, handle: JobSetHandle, resource_version: str | None, timeout: float
    ) -> dict[str, Any] | None:
        """Watch the JobSet from ``resource_version``: the first changed object, or None after
        ``timeout`` seconds without a change. A DELETED event raises :class:`JobSetNotFound`.
        The API's watch timeout is in whole seconds: a shorter wait just sleeps."""
        from kubernetes import watch

        if timeout < 1:
            self._sleep(max(0.0, timeout))
            return None
        w = watch.Watch()

        def first_event() -> dict[str, Any] | None:
            kwargs: dict[str, Any] = {
                "field_selector": f"metadata.name={handle.name}",
                "timeout_seconds": int(timeout),
                # The socket read must outlast the server-side window.
                "_request_timeout": (self.request_timeout, timeout + self.request_timeout),
            }
            if resource_version:
                kwargs["resource_version"] = resource_version
            stream = w.stream(
                self._custom().list_namespaced_custom_object,
                GROUP,
                VERSION,
                handle.namespace,
                PLURAL,
                **kwargs,
            )
            try:
                for event in stream:
                    obj = event.get("raw_object") or event.get("object")
                    if event.get("type") == "DELETED":
                        raise JobSetNotFound(f"JobSet {handle.namespace}/{handle.name} deleted")
                    return obj
                return None
            finally:
                w.stop()

        return self._call(f"watch JobSet {handle.namespace}/{handle.name}", first_event)

    # -- pods and logs ------------------------------------------------------------------------

    def pods(self, handle: JobSetHandle, **labels: str) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in {JOBSET_NAME_KEY: handle.name, **labels}.items())
        result = self._call(
            f"list pods of JobSet {handle.namespace}/{handle.name}",
            lambda: self._core().list_namespaced_pod(
                handle.namespace, label_selector=selector, _request_timeout=self.request_timeout
            ),
        )
        # Plain dicts with the API's camelCase keys, like every other object here.
        return list(self._client().sanitize_for_serialization(result).get("items") or ())

    def leader_pod(self, handle: JobSetHandle) -> dict[str, Any] | None:
        """Slice 0, worker 0 of the newest attempt (the JAX coordinator, whose log says most)."""
        pods = self.pods(handle, **{JOB_INDEX_KEY: "0", COMPLETION_INDEX_KEY: "0"})
        if not pods:
            return None

        def newest(pod: Mapping[str, Any]) -> tuple[int, str]:
            meta = pod.get("metadata") or {}
            attempt = int((meta.get("labels") or {}).get(RESTART_ATTEMPT_KEY) or 0)
            return attempt, str(meta.get("creationTimestamp") or "")

        return max(pods, key=newest)

    def leader_log_tail(
        self, handle: JobSetHandle, lines: int = 50
    ) -> tuple[str | None, list[str]]:
        """(leader pod name, the last ``lines`` lines of its log); (None, []) before it exists."""
        pod = self.leader_pod(handle)
        if pod is None:
            return None, []
        name = pod["metadata"]["name"]
        try:
            text = self._call(
                f"read log of pod {handle.namespace}/{name}",
                lambda: self._core().read_namespaced_pod_log(
                    name,
                    handle.namespace,
                    tail_lines=lines,
                    _request_timeout=self.request_timeout,
                ),
            )
        except (JobSetNotFound, JobSetApiError) as exc:
            # Pod gone between list and read, or its container not started yet (400).
            if isinstance(exc, JobSetApiError) and exc.status not in (400, None):
                raise
            return name, []
        return name, str(text or "").splitlines()

    def object_dump(self, handle: JobSetHandle) -> str:
        """The JobSet object as JSON (for failure messages)."""
        return json.dumps(copy.deepcopy(self.get(handle)), indent=2, sort_keys=True)
