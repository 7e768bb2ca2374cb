"""A night's report: its grid and fits as plots, and a JSON summary, in ``{run folder}/report/``.

* ``isoflop.png`` / ``.svg`` -- the metric against N, one colour per budget: the cells, each
  budget's fitted parabola (Chinchilla approach 2) and its minimum, the cells left out listed
  with their reasons, and each forecast run (its prediction with the interval, and its outcome);
* ``scaling.png`` / ``.svg`` -- N*(C) and L*(C): the budgets' optima, approach 2's power laws
  carried out to the forecast budgets, approach 3's compute-optimal curve, and each forecast
  with its interval and outcome;
* ``report.json`` -- the night in numbers: the cells (metric, or why left out; the time each
  took beside its estimate), both fits, the forecasts with their checks, and the plots with
  their content hashes.

``fit`` writes it before the forecast runs train (no outcome yet) and ``check`` writes it again
with the outcomes; both list the files as lineage artifacts. Same record in, same bytes out
(matplotlib's Agg backend, the SVG's date and hash salt fixed).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

REPORT_FOLDER = "report"
PLOTS = ("isoflop", "scaling")
FORMATS = ("png", "svg")
LEFT_OUT_CHARS = 100  # per line of the IsoFLOP plot's "left out" note: fits inside its axes


def summary(
    run_id: str,
    record: Mapping[str, Any],
    registrations: Mapping[str, Mapping[str, Any]],
    checks: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """``report.json``'s body without its file list: the cells, the fits, and each forecast as
    pre-registered (``registrations``: sha256 -> body) with its check where there is one."""
    by_sha = {c["sha256"]: c for c in checks}
    forecasts = []
    for f in record.get("forecasts") or []:
        registered = registrations.get(f["sha256"]) or {}
        predicted = (registered.get("predicted") or {}).get("metric") or {}
        check = by_sha.get(f["sha256"]) or {}
        forecasts.append(
            {
                "budget": f["cell"]["budget"],
                "label": f["cell"]["label"],
                "params": f["cell"]["plan"]["non_embedding_params"],
                "tokens": f["cell"]["plan"]["tokens"],
                "sha256": f["sha256"],
                "registered_by": registered.get("run_id"),
                "post_hoc": bool(registered.get("post_hoc")),
                "fit": (registered.get("predicted") or {}).get("fit"),
                "predicted": predicted.get("estimate"),
                "interval": [predicted.get("low"), predicted.get("high")],
                "outcome": check.get("outcome") if check.get("checked") else None,
                "relative_error": check.get("relative_error"),
                "inside_interval": check.get("inside_interval"),
                "checked": bool(check.get("checked")),
                "estimate": f["cell"].get("estimate"),
                "actual": check.get("actual"),
            }
        )
    fits = {}
    for name, fit in (record.get("fits") or {}).items():
        fits[name] = {k: v for k, v in fit.items() if k not in ("forecasts",)}
    return {
        "run_id": run_id,
        "cells": [
            {
                k: c.get(k)
                for k in (
                    "index",
                    "label",
                    "budget",
                    "params",
                    "tokens",
                    "metric",
                    "reason",
                    "estimate",
                    "actual",
                )
            }
            for c in record.get("cells") or []
        ],
        "fits": fits,
        "forecasts": forecasts,
    }


def _colours(budgets: Sequence[float]) -> dict[float, Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    n = max(len(budgets) - 1, 1)
    return {b: cmap(0.85 * i / n) for i, b in enumerate(sorted(budgets))}


def _usable(cell: Mapping[str, Any]) -> bool:
    m = cell["metric"]
    return m is not None and math.isfinite(m) and not cell["reason"]


def _forecast_points(ax: Any, forecasts: Sequence[Mapping[str, Any]], x_key: str) -> None:
    """Each forecast's prediction (diamond, interval as an error bar) and outcome (star)."""
    for i, f in enumerate(forecasts):
        if f["predicted"] is None:
            continue
        x = f[x_key]
        low, high = f["interval"]
        yerr = None
        if low is not None and high is not None:
            yerr = [[max(f["predicted"] - low, 0.0)], [max(high - f["predicted"], 0.0)]]
        ax.errorbar(
            [x],
            [f["predicted"]],
            yerr=yerr,
            fmt="D",
            color="crimson",
            mfc="white",
            capsize=4,
            label="forecast (pre-registered)" if i == 0 else None,
            zorder=5,
        )
        if f["outcome"] is not None:
            ax.plot(
                [x],
                [f["outcome"]],
                "*",
                color="crimson",
                ms=13,
                label=f"outcome ({f['relative_error']:+.2%})",
                zorder=6,
            )


def isoflop_figure(night: Mapping[str, Any], metric: str) -> Any:
    """The IsoFLOP curves (see the module docstring)."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5), layout="constrained")
    ax = fig.add_subplot()
    cells = night["cells"]
    colours = _colours(sorted({c["budget"] for c in cells}))
    optima = {o["compute"]: o for o in (night["fits"].get("isoflop") or {}).get("optima") or []}
    beyond = False  # any usable cell outside its budget's parabola window
    for budget, colour in colours.items():
        group = [c for c in cells if c["budget"] == budget]
        used = [c for c in group if _usable(c)]
        optimum = optima.get(budget)
        # The parabola is fitted to the cells around the curve's minimum (optimum["cells"]):
        # those beyond it are drawn hollow, and the curve is drawn over the window only.
        window = set(optimum["cells"]) if optimum else {c["label"] for c in used}
        fitted = [c for c in used if c["label"] in window]
        if not fitted:  # cells recorded without labels the fit knows: draw them all as used
            window, fitted = {c["label"] for c in used}, used
        outside = [c for c in used if c["label"] not in window]
        beyond = beyond or bool(outside)
        ax.plot(
            [c["params"] for c in fitted],
            [c["metric"] for c in fitted],
            "o",
            color=colour,
            label=f"C = {budget:.3g}" + ("" if optimum else " (no fitted minimum)"),
        )
        if outside:
            ax.plot(
                [c["params"] for c in outside],
                [c["metric"] for c in outside],
                "o",
                color=colour,
                mfc="none",
            )
        if optimum and fitted:
            a, b, c = optimum["parabola"]
            xs = np.linspace(
                math.log(min(u["params"] for u in fitted)),
                math.log(max(u["params"] for u in fitted)),
            )
            ax.plot(np.exp(xs), a * xs**2 + b * xs + c, "-", color=colour, lw=1.2)
            ax.plot([optimum["params"]], [optimum["metric"]], "s", color=colour, ms=7, mec="k")
    if beyond:
        ax.plot(
            [], [], "o", color="0.4", mfc="none", label="outside its parabola (approach 3 only)"
        )
    _forecast_points(ax, night["forecasts"], "params")
    # One short line per cell left out (the whole reason is in report.json and on the pages):
    # a long one would run past the axes, and the layout would shrink them to make room.
    left = [
        textwrap.shorten(f"[{c['index']}] {c['label']}: {c['reason']}", LEFT_OUT_CHARS)
        for c in cells
        if not _usable(c)
    ]
    if left:
        ax.text(
            0.01,
            0.01,
            "left out:\n" + "\n".join(left),
            transform=ax.transAxes,
            fontsize=7,
            va="bottom",
            color="0.3",
            in_layout=False,
        )
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title(f"IsoFLOP curves, {night['run_id']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def scaling_figure(night: Mapping[str, Any], metric: str) -> Any:
    """N*(C) and L*(C) (see the module docstring)."""
    import numpy as np
    from matplotlib.figure import Figure

    from trainer.fitting import ParametricFit, PowerLaw

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    ax_n, ax_l = fig.subplots(1, 2)
    iso = night["fits"].get("isoflop") or {}
    para = night["fits"].get("parametric") or {}
    budgets = [c["budget"] for c in night["cells"]] + [f["budget"] for f in night["forecasts"]]
    if budgets:
        cs = np.geomspace(min(budgets), max(budgets), 50)
        optima = iso.get("optima") or []
        if optima:
            ax_n.plot([o["compute"] for o in optima], [o["params"] for o in optima], "s", color="k")
            ax_l.plot(
                [o["compute"] for o in optima],
                [o["metric"] for o in optima],
                "s",
                color="k",
                label="budget minima (approach 2)",
            )
        if "params" in iso:
            for ax, law, symbol in ((ax_n, iso["params"], "N*"), (ax_l, iso["metric"], "L*")):
                power_law = PowerLaw(**law)
                ax.plot(
                    cs,
                    power_law(cs),
                    "-",
                    color="k",
                    label=f"{symbol} = {power_law.coefficient:.3g} C^{power_law.exponent:.3f}",
                )
        if "E" in para:
            fields = ("E", "A", "B", "alpha", "beta", "loss", "flops_per_param_token")
            optimal = ParametricFit(**{k: para[k] for k in fields}).forecast(cs)
            ax_n.plot(cs, optimal["params"], "--", color="tab:blue", label="approach 3")
            ax_l.plot(
                cs, optimal["metric"], "--", color="tab:blue", label="approach 3 (compute-optimal)"
            )
    for f in night["forecasts"]:
        ax_n.plot([f["budget"]], [f["params"]], "D", color="crimson", mfc="white")
    _forecast_points(ax_l, night["forecasts"], "budget")
    for ax, ylabel in ((ax_n, "N* (non-embedding parameters)"), (ax_l, f"L* (held-out {metric})")):
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs C")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_n.set_yscale("log")
    fig.suptitle(f"Scaling laws, {night['run_id']}", fontsize=9)
    return fig


def _render(fig: Any, fmt: str) -> bytes:
    buffer = io.BytesIO()
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    fig.savefig(buffer, format=fmt, dpi=110, metadata=metadata)
    return buffer.getvalue()


def write_report(
    folder: str,
    run_id: str,
    record: Mapping[str, Any],
    registrations: Mapping[str, Mapping[str, Any]],
    checks: Sequence[Mapping[str, Any]] = (),
    metric: str = "loss",
) -> list[tuple[str, str]]:
    """Write the report into ``{folder}/report/`` (local or object store); its files as
    (path, sha256), ``report.json`` last."""
    import fsspec
    import matplotlib

    from operators.steps import join

    night = summary(run_id, record, registrations, checks)
    out = join(folder, REPORT_FOLDER)
    fs, base = fsspec.core.url_to_fs(out)
    fs.makedirs(base, exist_ok=True)
    written: list[tuple[str, str]] = []
    files: dict[str, str] = {}
    with matplotlib.rc_context({"svg.hashsalt": "slipway", "path.simplify": True}):
        for name, draw in (("isoflop", isoflop_figure), ("scaling", scaling_figure)):
            fig = draw(night, metric)
            for fmt in FORMATS:
                data = _render(fig, fmt)
                path = join(out, f"{name}.{fmt}")
                fs.pipe_file(f"{base}/{name}.{fmt}", data)
                digest = hashlib.sha256(data).hexdigest()
                written.append((path, digest))
                files[f"{name}.{fmt}"] = digest
    body = json.dumps({**night, "files": files}, indent=2, sort_keys=True, default=str) + "\n"
    fs.pipe_file(f"{base}/report.json", body.encode())
    written.append((join(out, "report.json"), hashlib.sha256(body.encode()).hexdigest()))
    return written
