"""JobSetHook: where a rendered JobSet manifest runs.

``local`` runs the manifest's pods as processes on this machine
(:class:`~operators.jobset.LocalBackend`): what ``airflow dags test`` and ``airflow
standalone`` use. ``gke`` is the production slot: a backend implementing the same
:class:`~operators.jobset.Backend` protocol on the Kubernetes API (create / get / delete the
``jobset.x-k8s.io`` custom object with a ``kubernetes_conn_id`` connection, pod logs through
the core API), plus a trigger that polls ``status.terminalState`` so the training task can
defer instead of holding a worker slot for days. Neither exists yet; asking for ``gke``
fails with that message (the run form's cross-check refuses it before any task runs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from airflow.sdk import BaseHook


class BackendUnavailable(RuntimeError):
    pass


class JobSetHook(BaseHook):
    """Builds the :class:`~operators.jobset.Backend` named by ``backend``."""

    conn_name_attr = "kubernetes_conn_id"
    default_conn_name = "kubernetes_default"
    hook_name = "Slipway JobSet"

    def __init__(
        self,
        backend: str = "local",
        *,
        kubernetes_conn_id: str = default_conn_name,
        log_sink: Callable[[str], None] | None = None,
        extra_env: Mapping[str, str] | None = None,
        grace_period: float | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.kubernetes_conn_id = kubernetes_conn_id  # reserved for the gke backend
        self.log_sink = log_sink
        self.extra_env = dict(extra_env or {})
        self.grace_period = grace_period

    def get_conn(self) -> Any:
        return self.get_backend()

    def get_backend(self) -> Any:
        if self.backend == "local":
            from operators.jobset import LocalBackend

            return LocalBackend(
                self.log_sink, extra_env=self.extra_env, grace_period=self.grace_period
            )
        if self.backend == "gke":
            raise BackendUnavailable(
                "the gke JobSet backend is not implemented yet: use backend=local "
                "(same manifest, pods as local processes); see docs/orchestration.md"
            )
        raise BackendUnavailable(f"unknown JobSet backend {self.backend!r}; known: local, gke")
