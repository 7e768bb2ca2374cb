"""JobSetHook and JobSetAsyncHook: where a rendered JobSet manifest runs, and the calls on it.

The hook owns the connection: it builds the backend (the Kubernetes client for ``gke``) once,
from its source below, and every call the operators make goes through it (``submit``,
``poll``, ``wait``, ``cancel``); ``close`` releases it. :class:`JobSetAsyncHook` gives the
trigger the same connection as coroutines (``observe``, ``wait_for_change``,
``leader_log_tail``, ``with_exits``, ``cancel``): the Kubernetes client blocks, so each call
runs in a worker thread and the triggerer's event loop never waits on the API server.

``local`` runs the manifest's pods as processes on this machine
(:class:`~operators.jobset.LocalBackend`): what ``airflow dags test`` and ``airflow
standalone`` use. ``gke`` creates the manifest as a ``jobset.x-k8s.io/v1alpha2`` object on a
Kubernetes cluster (:class:`~operators.jobset.gke.GkeBackend`); the training operator then
defers to :class:`~operators.triggers.jobset.JobSetTrigger` instead of holding a worker slot
for the days a run takes.

Credentials for ``gke``, from the :class:`~operators.jobset.gke.ClusterSettings` given as
``cluster`` (one source):

* ``cluster_name`` + ``location`` [+ ``project_id``, ``gcp_conn_id``]: the google provider's
  credentials for that Airflow GCP connection (``GoogleBaseHook``: key file, Workload Identity,
  impersonation chain), the cluster's endpoint and CA from the GKE API
  (``google-cloud-container``), and a bearer token refreshed by google-auth before it expires.
  Imported lazily: the core install does not need the ``gcp`` extra;
* ``kubeconfig`` and/or ``context``: that kubeconfig (exec plugins such as
  ``gke-gcloud-auth-plugin`` included);
* ``in_cluster``: the pod's service account (Airflow running on the cluster itself);
* none: the Airflow connection ``kubernetes_conn_id`` if it exists (the cncf.kubernetes
  connection's extras ``in_cluster``, ``kube_config_path``, ``cluster_context``,
  ``namespace``), else in-cluster inside a pod, else the default kubeconfig.

Whatever the source, a 401 rebuilds the client from it and retries once, so credentials that
expire during a weeks-long run are renewed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from airflow.sdk import BaseHook

from operators.jobset.backend import Backend, JobSetHandle, JobSetObservation, JobSetStatus

log = logging.getLogger(__name__)

BACKENDS = ("local", "gke")


class BackendUnavailable(RuntimeError):
    pass


class JobSetHook(BaseHook):
    """The connection to the :class:`~operators.jobset.Backend` named by ``backend``."""

    conn_name_attr = "kubernetes_conn_id"
    default_conn_name = "kubernetes_default"
    hook_name = "Slipway JobSet"

    def __init__(
        self,
        backend: str = "local",
        *,
        kubernetes_conn_id: str = default_conn_name,
        cluster: Any = None,
        log_sink: Callable[[str], None] | None = None,
        extra_env: Mapping[str, str] | None = None,
        grace_period: float | None = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.kubernetes_conn_id = kubernetes_conn_id
        self.cluster = cluster  # ClusterSettings, or its dict (the run form's `gke` object)
        self.log_sink = log_sink
        self.extra_env = dict(extra_env or {})
        self.grace_period = grace_period
        self.backend_options = dict(backend_options or {})  # GkeBackend knobs (retries...)
        self._conn: Backend | None = None

    def get_conn(self) -> Backend:
        """The backend, built on first use and kept (its client too) until :meth:`close`."""
        if self._conn is None:
            self._conn = self._build()
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -- what the operators call ------------------------------------------------------------

    def submit(self, manifest: Mapping[str, Any]) -> JobSetHandle:
        return self.get_conn().submit(manifest)

    def poll(self, handle: JobSetHandle) -> JobSetStatus:
        return self.get_conn().poll(handle)

    def wait(self, handle: JobSetHandle, timeout: float | None = None) -> JobSetStatus:
        return self.get_conn().wait(handle, timeout)

    def cancel(self, handle: JobSetHandle) -> JobSetStatus:
        return self.get_conn().cancel(handle)

    # -- building the backend ---------------------------------------------------------------

    def _build(self) -> Backend:
        if self.backend == "local":
            from operators.jobset import LocalBackend

            return LocalBackend(
                self.log_sink, extra_env=self.extra_env, grace_period=self.grace_period
            )
        if self.backend == "gke":
            from operators.jobset.gke import GkeBackend

            settings = self.cluster_settings()
            return GkeBackend(
                settings,
                client_factory=self.client_factory(settings),
                log=self.log_sink,
                **self.backend_options,
            )
        raise BackendUnavailable(
            f"unknown JobSet backend {self.backend!r}; known: {', '.join(BACKENDS)}"
        )

    # -- gke -------------------------------------------------------------------------------

    def cluster_settings(self) -> Any:
        """The cluster settings given, else those of the ``kubernetes_conn_id`` connection."""
        from operators.jobset.gke import ClusterSettings

        settings = (
            self.cluster
            if isinstance(self.cluster, ClusterSettings)
            else ClusterSettings.from_dict(self.cluster)
        )
        problems = settings.problems()
        if problems:
            raise BackendUnavailable("gke cluster settings: " + "; ".join(problems))
        if settings.source == "auto":
            settings = self._from_connection(settings)
        return settings

    def _from_connection(self, settings: Any) -> Any:
        from dataclasses import replace

        try:
            conn = self.get_connection(self.kubernetes_conn_id)
        except Exception:  # no such connection (or no Airflow context): keep 'auto'
            return settings
        extra = conn.extra_dejson or {}
        return replace(
            settings,
            in_cluster=bool(extra.get("in_cluster", False)),
            kubeconfig=extra.get("kube_config_path") or None,
            context=extra.get("cluster_context") or None,
            namespace=extra.get("namespace") or settings.namespace,
        )

    @staticmethod
    def client_factory(settings: Any) -> Callable[[], Any] | None:
        """GKE's factory (google provider); None lets the backend use kubeconfig/in-cluster."""
        if settings.source != "gke":
            return None
        return lambda: gke_api_client(settings)


class JobSetAsyncHook(BaseHook):
    """The trigger's side of :class:`JobSetHook`: the same connection, awaited.

    Takes :class:`JobSetHook`'s arguments. Each call runs the blocking client in a thread;
    errors are the backend's (:class:`~operators.jobset.JobSetNotFound`,
    :class:`~operators.jobset.JobSetApiError` with ``transient``, ...).
    """

    hook_name = "Slipway JobSet (async)"

    def __init__(self, backend: str = "gke", **kwargs: Any) -> None:
        super().__init__()
        self.sync_hook = JobSetHook(backend, **kwargs)

    async def _call(self, method: str, *args: Any) -> Any:
        def call() -> Any:
            return getattr(self.sync_hook.get_conn(), method)(*args)

        return await asyncio.to_thread(call)

    async def observe(self, handle: JobSetHandle) -> JobSetObservation:
        return await self._call("observe", handle)

    async def wait_for_change(
        self, handle: JobSetHandle, version: str | None, timeout: float
    ) -> Any:
        return await self._call("wait_for_change", handle, version, timeout)

    async def leader_log_tail(
        self, handle: JobSetHandle, lines: int
    ) -> tuple[str | None, list[str]]:
        return await self._call("leader_log_tail", handle, lines)

    async def with_exits(self, status: JobSetStatus) -> JobSetStatus:
        return await self._call("with_exits", status)

    async def cancel(self, handle: JobSetHandle) -> JobSetStatus:
        return await self._call("cancel", handle)

    def close(self) -> None:
        self.sync_hook.close()


def gke_api_client(settings: Any) -> Any:
    """A client for a GKE cluster through the google provider's credentials.

    The google provider's own ``GKEKubernetesHook`` needs the cncf.kubernetes provider and
    kubernetes_asyncio, which Slipway does not install; this builds the same thing from
    ``GoogleBaseHook`` (connection, key, impersonation) and the GKE API's cluster record.
    """
    from airflow.providers.google.common.hooks.base_google import GoogleBaseHook
    from google.auth.transport.requests import Request
    from google.cloud import container_v1

    from operators.jobset.gke import bearer_client, decode_ca

    hook = GoogleBaseHook(gcp_conn_id=settings.gcp_conn_id or "google_cloud_default")
    credentials = hook.get_credentials()
    project = settings.project_id or hook.project_id
    if not project:
        raise BackendUnavailable(
            f"GKE cluster {settings.cluster_name}: no project_id given and connection "
            f"{settings.gcp_conn_id or 'google_cloud_default'} has none"
        )
    manager = container_v1.ClusterManagerClient(credentials=credentials)
    cluster = manager.get_cluster(
        name=f"projects/{project}/locations/{settings.location}/clusters/{settings.cluster_name}"
    )
    endpoint = (
        cluster.private_cluster_config.private_endpoint
        if settings.use_internal_ip
        else cluster.endpoint
    )

    def token() -> str:
        # google-auth tokens live about an hour: refreshed here, before each request, when due.
        if not credentials.valid:
            credentials.refresh(Request())
        return str(credentials.token)

    return bearer_client(
        f"https://{endpoint}", token, decode_ca(cluster.master_auth.cluster_ca_certificate)
    )
