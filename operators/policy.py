"""What the platform lets a run form choose: credentials, identities and images.

Credentials and identities come from the platform, not from the person filling in the form.
A run may name a kubeconfig, a GCP connection, a training namespace, a service account or an
image only if the platform set it as the form's default or lists it in an allow-list. The
allow-lists are environment variables of every Airflow container (the Helm chart's
``slipway-config`` ConfigMap, ``runPolicy`` values), each a comma-separated list:

=========================================  =====================================================
variable                                   what it adds to the platform's own value
=========================================  =====================================================
``SLIPWAY_ALLOWED_GCP_CONN_IDS``           ``gke.gcp_conn_id`` (always: ``google_cloud_default``)
``SLIPWAY_ALLOWED_KUBECONFIGS``            ``gke.kubeconfig`` paths (none by default: a kubeconfig
                                           can run an exec plugin, and any file on the worker
                                           could be named)
``SLIPWAY_ALLOWED_NAMESPACES``             ``gke.namespace`` (``$SLIPWAY_TRAINING_NAMESPACE``)
``SLIPWAY_ALLOWED_SERVICE_ACCOUNTS``       ``gke.service_account``
                                           (``$SLIPWAY_TRAINER_SERVICE_ACCOUNT``); where the
                                           platform has any, a gke run must name one
``SLIPWAY_ALLOWED_KUEUE_QUEUES``           ``gke.queue`` (``$SLIPWAY_KUEUE_QUEUE``); where the
                                           platform has any, a gke run must name one: a
                                           JobSet without the label bypasses Kueue's quota
``SLIPWAY_ALLOWED_DATAFLOW_SERVICE_ACCOUNTS`` ``dataflow.service_account``
                                           (``$SLIPWAY_DATAFLOW_SERVICE_ACCOUNT``)
``SLIPWAY_ALLOWED_IMAGES``                 the trainer ``image`` of a gke run and
                                           ``dataflow.sdk_container_image``: an entry is a
                                           repository (any tag or digest of it), or a prefix
                                           ending in ``/``; the repositories of
                                           ``$SLIPWAY_TRAINER_IMAGE`` and
                                           ``$SLIPWAY_DATAFLOW_SDK_CONTAINER_IMAGE`` always
``SLIPWAY_ALLOWED_GKE_CLUSTERS``           ``gke.cluster_name``, as ``<location>/<name>`` (a run
                                           naming no ``gke.project_id``: the connection's
                                           project) or ``<project>/<location>/<name>`` (none by
                                           default: the platform's GCP identity reaches the
                                           clusters its IAM grants, not only its own)
``SLIPWAY_ALLOWED_DATAFLOW_PROJECTS``      ``dataflow.project_id``
                                           (``$SLIPWAY_DATAFLOW_PROJECT_ID``)
``SLIPWAY_ALLOWED_DATAFLOW_LOCATIONS``     ``dataflow.temp_location`` and ``staging_location``:
                                           at or below an entry (``gs://`` prefixes); the
                                           platform's ``$SLIPWAY_DATAFLOW_TEMP_LOCATION``,
                                           ``$SLIPWAY_DATAFLOW_STAGING_LOCATION`` and a
                                           ``gs://`` storage root (``$SLIPWAY_HOME``, else the
                                           Airflow Variable ``slipway_home``) always
=========================================  =====================================================

``gke.context`` picks a context of ``gke.kubeconfig``: without an allowed kubeconfig it would
pick the worker's default one (``~/.kube/config``), so a run names a context only beside one.

Where corpora may be read from is :func:`operators.settings.allowed_data_roots`. Checked by
:func:`operators.params.check_run_config` (the DAG's ``validate`` task, ``slipway plan``), and
again where the values are used (:func:`enforce`: the trainer launch, the Dataflow launch), so
a run whose ``validate`` was marked successful by hand still cannot use what it names.
Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from operators.naming import image_repository

DEFAULT_GCP_CONN_ID = "google_cloud_default"
ALLOW_ENV = {
    "gcp_conn_ids": "SLIPWAY_ALLOWED_GCP_CONN_IDS",
    "kubeconfigs": "SLIPWAY_ALLOWED_KUBECONFIGS",
    "namespaces": "SLIPWAY_ALLOWED_NAMESPACES",
    "service_accounts": "SLIPWAY_ALLOWED_SERVICE_ACCOUNTS",
    "kueue_queues": "SLIPWAY_ALLOWED_KUEUE_QUEUES",
    "dataflow_service_accounts": "SLIPWAY_ALLOWED_DATAFLOW_SERVICE_ACCOUNTS",
    "images": "SLIPWAY_ALLOWED_IMAGES",
    "gke_clusters": "SLIPWAY_ALLOWED_GKE_CLUSTERS",
    "dataflow_projects": "SLIPWAY_ALLOWED_DATAFLOW_PROJECTS",
    "dataflow_locations": "SLIPWAY_ALLOWED_DATAFLOW_LOCATIONS",
}
# The platform's own values, always allowed (the form's defaults on a chart deploy).
_PLATFORM_VALUE_ENV = {
    "namespaces": ("SLIPWAY_TRAINING_NAMESPACE",),
    "service_accounts": ("SLIPWAY_TRAINER_SERVICE_ACCOUNT",),
    "kueue_queues": ("SLIPWAY_KUEUE_QUEUE",),
    "dataflow_service_accounts": ("SLIPWAY_DATAFLOW_SERVICE_ACCOUNT",),
    "images": ("SLIPWAY_TRAINER_IMAGE", "SLIPWAY_DATAFLOW_SDK_CONTAINER_IMAGE"),
    "dataflow_projects": ("SLIPWAY_DATAFLOW_PROJECT_ID",),
    "dataflow_locations": ("SLIPWAY_DATAFLOW_TEMP_LOCATION", "SLIPWAY_DATAFLOW_STAGING_LOCATION"),
}


class PolicyViolation(ValueError):
    """A run names what the platform does not allow, found where it would be used."""


def env_list(environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated environment variable as its non-empty, stripped entries."""
    return tuple(part.strip() for part in environ.get(name, "").split(",") if part.strip())


@dataclass(frozen=True)
class RunPolicy:
    """The allow-lists, platform values included (:meth:`from_env`)."""

    gcp_conn_ids: tuple[str, ...] = (DEFAULT_GCP_CONN_ID,)
    kubeconfigs: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    service_accounts: tuple[str, ...] = ()
    kueue_queues: tuple[str, ...] = ()
    dataflow_service_accounts: tuple[str, ...] = ()
    images: tuple[str, ...] = ()  # repositories, or prefixes ending in "/"
    gke_clusters: tuple[str, ...] = ()  # "<location>/<name>" or "<project>/<location>/<name>"
    dataflow_projects: tuple[str, ...] = ()
    dataflow_locations: tuple[str, ...] = ()  # gs:// prefixes

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RunPolicy:
        """The policy of ``environ`` (default: this process's environment, where the storage
        root may also come from the Airflow Variable, as every step's outputs do)."""
        if environ is None:
            from operators.settings import storage_root

            environ, root = os.environ, storage_root()
        else:
            from operators.settings import HOME_ENV

            root = environ.get(HOME_ENV, "").strip()
        found: dict[str, tuple[str, ...]] = {}
        for field, name in ALLOW_ENV.items():
            values = list(env_list(environ, name))
            for platform in _PLATFORM_VALUE_ENV.get(field, ()):
                value = environ.get(platform, "").strip()
                if value and field == "images":
                    value = image_repository(value) or value
                if field == "dataflow_locations" and not value.startswith("gs://"):
                    continue  # a local path: Dataflow stages nothing there
                if value:
                    values.append(value)
            if field == "dataflow_locations" and root.startswith("gs://"):
                values.append(root)  # what the stages write below is the platform's bucket
            if field == "gcp_conn_ids":
                values.append(DEFAULT_GCP_CONN_ID)
            found[field] = tuple(dict.fromkeys(values))
        return cls(**found)

    def image_allowed(self, image: str) -> bool:
        repo = image_repository(image)
        if repo is None:
            return False
        return any(
            repo.startswith(entry) if entry.endswith("/") else repo == entry
            for entry in self.images
        )

    def location_allowed(self, location: str) -> bool:
        """``location`` at or below an allowed ``gs://`` prefix, without ``.``/``..`` parts."""
        if not location.startswith("gs://"):
            return False
        if any(part in (".", "..") for part in location[len("gs://") :].split("/")):
            return False
        for entry in self.dataflow_locations:
            root = entry.rstrip("/")
            if location.rstrip("/") == root or location.startswith(root + "/"):
                return True
        return False

    def _refusal(self, field: str, value: object, allowed: tuple[str, ...], env: str) -> str:
        shown = ", ".join(allowed) if allowed else "nothing"
        return (
            f"{field} {value!r} is not allowed by the platform (allowed: {shown}; an "
            f"operator adds more in {env})"
        )

    def _unlisted(self, where: str, values: Mapping[str, Any], key: str, field: str) -> list[str]:
        """``values[key]``, when set, refused unless the ``field`` allow-list has it."""
        value, allowed = values.get(key), getattr(self, field)
        if value not in (None, "") and value not in allowed:
            return [self._refusal(f"{where}.{key}", value, allowed, ALLOW_ENV[field])]
        return []

    def cluster_problems(self, gke: Mapping[str, Any]) -> list[str]:
        """What a gke run's cluster settings (its ``gke`` object: where and as whom the
        JobSets are managed) name that the platform does not allow. Also checked on settings
        read back from storage (a deferred task's handle file), which others may write."""
        out: list[str] = []
        for key, field in (
            ("gcp_conn_id", "gcp_conn_ids"),
            ("kubeconfig", "kubeconfigs"),
            ("namespace", "namespaces"),
        ):
            out += self._unlisted("gke", gke, key, field)
        if gke.get("namespace") in (None, ""):  # never Kubernetes' "default" by omission
            out.append("gke.namespace: a gke run names its training namespace")
        if gke.get("cluster_name") not in (None, ""):
            where = f"{gke.get('location') or ''}/{gke['cluster_name']}"
            if gke.get("project_id"):
                where = f"{gke['project_id']}/{where}"
            if where not in self.gke_clusters:
                out.append(
                    self._refusal(
                        "gke cluster", where, self.gke_clusters, ALLOW_ENV["gke_clusters"]
                    )
                )
        if gke.get("context") not in (None, "") and gke.get("kubeconfig") in (None, ""):
            out.append(
                f"gke.context {gke['context']!r}: names a context of gke.kubeconfig, and "
                "none is given (alone it would pick the worker's default kubeconfig)"
            )
        return out

    def problems(self, params: Mapping[str, Any]) -> list[str]:
        """Every form value the platform does not allow, as ``field: why`` sentences."""
        out: list[str] = []
        gke = params.get("gke") or {}
        if params.get("backend") == "gke":
            out += self.cluster_problems(gke)
            out += self._unlisted("gke", gke, "service_account", "service_accounts")
            out += self._unlisted("gke", gke, "queue", "kueue_queues")
            # A gke object given in full replaces the pre-filled one: leaving these out must
            # not run the pods as the namespace's default account, or around Kueue's quota.
            for key, field, what in (
                ("service_account", "service_accounts", "its trainer service account"),
                ("queue", "kueue_queues", "its Kueue queue (TPU quota)"),
            ):
                allowed = getattr(self, field)
                if allowed and gke.get(key) in (None, ""):
                    out.append(
                        f"gke.{key}: a gke run on this platform names {what}: one of "
                        f"{', '.join(allowed)}"
                    )
            image = params.get("image")
            if isinstance(image, str) and image_repository(image) and not self.image_allowed(image):
                out.append(self._refusal("image", image, self.images, ALLOW_ENV["images"]))
        else:
            # The local backend never uses them; a value here is a mistake, or a probe.
            for key in ("kubeconfig", "gcp_conn_id"):
                if gke.get(key) not in (None, ""):
                    out.append(f"gke.{key}: only a backend=gke run names cluster credentials")
        if params.get("runner") == "DataflowRunner":
            dataflow = params.get("dataflow") or {}
            out += self._unlisted(
                "dataflow", dataflow, "service_account", "dataflow_service_accounts"
            )
            image = dataflow.get("sdk_container_image")
            if isinstance(image, str) and image_repository(image) and not self.image_allowed(image):
                out.append(
                    self._refusal(
                        "dataflow.sdk_container_image", image, self.images, ALLOW_ENV["images"]
                    )
                )
            out += self._unlisted("dataflow", dataflow, "project_id", "dataflow_projects")
            for key in ("temp_location", "staging_location"):
                value = dataflow.get(key)
                if value not in (None, "") and not (
                    isinstance(value, str) and self.location_allowed(value)
                ):
                    out.append(
                        self._refusal(
                            f"dataflow.{key}",
                            value,
                            self.dataflow_locations,
                            ALLOW_ENV["dataflow_locations"],
                        )
                    )
        return out


def checked_cluster(cluster: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``cluster`` (gke cluster settings read back from storage, where a trainer's or another
    task's account may write) if the platform allows it; :class:`PolicyViolation` if not."""
    problems = RunPolicy.from_env().cluster_problems(cluster or {})
    if problems:
        raise PolicyViolation(
            "the platform does not allow the stored cluster settings:\n  " + "\n  ".join(problems)
        )
    return cluster


def checked_handle(
    handle: Mapping[str, Any], cluster: Mapping[str, Any] | None, name: str
) -> Mapping[str, Any]:
    """``handle`` (a JobSet handle read back from storage, with its ``cluster``, itself
    checked by :func:`checked_cluster`) if it names this step's own JobSet: a gke JobSet
    named ``name`` in the cluster's namespace, with the uid the API server gave it (the
    delete's precondition). Anyone who may write the bucket must not be able to point a
    timed-out task's delete at another JobSet. :class:`PolicyViolation` if not."""
    problems = []
    if handle.get("backend") != "gke":
        problems.append(f"backend {handle.get('backend')!r} is not gke")
    if handle.get("name") != name:
        problems.append(f"name {handle.get('name')!r} is not this step's JobSet {name!r}")
    if handle.get("namespace") != (cluster or {}).get("namespace"):
        problems.append(
            f"namespace {handle.get('namespace')!r} is not the stored cluster's "
            f"{(cluster or {}).get('namespace')!r}"
        )
    if not handle.get("uid"):
        problems.append("no uid (the delete would have no precondition)")
    if problems:
        raise PolicyViolation(
            "the stored JobSet handle is not this step's:\n  " + "\n  ".join(problems)
        )
    return handle


def enforce(params: Mapping[str, Any]) -> None:
    """Raise :class:`PolicyViolation` with every problem of :meth:`RunPolicy.problems`: at
    the point of use, so a refused value is refused even when ``validate`` did not run."""
    problems = RunPolicy.from_env().problems(params)
    if problems:
        raise PolicyViolation("the platform does not allow this run:\n  " + "\n  ".join(problems))
