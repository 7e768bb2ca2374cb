"""The scaling sweep's core without Airflow: its form, its grid and steps, outcomes, fits,
pre-registration and check."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from operators.pipeline.form import RunConfigError, check_value, with_defaults
from operators.steps import StepRunner
from operators.sweep.form import (
    RECIPE_NAMES,
    REPLACED_BY_RECIPE,
    check_sweep_config,
    sweep_form_fields,
)
from operators.sweep.grid import (
    add_estimates,
    cell_evaluate_step,
    cell_steps,
    cell_train_step,
    forecast_cells,
    grid_for,
)
from operators.sweep.outcomes import (
    cell_outcome,
    check_forecast,
    find_registration,
    fit_record,
    forecast_body,
    forecast_from,
    preregister,
    registration_key,
)
from tests.support.tiny_pipeline import make_corpora, tiny_conf
from trainer.recipes import RECIPES

VOCAB = 2048


def sweep_params(**overrides):
    fields = sweep_form_fields()
    params = {k: v["default"] for k, v in fields.items()}
    params.update(overrides)
    for name, spec in fields.items():
        check_value(name, spec, params[name])
    return with_defaults(params)


def test_the_form_offers_every_recipe_and_leaves_the_reference_run_to_it():
    fields = sweep_form_fields()
    assert sorted(RECIPE_NAMES) == sorted(RECIPES)  # the form's list is the recipes'
    assert fields["recipe"]["enum"] == list(RECIPE_NAMES)
    assert not set(REPLACED_BY_RECIPE) & set(fields)
    # ... the launch fields are the pipeline's, shared with slipway_pipeline
    for name in ("accelerator", "topology", "slices", "backend", "image", "sources", "gke"):
        assert name in fields
    check_sweep_config(sweep_params(), VOCAB)  # the defaults are a valid sweep


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"budgets": [1e12, 3e11]}, "budgets: must be strictly increasing"),
        ({"budgets": [1e12, 1e12]}, "budgets: must be strictly increasing"),
        ({"budgets": [1e6, 1e12]}, r"budgets: .*gives \d+ steps"),
        ({"forecast_budgets": [1e12]}, "forecast_budgets: .* not above the largest fitted"),
        ({"fail_cells": [99]}, r"fail_cells: \[99\] not in the grid"),
        ({"fail_cells": [0], "backend": "gke"}, "fail_cells: fault injection is for backend=local"),
        ({"points": 3, "spread": 1.5}, "a parabola needs 3"),
    ],
)
def test_bad_sweeps_are_refused_naming_the_field(overrides, message):
    with pytest.raises(RunConfigError, match=message):
        check_sweep_config(sweep_params(**overrides), VOCAB)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("recipe", "gpt-3"),
        ("budgets", [1e12]),
        ("budgets", [0, 1e12]),
        ("points", 2),
        ("seeds", [0, 0]),
        ("metric", "accuracy"),
        ("metric_stores", ["heldout-brown; rm -rf /"]),
    ],
)
def test_the_schema_refuses_at_trigger_time(field, value):
    with pytest.raises(RunConfigError, match=f"^{field}: "):
        check_value(field, sweep_form_fields()[field], value)


@pytest.fixture
def graph(tmp_path):
    from operators.pipeline.graph import build_graph

    data = make_corpora(tmp_path / "data")
    return build_graph(with_defaults(tiny_conf(data)))


def test_cells_are_content_addressed_and_a_longer_sweep_keeps_earlier_cells(graph):
    night1 = grid_for(sweep_params(), VOCAB)
    assert [c["index"] for c in night1] == list(range(len(night1)))
    assert len({c["label"] for c in night1}) == len(night1)
    night2 = grid_for(sweep_params(budgets=[3e11, 1e12, 3e12, 1e13], seeds=[0]), VOCAB)
    keys1 = {cell_train_step(c, graph).key for c in night1}
    keys2 = {cell_train_step(c, graph).key for c in night2}
    assert keys1 <= keys2 and len(keys2) > len(keys1)  # earlier cells: the same steps
    step = cell_train_step(night1[0], graph)
    # What ran is versioned; why it ran (budget, recipe, label) and how (backend) is not.
    assert step.config["sources"] == graph.train.config["sources"]
    assert step.config["model"]["vocab_size"] == 0  # the token store's
    assert {"budget", "recipe", "label", "backend"} <= set(step.unversioned)
    seeds = grid_for(sweep_params(seeds=[0, 1]), VOCAB)
    assert len(seeds) == 2 * len(night1)
    assert cell_train_step(seeds[0], graph).key != cell_train_step(seeds[1], graph).key


def test_a_cell_trains_as_the_trainer_validates_and_evaluates_the_metric_stores(graph, tmp_path):
    from operators.pipeline.graph import trainer_run_config
    from operators.steps import resolve

    (cell, *_) = grid_for(sweep_params(), VOCAB)
    train = cell_train_step(cell, graph)
    spec = resolve(train, str(tmp_path / "steps"))  # references to the stores made paths
    config = trainer_run_config(spec.config, spec.output_path)  # the trainer's own checks
    assert config["model"]["hidden_dim"] == cell["plan"]["model"]["hidden_dim"]
    assert config["optimizer"]["beta2"] == cell["plan"]["beta2"]
    assert config["optimizer"]["decay"] == "linear"
    evaluate = cell_evaluate_step(cell, graph, ["heldout-brown"], 512)
    assert list(evaluate.config["stores"]) == ["heldout-brown"]
    assert evaluate.config["train"].step.key == train.key
    (forecast,) = forecast_cells(sweep_params(), VOCAB)
    assert forecast["kind"] == "forecast" and forecast["budget"] == 3e13


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_cell_batch_splits_over_the_launchs_data_parallel_devices(recipe):
    # On 2 x 8x8 v5e the trainer splits the batch 128 ways and refuses another batch at its
    # start: a small budget's batch of 8 or 64 would fail its cell after the data plane.
    tpu = {"accelerator": "v5e", "topology": "8x8", "slices": 2, "budgets": [1e14, 1e15, 1e16]}
    params = sweep_params(recipe=recipe, forecast_budgets=[1e17], **tpu)
    cells = grid_for(params, 8192) + forecast_cells(params, 8192)
    assert cells and all(c["plan"]["batch_size"] % 128 == 0 for c in cells)
    assert any(c["plan"]["batch_size"] == 128 for c in cells)  # a batch raised to the devices
    for c in cells:  # the budget is still spent: the steps follow the larger batch
        plan = c["plan"]
        spent = plan["steps"] * plan["batch_size"] * plan["seq_len"] / plan["tokens"]
        assert spent == pytest.approx(1, rel=0.1)
    on_cpu = grid_for(sweep_params(recipe=recipe), VOCAB)  # one device: the recipe's own batch
    assert any(c["plan"]["batch_size"] % 128 for c in on_cpu)


def _outcomes(graph, root: str, metric_of) -> list[dict]:
    """Cells whose evaluate steps ran (SUCCESS with ``metric_of(cell)``) or failed (None)."""
    out = []
    for cell in grid_for(sweep_params(), VOCAB):
        train = cell_train_step(cell, graph)
        evaluate = cell_evaluate_step(cell, graph, ["heldout-brown"], 512)
        value = metric_of(cell)
        runner = StepRunner(root)
        runner.run(train, lambda spec: {"steps": 1})
        if value is None:
            with pytest.raises(RuntimeError):
                runner.run(evaluate, _raise)
        else:
            runner.run(evaluate, lambda spec, v=value: {"results": {"heldout-brown": {"loss": v}}})
        out.append(cell_outcome(root, cell, train, evaluate, ["heldout-brown"], "loss"))
    return out


def _raise(spec):
    raise RuntimeError("evaluation JobSet Failed")


def _chinchilla(cell) -> float:
    p = cell["plan"]
    return 1.69 + 406.4 / p["non_embedding_params"] ** 0.34 + 410.7 / p["tokens"] ** 0.28


def test_outcomes_fits_and_a_failed_cell_left_out_with_its_reason(graph, tmp_path):
    root = str(tmp_path / "steps")
    outcomes = _outcomes(graph, root, lambda c: None if c["index"] == 1 else _chinchilla(c))
    failed = outcomes[1]
    assert failed["metric"] is None and "evaluation FAILED" in failed["reason"]
    assert "evaluation JobSet Failed" in failed["reason"]
    first = grid_for(sweep_params(), VOCAB)[0]
    assert outcomes[0]["metric"] == pytest.approx(_chinchilla(first))
    assert outcomes[0]["reason"] is None
    (run,) = forecast_cells(sweep_params(), VOCAB)
    planned = (run["plan"]["non_embedding_params"], run["plan"]["tokens"])
    record = fit_record(outcomes, {3e13: planned})
    assert set(record["fits"]) == {"isoflop", "parametric"}
    iso = record["fits"]["isoflop"]
    if "error" not in iso:
        assert failed["label"] in {e["cell"] for e in iso["excluded"]}
    par = record["fits"]["parametric"]
    assert "error" not in par, par
    assert {e["cell"] for e in par["excluded"]} == {failed["label"]}
    # The outcomes follow the law exactly, so the parametric fit recovers it, with no
    # warnings, and is the one the forecast uses.
    truth = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
    assert {k: par[k] for k in truth} == pytest.approx(truth, rel=1e-3), par
    assert not par["warnings"], par["warnings"]
    prediction = forecast_from(record, 3e13)
    assert prediction["fit"] == "parametric"
    low, estimate, high = (prediction["metric"][k] for k in ("low", "estimate", "high"))
    assert low <= estimate <= high
    # The forecast is of the run that will train there, not of the law's own optimum.
    assert (prediction["params"]["estimate"], prediction["tokens"]["estimate"]) == planned
    assert estimate == pytest.approx(_chinchilla(run), rel=1e-4)


def test_a_pre_registration_is_written_once_and_never_replaced(graph, tmp_path):
    root = str(tmp_path / "steps")
    (cell,) = forecast_cells(sweep_params(), VOCAB)
    train, evaluate = cell_steps(cell, graph, sweep_params())
    key = registration_key(train, evaluate, "loss")
    prediction = {"fit": "parametric", "metric": {"estimate": 3.0, "low": 2.9, "high": 3.1}}
    record = {
        "cells": [
            {"label": "a", "steps": {}, "metric": 3.5, "reason": None},
            {"label": "b", "steps": {}, "metric": math.nan, "reason": "diverged: loss NaN"},
        ],
        "fits": {},
    }
    body = forecast_body("night-1", cell, key, prediction, record)
    assert [c["label"] for c in body["fit_inputs"]] == ["a"]  # a diverged cell is no input
    path, digest, created = preregister(root, body)
    assert created and Path(path).name == f"{digest}.json"
    assert json.loads(Path(path).read_text())["train_step"] == train.key
    assert find_registration(root, key) == (path, json.loads(Path(path).read_text()))
    # The same run measured another way is another forecast: never held to this one.
    assert find_registration(root, {**key, "metric": "bits_per_byte"}) is None
    other_stores = cell_steps(cell, graph, sweep_params(metric_stores=["heldout-brown"]))[1]
    assert other_stores.key != evaluate.key
    assert find_registration(root, {**key, "evaluate_step": other_stores.key}) is None
    unchecked = check_forecast(json.loads(Path(path).read_text()), 1.2, "bits_per_byte")
    assert not unchecked["checked"] and "not comparable" in unchecked["reason"]
    # A registration from before the evaluate step was recorded matches on run and metric.
    legacy_root = str(tmp_path / "legacy")
    legacy = {k: v for k, v in body.items() if k != "evaluate_step"}
    legacy_path, _, _ = preregister(legacy_root, legacy)
    found = find_registration(legacy_root, {**key, "evaluate_step": other_stores.key})
    assert found is not None and found[0] == legacy_path
    assert find_registration(legacy_root, {**key, "metric": "bits_per_byte"}) is None
    before = Path(path).read_bytes()
    again = preregister(root, body)
    assert again == (path, digest, False) and Path(path).read_bytes() == before
    later = preregister(root, {**body, "run_id": "night-2"})
    assert later[0] != path and Path(path).read_bytes() == before

    inside = check_forecast(json.loads(before), 3.05)
    assert inside["checked"] and inside["inside_interval"]
    assert inside["relative_error"] == pytest.approx((3.05 - 3.0) / 3.05)
    outside = check_forecast(json.loads(before), 3.5)
    assert not outside["inside_interval"]
    assert check_forecast(json.loads(before), None) == {
        "outcome": None,
        "checked": False,
        "reason": "the forecast run has no metric",
    }


def test_a_trained_cell_records_its_time_beside_the_estimate(graph, tmp_path):
    params = sweep_params(accelerator="v5e", topology="2x2")
    cells = grid_for(params, VOCAB)
    peak = add_estimates(cells, params)
    assert peak == 4 * 197e12  # four v5e chips
    cell = cells[0]
    flops = cell["plan"]["flops"]
    assert cell["estimate"] == {
        "flops": flops,
        "chips": 4,
        "seconds": pytest.approx(flops / (peak * 0.4)),
        "mfu_assumed": 0.4,
        "peak_flops": peak,
    }
    train = cell_train_step(cell, graph)
    evaluate = cell_evaluate_step(cell, graph, ["heldout-brown"], 512)
    root = str(tmp_path / "steps")
    runner = StepRunner(root)
    untrained = cell_outcome(root, cell, train, evaluate, ["heldout-brown"], "loss")
    assert untrained["actual"] is None and untrained["estimate"] == cell["estimate"]
    marker = runner.run(train, lambda spec: {"steps": 1, "train_seconds": 0.25}).status
    runner.run(evaluate, lambda spec: {"results": {"heldout-brown": {"loss": 3.0}}})
    actual = cell_outcome(root, cell, train, evaluate, ["heldout-brown"], "loss")["actual"]
    assert actual["train_seconds"] == 0.25
    assert actual["wall_seconds"] == marker.updated_at - marker.started_at >= 0
    assert actual["chip_seconds"] == pytest.approx(4 * actual["wall_seconds"])
    assert actual["mfu"] == pytest.approx(flops / (0.25 * peak))

    cpu = sweep_params()  # no known peak: FLOPs only, and no MFU after
    cpu_cells = grid_for(cpu, VOCAB)
    assert add_estimates(cpu_cells, cpu) is None
    assert set(cpu_cells[0]["estimate"]) == {"flops", "chips"}


def test_a_pre_empted_cell_is_left_out_even_if_its_checkpoint_was_scored(graph, tmp_path):
    root = str(tmp_path / "steps")
    (cell, *_) = grid_for(sweep_params(), VOCAB)
    train = cell_train_step(cell, graph)
    evaluate = cell_evaluate_step(cell, graph, ["heldout-brown"], 512)
    runner = StepRunner(root)
    with pytest.raises(RuntimeError):
        runner.run(train, lambda spec: (_ for _ in ()).throw(RuntimeError("fault injection")))
    runner.run(evaluate, lambda spec: {"results": {"heldout-brown": {"loss": 4.0}}})
    outcome = cell_outcome(root, cell, train, evaluate, ["heldout-brown"], "loss")
    assert outcome["metric"] is None
    assert (
        outcome["reason"].startswith("training FAILED") and "fault injection" in outcome["reason"]
    )


@pytest.mark.parametrize("run_id", ["..", ".", "../../etc", ".hidden", ""])
def test_a_run_id_never_names_a_folder_outside_runs(run_id, tmp_path, monkeypatch):
    from operators.settings import run_folder

    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    folder = Path(run_folder(run_id))
    assert folder.parent == tmp_path / "runs" and not folder.name.startswith(".")


def test_metric_stores_must_be_stores_of_the_run():
    with pytest.raises(RunConfigError, match=r"metric_stores: \['heldout-wikipedia'\]"):
        check_sweep_config(sweep_params(metric_stores=["heldout-wikipedia"]), VOCAB)
    check_sweep_config(sweep_params(metric_stores=["heldout-brown", "eval-lambada"]), VOCAB)


def _cell(index: int, params: float, metric: float | None, budget: float = 1e12) -> dict:
    """One IsoFLOP cell as a night's report holds it, trained to ``metric``."""
    return {
        "index": index,
        "label": f"c{index}",
        "budget": budget,
        "params": params,
        "tokens": budget / (6 * params),
        "metric": metric,
        "reason": None,
    }


def test_a_long_left_out_reason_leaves_the_isoflop_axes_their_size():
    """A cell left out is named under the curves with its reason, cut to one short line: a
    long reason (a training failure's whole message) would run past the axes, and the layout
    would shrink them to a third of the figure to make room."""
    from operators.sweep.figures import LEFT_OUT_CHARS, isoflop_figure

    def night(reason: str | None) -> dict:
        cells = [_cell(i, n, 3.0 + i / 10) for i, n in enumerate([1e4, 2e4, 4e4])]
        if reason:
            cells.append({**_cell(3, 8e4, None), "tokens": None, "reason": reason})
        return {"run_id": "night-1", "cells": cells, "forecasts": [], "fits": {}}

    def axes_width(fig) -> float:
        fig.draw_without_rendering()  # constrained layout places the axes when drawn
        return fig.axes[0].get_position().width

    reason = "training FAILED: " + "fault injection: fail_at_step=1 reached; " * 8
    with_note = isoflop_figure(night(reason), "loss")
    assert axes_width(with_note) == pytest.approx(
        axes_width(isoflop_figure(night(None), "loss")), rel=0.02
    )
    (note,) = [t.get_text() for t in with_note.axes[0].texts if t.get_text().startswith("left out")]
    assert note.splitlines()[1].startswith("[3] c3: training FAILED: fault injection")
    assert max(len(line) for line in note.splitlines()) <= LEFT_OUT_CHARS


def test_the_isoflop_plot_draws_each_parabola_over_the_cells_it_was_fitted_to():
    """A budget's parabola is fitted to the cells around its minimum: the plot draws it over
    those only, and the cells beyond (approach 3 still uses them) hollow, not as fitted."""
    from operators.sweep.figures import isoflop_figure

    sizes = [1e4, 2e4, 4e4, 8e4, 3.2e5]
    cells = [_cell(i, n, 3.0 + (math.log(n / 4e4)) ** 2 / 4) for i, n in enumerate(sizes)]
    optimum = {
        "compute": 1e12,
        "params": 4e4,
        "metric": 3.0,
        "cells": ["c1", "c2", "c3"],
        "parabola": [0.25, -2 * 0.25 * math.log(4e4), 3.0 + 0.25 * math.log(4e4) ** 2],
    }
    night = {
        "run_id": "night-1",
        "cells": cells,
        "forecasts": [],
        "fits": {"isoflop": {"optima": [optimum]}},
    }
    ax = isoflop_figure(night, "loss").axes[0]
    hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "none"]
    assert sorted(x for line in hollow for x in line.get_xdata()) == [1e4, 3.2e5]
    (curve,) = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
    assert min(curve.get_xdata()) == pytest.approx(2e4) and max(curve.get_xdata()) == pytest.approx(
        8e4
    )
    assert "outside its parabola (approach 3 only)" in [
        t.get_text() for t in ax.get_legend().get_texts()
    ]


def test_the_report_plots_the_night_and_adds_the_outcome_at_the_check(
    graph, tmp_path, monkeypatch, capsys
):
    import numpy as np
    from matplotlib.image import imread

    from operators.sweep.figures import write_report

    root = str(tmp_path / "steps")
    outcomes = _outcomes(graph, root, lambda c: None if c["index"] == 1 else _chinchilla(c))
    (run,) = forecast_cells(sweep_params(), VOCAB)
    record = fit_record(
        outcomes, {3e13: (run["plan"]["non_embedding_params"], run["plan"]["tokens"])}
    )
    key = registration_key(*cell_steps(run, graph, sweep_params()), "loss")
    body = forecast_body("night-1", run, key, forecast_from(record, 3e13), record)
    path, digest, _ = preregister(root, body)
    record["forecasts"] = [{"cell": run, "path": path, "sha256": digest, "new": True}]
    registrations = {digest: json.loads(Path(path).read_text())}

    folder = tmp_path / "runs" / "night-1"
    before = write_report(str(folder), "night-1", record, registrations, [], "loss")
    names = [Path(p).name for p, _ in before]
    assert names == ["isoflop.png", "isoflop.svg", "scaling.png", "scaling.svg", "report.json"]
    for p, sha in before:
        assert hashlib.sha256(Path(p).read_bytes()).hexdigest() == sha
    for name in ("isoflop.png", "scaling.png"):
        pixels = imread(folder / "report" / name)
        assert pixels.shape[0] > 300 and float(np.std(pixels)) > 0.05  # drawn, not blank
    svg = (folder / "report" / "isoflop.svg").read_text()
    assert all(f"C = {b:.3g}" in svg for b in sweep_params()["budgets"])
    assert "left out:" in svg and outcomes[1]["label"] in svg  # the failed cell, and why
    summary = json.loads((folder / "report" / "report.json").read_text())
    (forecast,) = summary["forecasts"]
    assert forecast["sha256"] == digest and forecast["outcome"] is None
    assert forecast["predicted"] == body["predicted"]["metric"]["estimate"]
    assert summary["cells"][1]["reason"] == outcomes[1]["reason"]
    assert summary["files"] == {Path(p).name: s for p, s in before[:-1]}
    again = write_report(str(folder), "night-1", record, registrations, [], "loss")
    assert again == before  # same record, same bytes

    check = {"budget": 3e13, "sha256": digest, **check_forecast(body, 3.1)}
    after = write_report(str(folder), "night-1", record, registrations, [check], "loss")
    summary = json.loads((folder / "report" / "report.json").read_text())
    assert summary["forecasts"][0]["outcome"] == 3.1
    assert summary["forecasts"][0]["relative_error"] == pytest.approx(check["relative_error"])
    assert (
        dict(after)[str(folder / "report" / "scaling.png")]
        != dict(before)[str(folder / "report" / "scaling.png")]
    )  # the outcome is drawn
    assert "outcome (" in (folder / "report" / "scaling.svg").read_text()

    # `slipway sweep show` reads the same night and points at its report
    from operators import cli
    from operators.settings import HOME_ENV

    (folder / "sweep.json").write_text(json.dumps(record))
    (folder / "forecast_checks.json").write_text(json.dumps([check]))
    monkeypatch.setenv(HOME_ENV, str(tmp_path))
    assert cli.main(["sweep", "show", "night-1"]) == 0
    shown = capsys.readouterr().out
    assert f"relative error {check['relative_error']:+.2%}" in shown
    m = body["predicted"]["metric"]  # the forecast to the estimate's precision, not repr's
    assert f"loss {m['estimate']:.4f} [{m['low']:.4f}, {m['high']:.4f}] (" in shown, shown
    assert f"report (plots and report.json): {folder / 'report'}" in shown
    assert "time (s)" in shown and "estimate" in shown

    # `latest`: the newest night lineage has; none recorded yet is an error that says so
    from operators.lineage.store import LineageStore
    from operators.sweep.report import SWEEP_DAG

    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    LineageStore().close()  # an empty database
    assert cli.main(["sweep", "show", "latest"]) == 1
    assert f"no {SWEEP_DAG} runs recorded" in capsys.readouterr().err
    with LineageStore() as store, store.recording("fit", run_id="night-1", pipeline=SWEEP_DAG):
        pass
    assert cli.main(["sweep", "show", "latest"]) == 0
    assert "sweep night-1" in capsys.readouterr().out
    # a night lineage does not have is no night, not one without a fit yet
    assert cli.main(["sweep", "show", "night-9", "--db", LineageStore().url]) == 1
    err = capsys.readouterr().err
    assert f"no {SWEEP_DAG} night 'night-9' recorded" in err and "no fit" not in err


def test_the_platform_sets_the_nightly_sweep_and_a_bad_value_is_refused_at_parse(tmp_path):
    from operators.pipeline.form import PlatformDefaultsError
    from operators.sweep.form import SWEEP_CONF_ENV

    conf = tmp_path / "nightly.json"
    conf.write_text(json.dumps({"budgets": [1e10, 3e10], "points": 3, "seeds": [0, 1]}))
    fields = sweep_form_fields({SWEEP_CONF_ENV: str(conf)})
    assert fields["budgets"]["default"] == [1e10, 3e10] and fields["points"]["default"] == 3
    assert fields["seeds"]["default"] == [0, 1]
    assert fields["recipe"]["default"] == "marin-2025"  # the rest stay the form's

    conf.write_text(json.dumps({"budgets": [3e10, 1e10]}))  # each value fits its schema
    with pytest.raises(PlatformDefaultsError, match=r"budgets: must be strictly increasing"):
        sweep_form_fields({SWEEP_CONF_ENV: str(conf)})
    conf.write_text(json.dumps({"points": 2, "learning_rate": 0.1}))
    with pytest.raises(PlatformDefaultsError) as err:
        sweep_form_fields({SWEEP_CONF_ENV: str(conf)})
    message = str(err.value)
    assert SWEEP_CONF_ENV in message and str(conf) in message
    assert "points: " in message  # below the schema's minimum of 3
    assert "learning_rate: not a field of the sweep form" in message  # the recipe's
    conf.write_text("[1, 2]")
    with pytest.raises(PlatformDefaultsError, match="must be a JSON object"):
        sweep_form_fields({SWEEP_CONF_ENV: str(conf)})
    with pytest.raises(PlatformDefaultsError, match="cannot read"):
        sweep_form_fields({SWEEP_CONF_ENV: str(tmp_path / "missing.json")})


def test_the_nightly_sweep_can_be_the_variables_own_json():
    """What the Helm chart's ``sweepForm`` sets: the object itself, not a file."""
    from operators.pipeline.form import PlatformDefaultsError
    from operators.sweep.form import SWEEP_CONF_ENV

    fields = sweep_form_fields({SWEEP_CONF_ENV: ' {"points": 4, "seeds": [3]} '})
    assert (fields["points"]["default"], fields["seeds"]["default"]) == (4, [3])
    with pytest.raises(PlatformDefaultsError, match=r"SLIPWAY_SWEEP_CONF: invalid sweep defaults"):
        sweep_form_fields({SWEEP_CONF_ENV: '{"points": 1}'})
    with pytest.raises(PlatformDefaultsError, match=r"SLIPWAY_SWEEP_CONF: cannot read a JSON"):
        sweep_form_fields({SWEEP_CONF_ENV: '{"points": 4'})


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "0 2 * * *"), ("", "0 2 * * *"), ("30 3 * * 1-5", "30 3 * * 1-5"), ("none", None)],
)
def test_a_schedule_is_the_platforms(monkeypatch, value, expected):
    from operators.settings import schedule_from_env

    if value is None:
        monkeypatch.delenv("SLIPWAY_SWEEP_SCHEDULE", raising=False)
    else:
        monkeypatch.setenv("SLIPWAY_SWEEP_SCHEDULE", value)
    assert schedule_from_env("SLIPWAY_SWEEP_SCHEDULE", "0 2 * * *") == expected


def test_cells_of_budgets_one_digit_cannot_tell_apart_have_their_own_steps(graph):
    # 1.5e12 once read 2e12: two cells of one size got one step name, and lineage (which
    # groups a run's executions by name) took the one's failure for the other's success.
    cells = grid_for(sweep_params(budgets=[1e12, 1.5e12, 2e12]), VOCAB)
    names = [cell_train_step(c, graph).name for c in cells]
    assert len(set(names)) == len(names)
    assert any(name.startswith("sweep/train/C1.5e12-") for name in names)
    # the names of budgets one digit says exactly are those of every earlier night
    (first, *_) = grid_for(sweep_params(), VOCAB)
    assert cell_train_step(first, graph).name.startswith("sweep/train/C3e11-N")


def test_the_forecast_record_lists_each_pre_registration_once(tmp_path, monkeypatch):
    # Night 2 keeps night 1's registration (the same grid, the same fit) and checks it:
    # one forecast, under the night that made it, with its outcome; night 3's is a new one.
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from operators.settings import run_folder
    from operators.sweep.report import SWEEP_DAG, render_forecasts

    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    cell = {"cell": {"budget": 3e13}}
    outcome = {"checked": True, "predicted": 3.2, "outcome": 3.1, "relative_error": -0.03}
    nights = {
        "night-1": ([{"sha256": "a", **cell}], [{"sha256": "a", "checked": False}]),
        "night-2": (
            [{"sha256": "a", **cell}],
            [{"sha256": "a", **outcome, "inside_interval": True}],
        ),
        "night-3": ([{"sha256": "b", **cell}], []),
    }
    runs = []
    for day, (run_id, (forecasts, checks)) in enumerate(nights.items(), start=1):
        folder = Path(run_folder(run_id))
        folder.mkdir(parents=True)
        (folder / "sweep.json").write_text(json.dumps({"forecasts": forecasts}))
        (folder / "forecast_checks.json").write_text(json.dumps(checks))
        started = datetime(2026, 12, day, 2, tzinfo=UTC)
        runs.append(SimpleNamespace(run_id=run_id, pipeline=SWEEP_DAG, started_at=started))
    lines = render_forecasts(runs).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("night-1") and "outcome 3.1000 error -3.00% inside" in lines[0]
    assert lines[1].startswith("night-3") and lines[1].endswith("not checked")


def test_a_tokenizer_config_without_vocab_size_takes_the_stages_default():
    # It once raised a bare KeyError in validate, naming no field.
    from operators.sweep_tasks import form_vocab
    from pipelines.configs import TrainTokenizerConfig

    assert form_vocab({"stage_configs": {"train_tokenizer": {"seed": 1}}}) == (
        TrainTokenizerConfig().vocab_size
    )
    assert form_vocab({"stage_configs": {"train_tokenizer": {"vocab_size": 1024}}}) == 1024


def test_the_sweeps_validate_does_not_check_a_batch_its_form_has_not():
    # The pipeline's default batch (16) fills the sweep's params; its cells' batches are the
    # recipe's, multiples of the data-parallel size. On 3 x 4x4 v5e (48 ways) the sweep is
    # valid; the pipeline's validate, whose form sets the batch, refuses 16 there.
    from operators.pipeline.form import RunConfigError
    from operators.sweep_tasks import ValidateSweepOperator
    from operators.validate import ValidateRunOperator

    tpu = {"accelerator": "v5e", "topology": "4x4", "slices": 3}
    params = sweep_params(budgets=[1e14, 3e14, 1e15], forecast_budgets=[1e16], **tpu)
    ValidateSweepOperator(task_id="validate").check(params)
    with pytest.raises(RunConfigError, match="batch_size: 16 is not divisible by the data-par"):
        ValidateRunOperator(task_id="validate").check(params)
