"""The promotion gate: each criterion passed or failed by how much, a missing result never
passing, the promoted model read back from a real lineage store (SQLite), and the ``gate``
task's records: lineage, the Asset event through its alias, the run summary when it fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from operators.promotion import (
    MODELS_ALIAS,
    Criteria,
    Metrics,
    current_promotion,
    decide,
    gate_line,
    gate_outcome,
    latest_version,
    model_uri,
    promotions,
    record_promotion,
)
from tests.support.tiny_pipeline import tiny_params


def evaluation(
    brown: float | None = 2.0,
    fortunes: float | None = 2.4,
    benchmarks: dict[str, float] | None = None,
) -> dict:
    """An evaluate task's result as it reaches the gate (XCom): stores and benchmarks."""

    def store(bpb: float | None) -> dict:
        return {"tokens": 512, "loss": 3.0, "perplexity": 20.0, "bits_per_byte": bpb}

    body = {
        "outcome": "RAN",
        "output": "/steps/evaluate-0000",
        "checkpoint": "/steps/train-0000/checkpoints/6",
        "step": 6,
        # LAMBADA is prose but no held-out store: not in the held-out mean.
        "results": {
            "heldout-brown": store(brown),
            "heldout-fortunes": store(fortunes),
            "eval-lambada": store(9.0),
        },
    }
    if benchmarks is not None:
        body["benchmarks"] = {
            task: {
                "task": task,
                "n": 200,
                "shots": 0,
                "acc": acc,
                "acc_stderr": 0.03,
                "acc_norm": None,
                "acc_norm_stderr": None,
                "chance": 0.5,
                "perplexity": None,
            }
            for task, acc in benchmarks.items()
        }
    return body


def metrics(**kwargs) -> Metrics:
    return Metrics.from_evaluation(evaluation(**kwargs))


@pytest.fixture
def store(tmp_path):
    from operators.lineage import LineageStore

    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as s:
        yield s


def promote(store, name: str, run_id: str, m: Metrics):
    """What a passing gate records: its execution and the promoted model."""
    execution = store.start_execution("gate", run_id=run_id, pipeline="slipway_pipeline")
    promoted = record_promotion(
        store,
        execution,
        name,
        m,
        run_id=run_id,
        pipeline="slipway_pipeline",
        model=f"/steps/train-{run_id}",
        checkpoint=f"/steps/train-{run_id}/checkpoints/6",
        step=6,
        decision=decide(Criteria(), m),
        if_latest=latest_version(store, name),
    )
    store.finish_execution(execution)
    return promoted


# -- the decision on its own ------------------------------------------------------------------


def test_metrics_are_the_held_out_mean_and_acc_per_task():
    m = metrics(benchmarks={"piqa": 0.6, "boolq": float("nan")})
    assert dict(m.bits_per_byte) == {"heldout-brown": 2.0, "heldout-fortunes": 2.4}
    assert m.mean_bits_per_byte == pytest.approx(2.2)
    assert dict(m.accuracy) == {"piqa": 0.6}
    assert m.missing == ("boolq",)  # listed, so that a criterion on it fails
    # No benchmarks key at all (before the benchmarks run): no accuracy, nothing missing.
    assert dict(metrics().accuracy) == {} and metrics().missing == ()


def test_no_criterion_passes_and_says_so():
    decision = decide(Criteria(), metrics())
    assert decision.passed and decision.checks == ()
    assert decision.table() == "no criterion set: promoted as evaluated"
    assert decision.summary() == "passed: no criterion set"


@pytest.mark.parametrize(
    ("limit", "passed", "outcome"),
    [
        (2.3, True, "pass (0.1000 to spare)"),
        (2.2, True, "pass (0.0000 to spare)"),  # at most: the limit itself passes
        (2.05, False, "FAIL by 0.1500"),
    ],
)
def test_max_bits_per_byte_is_the_held_out_mean(limit, passed, outcome):
    decision = decide(Criteria(max_bits_per_byte=limit), metrics())
    (check,) = decision.checks
    assert (decision.passed, check.value, check.outcome()) == (passed, pytest.approx(2.2), outcome)
    assert check.criterion == "held-out bits/byte, mean of 2 stores"


def test_a_held_out_store_without_bits_per_byte_fails_the_limit():
    finite, check = decide(Criteria(max_bits_per_byte=9.0), metrics(fortunes=None)).checks
    assert not check.passed and check.value is None
    assert check.outcome() == "FAIL: no bits/byte for heldout-fortunes"
    assert not finite.passed and "heldout-fortunes" in finite.outcome()
    bare = Metrics.from_evaluation({"results": {"eval-lambada": {"bits_per_byte": 1.0}}})
    (check,) = decide(Criteria(max_bits_per_byte=9.0), bare).checks
    assert check.outcome() == "FAIL: no result for a held-out store (heldout-*)"


@pytest.mark.parametrize(
    "criteria",
    [Criteria(), Criteria(max_regression=0.05), Criteria(min_accuracy={"piqa": 0.5})],
    ids=["no criterion", "regression only", "accuracy only"],
)
def test_a_metric_without_a_finite_value_is_never_promoted(criteria):
    # A diverged model: NaN bits/byte on one held-out store. No criterion on held-out stores
    # (the form's default sets none) must still not promote it.
    decision = decide(criteria, metrics(brown=float("nan"), benchmarks={"piqa": 0.9}))
    assert not decision.passed
    first = decision.checks[0]
    assert first.criterion == "evaluated metrics without a finite value"
    assert first.outcome() == "FAIL by 1.0000: heldout-brown (a diverged model?)"


def test_min_accuracy_per_task_and_a_missing_result_fails():
    criteria = Criteria(min_accuracy={"piqa": 0.5, "arc_easy": 0.4, "hellaswag": 0.3})
    decision = decide(criteria, metrics(benchmarks={"piqa": 0.62, "arc_easy": 0.35}))
    outcomes = {c.criterion: c.outcome() for c in decision.checks}
    assert outcomes == {
        "arc_easy acc": "FAIL by 0.0500",
        "hellaswag acc": "FAIL: no result for hellaswag",
        "piqa acc": "pass (0.1200 to spare)",
    }
    assert not decision.passed
    assert decision.summary() == "failed 2 of 3 criteria: arc_easy acc, hellaswag acc"
    # Before the benchmarks exist at all: still a failure, never a silent pass.
    (check,) = decide(Criteria(min_accuracy={"piqa": 0.0}), metrics()).checks
    assert check.outcome() == "FAIL: no result for piqa"


def test_the_table_lists_each_criterion_threshold_value_and_shortfall():
    criteria = Criteria(max_bits_per_byte=2.0, min_accuracy={"piqa": 0.7})
    table = decide(criteria, metrics(benchmarks={"piqa": 0.65})).table()
    lines = table.splitlines()
    assert lines[0].split() == ["criterion", "threshold", "value", "outcome"]
    assert set(lines[1]) == {"-"}
    assert "held-out bits/byte, mean of 2 stores  <= 2.0000  2.2000  FAIL by 0.2000" in lines[2]
    assert lines[3].split() == ["piqa", "acc", ">=", "0.7000", "0.6500", "FAIL", "by", "0.0500"]


# -- the promoted model, from lineage ----------------------------------------------------------


def test_the_current_promotion_is_the_latest_of_that_name(store):
    assert current_promotion(store, "demo") is None
    first = promote(store, "demo", "run-1", metrics(brown=2.0))
    second = promote(store, "demo", "run-2", metrics(brown=1.9))
    promote(store, "other", "run-3", metrics(brown=5.0))
    current = current_promotion(store, "demo")
    assert current is not None and current.version == second.version != first.version
    assert current.uri == model_uri("demo") == "slipway://models/demo"
    assert (current.run_id, current.model) == ("run-2", "/steps/train-run-2")
    assert current.metrics.bits_per_byte["heldout-brown"] == 1.9
    assert [p.run_id for p in promotions(store, "demo")] == ["run-1", "run-2"]
    # A gate cleared and run again compares against the model before its own promotion.
    assert current_promotion(store, "demo", exclude_run="run-2").run_id == "run-1"
    # Traceable like any output: produced by its run's gate execution.
    trace = store.trace(model_uri("demo"))
    assert (trace.producer.name, trace.producer.run_id) == ("gate", "run-2")


def test_regression_against_the_promoted_model(store):
    promote(store, "demo", "run-1", metrics(brown=2.0, fortunes=2.4, benchmarks={"piqa": 0.6}))
    baseline = current_promotion(store, "demo")
    candidate = metrics(brown=2.04, fortunes=2.5, benchmarks={"piqa": 0.52, "boolq": 0.1})
    decision = decide(Criteria(max_regression=0.05), candidate, baseline)
    outcomes = {c.criterion: c.outcome() for c in decision.checks}
    assert outcomes == {
        "heldout-brown bits/byte vs promoted": "pass (0.0100 to spare): promoted 2.0000",
        "heldout-fortunes bits/byte vs promoted": "FAIL by 0.0500: promoted 2.4000",
        # boolq: only the candidate has it, nothing to compare.
        "piqa acc vs promoted": "FAIL by 0.0300: promoted 0.6000",
    }
    assert not decision.passed
    assert decision.to_dict()["baseline"]["run_id"] == "run-1"
    # Within the margin everywhere: promoted.
    better = metrics(brown=1.99, fortunes=2.41, benchmarks={"piqa": 0.58})
    assert decide(Criteria(max_regression=0.05), better, baseline).passed


def test_no_criterion_promotes_a_worse_model_but_says_so(store):
    """A throwaway run, gated by the form's defaults (no criterion), replaces a better model:
    promoted as the form asks, with a warning in the summary and the table."""
    promote(store, "demo", "run-1", metrics(brown=2.0, fortunes=2.4))
    baseline = current_promotion(store, "demo")
    worse = decide(Criteria(), metrics(brown=2.9, fortunes=3.1), baseline)
    assert worse.passed and worse.checks == ()
    assert worse.summary() == "passed: no criterion set (worse than the model it replaces)"
    assert worse.warning == (
        "held-out bits/byte 3.0000 (mean of 2 stores) is worse than 2.2000 for the model it "
        f"replaces, slipway://models/demo @{baseline.version} (run run-1); set "
        "gate_max_regression to keep the better one"
    )
    assert worse.table().splitlines()[1] == f"warning: {worse.warning}"
    assert worse.to_dict()["warning"] == worse.warning
    better = decide(Criteria(), metrics(brown=1.9, fortunes=2.4), baseline)
    assert better.warning is None and better.summary() == "passed: no criterion set"
    # the printed run summary (make demo, python -m operators.summary) says it too
    outcome = {"promoted": True, "uri": "slipway://models/demo", "version": "promotion:9"}
    line = gate_line({**outcome, "summary": worse.summary(), "warning": worse.warning})
    assert line.splitlines()[1] == f"  warning: {worse.warning}"


def test_regression_with_no_promoted_model_passes_and_with_nothing_in_common_fails(store):
    (check,) = decide(Criteria(max_regression=0.0), metrics(), None).checks
    assert check.passed
    assert check.note == "no model of this name promoted yet: nothing to regress against"
    promote(store, "demo", "run-1", Metrics({"heldout-factbook": 1.0}, {"mmlu": 0.3}))
    (check,) = decide(
        Criteria(max_regression=0.0), metrics(), current_promotion(store, "demo")
    ).checks
    assert not check.passed
    assert "no held-out store or task in common with slipway://models/demo" in check.outcome()


# -- the gate task --------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    return tmp_path / "home"


@pytest.fixture
def params(tmp_path):
    return tiny_params(tmp_path / "data")


EXPORT_DIR = "/steps/export-0000/hf"


class _TaskInstance:
    """What the gate asks of its task instance: the evaluate and export tasks' XComs."""

    def __init__(self, xcom: dict | None) -> None:
        self.xcom, self.try_number = xcom, 1

    def xcom_pull(self, task_ids: str) -> dict | None:
        assert task_ids in ("evaluate", "export")
        return self.xcom if task_ids == "evaluate" else {"hf_dir": EXPORT_DIR}


def _context(params, run_id: str, xcom: dict | None, **form) -> dict:
    from airflow.sdk.execution_time.context import OutletEventAccessors

    return {
        "params": {**params, **form},
        "run_id": run_id,
        "ti": _TaskInstance(xcom),
        "outlet_events": OutletEventAccessors(),
    }


def _events(context) -> list:
    from airflow.sdk import AssetAlias

    return context["outlet_events"][AssetAlias(MODELS_ALIAS)].asset_alias_events


def _lineage(home: Path):
    from operators.lineage import LineageStore

    return LineageStore(f"sqlite:///{home / 'lineage.db'}")


def test_the_gate_promotes_records_and_emits_the_asset_event(home, params):
    from operators.gate import GateOperator

    context = _context(params, "run-1", evaluation(benchmarks={"piqa": 0.6}))
    result = GateOperator().execute(context)
    assert result["promoted"] and result["uri"] == "slipway://models/slipway-demo"
    (event,) = _events(context)
    assert event.dest_asset_key.uri == "slipway://models/slipway-demo"
    assert event.extra["version"] == result["version"] and event.extra["run_id"] == "run-1"
    with _lineage(home) as store:
        (gate,) = store.executions("run-1")
        assert (gate.name, str(gate.state)) == ("gate", "COMPLETE")
        assert gate.properties["gate"]["table"] == "no criterion set: promoted as evaluated"
        node = store.run_graph("run-1").steps[0]
        inputs = {link.role: link.artifact for link in node.inputs}
        assert inputs["trained_run"].uri.startswith(str(home))  # the train step's output
        assert {
            "eval:heldout-brown",
            "eval:heldout-fortunes",
            "eval:eval-lambada",
            "eval:benchmark-piqa",
        } <= set(inputs)
        current = current_promotion(store, "slipway-demo")
        assert current.version == result["version"]
        assert current.model == inputs["trained_run"].uri
        assert current.checkpoint == "/steps/train-0000/checkpoints/6"
        assert current.export == EXPORT_DIR == event.extra["export"]
        assert current.metrics.accuracy == {"piqa": 0.6}
        # What the run summary and `python -m operators.summary` say of it.
        outcome = gate_outcome(store.executions("run-1"))
        assert (outcome["promoted"], outcome["version"]) == (True, result["version"])
        assert gate_line(outcome) == (
            f"gate: promoted slipway://models/slipway-demo @{result['version']} "
            "(passed: no criterion set)"
        )
        assert gate_outcome(store.executions("no-such-run")) is None
        assert gate_line(None) is None

    # The next run must not regress by more than 0.01: it reads run-1's promotion as baseline.
    worse = _context(params, "run-2", evaluation(brown=2.1), gate_max_regression=0.01)
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=r"heldout-brown bits/byte vs promoted"):
        GateOperator().execute(worse)
    assert _events(worse) == []
    with _lineage(home) as store:
        (gate,) = store.executions("run-2")
        assert str(gate.state) == "FAILED" and "FAIL by 0.0900" in gate.error
        inputs = {link.role: link.artifact for link in store.run_graph("run-2").steps[0].inputs}
        assert inputs["promoted_before"].version == result["version"]
        assert current_promotion(store, "slipway-demo").run_id == "run-1"  # still run-1's


def test_a_failed_gate_is_recorded_and_the_run_summary_says_why(home, params):
    from airflow.sdk.exceptions import AirflowFailException

    from operators.gate import GateOperator
    from operators.record import RecordRunOperator

    form = {"gate_max_bits_per_byte": 2.0, "gate_min_accuracy": {"piqa": 0.5}}
    context = _context(params, "run-f", evaluation(), **form)
    with pytest.raises(AirflowFailException) as err:
        GateOperator().execute(context)
    message = str(err.value)
    assert message.startswith("model slipway-demo not promoted: gate failed 2 of 2 criteria")
    assert "held-out bits/byte, mean of 2 stores  <= 2.0000  2.2000  FAIL by 0.2000" in message
    assert "FAIL: no result for piqa" in message
    with _lineage(home) as store:
        assert current_promotion(store, "slipway-demo") is None
        (gate,) = store.executions("run-f")
        assert gate.error == message and not gate.properties["gate"]["passed"]

    summary = RecordRunOperator().summarize({**context, "ti": None})
    assert summary["state"] == "FAILED"
    assert summary["failed"] == [{"step": "gate", "error": message}]
    assert summary["gate"]["state"] == "FAILED" and not summary["gate"]["promoted"]
    assert "FAIL by 0.2000" in summary["gate"]["table"]
    assert gate_line(summary["gate"]) == (
        "gate: FAILED, slipway-demo not promoted (failed 2 of 2 criteria: held-out bits/byte, "
        "mean of 2 stores, piqa acc)"
    )


def test_a_diverged_evaluation_kept_in_its_marker_fails_the_gate(home, params):
    # The gate's fallback when the evaluate XCom is gone: the step's SUCCESS marker. A NaN
    # there once dropped the whole result, and the gate promoted a model with no metrics.
    from airflow.sdk.exceptions import AirflowFailException

    from operators.gate import GateOperator
    from operators.steps import StepRunner

    context = _context(params, "run-nan", None)
    gate = GateOperator()
    step = gate.step_graph(context).evaluate
    body = evaluation(brown=float("inf"))
    body["results"]["heldout-fortunes"]["loss"] = float("nan")
    StepRunner(gate.steps_root()).run(step, lambda spec: body)
    with pytest.raises(AirflowFailException, match="evaluated metrics without a finite value"):
        gate.execute(context)
    with _lineage(home) as store:
        assert current_promotion(store, "slipway-demo") is None


def test_a_gate_with_nothing_to_judge_fails_recorded(home, params):
    from operators.gate import GateFailed, GateOperator

    with pytest.raises(GateFailed, match="no evaluation to judge"):
        GateOperator().execute(_context(params, "run-n", None))  # no XCom, no SUCCESS marker
    with _lineage(home) as store:
        (gate,) = store.executions("run-n")
        assert str(gate.state) == "FAILED" and "GateFailed" in gate.error


def test_a_metric_measured_on_other_data_is_not_compared_with_the_promoted_one(home, params):
    # run-1 promoted with accuracy over 10 piqa examples; run-2 scores 20. The same name is
    # not the same measurement: piqa is shown as not compared, the held-out stores (the same
    # data) are judged. A run on other data everywhere cannot be judged at all: it fails,
    # saying how to start a new baseline, instead of passing on nothing.
    from airflow.sdk.exceptions import AirflowFailException

    from operators.gate import GateOperator

    first = _context(params, "run-1", evaluation(benchmarks={"piqa": 0.6}))
    GateOperator().execute(first)
    form = {"gate_max_regression": 0.05, "eval_task_limit": 20}
    second = _context(params, "run-2", evaluation(benchmarks={"piqa": 0.1}), **form)
    result = GateOperator().execute(second)
    assert result["promoted"]
    with _lineage(home) as store:
        current = current_promotion(store, "slipway-demo")
        assert current.run_id == "run-2"
        (gate,) = store.executions("run-2")
        table = gate.properties["gate"]["table"]
        assert "piqa acc vs promoted" in table and "not compared: measured on" in table
        assert "limit=20, the promoted model on" in table and "limit=10" in table
        assert "heldout-brown bits/byte vs promoted" in table
        assert gate.properties["gate"]["summary"] == "passed: 2 criteria (1 not compared)"
        measured = current.metrics.measured
        assert (
            measured["piqa"].endswith("limit=20") and "max_tokens=512" in measured["heldout-brown"]
        )

    third = _context(
        params,
        "run-3",
        evaluation(benchmarks={"piqa": 0.9}),
        gate_max_regression=0.05,
        eval_task_limit=30,
        eval_max_tokens=1024,
    )
    with pytest.raises(AirflowFailException) as err:
        GateOperator().execute(third)
    message = str(err.value)
    assert "every one in common was measured on other data" in message
    assert "promote once without gate_max_regression" in message


@pytest.mark.parametrize("overtaken_in", ["decide", "current_promotion"])
def test_of_two_gates_deciding_at_once_the_second_to_record_promotes_nothing(
    home, params, monkeypatch, overtaken_in
):
    # run-2's gate decides against run-1's model; before it records, run-3's gate promotes:
    # after run-2's decision, or right after it read run-1's model as its baseline (which
    # only the gate's reading of the latest version *before* the baseline catches). run-2
    # must not replace run-3's model on a comparison with run-1's: it fails, saying so, and
    # cleared, it decides again against run-3's.
    from operators import promotion
    from operators.gate import GateFailed, GateOperator

    GateOperator().execute(_context(params, "run-1", evaluation(brown=2.0)))
    form = {"gate_max_regression": 0.05}
    real = getattr(promotion, overtaken_in)
    third = _context(params, "run-3", evaluation(brown=1.5), **form)
    interleaved = []

    def while_run_3_promotes(*args, **kwargs):
        found = real(*args, **kwargs)
        if not interleaved:  # run-2's call: run-3's whole gate runs before run-2 goes on
            interleaved.append(True)
            GateOperator().execute(third)
        return found

    monkeypatch.setattr(promotion, overtaken_in, while_run_3_promotes)
    second = _context(params, "run-2", evaluation(brown=2.04), **form)
    with pytest.raises(GateFailed) as err:
        GateOperator().execute(second)
    assert str(err.value).startswith(
        "model slipway-demo not promoted: another gate promoted slipway-demo while this one"
        " decided (slipway://models/slipway-demo changed meanwhile: its latest version is"
    )
    assert str(err.value).endswith("Clear this gate to decide again, against that model")
    assert _events(second) == []
    with _lineage(home) as store:
        assert current_promotion(store, "slipway-demo").run_id == "run-3"
        (gate,) = store.executions("run-2")
        assert str(gate.state) == "FAILED"
        assert str(err.value) == f"model slipway-demo not promoted: {gate.error}"
        assert gate.properties["promoted"] is None and gate.properties["gate"]["passed"]
        # The run summary says why: not its criteria, which passed.
        assert gate_line(gate_outcome(store.executions("run-2"))) == (
            f"gate: FAILED, slipway-demo not promoted: {gate.error}"
        )
        from markupsafe import escape

        from operators.reports import pages

        page = pages.run_page(store, "run-2", "/slipway")
        assert f"FAILED: slipway-demo not promoted: {escape(gate.error)}</p>" in page
        assert "promoted" not in {link.role for link in store.run_graph("run-2").steps[0].outputs}

    monkeypatch.setattr(promotion, overtaken_in, real)
    from airflow.sdk.exceptions import AirflowFailException

    # Cleared: judged against run-3's 1.5, 2.04 is a regression of 0.54.
    with pytest.raises(AirflowFailException, match=r"heldout-brown bits/byte vs promoted"):
        GateOperator().execute(_context(params, "run-2", evaluation(brown=2.04), **form))
