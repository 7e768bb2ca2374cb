"""The ``evaluate`` task: ``python -m trainer.evaluate`` on the final checkpoint, as a JobSet
on one slice of the training topology.

Through the same launch path as training (:mod:`operators.launching`), over the held-out store
of each source and the eval sets tokenized as prose (LAMBADA); one result file per store under
the step's output, recorded in lineage as eval results. With the form's ``eval_tasks``, the same
launch scores the benchmarks (``trainer/tasks.py``): ``results/benchmark-<task>.json`` each, the
per-example scores under ``benchmarks/``, and ``benchmarks`` in the task's result (the gate
reads it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.launching import (
    TRAINER_CONFIG,
    JobSetRunner,
    TrainingFailed,
    one_slice_runner,
    run_on_one_slice,
    write_json,
)
from operators.step_lineage import (
    ArtifactRef,
    StepLineageMixin,
    resolve_uri,
    tokenizer_input,
    trained_model_input,
)
from operators.steps import Step, StepResult, StepSpec, join, output_path, without_non_finite
from trainer.rundir import last_checkpoint
from trainer.rundir import read_json as _read_json

BENCHMARK_PREFIX = "benchmark-"  # results/benchmark-<task>.json, lineage role benchmark-<task>
SAMPLES = "samples"  # results/samples.json, lineage role samples: the fixed prompts' completions


class EvaluationOperator(StepLineageMixin, BaseOperator):
    """The ``evaluate`` step: ``trainer.evaluate`` on the final checkpoint, per held-out store."""

    ui_color = "#d0f5a9"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "evaluate")
        super().__init__(**kwargs)
        self._jobset: JobSetRunner | None = None

    def evaluate_step(self, context: Mapping[str, Any]) -> Step:
        """The step this task runs: the pipeline's ``evaluate`` (a sweep cell overrides it)."""
        return self.step_graph(context).evaluate

    def planned_io(self, context: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        root = self.steps_root()
        step = self.evaluate_step(context)
        inputs = [resolve_uri(step.config["train"], root)]
        inputs += [resolve_uri(v, root) for v in step.config["stores"].values()]
        return inputs, [output_path(root, step)]

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.pipeline.graph import TOKEN_STORE

        params = self.run_params(context)
        step = self.evaluate_step(context)
        inputs = [
            trained_model_input(step.config["train"], self.steps_root()),
            tokenizer_input(step.config["tokenizer"]),
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
        if c.get("samples"):
            args += ["--samples", str(c["samples"])]
        tasks = list(c.get("tasks") or [])
        if tasks:  # benchmarks: per-example scores kept beside the results
            args += ["--tasks", ",".join(tasks), "--task-data", spec.unversioned["task_data"]]
            args += ["--limit", str(c.get("task_limit") or 0)]
            args += ["--details", join(out, "benchmarks")]
        self._jobset = one_slice_runner(self, spec, params)
        status = run_on_one_slice(
            self._jobset, spec, params, kind="eval", module="trainer.evaluate", args=args
        )
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
            # A diverged model's NaN or infinite loss is kept as null (JSON has no NaN): the
            # gate refuses a model with a metric that is not finite.
            results[name] = without_non_finite(
                {k: r.get(k) for k in ("tokens", "loss", "perplexity", "bits_per_byte")}
            )
            write_json(join(out, "results", f"{name}.json"), {"store": path, **results[name]})
        benchmarks = without_non_finite(dict(body.get("benchmarks") or {}))
        missing = [t for t in tasks if t not in benchmarks]
        if missing:
            raise TrainingFailed(f"evaluation has no result for the task(s) {missing}")
        for task, metrics in benchmarks.items():
            write_json(join(out, "results", f"{BENCHMARK_PREFIX}{task}.json"), metrics)
        samples = body.get("samples")
        if samples is not None:
            write_json(join(out, "results", f"{SAMPLES}.json"), samples)
        return {
            "checkpoint": ckpt[1],
            "step": body["step"],
            "results": results,
            "benchmarks": benchmarks,
            "samples": samples,
        }

    @staticmethod
    def _outputs(spec: StepSpec, result: StepResult) -> list[ArtifactRef]:
        from operators.lineage import ArtifactType

        r = dict(result.result or {})
        checkpoint = {"checkpoint": r.get("checkpoint")}

        def result_file(name: str, **fields: Any) -> ArtifactRef:
            uri = join(spec.output_path, "results", f"{name}.json")
            return ArtifactRef(uri, ArtifactType.EVAL_RESULT, role=name, fields=fields)

        refs = [
            result_file(name, counts=metrics, properties=checkpoint)
            for name, metrics in (r.get("results") or {}).items()
        ]
        refs += [
            result_file(
                f"{BENCHMARK_PREFIX}{task}",
                counts={k: v for k, v in m.items() if isinstance(v, int | float)},
                properties=checkpoint,
            )
            for task, m in (r.get("benchmarks") or {}).items()
        ]
        if r.get("samples"):
            refs.append(result_file(SAMPLES, properties={**checkpoint, **r["samples"]}))
        return refs

    def on_kill(self) -> None:
        if self._jobset is not None:
            self._jobset.cancel()

    def on_lease_lost(self) -> None:
        if self._jobset is not None:
            self._jobset.cancel_if_local()
