"""Training and evaluation: the trainer's entrypoints launched as a JobSet.

:class:`TrainingOperator` writes the trainer config (``trainer/config.py`` format) into the
``train`` step's output directory, renders the JobSet manifest (:mod:`operators.jobset`) and
runs it through :class:`~operators.hooks.jobset.JobSetHook` (``local`` now, ``gke`` later),
with every pod's output in the task log. Killing the task (``on_kill``) cancels the pods:
SIGTERM, the trainer checkpoints, SIGKILL after the grace period.

The step's output directory is the trainer's ``output_dir``, so a rerun of a FAILED step
(Airflow retry, cleared task, backfill) resumes from its last checkpoint.

**Fault injection** (the trainer has no switch of its own): with ``fail_at_step = N`` the
operator watches ``metrics.jsonl`` and, once the trainer has logged step N, cancels the JobSet
exactly as a preemption would (SIGTERM: the trainer saves a checkpoint at the step it reached
and exits 42), then fails the task. It only fires when the run *starts* below step N, so the
retry resumes from that checkpoint and completes: the recovery path is exercised end to end.

:class:`EvaluationOperator` runs ``python -m trainer.evaluate`` on the final checkpoint through
the same JobSet path, over the held-out store of each source and LAMBADA prose.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.step_lineage import ArtifactRef, StepLineageMixin, resolve_uri
from operators.steps import StepResult, StepSpec, join, output_path

TRAINER_CONFIG = "trainer_config.json"
JOBSET_MANIFEST = "jobset.json"
POLL_SECONDS = 1.0
FAULT_POLL_SECONDS = 0.05  # small models run hundreds of steps a second once compiled
PROGRESS_SECONDS = 10.0  # the trainer prints no per-step lines: log metrics.jsonl this often
_STEP_DIR = re.compile(r"^step-(\d{9})$")


class TrainingFailed(RuntimeError):
    pass


class FaultInjected(TrainingFailed):
    pass


# -- trainer output files (read as plain files: operators never import the trainer) ----------


def _read_json(path: str) -> dict[str, Any] | None:
    import fsspec

    try:
        with fsspec.open(path, "r") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def read_metrics(out: str) -> list[dict[str, Any]]:
    """``metrics.jsonl``, the last line per step winning (a resume logs steps again)."""
    import fsspec

    try:
        with fsspec.open(join(out, "metrics.jsonl"), "r") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def last_logged_step(out: str) -> int:
    metrics = read_metrics(out)
    return int(metrics[-1]["step"]) if metrics else 0


def last_checkpoint(out: str) -> tuple[int, str] | None:
    """(step, path) of the newest *committed* checkpoint (``commit.json`` written last)."""
    import fsspec

    root = join(out, "checkpoints")
    fs, base = fsspec.core.url_to_fs(root)
    if not fs.exists(base):
        return None
    best = None
    for entry in fs.ls(base, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        m = _STEP_DIR.match(name)
        if m and fs.exists(f"{entry.rstrip('/')}/commit.json"):
            step = int(m.group(1))
            if best is None or step > best[0]:
                best = (step, join(root, name))
    return best


def trainer_config(spec: StepSpec) -> dict[str, Any]:
    """The ``train`` step's config as a trainer config file (``trainer/config.py``)."""
    c = spec.config
    steps = int(c["steps"])
    return {
        "output_dir": spec.output_path,
        "steps": steps,
        "batch_size": c["batch_size"],
        "seq_len": c["seq_len"],
        "seed": c["seed"],
        "log_every": 1,
        "model": dict(c["model"]),
        "data": {
            "sources": [
                {"path": s["path"], "weight": s["weight"], "name": s["name"]} for s in c["sources"]
            ]
        },
        "optimizer": dict(c["optimizer"]),
        # A few rolling checkpoints per run: a preempted or failed run loses little.
        "checkpoint": {"save_every": max(1, steps // 4), "keep": 1},
    }


def _jobset_name(kind: str, spec: StepSpec) -> str:
    return f"slipway-{kind}-{spec.version[:8]}"


class _JobSetRunner:
    """Submit a manifest, stream its logs, watch it, cancel it on kill."""

    def __init__(self, operator: BaseOperator, backend: str) -> None:
        from operators.hooks.jobset import JobSetHook

        self.operator = operator
        self.backend = JobSetHook(backend, log_sink=operator.log.info).get_backend()
        self.handle: Any = None

    def run(
        self,
        manifest: Mapping[str, Any],
        watch: Any = None,
        progress: Any = None,
        poll_seconds: float = POLL_SECONDS,
    ) -> Any:
        self.handle = self.backend.submit(manifest)
        self.operator.log.info("JobSet %s submitted (%s)", self.handle.name, self.handle.uid)
        last_progress = time.monotonic()
        try:
            while True:
                status = self.backend.poll(self.handle)
                if status.done:
                    if progress is not None:
                        progress()
                    return status
                if watch is not None and (reason := watch()):
                    self.operator.log.warning("%s: cancelling the JobSet", reason)
                    self.backend.cancel(self.handle)
                    raise FaultInjected(reason)
                if progress is not None and time.monotonic() - last_progress >= PROGRESS_SECONDS:
                    progress()
                    last_progress = time.monotonic()
                time.sleep(poll_seconds)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        if self.handle is not None:
            status = self.backend.cancel(self.handle)
            self.operator.log.info("JobSet %s cancelled: %s", self.handle.name, status.reason)


def _launch(spec_name: str, params: Mapping[str, Any], **kwargs: Any) -> Any:
    from operators.jobset import TrainingLaunch

    return TrainingLaunch(
        name=spec_name,
        image=params["image"],
        accelerator=params["accelerator"],
        topology=params["topology"],
        slices=int(params["slices"]),
        labels={"app.kubernetes.io/part-of": "slipway"},
        **kwargs,
    )


def _write_json(path: str, body: Any) -> None:
    import fsspec

    with fsspec.open(path, "w") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")


class TrainingOperator(StepLineageMixin, BaseOperator):
    """The ``train`` step: trainer config -> JobSet -> checkpoints, metrics, result."""

    ui_color = "#f5d0a9"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "train")
        super().__init__(**kwargs)
        self._jobset: _JobSetRunner | None = None

    def planned_io(self, params: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        from operators.graph import build_graph

        root = self.steps_root()
        graph = build_graph(params)
        inputs = [output_path(root, s) for s in graph.train_stores.values()]
        return inputs, [output_path(root, graph.train)]

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.graph import TOKEN_STORE, build_graph

        params = self.run_params(context)
        graph = build_graph(params)
        step = graph.train
        result = self.run_step(
            context,
            step,
            lambda spec: self._train(spec, params),
            inputs=[
                ArtifactRef(s["path"], TOKEN_STORE, role=f"train_data:{s['name']}")
                for s in step.config["sources"]
            ],
            outputs=self._outputs,
            failure_properties=self._failure_properties,
            complete_properties=self._complete_properties,
        )
        return {
            "outcome": str(result.outcome),
            "output": result.spec.output_path,
            **(result.result or {}),
        }

    def _train(self, spec: StepSpec, params: Mapping[str, Any]) -> dict[str, Any]:
        out = spec.output_path
        config_uri = join(out, TRAINER_CONFIG)
        _write_json(config_uri, trainer_config(spec))
        launch = _launch(_jobset_name("train", spec), params, config_uri=config_uri)
        manifest = launch.render()
        _write_json(join(out, JOBSET_MANIFEST), manifest)
        fail_at = int(spec.unversioned.get("fail_at_step") or 0)
        start = last_checkpoint(out)
        watch = None
        if fail_at and (start is None or start[0] < fail_at):

            def watch() -> str | None:
                step = last_logged_step(out)
                if step >= fail_at:
                    return f"fault injection: fail_at_step={fail_at} reached (trainer at {step})"
                return None
        elif fail_at:
            self.log.info(
                "fail_at_step=%d: resuming from step %d, not injecting", fail_at, start[0]
            )
        if start:
            self.log.info("resuming from checkpoint %s", start[1])
        self._jobset = _JobSetRunner(self, spec.unversioned.get("backend", "local"))
        status = self._jobset.run(
            manifest,
            watch,
            progress=lambda: self._log_progress(out, int(spec.config["steps"])),
            poll_seconds=FAULT_POLL_SECONDS if watch else POLL_SECONDS,
        )
        result = _read_json(join(out, "result.json")) or {}
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
            "resumed_from": start[0] if start else None,
            "restarts": status.restarts,
        }

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
        refs.append(ArtifactRef(join(spec.output_path, "metrics.jsonl"), ArtifactType.METRICS))
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
        return {
            "last_checkpoint": ckpt[1] if ckpt else None,
            "last_checkpoint_step": ckpt[0] if ckpt else None,
            "last_logged_step": last_logged_step(spec.output_path),
            "trainer_result": _read_json(join(spec.output_path, "result.json")),
            "resumable": ckpt is not None,
        }

    def on_kill(self) -> None:
        if self._jobset is not None:
            self._jobset.cancel()


class EvaluationOperator(StepLineageMixin, BaseOperator):
    """The ``evaluate`` step: ``trainer.evaluate`` on the final checkpoint, per held-out store."""

    ui_color = "#d0f5a9"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "evaluate")
        super().__init__(**kwargs)
        self._jobset: _JobSetRunner | None = None

    def planned_io(self, params: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        from operators.graph import build_graph

        root = self.steps_root()
        step = build_graph(params).evaluate
        inputs = [resolve_uri(step.config["train"], root)]
        inputs += [resolve_uri(v, root) for v in step.config["stores"].values()]
        return inputs, [output_path(root, step)]

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.graph import TOKEN_STORE, TOKENIZER, build_graph
        from operators.lineage import ArtifactType

        params = self.run_params(context)
        step = build_graph(params).evaluate
        inputs = [
            ArtifactRef(step.config["train"], ArtifactType.MODEL, role="trained_run"),
            ArtifactRef(step.config["tokenizer"], TOKENIZER, role="tokenizer"),
            *(
                ArtifactRef(v, TOKEN_STORE, role=f"eval_data:{k}")
                for k, v in step.config["stores"].items()
            ),
        ]
        result = self.run_step(
            context,
            step,
            lambda spec: self._evaluate(spec, params),
            inputs=inputs,
            outputs=self._outputs,
        )
        return {
            "outcome": str(result.outcome),
            "output": result.spec.output_path,
            **(result.result or {}),
        }

    def _evaluate(self, spec: StepSpec, params: Mapping[str, Any]) -> dict[str, Any]:
        c = spec.config
        out = spec.output_path
        stores = dict(c["stores"])
        train_out = c["train"]
        ckpt = last_checkpoint(train_out)
        if ckpt is None:
            raise TrainingFailed(f"{train_out} has no committed checkpoint to evaluate")
        eval_json = join(out, "eval.json")
        args = ["--config", join(train_out, TRAINER_CONFIG), "--step", str(ckpt[0])]
        args += ["--max-tokens", str(c["max_tokens"]), "--output", eval_json]
        args += ["--tokenizer", c["tokenizer"]]
        for path in stores.values():
            args += ["--store", path]
        launch = _launch(
            _jobset_name("eval", spec),
            params,
            command=("python", "-m", "trainer.evaluate"),
            args=tuple(args),
            max_restarts=0,
        )
        self._jobset = _JobSetRunner(self, spec.unversioned.get("backend", "local"))
        status = self._jobset.run(launch.render())
        body = _read_json(eval_json)
        if not status.succeeded or body is None:
            raise TrainingFailed(
                f"evaluation JobSet {status.terminal_state} ({status.reason}); "
                f"exit codes {status.exit_codes}"
            )
        by_path = {r["store"].rstrip("/"): r for r in body["results"]}
        results = {}
        for name, path in stores.items():
            r = by_path.get(path.rstrip("/")) or by_path.get(os.path.abspath(path))
            if r is None:
                raise TrainingFailed(f"evaluation has no result for {name} ({path})")
            results[name] = {k: r.get(k) for k in ("tokens", "loss", "perplexity", "bits_per_byte")}
            _write_json(join(out, "results", f"{name}.json"), {"store": path, **results[name]})
        return {"checkpoint": ckpt[1], "step": body["step"], "results": results}

    @staticmethod
    def _outputs(spec: StepSpec, result: StepResult) -> list[ArtifactRef]:
        from operators.lineage import ArtifactType

        r = dict(result.result or {})
        return [
            ArtifactRef(
                join(spec.output_path, "results", f"{name}.json"),
                ArtifactType.EVAL_RESULT,
                role=name,
                fields={"counts": metrics, "properties": {"checkpoint": r.get("checkpoint")}},
            )
            for name, metrics in (r.get("results") or {}).items()
        ]

    def on_kill(self) -> None:
        if self._jobset is not None:
            self._jobset.cancel()
