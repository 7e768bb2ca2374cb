"""Recorded pipeline runs for the report pages' tests and benchmark: a run's lineage written
through the real ``LineageStore`` API the operators use, in the shape a ``slipway_pipeline`` run
leaves (raw corpus -> ingest -> quality -> tokenize -> train -> evaluate -> export -> gate ->
record), with the trainer's ``metrics.jsonl`` on disk; or the same run failing at ``train``.

The numbers are made up and small; what the pages show is checked against what is recorded
here (the tests read it back from the store), never against constants in the test.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from operators.lineage import LineageStore
from operators.promotion import PROMOTED_MODEL, model_uri, promotion_version
from operators.training import last_loss_properties
from trainer.rundir import read_metrics

PIPELINE = "slipway_pipeline"
TRAIN_STEPS = 20
# The form's values as validate records them: a few at their defaults, three changed (one an
# object too long to show inline).
SETTINGS = {
    "params": {
        "model_preset": "nano",
        "steps": TRAIN_STEPS,
        "learning_rate": 0.01,
        "seed": 0,
        "stage_configs": {"quality": {"sources": {"brown": {"min_words": 3}}}, "tokenize": {}},
        "model_name": "demo",
    },
    "changed": ["learning_rate", "stage_configs", "steps"],
}


def _step(
    store: LineageStore, name: str, run_id: str, t: datetime, version: str, **properties: str
) -> int:
    """A step's execution started as the operators start it (``properties``: e.g. its output)."""
    return store.start_execution(
        name,
        run_id=run_id,
        pipeline=PIPELINE,
        step_version=version,
        started_at=t,
        properties=properties,
    )


def record_run(
    store: LineageStore,
    run_id: str,
    root: Path,
    *,
    fail_train: bool = False,
    started_at: datetime | None = None,
    run_type: str | None = None,
) -> None:
    t = started_at or datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
    tick = timedelta(seconds=7)
    corpus = "file:///data/brown/brown.tar.gz"
    store.record_artifact(corpus, "dataset", version="sha256:" + "ab" * 32, content_hash="ab" * 32)

    # validate records the run's settings on the run (operators/validate.py)
    ex = store.start_execution(
        "validate",
        run_id=run_id,
        pipeline=PIPELINE,
        started_at=t,
        run_properties={**SETTINGS, "run_type": run_type} if run_type else SETTINGS,
    )
    store.finish_execution(ex, ended_at=t)

    ex = _step(store, "ingest", run_id, t, "11111111")
    store.record_input(ex, corpus, "dataset", version="sha256:" + "ab" * 32)
    ingest = f"{root}/steps/ingest-11111111"
    counts = {"records_in": 120, "records_out": 116, "dropped": {"invalid_input": 4}}
    store.record_output(ex, ingest, "dataset", counts=counts)
    store.finish_execution(ex, ended_at=t + tick)

    ex = _step(store, "quality", run_id, t + tick, "22222222")
    store.record_input(ex, ingest, "dataset")
    quality = f"{root}/steps/quality-22222222"
    drops = {"gopher_short_document": 9, "c4_no_terminal_punct": 5, "gopher_symbol_ratio": 2}
    counts = {"records_in": 116, "records_out": 100, "dropped": drops}
    store.record_output(ex, quality, "dataset", counts=counts)
    store.finish_execution(ex, "CACHED", ended_at=t + 2 * tick)

    ex = _step(store, "tokenize", run_id, t + 2 * tick, "33333333")
    store.record_input(ex, quality, "dataset")
    tokens = f"{root}/steps/tokenize-33333333"
    counts = {"records_in": 100, "records_out": 100, "dropped": {}, "num_tokens": 51200}
    store.record_output(ex, tokens, "token_store", counts=counts)
    store.finish_execution(ex, ended_at=t + 3 * tick)

    train_dir = root / "steps" / "train-44444444"
    train_dir.mkdir(parents=True, exist_ok=True)
    with open(train_dir / "metrics.jsonl", "w") as f:
        for step in range(1, TRAIN_STEPS + 1):
            f.write(json.dumps({"step": step, "loss": 9.0 - 0.15 * step}) + "\n")
    ex = _step(store, "train", run_id, t + 3 * tick, "44444444", output=str(train_dir))
    store.record_input(ex, tokens, "token_store")
    if fail_train:
        store.finish_execution(
            ex,
            "FAILED",
            error="TrainerFailed: the trainer exited 3 (preempted) at step 12",
            traceback='Traceback (most recent call last):\n  File "trainer/train.py"\n'
            "TrainerFailed: the trainer exited 3 (preempted) at step 12",
            properties={
                "last_checkpoint_step": 10,
                "resumable": True,
                **last_loss_properties(read_metrics(str(train_dir))),
            },
            ended_at=t + 4 * tick,
        )
        _record_summary(store, run_id, t + 5 * tick, failed=True)
        return
    checkpoint = f"{train_dir}/checkpoints/step-{TRAIN_STEPS:09d}"
    counts = {"steps": TRAIN_STEPS, "params": 123456, "loss_start": 8.85, "loss_end": 6.0}
    store.record_output(ex, checkpoint, "checkpoint", role="final", counts=counts)
    store.record_output(ex, f"{train_dir}/metrics.jsonl", "metrics")
    store.finish_execution(ex, ended_at=t + 6 * tick)

    ex = _step(store, "evaluate", run_id, t + 6 * tick, "55555555")
    store.record_input(ex, checkpoint, "checkpoint")
    evals = f"{root}/steps/evaluate-55555555"
    store.record_output(
        ex,
        f"{evals}/heldout-brown.json",
        "eval_result",
        role="heldout-brown",
        counts={"loss": 6.1, "perplexity": 445.9, "bits_per_byte": 2.31, "tokens": 4096},
    )
    store.record_output(
        ex,
        f"{evals}/benchmark-piqa.json",
        "eval_result",
        role="benchmark-piqa",
        counts={
            "n": 10,
            "acc": 0.5,
            "acc_stderr": 0.16,
            "acc_norm": 0.6,
            "chance": 0.5,
            "truncated": 3,
        },
    )
    samples = {"decoding": "greedy", "completions": [{"prompt": "The <b>", "completion": " end"}]}
    store.record_output(
        ex, f"{evals}/samples.json", "eval_result", role="samples", properties=samples
    )
    store.finish_execution(ex, ended_at=t + 7 * tick)

    ex = _step(store, "export", run_id, t + 6 * tick, "66666666")
    store.record_input(ex, checkpoint, "checkpoint", role="trained_run")
    store.record_output(
        ex,
        f"{root}/steps/export-66666666/output/hf",
        "hf_export",
        role="hf_export",
        properties={"checkpoint": checkpoint, "step": TRAIN_STEPS, "dtype": "bfloat16"},
    )
    store.finish_execution(ex, ended_at=t + 7 * tick)

    ex = _step(store, "gate", run_id, t + 7 * tick, None)
    # the promoted model, as operators/promotion.py records it: a version of the model's URI
    # of its own per gate execution, with the run that made it
    promoted = {"uri": model_uri("demo"), "version": promotion_version(ex)}
    store.record_output(
        ex,
        promoted["uri"],
        PROMOTED_MODEL,
        role="promoted",
        version=promoted["version"],
        properties={"name": "demo", "run_id": run_id, "pipeline": PIPELINE},
    )
    store.finish_execution(
        ex,
        properties={"model_name": "demo", "promoted": promoted, "gate": {"summary": "no criteria"}},
        ended_at=t + 8 * tick,
    )
    _record_summary(store, run_id, t + 8 * tick, failed=False)


def _record_summary(store: LineageStore, run_id: str, t: datetime, *, failed: bool) -> None:
    """The ``record`` task's run summary, as ``operators/record.py`` writes it."""
    keys = ["ingest-11111111", "quality-22222222", "tokenize-33333333"]
    summary = {
        "run_id": run_id,
        "state": "FAILED" if failed else "SUCCESS",
        "failed": [{"step": "train", "error": "TrainerFailed: preempted at step 12"}]
        if failed
        else [],
        "resume": {
            "skipped_on_rerun": keys if failed else [*keys, "train-44444444"],
            "rerun": ["train-44444444", "evaluate-55555555"] if failed else [],
            "training_resumes_from": {"step": 10, "checkpoint": "step-000000010"}
            if failed
            else None,
        },
        # Airflow's task states, as record reads them (a task with no steps: gate)
        "task_states": {"train": "failed", "evaluate": "upstream_failed", "gate": "upstream_failed"}
        if failed
        else {"train": "success", "evaluate": "success", "gate": "success"},
    }
    ex = store.start_execution("record", run_id=run_id, pipeline=PIPELINE, started_at=t)
    store.record_output(ex, f"/runs/{run_id}/summary.json", "run_summary", properties=summary)
    store.finish_execution(ex, ended_at=t + timedelta(seconds=1))
