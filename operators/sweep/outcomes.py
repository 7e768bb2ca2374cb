"""What a sweep's cells reached, the fits through them, the pre-registered forecasts, the check.

* :func:`cell_outcome` -- one cell's metric from its evaluate step's status marker (SUCCESS),
  or why it has none (the train or the evaluation failed, or never ran), and the time it
  took beside its estimate (:func:`actual_time`);
* :func:`fit_record` -- both fits (:mod:`trainer.fitting`), each with the cells it used and the
  ones it left out with their reason, bootstrap intervals, and the forecasts at the forecast
  budgets; a fit that cannot be made is recorded with its reason instead;
* :func:`preregister` -- a forecast written once, content-addressed
  (``{root}/sweep/forecasts/<sha256>.json``), before its run trains: a later night never
  overwrites it (a create that finds the file leaves it as it was), and the same forecast
  (the run, measured the same way: :func:`registration_key`) keeps its first registration
  (:func:`find_registration`);
* :func:`check_forecast` -- the outcome against the pre-registered prediction: relative error
  and whether it fell inside the interval.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from operators.steps import Status, StatusRecord, Step, join, probe
from operators.steps.store import store_for

BOOTSTRAP_SAMPLES = 100
FORECASTS = "sweep/forecasts"  # below the steps root: one immutable file per forecast


def cell_metric(result: Mapping[str, Any], stores: Sequence[str], metric: str) -> float | None:
    """The metric averaged over ``stores`` from an evaluate step's result, or None."""
    values = [(result.get("results") or {}).get(s, {}).get(metric) for s in stores]
    if not values or any(v is None for v in values):
        return None
    return float(sum(values) / len(values))


def cell_outcome(
    root: str,
    cell: Mapping[str, Any],
    train: Step,
    evaluate: Step,
    stores: Sequence[str],
    metric: str,
) -> dict[str, Any]:
    """``{"index", "label", "budget", "params", "tokens", "metric", "reason", "steps",
    "estimate", "actual"}``: ``actual`` is :func:`actual_time` once the cell has trained."""
    plan = cell["plan"]
    out: dict[str, Any] = {
        "index": cell["index"],
        "label": cell["label"],
        "budget": cell["budget"],
        "params": plan["non_embedding_params"],
        "tokens": plan["tokens"],
        "metric": None,
        "reason": None,
        "steps": {"train": train.key, "evaluate": evaluate.key},
        "estimate": cell.get("estimate"),
        "actual": None,
    }
    trained = probe(root, train).status
    if trained is None or trained.status is not Status.SUCCESS:
        # Its evaluation may have scored a pre-emption checkpoint: not the cell's run.
        state = "never ran" if trained is None else f"{trained.status}: {trained.error}"
        out["reason"] = f"training {state}"
        return out
    out["actual"] = actual_time(trained, plan["flops"], cell.get("estimate") or {})
    evaluated = probe(root, evaluate).status
    if evaluated is None or evaluated.status is not Status.SUCCESS:
        state = "never ran" if evaluated is None else f"{evaluated.status}: {evaluated.error}"
        out["reason"] = f"evaluation {state}"
        return out
    out["metric"] = cell_metric(evaluated.result or {}, stores, metric)
    if out["metric"] is None:
        # The evaluation keeps a NaN or infinite value as null: most likely a diverged run.
        out["reason"] = (
            f"evaluation has no finite {metric} for every store of {list(stores)} (diverged?)"
        )
    elif not math.isfinite(out["metric"]):
        out["reason"] = f"{metric} is {out['metric']}: the run diverged"
    return out


def actual_time(
    marker: StatusRecord, flops: float, estimate: Mapping[str, Any]
) -> dict[str, float | None]:
    """What a trained cell took, beside its estimate: ``wall_seconds`` of the train step's
    successful launch (its status marker: start to end, startup included; after a
    pre-emption, the launch that finished), ``train_seconds`` of its step loop (the trainer's
    result), and where the grid knew them, ``chip_seconds`` (wall x the slice's chips) and
    the ``mfu`` the step loop reached on the accelerator's peak."""
    wall = marker.updated_at - marker.started_at if marker.started_at else None
    train_s = (marker.result or {}).get("train_seconds")
    chips, peak = estimate.get("chips"), estimate.get("peak_flops")
    return {
        "wall_seconds": wall,
        "train_seconds": train_s,
        "chip_seconds": wall * chips if wall is not None and chips else None,
        "mfu": flops / (train_s * peak) if train_s and peak else None,
    }


def fit_record(
    outcomes: Sequence[Mapping[str, Any]],
    forecast_runs: Mapping[float, tuple[float, float]],
    seed: int = 0,
) -> dict[str, Any]:
    """Both fits of the outcomes, with intervals and the forecasts of the runs that will train
    at the forecast budgets (``forecast_runs``: budget -> (N, D)); see the module docstring.

    A fit that cannot be made is recorded with its reason; one whose bootstrap cannot be made
    (too few resamples fitted) keeps its point estimate, its intervals left out and why."""
    from trainer.fitting import Cell, FitError, bootstrap, fit_isoflop, fit_parametric

    cells = [
        Cell(o["budget"], o["params"], o["tokens"], o["metric"], name=o["label"]) for o in outcomes
    ]
    reasons = {o["label"]: o["reason"] for o in outcomes if o["reason"]}
    budgets = sorted(forecast_runs)
    record: dict[str, Any] = {"cells": list(outcomes), "fits": {}}
    for name, fit, make_boot in (
        ("isoflop", fit_isoflop, lambda f: fit_isoflop),
        (
            "parametric",
            fit_parametric,
            lambda f: functools.partial(fit_parametric, starts=[f.start()]),
        ),
    ):
        try:
            point = fit(cells)
        except FitError as exc:
            record["fits"][name] = {"error": str(exc)}
            continue
        entry = {
            **point.to_dict(),
            "excluded": [
                {"cell": e.cell, "reason": reasons.get(e.cell) or e.reason} for e in point.excluded
            ],
            "forecasts": {
                f"{b:.6g}": {
                    k: {"estimate": v, "low": None, "high": None}
                    for k, v in point.forecast(b, *forecast_runs[b]).items()
                }
                for b in budgets
            },
            "intervals": None,
        }
        try:
            boot = bootstrap(
                make_boot(point),
                cells,
                forecast_budgets=budgets,
                forecast_runs=forecast_runs,
                samples=BOOTSTRAP_SAMPLES,
                seed=seed,
            )
        except FitError as exc:
            entry["bootstrap"] = {"error": str(exc)}
        else:
            entry["intervals"] = {k: vars(v) for k, v in boot.quantities.items()}
            entry["forecasts"] = {
                f"{b:.6g}": {k: vars(v) for k, v in per.items()}
                for b, per in boot.forecasts.items()
            }
            entry["bootstrap"] = {"samples": boot.samples, "failed": boot.failed, "seed": seed}
        record["fits"][name] = entry
    return record


def forecast_from(record: Mapping[str, Any], budget: float) -> dict[str, Any] | None:
    """The prediction at ``budget``: approach 3's (it has the irreducible loss) unless a
    parameter of it sits at a bound, then approach 2's, then approach 3's with its warnings;
    None when neither fitted."""
    fits = {n: f for n, f in record["fits"].items() if f and "error" not in f}
    order = ["parametric", "isoflop"]
    if (fits.get("parametric") or {}).get("warnings"):
        order = ["isoflop", "parametric"]
    for name in order:
        if name in fits:
            fit = fits[name]
            return {
                "fit": name,
                "warnings": list(fit.get("warnings") or []),
                **fit["forecasts"][f"{budget:.6g}"],
            }
    return None


def registration_key(train: Step, evaluate: Step, metric: str) -> dict[str, str]:
    """What a forecast is of: the run (its train step) and how its outcome is measured (the
    evaluate step, which names the stores and tokens, and the metric read from it)."""
    return {"train_step": train.key, "evaluate_step": evaluate.key, "metric": metric}


def find_registration(root: str, key: Mapping[str, str]) -> tuple[str, dict[str, Any]] | None:
    """The earliest pre-registration of the same forecast (:func:`registration_key`), or None:
    a night that measures the same run another way (bits/byte instead of loss, other stores)
    forecasts afresh instead of being held to a prediction of something else. A registration
    written before the evaluate step was part of the key matches on the rest."""
    import fsspec

    folder = join(root, FORECASTS)
    fs, path = fsspec.core.url_to_fs(folder)
    if not fs.exists(path):
        return None
    found = []
    for name in sorted(fs.ls(path, detail=False)):
        if not str(name).endswith(".json"):
            continue
        body = json.loads(fs.cat_file(name))
        # The run must be the same; a field the registration does not record matches
        if body.get("train_step") == key["train_step"] and all(
            body.get(k, v) == v for k, v in key.items()
        ):
            uri = join(folder, str(name).rsplit("/", 1)[-1])
            found.append((body.get("registered_at", 0.0), uri, body))
    if not found:
        return None
    _, uri, body = min(found, key=lambda item: item[:2])
    return uri, body


def preregister(root: str, body: Mapping[str, Any]) -> tuple[str, str, bool]:
    """Write a forecast once; (path, sha256, created). Its name is its content's hash (the
    registration time included), and nothing ever replaces one."""
    data = json.dumps({**body}, indent=2, sort_keys=True).encode() + b"\n"
    digest = hashlib.sha256(data).hexdigest()
    path = join(root, FORECASTS, f"{digest}.json")
    store = store_for(root)
    store.makedirs(join(root, FORECASTS))
    created = store.create(path, data)
    return path, digest, created


def forecast_body(
    run_id: str,
    cell: Mapping[str, Any],
    key: Mapping[str, str],
    prediction: Mapping[str, Any],
    record: Mapping[str, Any],
) -> dict[str, Any]:
    """What a pre-registration holds: the budget, what is forecast (``key``:
    :func:`registration_key`), the prediction, and the cells the fits could use (a cell left
    out with a reason, a diverged one included, is not an input)."""
    used = [
        {"label": o["label"], "steps": o["steps"], "metric": o["metric"]}
        for o in record["cells"]
        if o["metric"] is not None and o.get("reason") is None
    ]
    return {
        "registered_at": time.time(),
        "run_id": run_id,
        "budget": cell["budget"],
        **key,
        "config": cell["plan"],
        "estimate": cell.get("estimate"),
        "predicted": dict(prediction),
        "fit_inputs": used,
    }


def check_forecast(
    forecast: Mapping[str, Any], outcome: float | None, metric: str | None = None
) -> dict[str, Any]:
    """The outcome (of ``metric``, where given) against its pre-registered prediction
    (``inside_interval`` None when the prediction had no interval). An outcome of another
    metric than the one forecast is never compared."""
    predicted = forecast["predicted"]["metric"]
    if metric is not None and forecast.get("metric") not in (None, metric):
        return {
            "outcome": outcome,
            "checked": False,
            "reason": f"forecast of {forecast['metric']}, measured {metric}: not comparable",
        }
    if outcome is None or not math.isfinite(outcome):
        return {"outcome": outcome, "checked": False, "reason": "the forecast run has no metric"}
    low, high = predicted.get("low"), predicted.get("high")
    return {
        "outcome": outcome,
        "checked": True,
        "predicted": predicted["estimate"],
        "relative_error": (outcome - predicted["estimate"]) / outcome,
        "inside_interval": None if low is None or high is None else low <= outcome <= high,
        "interval": [low, high],
    }
