"""Render a training launch as a JobSet (``jobset.x-k8s.io/v1alpha2``) manifest.

One replicated job, one Job per slice, one pod per TPU host:

* ``replicas = slices``; each Job is Indexed with ``parallelism = completions = hosts per
  slice`` and ``backoffLimit: 0``, so any failed pod fails its Job and the JobSet decides
  (restart everything, or fail) -- multi-host JAX cannot lose one process and continue.
* Failure handling is split the way Kubernetes splits it. The Job's ``podFailurePolicy``
  turns a *fatal* trainer exit code into Job failure reason ``PodFailurePolicy``; the JobSet
  rule ``failFastOnFatalExitCode`` fails the whole JobSet on that reason. Anything else
  (the trainer's "restart me" code after SIGTERM, a node preemption -- pod condition
  ``DisruptionTarget`` is matched first so it is never mistaken for a fatal code -- an OOM
  kill) fails the Job with ``BackoffLimitExceeded`` and falls through to JobSet's default
  action, ``RestartJobSet``, up to ``maxRestarts``.
* Pods find each other through JobSet's headless service (``network.enableDNSHostnames``):
  pod ``<jobset>-<rjob>-<slice>-<worker>.<jobset>``. Multislice identity comes from JobSet's
  pod annotations through the downward API, so one template serves every slice.

Every string is validated before it reaches the manifest (see :mod:`.names`); args are an argv
list, never a shell string, and ``$`` in env values is escaped against ``$(VAR)`` expansion.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from operators.jobset.catalogue import SliceShape, resolve
from operators.jobset.names import (
    ManifestError,
    check_arg,
    check_command,
    check_dns1123_label,
    check_dns1123_subdomain,
    check_env_name,
    check_env_value,
    check_image,
    check_label_value,
    check_labels,
)

__all__ = [
    "API_VERSION",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_RESTART",
    "TRAINER_COMMAND",
    "ManifestError",
    "TrainingLaunch",
    "render",
]

API_VERSION = "jobset.x-k8s.io/v1alpha2"
KIND = "JobSet"

# The trainer's documented exit codes (trainer/train.py; a test checks they still agree).
# Only the numbers are shared: operators must not import the trainer (it pulls in JAX).
EXIT_FAILED, EXIT_CONFIG, EXIT_RESTART = 1, 2, 42

TRAINER_COMMAND = ("python", "-m", "trainer.train")
JAX_COORDINATOR_PORT = 8476  # the trainer's DistributedConfig.port default (JAX's too)

# JobSet's own label/annotation keys (jobset api/v1alpha2 constants).
JOBSET_NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_NAME_KEY = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS_KEY = "jobset.sigs.k8s.io/replicatedjob-replicas"
GLOBAL_REPLICAS_KEY = "jobset.sigs.k8s.io/global-replicas"
JOB_INDEX_KEY = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX_KEY = "jobset.sigs.k8s.io/job-global-index"
JOB_KEY = "jobset.sigs.k8s.io/job-key"
RESTART_ATTEMPT_KEY = "jobset.sigs.k8s.io/restart-attempt"
EXCLUSIVE_KEY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# Set by the Kubernetes Job controller on Indexed Jobs' pods.
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
KUEUE_QUEUE_KEY = "kueue.x-k8s.io/queue-name"

GKE_NODEPOOL_KEY = "cloud.google.com/gke-nodepool"
GKE_TPU_ACCELERATOR_KEY = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY_KEY = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"

FAIL_FAST_RULE = "failFastOnFatalExitCode"
MANAGED_BY = "slipway"

# Env the platform sets (JobSet, the Job controller, GKE's TPU webhook, or this renderer):
# a user env entry with one of these names would fake a process's identity.
RESERVED_ENV = frozenset(
    {
        "JOB_COMPLETION_INDEX",
        "JOBSET_NAME",
        "REPLICATED_JOB_NAME",
        "JOB_INDEX",
        "TPU_WORKER_ID",
        "TPU_WORKER_HOSTNAMES",
        "MEGASCALE_NUM_SLICES",
        "MEGASCALE_SLICE_ID",
        "MEGASCALE_COORDINATOR_ADDRESS",
    }
)
RESERVED_LABEL_PREFIXES = ("jobset.sigs.k8s.io/", "alpha.jobset.sigs.k8s.io/", "kueue.x-k8s.io/")


def _frozen_map(value: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(value))


@dataclass(frozen=True)
class TrainingLaunch:
    """Everything needed to launch one training run as a JobSet. Validated on construction.

    ``args`` defaults to ``--config <config_uri>`` after ``command`` (``python -m
    trainer.train``). ``fatal_exit_codes`` fail the JobSet at once; any other failure restarts
    all slices, at most ``max_restarts`` times. The defaults make the trainer's "failed" (1) and
    "invalid config" (2) fatal and its "restart me" (42), preemptions and kills retryable.
    """

    name: str
    image: str
    config_uri: str = ""
    accelerator: str = "cpu"
    topology: str = "1"
    slices: int = 1
    namespace: str = "default"
    command: tuple[str, ...] = TRAINER_COMMAND
    args: tuple[str, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 3
    fatal_exit_codes: tuple[int, ...] = (EXIT_FAILED, EXIT_CONFIG)
    service_account: str | None = None  # Workload Identity: a KSA bound to a Google SA
    queue: str | None = None  # Kueue LocalQueue name
    ttl_seconds_after_finished: int | None = 86400  # keep a finished JobSet a day to inspect
    labels: Mapping[str, str] = field(default_factory=dict)
    # SIGTERM -> checkpoint -> exit 42 must fit in here before the kubelet sends SIGKILL.
    termination_grace_seconds: int = 120
    run_as_user: int = 1000
    replicated_job: str = "slice"
    container: str = "trainer"
    coordinator_port: int = JAX_COORDINATOR_PORT
    shape: SliceShape = field(init=False, repr=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise fields once, here
        check_dns1123_label(self.name, "name")
        check_dns1123_label(self.namespace, "namespace")
        check_dns1123_label(self.replicated_job, "replicated job name")
        check_dns1123_label(self.container, "container name")
        check_image(self.image)
        try:
            shape = resolve(self.accelerator, self.topology, self.slices)
        except ValueError as e:
            raise ManifestError(str(e)) from None
        set_(self, "shape", shape)
        # Pod hostnames <name>-<rjob>-<slice>-<worker> must be DNS labels (<= 63 chars).
        longest = (
            f"{self.name}-{self.replicated_job}-{shape.slices - 1}-{shape.hosts_per_slice - 1}"
        )
        if len(longest) > 63:
            raise ManifestError(
                f"name {self.name!r}: pod hostname {longest!r} would exceed 63 characters; "
                "use a shorter name"
            )
        if isinstance(self.command, str) or (self.args is not None and isinstance(self.args, str)):
            raise ManifestError("command and args must be lists of strings, not a shell string")
        set_(self, "command", check_command(self.command))
        if self.args is None:
            if not self.config_uri:
                raise ManifestError("config_uri is required unless args are given")
            set_(self, "args", ("--config", check_arg(self.config_uri, "config_uri")))
        else:
            set_(self, "args", tuple(check_arg(a, "arg") for a in self.args))
        env = {}
        for key, value in dict(self.env).items():
            check_env_name(key)
            if key in RESERVED_ENV:
                raise ManifestError(
                    f"environment variable {key} is set by JobSet/GKE; not settable"
                )
            env[key] = check_env_value(key, value)
        set_(self, "env", _frozen_map(env))
        set_(self, "labels", _frozen_map(check_labels(self.labels, RESERVED_LABEL_PREFIXES)))
        if self.service_account is not None:
            check_dns1123_subdomain(self.service_account, "service account")
        if self.queue is not None:
            check_dns1123_subdomain(self.queue, "Kueue queue")
            check_label_value(self.queue, "Kueue queue")
        _check_int(self.max_restarts, "max_restarts", 0, 1000)
        _check_int(self.termination_grace_seconds, "termination_grace_seconds", 0, 86400)
        _check_int(self.run_as_user, "run_as_user", 1, 2**31 - 1)  # 0 would be root
        _check_int(self.coordinator_port, "coordinator_port", 1, 65535)
        if self.ttl_seconds_after_finished is not None:
            _check_int(self.ttl_seconds_after_finished, "ttl_seconds_after_finished", 0, 2**31 - 1)
        codes = tuple(sorted(set(self.fatal_exit_codes)))
        for code in codes:
            # podFailurePolicy "In" may not list 0 (success); exit codes are 0..255.
            _check_int(code, "fatal exit code", 1, 255)
        if EXIT_RESTART in codes:
            raise ManifestError(f"exit code {EXIT_RESTART} means 'restart me'; it cannot be fatal")
        set_(self, "fatal_exit_codes", codes)

    def render(self) -> dict[str, Any]:
        return render(self)


def _check_int(value: object, what: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ManifestError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")


def _escape(value: str) -> str:
    """Kubernetes expands $(VAR) in env values and args; '$$' is a literal '$'."""
    return value.replace("$", "$$")


def _field_env(name: str, annotation: str) -> dict[str, Any]:
    path = f"metadata.annotations['{annotation}']"
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _pod_host(slice_expr: str, worker: int) -> str:
    # $(VAR) references are expanded by the kubelet from variables defined earlier in the list.
    return f"$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-{slice_expr}-{worker}.$(JOBSET_NAME)"


def _env(spec: TrainingLaunch) -> list[dict[str, Any]]:
    shape = spec.shape
    env = [
        _field_env("JOBSET_NAME", JOBSET_NAME_KEY),
        _field_env("REPLICATED_JOB_NAME", REPLICATED_JOB_NAME_KEY),
        _field_env("JOB_INDEX", JOB_INDEX_KEY),
    ]
    if shape.multislice:
        # libtpu's DCN transport and the trainer both read these; slice 0 worker 0 coordinates.
        env += [
            _field_env("MEGASCALE_NUM_SLICES", REPLICATED_JOB_REPLICAS_KEY),
            _field_env("MEGASCALE_SLICE_ID", JOB_INDEX_KEY),
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": _pod_host("0", 0)},
        ]
    if not shape.is_tpu:
        # GKE's TPU webhook injects TPU_WORKER_ID/HOSTNAMES only into pods that request TPUs;
        # a CPU run spells them out so the trainer finds its peers the same way.
        hosts = ",".join(_pod_host("$(JOB_INDEX)", w) for w in range(shape.hosts_per_slice))
        env += [
            _field_env("TPU_WORKER_ID", COMPLETION_INDEX_KEY),
            {"name": "TPU_WORKER_HOSTNAMES", "value": hosts},
        ]
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})  # log lines as they happen
    env += [{"name": k, "value": _escape(v)} for k, v in sorted(spec.env.items())]
    return env


def _pod_spec(spec: TrainingLaunch) -> dict[str, Any]:
    shape = spec.shape
    uid = spec.run_as_user
    container: dict[str, Any] = {
        "name": spec.container,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [_escape(c) for c in spec.command],
        "args": [_escape(a) for a in spec.args or ()],
        "env": _env(spec),
        "ports": [{"name": "jax-coord", "containerPort": spec.coordinator_port}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # required by podFailurePolicy; JobSet restarts, not kubelet
        "terminationGracePeriodSeconds": spec.termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        # The trainer talks to GCS through Workload Identity, never to the Kubernetes API:
        # no API token in the pod, whichever account it runs as.
        "automountServiceAccountToken": False,
    }
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    if shape.is_tpu:
        chips = str(shape.chips_per_host)
        container["resources"] = {
            "requests": {TPU_RESOURCE: chips},
            "limits": {TPU_RESOURCE: chips},
        }
        container["ports"] += [
            {"name": "tpu-runtime", "containerPort": 8471},
            {"name": "megascale", "containerPort": 8080},
        ]
        pod["nodeSelector"] = {
            GKE_TPU_ACCELERATOR_KEY: shape.gke_accelerator,
            GKE_TPU_TOPOLOGY_KEY: shape.topology,
        }
        pod["tolerations"] = [
            {"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
        ]
        # TPU hosts talk over the VM network (DCN for multislice); one pod per node anyway.
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    return pod


def _job_spec(spec: TrainingLaunch, pod_labels: dict[str, str]) -> dict[str, Any]:
    hosts = spec.shape.hosts_per_slice
    rules: list[dict[str, Any]] = [
        # A preempted/evicted pod is a restart, whatever its exit code: checked first.
        {
            "action": "Count",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        }
    ]
    if spec.fatal_exit_codes:
        rules.append(
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": spec.container,
                    "operator": "In",
                    "values": list(spec.fatal_exit_codes),
                },
            }
        )
    return {
        "parallelism": hosts,
        "completions": hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": rules},
        "template": {"metadata": {"labels": pod_labels}, "spec": _pod_spec(spec)},
    }


def render(spec: TrainingLaunch) -> dict[str, Any]:
    """The JobSet manifest for ``spec`` as a plain dict (JSON/YAML serialisable)."""
    shape = spec.shape
    common = {
        "app.kubernetes.io/name": "slipway-trainer",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    labels = {**spec.labels, **common}
    meta_labels = dict(labels)
    if spec.queue:
        meta_labels[KUEUE_QUEUE_KEY] = spec.queue
    annotations = {}
    if shape.is_tpu:
        # One slice per node pool: two slices' pods must never share (or split) a TPU slice.
        annotations[EXCLUSIVE_KEY] = GKE_NODEPOOL_KEY
    failure_policy: dict[str, Any] = {
        "maxRestarts": spec.max_restarts,
        "restartStrategy": "Recreate",
    }
    if spec.fatal_exit_codes:
        failure_policy["rules"] = [
            {
                "name": FAIL_FAST_RULE,
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
            }
        ]
    jobset_spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [spec.replicated_job]},
        "failurePolicy": failure_policy,
        "replicatedJobs": [
            {
                "name": spec.replicated_job,
                "replicas": shape.slices,
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": _job_spec(spec, dict(labels)),
                },
            }
        ],
    }
    if spec.ttl_seconds_after_finished is not None:
        jobset_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    metadata: dict[str, Any] = {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": meta_labels,
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": jobset_spec}
