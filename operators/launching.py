"""Launching a trainer entrypoint from a DAG task: the JobSet, its mesh, and following it.

Shared by the ``train`` task (:mod:`operators.training`) and the ``evaluate`` task
(:mod:`operators.evaluation`): both render a :class:`~operators.jobset.TrainingLaunch` for the
run's slice shape (:func:`trainer_launch`, with the device mesh the shape implies), and, when
the task itself waits for it, run it through :class:`JobSetRunner` (submit, stream the pods'
logs into the task log, poll, cancel on kill).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.steps import Step, StepSpec

TRAINER_CONFIG = "trainer_config.json"
JOBSET_MANIFEST = "jobset.json"
POLL_SECONDS = 1.0
PROGRESS_SECONDS = 10.0  # the trainer prints no per-step lines: log metrics.jsonl this often


class TrainingFailed(RuntimeError):
    pass


class FaultInjected(TrainingFailed):
    pass


def jobset_name(kind: str, spec: StepSpec) -> str:
    return f"slipway-{kind}-{spec.version[:8]}"


class JobSetRunner:
    """Submit a manifest, stream its logs, watch it, cancel it on kill. The hook's client is
    closed when ``run`` returns or raises, and the JobSet is then no longer this runner's to
    cancel: it has ended, or ``run`` cancelled it. A kill during ``run`` (``on_kill`` from the
    task's signal handler) cancels through the open client, and ``run`` sees it end. The
    local backend keeps its runs in the client itself, so only ``run`` may close it."""

    def __init__(
        self, operator: BaseOperator, backend: str, cluster: Mapping[str, Any] | None = None
    ) -> None:
        from operators.hooks.jobset import JobSetHook

        self.operator = operator
        self.hook = JobSetHook(backend, cluster=cluster, log_sink=operator.log.info)
        self.handle: Any = None

    def run(
        self,
        manifest: Mapping[str, Any],
        watch: Any = None,
        progress: Any = None,
        poll_seconds: float = POLL_SECONDS,
    ) -> Any:
        self.handle = handle = self.hook.submit(manifest)
        self.operator.log.info("JobSet %s submitted (%s)", handle.name, handle.uid)
        last_progress = time.monotonic()
        try:
            while True:
                status = self.hook.poll(handle)
                if status.done:
                    if progress is not None:
                        progress()
                    return status
                if watch is not None and (reason := watch()):
                    self.operator.log.warning("%s: cancelling the JobSet", reason)
                    self.hook.cancel(handle)
                    raise FaultInjected(reason)
                if progress is not None and time.monotonic() - last_progress >= PROGRESS_SECONDS:
                    progress()
                    last_progress = time.monotonic()
                time.sleep(poll_seconds)
        except BaseException:
            self.cancel()
            raise
        finally:
            self.handle = None
            self.hook.close()

    def cancel(self) -> None:
        handle = self.handle
        if handle is not None:
            status = self.hook.cancel(handle)
            self.operator.log.info("JobSet %s cancelled: %s", handle.name, status.reason)

    def cancel_if_local(self) -> None:
        """Cancel the JobSet only where it is this process's alone: a local run's pods. A
        GKE JobSet is found again by its name and step labels and adopted by whoever runs the
        step next (:func:`gke_launch_options`), so it is theirs to keep or end."""
        if self.hook.backend == "local":
            self.cancel()


def trainer_launch(
    spec_name: str, params: Mapping[str, Any], *, slices: int | None = None, **kwargs: Any
) -> Any:
    """The JobSet launch of a trainer entrypoint (training or evaluation) for this run: its
    slice shape (the run's, or ``slices`` of its topology), and the device mesh that shape
    implies (``--set mesh.*``, after the entrypoint's own arguments:
    :func:`operators.jobset.mesh.launch_mesh`)."""
    from operators.jobset import TrainingLaunch
    from operators.jobset.catalogue import resolve
    from operators.jobset.mesh import launch_mesh, mesh_args
    from operators.policy import enforce

    enforce(params)  # again where the image and the cluster's identity are used
    slices = int(params["slices"]) if slices is None else slices
    shape = resolve(params["accelerator"], params["topology"], slices)
    mesh = launch_mesh(shape, params["model_preset"], params.get("mesh") or {})
    args = kwargs.pop("args", None) or ("--config", kwargs.get("config_uri", ""))
    labels = {"app.kubernetes.io/part-of": "slipway", **kwargs.pop("labels", {})}
    return TrainingLaunch(
        name=spec_name,
        image=params["image"],
        accelerator=params["accelerator"],
        topology=params["topology"],
        slices=slices,
        labels=labels,
        args=(*args, *mesh_args(mesh)),
        **kwargs,
    )


def is_gke(spec: StepSpec | Step) -> bool:
    return spec.unversioned.get("backend", "local") == "gke"


def gke_launch_options(spec: StepSpec, params: Mapping[str, Any]) -> dict[str, Any]:
    """Namespace, Workload-Identity service account, Kueue queue and the step labels that let
    a resubmission recognise its own JobSet (same name, same step version: adopt it)."""
    from operators.jobset.gke import STEP_LABEL, STEP_VERSION_LABEL
    from operators.jobset.names import label_safe
    from operators.pipeline.form import gke_cluster

    gke = dict(params.get("gke") or {})
    options: dict[str, Any] = {
        "namespace": gke_cluster(params).get("namespace", "default"),
        # The step's name for people reading the JobSet (a sweep cell's has slashes); the
        # adoption of a resubmitted JobSet goes by its name and version, not by this.
        "labels": {STEP_LABEL: label_safe(spec.name), STEP_VERSION_LABEL: spec.version[:63]},
    }
    for key in ("service_account", "queue"):
        if gke.get(key):
            options[key] = gke[key]
    return options


def one_slice_runner(
    operator: BaseOperator, spec: StepSpec, params: Mapping[str, Any]
) -> JobSetRunner:
    """The runner of an evaluation's or export's JobSet (:func:`run_on_one_slice`). The
    operator keeps it before the run starts, so that ``on_kill`` and a lost lease can stop
    what it runs."""
    if is_gke(spec):
        from operators.pipeline.form import gke_cluster

        return JobSetRunner(operator, "gke", gke_cluster(params))
    return JobSetRunner(operator, spec.unversioned.get("backend", "local"))


def run_on_one_slice(
    runner: JobSetRunner,
    spec: StepSpec,
    params: Mapping[str, Any],
    *,
    kind: str,
    module: str,
    args: list[str],
) -> Any:
    """``python -m <module> <args>`` as a JobSet on one slice of the run's topology, local or
    GKE, to its end: its final status. What evaluation and export launch: with the replica
    axis across slices each slice holds the whole model, and neither needs more than one.
    Minutes long: polled from the worker, 10 s apart on GKE, without deferral."""
    gke = is_gke(spec)
    launch = trainer_launch(
        jobset_name(kind, spec),
        params,
        command=("python", "-m", module),
        args=tuple(args),
        slices=1,
        max_restarts=0,
        **(gke_launch_options(spec, params) if gke else {}),
    )
    if gke:
        return runner.run(launch.render(), poll_seconds=10.0)
    return runner.run(launch.render())


def write_json(path: str, body: Any) -> None:
    import fsspec

    with fsspec.open(path, "w") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")
