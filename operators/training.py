"""Training: the trainer's entrypoint launched as a JobSet.

:class:`TrainingOperator` writes the trainer config (``trainer/config.py`` format) into the
``train`` step's output directory, renders the JobSet manifest (:mod:`operators.jobset`) and
runs it through :class:`~operators.hooks.jobset.JobSetHook`, with every pod's output in the
task log. Killing the task (``on_kill``) cancels the pods: SIGTERM, the trainer checkpoints,
SIGKILL after the grace period.

With ``backend=gke`` the training task is **deferrable**: it claims the step (lease), creates
the JobSet on the cluster and defers to :class:`~operators.triggers.jobset.JobSetTrigger`,
which follows the JobSet in the triggerer (restarts, leader pod log lines) and renews the
step's lease; ``execute_complete`` reads the trainer's result and records the step and its
lineage as the local path does. A deferred task killed by a user is handled by the trigger's
``on_kill`` (JobSet deleted); a trigger timeout (``execution_timeout``) or trigger failure
resumes the task through ``__fail__``, where :meth:`TrainingOperator.resume_execution` deletes
the JobSet and fails the step before Airflow fails the task. No TPU slice is left orphaned.

The step's output directory is the trainer's ``output_dir``, so a rerun of a FAILED step
(Airflow retry, cleared task, backfill) resumes from its last checkpoint.

**Fault injection** (the trainer has no switch of its own): with ``fail_at_step = N`` the
operator watches ``metrics.jsonl`` and, once the trainer has logged step N, cancels the JobSet
exactly as a preemption would (SIGTERM: the trainer saves a checkpoint at the step it reached
and exits 42), then fails the task. It only fires when the run *starts* below step N, so the
retry resumes from that checkpoint and completes: the recovery path is exercised end to end.

Evaluation is :mod:`operators.evaluation`; what both launch with is :mod:`operators.launching`;
the step model and lineage of the deferred path are
:class:`~operators.step_lineage.DeferredStep`'s.

One module of ~600 lines, on purpose: the local and the GKE paths are one operator's two ways
to run the same step, sharing its inputs, outputs, failure properties and result; what is
GKE-only here is the deferral's Airflow side (submit, defer, follow another run's JobSet,
``__fail__``), which has no other user.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from operators.launching import (
    JOBSET_MANIFEST,
    POLL_SECONDS,
    TRAINER_CONFIG,
    JobSetRunner,
    TrainingFailed,
    gke_launch_options,
    is_gke,
    jobset_name,
    trainer_launch,
    write_json,
)
from operators.step_lineage import ArtifactRef, DeferredStep, StepLineageMixin
from operators.steps import Step, StepResult, StepSpec, join, output_path
from trainer import rundir
from trainer.rundir import last_checkpoint, read_metrics
from trainer.rundir import read_json as _read_json

if TYPE_CHECKING:
    from operators.jobset.catalogue import SliceShape
    from operators.jobset.preflight import PreflightResult

GKE_POLL_SECONDS = 30.0  # a watch returns at once on a change; this bounds a quiet wait
GKE_LOG_SECONDS = 60.0  # leader pod log lines in the task log this often
FAULT_POLL_SECONDS = 0.05  # small models run hundreds of steps a second once compiled


# -- trainer output files: trainer/rundir.py owns the layout (JAX-free) -------------------------


def last_logged_step(out: str, since: int = 0) -> int:
    return _last_step(read_metrics(out, since))


def _last_step(metrics: list[dict[str, Any]]) -> int:
    return int(metrics[-1]["step"]) if metrics else 0


def last_loss_properties(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What a failed training records of where it stopped, for the runs list: the last loss
    in ``metrics`` (:func:`read_metrics`; NaN for a diverged run) and its step, or None for
    both before any loss. Every attempt's lines count, as on the run page's curve."""
    logged = [m for m in metrics if m.get("loss") is not None]
    last = logged[-1] if logged else None
    return {
        "last_logged_loss": float(last["loss"]) if last else None,
        "last_logged_loss_step": int(last["step"]) if last else None,
    }


def fault_watch(out: str, fail_at: int, start_step: int | None) -> Callable[[], str | None] | None:
    """The local backend's fault injection: a check that says why to cancel once this
    attempt's trainer logs step ``fail_at`` (None when there is nothing to inject: no
    ``fail_at``, or training resumes at or past it). Only this attempt's lines count: an
    earlier attempt may have logged past ``fail_at`` before its checkpoint was lost, and would
    cancel every retry before it made progress."""
    from trainer.rundir import metrics_size

    if not fail_at or (start_step is not None and start_step >= fail_at):
        return None
    since = metrics_size(out)

    def watch() -> str | None:
        step = last_logged_step(out, since)
        if step >= fail_at:
            # the trainer checkpoints on the SIGTERM that follows: a fast model may get a few
            # steps further first, so its last checkpoint can be past `step`
            return (
                f"fault injection: fail_at_step={fail_at} reached (trainer at {step} when "
                "cancelled; it checkpoints where it stops, which can be a few steps later)"
            )
        return None

    return watch


def trainer_config(spec: StepSpec) -> dict[str, Any]:
    """The ``train`` step's trainer config file (:func:`operators.pipeline.graph.trainer_run_config`)."""
    from operators.pipeline.graph import trainer_run_config

    return trainer_run_config(spec.config, spec.output_path)


def _training_result(out: str, status: Any, resumed_from: int | None) -> dict[str, Any]:
    """The train step's result from the trainer's files; :class:`TrainingFailed` unless both
    the JobSet and the trainer say it succeeded."""
    result = _read_json(join(out, rundir.RESULT)) or {}
    if not status.succeeded or result.get("status") != "succeeded":
        raise TrainingFailed(
            f"JobSet {status.terminal_state} ({status.reason}: {status.message}); "
            f"exit codes {status.exit_codes}; trainer: {result.get('status')} "
            f"{result.get('error') or ''}".strip()
        )
    metrics = read_metrics(out)
    ckpt = last_checkpoint(out)
    return {
        "steps": result.get("steps"),
        "params": result.get("params"),
        "loss_start": metrics[0]["loss"] if metrics else None,
        "loss_end": result.get("final_loss"),
        "checkpoint": ckpt[1] if ckpt else None,
        "checkpoint_step": ckpt[0] if ckpt else None,
        "resumed_from": resumed_from,
        "restarts": status.restarts,
        "train_seconds": result.get("train_seconds"),
    }


def _task_result(result: StepResult) -> dict[str, Any]:
    """The task's return value (XCom): the outcome, the output, the training's summary."""
    return {
        "outcome": str(result.outcome),
        "output": result.spec.output_path,
        **(result.result or {}),
    }


class TrainingOperator(StepLineageMixin, BaseOperator):
    """The ``train`` step: trainer config -> JobSet -> checkpoints, metrics, result."""

    ui_color = "#f5d0a9"

    def __init__(
        self,
        *,
        gke_poll_seconds: float = GKE_POLL_SECONDS,
        gke_log_seconds: float = GKE_LOG_SECONDS,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("task_id", "train")
        super().__init__(**kwargs)
        self.gke_poll_seconds = gke_poll_seconds
        self.gke_log_seconds = gke_log_seconds
        self._jobset: JobSetRunner | None = None
        self._gke: Any = None  # (hook, handle) while a gke submission is in this process
        # The TPU preflight's client: None is google-cloud-tpu's TpuClient with the GCP
        # connection's credentials (tests put a fake here; not a constructor argument, since
        # a client is not something a DAG file can serialize).
        self.tpu_client: Any = None

    def planned_io(self, context: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        root = self.steps_root()
        graph = self.step_graph(context)
        inputs = [output_path(root, s) for s in graph.train_stores.values()]
        return inputs, [output_path(root, self.train_step(context))]

    def train_step(self, context: Mapping[str, Any]) -> Step:
        """The step this task trains: the pipeline's ``train`` (a sweep cell overrides it)."""
        return self.step_graph(context).train

    @staticmethod
    def _inputs(step: Step) -> list[ArtifactRef]:
        from operators.pipeline.graph import TOKEN_STORE

        return [
            ArtifactRef(s["path"], TOKEN_STORE, role=f"train_data:{s['name']}")
            for s in step.config["sources"]
        ]

    def execute(self, context: Any) -> dict[str, Any]:
        params = self.run_params(context)
        step = self.train_step(context)
        if is_gke(step):
            return self._execute_gke(context, params, step)
        result = self.run_step(
            context,
            step,
            lambda spec: self._train(spec, params),
            inputs=self._inputs(step),
            outputs=self._outputs,
            failure_properties=self._failure_properties,
            complete_properties=self._complete_properties,
        )
        return _task_result(result)

    # -- gke: submit, defer, complete ---------------------------------------------------------
    #
    # The step model and lineage as run_step does them, split at the deferral (DeferredStep):
    # execute starts the lineage execution and submits under a held lease, the trigger renews
    # the lease while the JobSet runs, execute_complete finishes both.

    def _deferred(self, step: Step) -> DeferredStep:
        return DeferredStep(
            self,
            step,
            inputs=self._inputs(step),
            outputs=self._outputs,
            failure_properties=self._failure_properties,
            complete_properties=self._complete_properties,
        )

    def _execute_gke(
        self,
        context: Any,
        params: Mapping[str, Any],
        step: Step,
        execution: int | None = None,
        allow_follow: bool = True,
    ) -> dict[str, Any]:
        deferred = self._deferred(step)
        if execution is None:
            execution = deferred.begin(context)
        if allow_follow and (target := self._follow_target(deferred.root, step)) is not None:
            self._defer_follow(target, execution, jobset_name("train", deferred.spec))
        submission = deferred.submit(
            execution, lambda spec, lease: self._submit(spec, params, lease, context, execution)
        )
        if submission.result is not None:
            return _task_result(submission.result)
        self.log.info(
            "%s: JobSet %s submitted; deferring (the triggerer follows it, no worker slot held)",
            step.key,
            submission.value["handle"]["name"],
        )
        lease = submission.lease.to_dict()
        self.defer(
            trigger=self._trigger(submission.value["handle"], params, lease),
            method_name="execute_complete",
            kwargs={
                "execution_id": execution,
                "lease": lease,
                "resumed_from": submission.value.get("resumed_from"),
            },
        )

    def _trigger(
        self, handle: Mapping[str, Any], params: Mapping[str, Any], lease: Mapping[str, Any] | None
    ) -> Any:
        from operators.pipeline.form import gke_cluster
        from operators.triggers.jobset import JobSetTrigger

        return JobSetTrigger(
            handle=handle,
            cluster=gke_cluster(params),
            lease=lease,
            poll_seconds=self.gke_poll_seconds,
            log_seconds=self.gke_log_seconds,
        )

    def _submit(
        self,
        spec: StepSpec,
        params: Mapping[str, Any],
        lease: Any,
        context: Any,
        execution: int,
    ) -> dict[str, Any]:
        """Under the step's lease: config, manifest, create the JobSet, keep its handle."""
        from operators.hooks.jobset import JobSetHook
        from operators.pipeline.form import gke_cluster
        from operators.triggers.lease import handle_file

        out = spec.output_path
        if "://" not in out:
            self.log.warning(
                "storage root %s is local: pods on GKE cannot read or write it, so the "
                "trainer's result will not appear here; set SLIPWAY_HOME to a gs:// root",
                out,
            )
        if int(spec.unversioned.get("fail_at_step") or 0):
            self.log.warning("fail_at_step is a local-backend fault injection: ignored on gke")
        config_uri = join(out, TRAINER_CONFIG)
        launch = trainer_launch(
            jobset_name("train", spec),
            params,
            config_uri=config_uri,
            **gke_launch_options(spec, params),
        )
        cluster = gke_cluster(params)
        # Before anything is written or created: a zone without this TPU generation fails
        # the step in seconds instead of leaving pods pending on a node pool that cannot exist.
        self._tpu_preflight(launch.shape, cluster)
        write_json(config_uri, trainer_config(spec))
        manifest = launch.render()
        write_json(join(out, JOBSET_MANIFEST), manifest)
        start = last_checkpoint(out)
        if start:
            self.log.info("resuming from checkpoint %s", start[1])
        hook = JobSetHook("gke", cluster=cluster, log_sink=self.log.info)
        handle = hook.submit(manifest)
        self._gke = (hook, handle)
        try:
            # Read back after a trigger timeout (__fail__ carries no kwargs) and by followers.
            write_json(
                handle_file(out),
                {
                    "handle": handle.to_dict(),
                    "cluster": cluster,
                    "lease": lease.to_dict(),
                    "execution_id": execution,
                    "run_id": context.get("run_id"),
                    "try_number": getattr(context.get("ti"), "try_number", None),
                },
            )
        except BaseException:
            hook.cancel(handle)  # nobody could find it again: no orphan
            raise
        finally:
            hook.close()  # the task defers next; a kill before that opens a new client
        return {"handle": handle.to_dict(), "resumed_from": start[0] if start else None}

    def _tpu_preflight(self, shape: SliceShape, cluster: Mapping[str, Any]) -> PreflightResult:
        """Ask the Cloud TPU API whether the cluster's zone offers ``shape``
        (:func:`~operators.jobset.preflight.check_accelerator_offered`): only a definite "not
        offered" raises; an API that cannot be asked is a warning in the task log.

        The zone is ``gke.tpu_zone`` (``$SLIPWAY_TPU_ZONE``: the TPU node pools' zone), else
        the GKE cluster settings' ``location``; the project theirs or the GCP connection's, the
        credentials the connection's (``GoogleBaseHook``, looked up only when the API is
        asked). With no zone (kubeconfig or in-cluster settings without ``tpu_zone``) it is
        skipped, with a line saying so; a regional location is skipped by the preflight.
        """
        from functools import cache

        from operators.jobset.gke import ClusterSettings
        from operators.jobset.preflight import PreflightResult, check_accelerator_offered

        settings = ClusterSettings.from_dict(cluster)
        zone = settings.tpu_zone or (settings.location if settings.source == "gke" else None)
        if shape.is_tpu and not zone:
            message = (
                f"cluster settings ({settings.source}) name no zone and gke.tpu_zone"
                " ($SLIPWAY_TPU_ZONE) is not set: preflight skipped"
            )
            self.log.info("TPU preflight: %s", message)
            return PreflightResult("skipped", shape.accelerator, "", message)

        @cache
        def hook() -> Any:
            from airflow.providers.google.common.hooks.base_google import GoogleBaseHook

            from operators.dataflow import GCP_CONN_ID

            return GoogleBaseHook(gcp_conn_id=settings.gcp_conn_id or GCP_CONN_ID)

        # Its own logger reports the outcome (a warning unless verified) into the task log.
        return check_accelerator_offered(
            shape,
            project=settings.project_id or (lambda: hook().project_id),
            zone=zone or "",
            client=self.tpu_client,
            credentials=lambda: hook().get_credentials(),
        )

    def _follow_target(self, root: str, step: Step) -> dict[str, Any] | None:
        """Another run holds the step's live lease and its JobSet is known: follow that one
        (deferred) instead of waiting on a worker for the weeks it may train. The owner
        writes its handle right after submitting: give it that long before falling back to
        the step runner's wait."""
        from operators.steps import Action, decide, probe
        from operators.triggers.lease import DEFERRED_LEASE_SECONDS, handle_file

        deadline = time.monotonic() + DEFERRED_LEASE_SECONDS
        while True:
            state = probe(root, step)
            action, reason = decide(state, time.time())
            if action is not Action.WAIT or state.lease is None:
                return None
            saved = _read_json(handle_file(state.path)) or {}
            lease = saved.get("lease") or {}
            if (lease.get("owner"), lease.get("generation")) == (
                state.lease.owner,
                state.lease.generation,
            ):
                self.log.info("%s: %s; following its JobSet", step.key, reason)
                return saved
            if time.monotonic() >= deadline:
                return None  # e.g. a local-backend run holds it: wait as the step model does
            time.sleep(min(5.0, self.gke_poll_seconds))

    def _defer_follow(self, target: Mapping[str, Any], execution: int, name: str) -> None:
        from operators.policy import checked_cluster, checked_handle
        from operators.triggers.jobset import JobSetTrigger

        # read back from the owner's handle file: checked as the run's own settings
        cluster = checked_cluster(target.get("cluster"))
        self.defer(
            trigger=JobSetTrigger(
                handle=dict(checked_handle(target.get("handle") or {}, cluster, name)),
                cluster=cluster,
                lease=None,  # not ours to renew
                poll_seconds=self.gke_poll_seconds,
                log_seconds=self.gke_log_seconds,
                owns_jobset=False,  # nor ours to delete when this task is killed
            ),
            method_name="execute_complete",
            kwargs={"execution_id": execution, "follow": target["lease"]["owner"]},
        )

    def execute_complete(
        self,
        context: Any,
        event: Mapping[str, Any],
        execution_id: int,
        lease: Mapping[str, Any] | None = None,
        resumed_from: int | None = None,
        follow: str | None = None,
    ) -> dict[str, Any]:
        """The trigger fired: record the step's end (SUCCESS/FAILED) and its lineage."""
        params = self.run_params(context)
        step = self.train_step(context)
        if follow is not None:
            return self._complete_follow(context, params, step, event, execution_id, follow)
        deferred = self._deferred(step)
        result = deferred.finish(
            execution_id,
            lease or {},
            lambda: self._finished_jobset(deferred.spec, event, lease or {}, resumed_from),
        )
        return _task_result(result)

    def _finished_jobset(
        self,
        spec: StepSpec,
        event: Mapping[str, Any],
        lease: Mapping[str, Any],
        resumed_from: int | None,
    ) -> dict[str, Any]:
        """The training's value from the trigger's event; raises when it did not succeed."""
        from operators.jobset.gke import status_from_dict
        from operators.steps import LeaseLost
        from operators.triggers.jobset import ERROR, LEASE_LOST, TERMINAL

        kind, message = event.get("event"), event.get("message", "")
        if kind == LEASE_LOST:
            raise LeaseLost(message)  # the new owner follows the JobSet: leave it running
        if kind != TERMINAL:
            if kind == ERROR:
                self._cancel_quietly(event["handle"], lease.get("output") or spec.output_path)
            raise TrainingFailed(f"JobSet {event['handle']['name']} {kind}: {message}")
        status = status_from_dict(event["status"])
        self.log.info(
            "JobSet %s %s (%s) after %d restart(s)",
            status.handle.name,
            status.terminal_state,
            status.reason,
            status.restarts,
        )
        return _training_result(spec.output_path, status, resumed_from)

    def _complete_follow(
        self,
        context: Any,
        params: Mapping[str, Any],
        step: Step,
        event: Mapping[str, Any],
        execution: int,
        owner: str,
    ) -> dict[str, Any]:
        """The JobSet we followed ended: its owner records the step; take what it recorded."""
        from operators.steps import Status, StepFailedElsewhere, probe
        from operators.triggers.jobset import TERMINAL

        state = probe(self.steps_root(), step)
        marker = state.status.status if state.status is not None else None
        by_owner = marker is Status.FAILED and state.status.owner == owner
        killed = by_owner and bool(state.status.terminated)
        exc: BaseException | None = None
        if by_owner and not killed:
            exc = StepFailedElsewhere(f"{step.key}: run by {owner} failed: {state.status.error}")
        elif not killed and marker is not Status.SUCCESS and event.get("event") != TERMINAL:
            # Lost sight of it (403, deleted from outside): do not wait on a worker.
            exc = TrainingFailed(
                f"following {owner}'s JobSet {event['handle']['name']}: {event.get('event')} "
                f"{event.get('message', '')}".strip()
            )
        if exc is not None:
            self._deferred(step).fail(execution, exc, None)  # the lease is the owner's
            raise exc
        # SUCCESS (a cache hit), or the owner is about to record it (its lease is still live:
        # the step runner waits for it), or it died (stale lease: taken over and resubmitted,
        # which adopts the JobSet if it is still ours to follow), or its task was killed (a
        # FAILED marker that says so: submitted here, resuming from its last checkpoint).
        return self._execute_gke(context, params, step, execution, allow_follow=False)

    def resume_execution(
        self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any
    ) -> Any:
        """``__fail__`` (trigger timeout / execution_timeout, or a trigger that crashed):
        delete the JobSet and fail the step before Airflow fails the task."""
        from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR

        if next_method == TRIGGER_FAIL_REPR:
            try:
                self._abandon_deferred(context, (next_kwargs or {}).get("error") or "unknown")
            except Exception:  # Airflow's own failure must still happen
                self.log.exception("could not clean up the deferred JobSet")
        return super().resume_execution(next_method, next_kwargs, context)

    def _abandon_deferred(self, context: Any, error: Any) -> None:
        from operators.hooks.jobset import JobSetHook
        from operators.jobset import JobSetHandle
        from operators.policy import checked_cluster, checked_handle
        from operators.triggers.lease import handle_file

        deferred = self._deferred(self.train_step(context))
        saved = _read_json(handle_file(deferred.spec.output_path))
        try_number = getattr(context.get("ti"), "try_number", None)
        if (
            not saved
            or saved.get("run_id") != context.get("run_id")
            or (try_number is not None and saved.get("try_number") not in (None, try_number))
        ):
            # Not this task's JobSet (a follower timed out, or a newer attempt owns it).
            self.log.warning("deferral ended (%s); no JobSet of this task to delete", error)
            return
        ended = f"deferral ended: {getattr(error, 'value', error)}"
        name = jobset_name("train", deferred.spec)
        reason = f"{ended}; deleting JobSet {name} did not finish"
        hook = None
        try:
            cluster = checked_cluster(saved.get("cluster"))
            handle = JobSetHandle.from_dict(
                checked_handle(saved.get("handle") or {}, cluster, name)
            )
            hook = JobSetHook("gke", cluster=cluster, log_sink=self.log.info)
            status = hook.cancel(handle)
            reason = f"{ended}; JobSet {name}: {status.message}"
            self.log.warning("%s", reason)
        except Exception as exc:
            reason = f"{ended}; deleting JobSet {name} failed ({exc})"
            raise
        finally:
            # The step and its lineage end whatever the delete did (a rerun adopts the JobSet),
            # before anything else here can fail.
            try:
                deferred.fail(saved.get("execution_id"), TrainingFailed(reason), saved["lease"])
            finally:
                if hook is not None:
                    hook.close()

    def _cancel_quietly(self, handle: Mapping[str, Any], output: str) -> None:
        from operators.hooks.jobset import JobSetHook
        from operators.jobset import JobSetHandle
        from operators.policy import checked_cluster
        from operators.triggers.lease import handle_file

        saved = _read_json(handle_file(output)) or {}
        try:
            cluster = checked_cluster(saved.get("cluster"))
            hook = JobSetHook("gke", cluster=cluster, log_sink=self.log.info)
            try:
                hook.cancel(JobSetHandle.from_dict(handle))
            finally:
                hook.close()
        except Exception:
            self.log.exception("could not delete JobSet %s", handle.get("name"))

    def _train(self, spec: StepSpec, params: Mapping[str, Any]) -> dict[str, Any]:
        out = spec.output_path
        config_uri = join(out, TRAINER_CONFIG)
        write_json(config_uri, trainer_config(spec))
        launch = trainer_launch(jobset_name("train", spec), params, config_uri=config_uri)
        manifest = launch.render()
        write_json(join(out, JOBSET_MANIFEST), manifest)
        fail_at = int(spec.unversioned.get("fail_at_step") or 0)
        start = last_checkpoint(out)
        watch = fault_watch(out, fail_at, start[0] if start else None)
        if fail_at and watch is None:
            self.log.info(
                "fail_at_step=%d: resuming from step %d, not injecting", fail_at, start[0]
            )
        if start:
            self.log.info("resuming from checkpoint %s", start[1])
        self._jobset = JobSetRunner(self, spec.unversioned.get("backend", "local"))
        status = self._jobset.run(
            manifest,
            watch,
            progress=lambda: self._log_progress(out, int(spec.config["steps"])),
            poll_seconds=FAULT_POLL_SECONDS if watch else POLL_SECONDS,
        )
        return _training_result(out, status, start[0] if start else None)

    def _log_progress(self, out: str, steps: int) -> None:
        metrics = read_metrics(out)
        if metrics:
            m = metrics[-1]
            self.log.info(
                "training: step %d/%d loss %.4f lr %.2e %.0f tokens/s",
                m["step"],
                steps,
                m["loss"],
                m.get("lr", 0.0),
                m.get("tokens_per_s", 0.0),
            )

    @staticmethod
    def _outputs(spec: StepSpec, result: StepResult) -> list[ArtifactRef]:
        from operators.lineage import ArtifactType

        r = dict(result.result or {})
        refs = []
        if r.get("checkpoint"):
            refs.append(
                ArtifactRef(
                    r["checkpoint"],
                    ArtifactType.CHECKPOINT,
                    role="final",
                    fields={
                        "counts": {
                            k: r.get(k) for k in ("steps", "params", "loss_start", "loss_end")
                        },
                        "config": trainer_config(spec),
                    },
                )
            )
        refs.append(ArtifactRef(join(spec.output_path, rundir.METRICS), ArtifactType.METRICS))
        return refs

    @staticmethod
    def _complete_properties(result: StepResult) -> dict[str, Any]:
        # Where this attempt started (a resumed run says from which checkpoint step) and how
        # often the JobSet restarted its pods: what `slipway lineage show` reports.
        r = dict(result.result or {})
        return {"resumed_from_step": r.get("resumed_from"), "restarts": r.get("restarts", 0)}

    @staticmethod
    def _failure_properties(spec: StepSpec) -> dict[str, Any]:
        ckpt = last_checkpoint(spec.output_path)
        metrics = read_metrics(spec.output_path)  # one read: on GCS, a download
        return {
            "last_checkpoint": ckpt[1] if ckpt else None,
            "last_checkpoint_step": ckpt[0] if ckpt else None,
            "last_logged_step": _last_step(metrics),
            **last_loss_properties(metrics),
            "trainer_result": _read_json(join(spec.output_path, rundir.RESULT)),
            "resumable": ckpt is not None,
        }

    def on_lease_lost(self) -> None:
        # A local run's pods only: a gke run is deferred, its lease renewed by the trigger.
        if self._jobset is not None:
            self._jobset.cancel_if_local()

    def on_kill(self) -> None:
        # Killed while running on a worker (local run, or a gke task submitting / completing);
        # a task killed while *deferred* is the trigger's on_kill.
        if self._jobset is not None:
            self._jobset.cancel()
        if self._gke is not None:
            hook, handle = self._gke
            try:
                hook.cancel(handle)
            finally:
                hook.close()
