"""What a run summary names as the failure when no step's execution says (operators/run_steps.py):
the task that failed, never one that was only upstream_failed, first in the DAG's order."""

from __future__ import annotations

from operators.run_steps import settle_failures

PIPELINE = ["validate", "fetch", "ingest", "quality", "exact_dedup", "decontaminate", "train"]
SWEEP = ["validate", "grid", "train_cell", "evaluate_cell", "fit", "check"]


def test_the_failed_task_is_named_not_the_first_downstream_of_it():
    # quality raised before it recorded anything; everything after it is upstream_failed, and
    # "decontaminate" sorts first by name.
    states = {
        "validate": "success",
        "quality": "failed",
        "decontaminate": "upstream_failed",
        "exact_dedup": "upstream_failed",
        "train": "upstream_failed",
    }
    assert settle_failures([], states, None, order=PIPELINE) == [
        {"step": "quality", "error": "task failed"}
    ]


def test_mapped_instances_in_index_order_and_the_writers_own_entry_kept_second():
    cells = {"evaluate_cell_10": "failed", "evaluate_cell_3": "failed", "fit": "success"}
    assert settle_failures([], cells, None, order=SWEEP)[0]["step"] == "evaluate_cell_3"
    # The sweep's check always says the night is incomplete: grid's failure is still named,
    # first, though its own entry is there.
    incomplete = {"step": "check", "error": "no forecast this night: fit failed"}
    states = {"grid": "failed", "train_cell": "upstream_failed", "check": "running"}
    assert settle_failures([incomplete], states, None, order=SWEEP, own={"check"}) == [
        {"step": "grid", "error": "task failed"},
        incomplete,
    ]


def test_a_failure_a_step_recorded_stands_and_the_graph_error_is_the_last_resort():
    recorded = [{"step": "train", "error": "TrainerFailed: preempted"}]
    assert settle_failures(recorded, {"quality": "failed"}, None, order=PIPELINE) == recorded
    assert settle_failures([], {}, "CorpusMissing: brown") == [
        {"step": "fetch", "error": "CorpusMissing: brown"}
    ]
