"""The report pages as HTML strings: the runs list, a run, an artifact's lineage, the sweeps.

Rendered from ``templates/`` with Jinja2, autoescaped: run ids, errors and tracebacks are user-
or code-supplied text and are never trusted as markup. ``base`` is where the plugin's pages are
mounted (``/slipway`` under the Airflow API server), or None for the static report, which
links nowhere and carries its images inline. Nothing here knows about Airflow or HTTP.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import cache
from typing import Any

from operators.lineage.render import near_chance
from operators.lineage.schema import ExecutionState
from operators.lineage.store import (
    ArtifactRecord,
    LineageStore,
    NotFound,
    RunSummary,
    TraceNode,
)
from operators.reports.plots import loss_png
from operators.reports.view import RunView, loss_curve, run_view

SWEEP_DAG = "slipway_scaling_sweep"
SWEEP_PLOTS = ("isoflop", "scaling")


@cache
def _env() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("operators.reports", "templates"),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["step_name"] = step_name
    env.globals.update(
        fmt_num=fmt_num, fmt_duration=fmt_duration, duration=run_duration, near_chance=near_chance
    )
    return env


def step_name(key: str) -> str:
    """``train-1a2b3c4d`` (a step's key in the run summary) -> ``train``."""
    name, _, version = key.rpartition("-")
    return name if name and len(version) == 8 else key


def fmt_num(value: Any, digits: int = 4) -> str:
    if not isinstance(value, int | float | str) or isinstance(value, bool):  # None, Undefined
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "running"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(seconds), 60)
    return (
        f"{minutes} min {s:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
    )


def run_duration(run: RunSummary) -> str:
    if run.ended_at is None:
        return "running"
    return fmt_duration((run.ended_at - run.started_at).total_seconds())


def _render(template: str, base: str | None, **context: Any) -> str:
    written_at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return _env().get_template(template).render(base=base, written_at=written_at, **context)


def png_data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


# -- errors ---------------------------------------------------------------------------------------

_ERROR_TITLES = {400: "Bad request", 403: "Not allowed", 404: "Not found", 422: "Bad request"}


def error_page(status: int, detail: str, base: str) -> str:
    """An error as a page a person can read, with the way back (API clients get text)."""
    title = _ERROR_TITLES.get(status, "Error")
    return _render("error.html", base, status=status, title=title, detail=detail)


# -- the runs list -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunFilters:
    pipeline: str = ""
    state: str = ""
    q: str = ""

    def keep(self, run: RunSummary) -> bool:
        return (
            (not self.pipeline or run.pipeline == self.pipeline)
            and (not self.state or str(run.state) == self.state)
            and (not self.q or self.q.lower() in run.run_id.lower())
        )


def with_dag_run_states(
    runs: Sequence[RunSummary], states: Mapping[tuple[str, str], str]
) -> list[RunSummary]:
    """``runs`` with the state Airflow gives each DAG run (``states``: by dag id and run id),
    where it has one. Lineage sees only the steps that recorded something: between two
    tasks of a running DAG run every recorded step is done, and the run would read COMPLETE;
    and a step that failed once and passed on its retry leaves a FAILED execution behind."""
    return [
        dataclasses.replace(r, state=states[r.pipeline, r.run_id])
        if r.pipeline and (r.pipeline, r.run_id) in states
        else r
        for r in runs
    ]


def runs_page(runs: Sequence[RunSummary], base: str, filters: RunFilters | None = None) -> str:
    """Every run (``LineageStore.runs()``, newest first) that passes ``filters``."""
    filters = filters or RunFilters()
    shown = [r for r in runs if filters.keep(r)]
    return _render(
        "runs.html",
        base,
        runs=shown,
        total=len(runs),
        filters=filters,
        pipelines=sorted({r.pipeline for r in runs if r.pipeline}),
        states=[str(s) for s in ExecutionState],
    )


# -- one run -------------------------------------------------------------------------------------


def run_page(
    store: LineageStore,
    run_id: str,
    base: str | None,
    *,
    loss_src: str | None = None,
    dag_run_state: str | None = None,
) -> str:
    """The run page (and the static report, with ``base=None``): ``loss_src`` is the loss
    plot's URL; None draws it here, inline as a data URI. ``dag_run_state``: Airflow's state
    of the DAG run, shown instead of lineage's (:func:`with_dag_run_states`). ``NotFound``
    for an unknown run."""
    view = run_view(store.run_graph(run_id))
    if dag_run_state is not None and dag_run_state != view.state:
        view = dataclasses.replace(view, state=dag_run_state)
    if loss_src is None:
        loss_src = png_data_uri(loss_png(loss_curve(view.training)))
    return _render(
        "run.html",
        base,
        v=view,
        loss_src=loss_src,
        checkpoint_raw=checkpoint_raw_inputs(store, view),
        sweep_dag=SWEEP_DAG,
    )


def checkpoint_raw_inputs(store: LineageStore, view: RunView) -> list[ArtifactRecord]:
    """The raw inputs (corpora, evaluation sets) the run's checkpoint was made from."""
    if view.training is None:
        return []
    try:
        trace = store.trace(view.training.checkpoint, view.training.checkpoint_version)
    except NotFound:  # recorded without this version
        return []
    return trace.raw_inputs()


# -- lineage -------------------------------------------------------------------------------------


def trace_page(root: TraceNode, base: str) -> str:
    """An artifact traced back to its raw inputs (``LineageStore.trace``): a graph, the raw
    inputs with their content hashes, and the producers step by step with code version and
    container image."""
    return _render(
        "trace.html",
        base,
        root=root,
        raw=root.raw_inputs(),
        graph_svg=lineage_svg(root),
        producers=producers(root),
    )


def producers(root: TraceNode) -> list[TraceNode]:
    """Each execution of the trace once, raw inputs' first and the artifact's producer last
    (a node reached along several paths, as a token store read by train and evaluate, is
    listed where it is first needed)."""
    seen: set[int] = set()
    order: list[TraceNode] = []

    def visit(node: TraceNode) -> None:
        if node.producer is None or node.producer.id in seen:
            return
        seen.add(node.producer.id)
        for child in node.inputs:
            visit(child)
        order.append(node)

    visit(root)
    return order


_BOX_W, _BOX_H, _GAP_X, _GAP_Y = 230, 30, 14, 26


def lineage_svg(root: TraceNode) -> str:
    """The trace as a top-down graph: raw inputs at the top, the artifact at the bottom, each
    producing execution between its inputs and its output. Drawn here as SVG: no
    script, no layout library; an artifact or execution reached twice is one node."""
    nodes: dict[str, tuple[int, str, str]] = {}  # key -> (depth, label, css class)
    edges: set[tuple[str, str]] = set()

    deepest: dict[int, int] = {}  # a shared node's subtree is laid out again only deeper

    def visit(node: TraceNode, depth: int) -> str:
        key = f"a{node.artifact.id}"
        if deepest.get(id(node), -1) >= depth:
            return key
        deepest[id(node)] = depth
        previous = nodes.get(key)
        if previous is None or previous[0] < depth:
            kind = "raw" if node.producer is None or not node.inputs else "artifact"
            label = f"{node.artifact.type}: {node.artifact.uri.rstrip('/').rsplit('/', 1)[-1]}"
            nodes[key] = (depth, label, kind)
        if node.producer is not None:
            ex_key = f"e{node.producer.id}"
            ex_prev = nodes.get(ex_key)
            if ex_prev is None or ex_prev[0] < depth + 1:
                nodes[ex_key] = (depth + 1, f"{node.producer.name} ({node.producer.state})", "exec")
            edges.add((ex_key, key))
            for child in node.inputs:
                edges.add((visit(child, depth + 2), ex_key))
        return key

    visit(root, 0)
    max_depth = max(d for d, _, _ in nodes.values())
    levels: dict[int, list[str]] = {}
    for key, (depth, _, _) in sorted(nodes.items(), key=lambda kv: kv[1][1]):
        levels.setdefault(max_depth - depth, []).append(key)
    widest = max(len(k) for k in levels.values())
    where = {}
    for level, keys in levels.items():
        indent = (widest - len(keys)) * (_BOX_W + _GAP_X) / 2  # each level centred
        for i, key in enumerate(keys):
            where[key] = (10 + indent + i * (_BOX_W + _GAP_X), 10 + level * (_BOX_H + _GAP_Y))
    width = 20 + widest * (_BOX_W + _GAP_X)
    height = 20 + (max_depth + 1) * (_BOX_H + _GAP_Y)
    fill = {"raw": "#fff8c5", "artifact": "#ddf4ff", "exec": "#f6f8fa"}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11" role="img" aria-label="lineage graph">'
    ]
    for src, dst in sorted(edges):
        (x1, y1), (x2, y2) = where[src], where[dst]
        parts.append(
            f'<line x1="{x1 + _BOX_W / 2}" y1="{y1 + _BOX_H}" x2="{x2 + _BOX_W / 2}" y2="{y2}" '
            'stroke="#8c959f" stroke-width="1"/>'
        )
    for key, (_, label, kind) in nodes.items():
        x, y = where[key]
        text = html.escape(label if len(label) <= 36 else label[:35] + "…")
        parts.append(
            f'<g class="node {kind}"><title>{html.escape(label)}</title>'
            f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="{4 if kind != "exec" else 12}" '
            f'fill="{fill[kind]}" stroke="#57606a"/>'
            f'<text x="{x + 8}" y="{y + _BOX_H / 2 + 4}">{text}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


# -- the sweep -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Night:
    run: RunSummary
    report: Mapping[str, Any] | None  # the night's report/report.json (operators/sweep/figures.py)

    @property
    def fit_lines(self) -> list[str]:
        from operators.sweep.report import fit_line

        fits = (self.report or {}).get("fits") or {}
        return [fit_line(name, fit).strip() for name, fit in fits.items()]


def night_report(run_id: str) -> dict[str, Any] | None:
    from operators.settings import run_folder
    from operators.steps import join
    from operators.sweep.figures import REPORT_FOLDER
    from trainer.rundir import read_json

    return read_json(join(run_folder(run_id), REPORT_FOLDER, "report.json"))


def sweeps_page(runs: Sequence[RunSummary], base: str, night_id: str | None = None) -> str:
    """The sweep's nights, one night (``night_id``, default the newest) with its grid, fits and
    plots, and every pre-registered forecast with its outcome, oldest night first."""
    nights = [Night(r, night_report(r.run_id)) for r in runs if r.pipeline == SWEEP_DAG]
    night = next((n for n in nights if n.run.run_id == night_id), nights[0] if nights else None)
    forecasts = [
        {"night": n.run.run_id, "f": f}
        for n in sorted(nights, key=lambda n: n.run.started_at)
        for f in (n.report or {}).get("forecasts") or []
    ]
    return _render(
        "sweeps.html",
        base,
        nights=nights,
        night=night,
        forecasts=forecasts,
        plots=SWEEP_PLOTS,
        sweep_dag=SWEEP_DAG,
    )


def sweep_plot(run_id: str, plot: str) -> bytes | None:
    """A night's ``report/<plot>.png``, or None (no such plot, or not written yet)."""
    if plot not in SWEEP_PLOTS:
        return None
    import fsspec

    from operators.settings import run_folder
    from operators.steps import join
    from operators.sweep.figures import REPORT_FOLDER

    try:
        with fsspec.open(join(run_folder(run_id), REPORT_FOLDER, f"{plot}.png"), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
