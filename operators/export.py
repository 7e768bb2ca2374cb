"""The ``export`` task: ``python -m trainer.export`` on the final checkpoint, as a JobSet on one
slice of the training topology.

A content-addressed step (its version: the trained run and the tokenizer), so a rerun with the
same model is a cache hit. The folder it writes, ``{step output}/hf``, is what transformers
loads as ``LlamaForCausalLM`` with its tokenizer (docs/export.md); lineage records it as an
``hf_export`` artifact of the checkpoint, and the gate names it in the promotion. An MoE run
has no transformers architecture that routes as ours does: its step succeeds without a
folder and says why, so a pipeline of MoE models still evaluates, gates and records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.launching import (
    TRAINER_CONFIG,
    JobSetRunner,
    TrainingFailed,
    one_slice_runner,
    run_on_one_slice,
)
from operators.step_lineage import (
    ArtifactRef,
    StepLineageMixin,
    resolve_uri,
    tokenizer_input,
    trained_model_input,
)
from operators.steps import Step, StepResult, StepSpec, join, output_path
from trainer.export_files import PROVENANCE
from trainer.rundir import last_checkpoint
from trainer.rundir import read_json as _read_json

HF_DIR = "hf"  # the export folder under the step's output
MOE_NOT_EXPORTED = (
    "not exported: an MoE model (top-k routing with a quantile-balancing selection bias and "
    "an always-on shared expert) has no transformers architecture that routes the same way"
)


class ExportOperator(StepLineageMixin, BaseOperator):
    """The ``export`` step: the trained run's final checkpoint as a Hugging Face folder."""

    ui_color = "#e8d4f5"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "export")
        super().__init__(**kwargs)
        self._jobset: JobSetRunner | None = None

    def export_step(self, context: Mapping[str, Any]) -> Step:
        return self.step_graph(context).export

    def planned_io(self, context: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        root = self.steps_root()
        step = self.export_step(context)
        inputs = [
            resolve_uri(step.config["train"], root),
            resolve_uri(step.config["tokenizer"], root),
        ]
        return inputs, [join(output_path(root, step), HF_DIR)]

    def execute(self, context: Any) -> dict[str, Any]:
        params = self.run_params(context)
        step = self.export_step(context)
        result = self.run_step(
            context,
            step,
            lambda spec: self._export(spec, params),
            inputs=[
                trained_model_input(step.config["train"], self.steps_root()),
                tokenizer_input(step.config["tokenizer"]),
            ],
            outputs=self._outputs,
        )
        return {
            "outcome": str(result.outcome),
            "output": result.spec.output_path,
            **(result.result or {}),
        }

    def _export(self, spec: StepSpec, params: Mapping[str, Any]) -> dict[str, Any]:
        train_out = spec.config["train"]
        ckpt = last_checkpoint(train_out)
        if ckpt is None:
            raise TrainingFailed(f"{train_out} has no committed checkpoint to export")
        config = _read_json(join(train_out, TRAINER_CONFIG)) or {}
        if (config.get("model") or {}).get("moe"):
            self.log.info("%s", MOE_NOT_EXPORTED)
            return {"checkpoint": ckpt[1], "step": ckpt[0], "hf_dir": None, "why": MOE_NOT_EXPORTED}
        hf_dir = join(spec.output_path, HF_DIR)
        args = ["--config", join(train_out, TRAINER_CONFIG), "--step", str(ckpt[0])]
        args += ["--tokenizer", spec.config["tokenizer"], "--out", hf_dir]
        args += ["--dtype", spec.config["dtype"]]
        self._jobset = one_slice_runner(self, spec, params)
        status = run_on_one_slice(
            self._jobset, spec, params, kind="export", module="trainer.export", args=args
        )
        provenance = _read_json(join(hf_dir, PROVENANCE))
        if not status.succeeded or provenance is None:
            raise TrainingFailed(
                f"export JobSet {status.terminal_state} ({status.reason}); "
                f"exit codes {status.exit_codes}"
            )
        return {
            "checkpoint": ckpt[1],
            "step": ckpt[0],
            "hf_dir": hf_dir,
            "dtype": provenance.get("dtype"),
        }

    @staticmethod
    def _outputs(spec: StepSpec, result: StepResult) -> list[ArtifactRef]:
        from operators.lineage import ArtifactType

        r = dict(result.result or {})
        if not r.get("hf_dir"):
            return []
        return [
            ArtifactRef(
                r["hf_dir"],
                ArtifactType.HF_EXPORT,
                role="hf_export",
                fields={
                    "properties": {
                        "checkpoint": r.get("checkpoint"),
                        "step": r.get("step"),
                        "dtype": r.get("dtype"),
                    }
                },
            )
        ]

    def on_kill(self) -> None:
        if self._jobset is not None:
            self._jobset.cancel()

    def on_lease_lost(self) -> None:
        if self._jobset is not None:
            self._jobset.cancel_if_local()
