"""The sweep as text: its nights, one night's grid, fits, forecasts and checks, and every
forecast against its outcome across nights (``slipway sweep ...``).

Reads what the sweep's tasks wrote: the run folder's ``sweep.json`` (grid outcomes, fits,
forecasts) and ``forecast_checks.json``, and the lineage store's runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SWEEP_DAG = "slipway_scaling_sweep"


def read_night(run_id: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(``sweep.json``, ``forecast_checks.json``) of a night; (None, []) before its fit."""
    from operators.settings import run_folder
    from operators.steps import join
    from trainer.rundir import read_json

    folder = run_folder(run_id)
    return read_json(join(folder, "sweep.json")), list(
        read_json(join(folder, "forecast_checks.json")) or []
    )


def render_nights(runs: Sequence[Any]) -> str:
    nights = [r for r in runs if r.pipeline == SWEEP_DAG]
    if not nights:
        return f"no {SWEEP_DAG} runs recorded"
    lines = [f"{'run id':<48} {'state':<10} started"]
    lines += [f"{r.run_id:<48} {r.state!s:<10} {r.started_at:%Y-%m-%d %H:%M}" for r in nights]
    return "\n".join(lines)


def fit_line(name: str, fit: Mapping[str, Any]) -> str:
    if "error" in fit:
        return f"  {name}: not fitted: {fit['error']}"
    if name == "isoflop":
        n, d = fit["params"], fit["tokens"]
        return (
            f"  isoflop (approach 2): N* = {n['coefficient']:.3g} C^{n['exponent']:.3f}, "
            f"D* = {d['coefficient']:.3g} C^{d['exponent']:.3f}, "
            f"{len(fit['optima'])} budget minima"
        )
    ci = fit.get("intervals") or {}

    def q(key: str) -> str:
        low, high = ci.get(key, {}).get("low"), ci.get(key, {}).get("high")
        span = f" [{low:.3g}, {high:.3g}]" if low is not None else ""
        return f"{fit[key]:.3g}{span}"

    warnings = "".join(f"\n    warning: {w}" for w in fit.get("warnings") or ())
    return (
        f"  parametric (approach 3): L = {q('E')} + {q('A')}/N^{q('alpha')} + "
        f"{q('B')}/D^{q('beta')}, {len(fit['cells'])} cells{warnings}"
    )


def _time(cell: Mapping[str, Any]) -> str:
    """``wall estimate``: the train step's wall seconds and the accelerator-time estimate
    (``-`` where there is none: not trained, or a chip without a known peak, as on CPU)."""
    actual = (cell.get("actual") or {}).get("wall_seconds")
    estimate = (cell.get("estimate") or {}).get("seconds")
    return " ".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in (actual, estimate))


def interval_text(metric: Mapping[str, Any]) -> str:
    """A forecast's interval to the estimate's precision, or why it has none."""
    low, high = metric.get("low"), metric.get("high")
    return "(no interval)" if low is None or high is None else f"[{low:.4f}, {high:.4f}]"


def render_night(run_id: str, record: Mapping[str, Any] | None, checks: Sequence[Any]) -> str:
    if record is None:
        return f"{run_id}: no fit recorded yet (the night has not reached its fit task)"
    lines = [f"sweep {run_id}", "", f"grid:{'metric':>47} {'time (s)':>9} {'estimate':>9}"]
    for cell in record["cells"]:
        metric = f"{cell['metric']:.4f}" if cell["metric"] is not None else "-"
        note = f"  left out: {cell['reason']}" if cell["reason"] else ""
        lines.append(f"  [{cell['index']}] {cell['label']:<32} {metric:>9} {_time(cell):>19}{note}")
    lines += ["", "fits:"]
    lines += [fit_line(name, fit) for name, fit in record["fits"].items()]
    lines += ["", "forecasts:"]
    by_sha = {c["sha256"]: c for c in checks}
    for forecast in record.get("forecasts") or []:
        from trainer.rundir import read_json

        registered = read_json(forecast["path"]) or {}
        if not registered:
            lines.append(f"  {forecast['path']}: missing")
            continue
        m = registered["predicted"]["metric"]
        lines.append(
            f"  C={registered['budget']:.3g}: {registered['metric']} {m['estimate']:.4f} "
            f"{interval_text(m)} ({registered['predicted']['fit']} fit), "
            f"pre-registered {forecast['sha256'][:12]} by {registered.get('run_id')}"
        )
        if registered.get("post_hoc"):
            lines.append("    registered after its run had trained: not a test")
        for warning in registered["predicted"].get("warnings") or ():
            lines.append(f"    warning: {warning}")
        check = by_sha.get(forecast["sha256"])
        if check and check.get("checked"):
            inside = {True: "inside", False: "outside", None: "no interval for"}[
                check["inside_interval"]
            ]
            lines.append(
                f"    outcome {check['outcome']:.4f}: relative error "
                f"{check['relative_error']:+.2%}, {inside} the interval"
            )
        elif check:
            lines.append(f"    not checked: {check.get('reason')}")
        else:
            lines.append("    not checked yet")
    return "\n".join(lines)


def render_forecasts(runs: Sequence[Any]) -> str:
    """Every forecast and its outcome, oldest first: the forecast record. A pre-registration
    is listed once, under the night that made it, with its first check that has an outcome:
    a later night that keeps it (the same grid, so the same fit) is not another forecast."""
    first: dict[str, tuple[str, Mapping[str, Any], Mapping[str, Any]]] = {}
    for run in sorted((r for r in runs if r.pipeline == SWEEP_DAG), key=lambda r: r.started_at):
        record, checks = read_night(run.run_id)
        by_sha = {c["sha256"]: c for c in checks}
        for forecast in (record or {}).get("forecasts") or []:
            check = by_sha.get(forecast["sha256"]) or {}
            kept = first.get(forecast["sha256"])
            if kept is None:
                first[forecast["sha256"]] = (run.run_id, forecast, check)
            elif not kept[2].get("checked") and check.get("checked"):
                first[forecast["sha256"]] = (kept[0], kept[1], check)
    rows = []
    for run_id, forecast, check in first.values():
        predicted = check.get("predicted")
        rows.append(
            f"{run_id:<48} C={forecast['cell']['budget']:<9.3g} "
            + (
                f"predicted {predicted:.4f} outcome {check['outcome']:.4f} "
                f"error {check['relative_error']:+.2%} "
                f"{ {True: 'inside', False: 'outside', None: 'no interval'}[check['inside_interval']] }"
                if check.get("checked")
                else "not checked"
            )
        )
    return "\n".join(rows) if rows else "no forecasts recorded"
