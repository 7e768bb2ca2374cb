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
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from functools import cache
from typing import Any, TypeVar
from urllib.parse import quote

from markupsafe import Markup

from operators.lineage.render import (
    BELOW_CHANCE_NOTE,
    CHANCE_NOTE,
    below_chance,
    near_chance,
)
from operators.lineage.schema import ExecutionState
from operators.lineage.store import (
    ArtifactRecord,
    LineageStore,
    NotFound,
    RunSummary,
    TraceNode,
)
from operators.promotion import PROMOTED_MODEL, Promotion, current_promotion
from operators.reports.plots import loss_png
from operators.reports.view import RunResult, RunView, loss_curve, run_view, step_name
from operators.sweep.report import SWEEP_DAG

PIPELINE_DAG = "slipway_pipeline"
SLIPWAY_DAGS = (PIPELINE_DAG, SWEEP_DAG)  # dags/: whose runs the list shows before they record
SWEEP_PLOTS = ("isoflop", "scaling")
LIVE_REFRESH_S = 30  # a running run's page reloads itself this often (new steps, the loss)


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
    env.filters["setting"] = fmt_setting
    env.filters["breakable"] = breakable
    env.tests["below_chance"] = below_chance
    env.globals.update(
        fmt_num=fmt_num,
        fmt_count=fmt_count,
        fmt_duration=fmt_duration,
        duration=run_duration,
        near_chance=near_chance,
        below_chance=below_chance,
        chance_note=CHANCE_NOTE,
        below_chance_note=BELOW_CHANCE_NOTE,
        changed_settings=changed_settings,
        trace_href=_trace_link,
        queued_unrecorded=queued_unrecorded,
    )
    return env


def breakable(text: Any) -> Markup:
    """``text`` escaped, with a line-break opportunity after each ``/``, ``_`` and ``:``: step
    names and drop reasons wrap between their parts in a narrow column, never mid-word."""
    escaped = str(Markup.escape(text))
    for mark in "/_:":
        escaped = escaped.replace(mark, mark + "<wbr>")
    return Markup(escaped)


def fmt_num(value: Any, digits: int = 4) -> str:
    if not isinstance(value, int | float | str) or isinstance(value, bool):  # None, Undefined
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def fmt_count(value: Any) -> str:
    """A count with thousands separators (``5,123,456``); "" for none."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    return f"{value:,}" if isinstance(value, int) or value.is_integer() else f"{value:,.1f}"


def fmt_setting(value: Any) -> str:
    """A form value as the form takes it: JSON for objects and lists, strings bare."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(", ", ": "))


def changed_settings(
    properties: Mapping[str, Any], brief_chars: int = 24, most: int | None = None
) -> str:
    """The settings a run's first task recorded (``RunSummary.properties``) that left the
    form's defaults, briefly: ``steps=500, learning_rate=0.01, stage_configs`` (a value longer
    than ``brief_chars``, or an object, by its name; past ``most`` of them, how many more).
    What tells runs apart at a glance."""
    params = properties.get("params") or {}
    changed = list(properties.get("changed") or ())
    parts = []
    if most is not None and len(changed) > most:
        changed, more = changed[:most], len(changed) - most
    else:
        more = 0
    for name in changed:
        value = params.get(name)
        shown = fmt_setting(value)
        scalar = isinstance(value, str | int | float | bool | None)
        parts.append(f"{name}={shown}" if scalar and len(shown) <= brief_chars else name)
    return ", ".join(parts) + (f" and {more} more" if more else "")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "running"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(seconds), 60)
    return (
        f"{minutes} min {s:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
    )


def queued_unrecorded(run: RunSummary) -> bool:
    """Queued in Airflow with nothing in lineage yet: its start is when it was queued."""
    return run.state == "QUEUED" and not run.counts


def run_duration(run: RunSummary) -> str:
    if run.ended_at is None:
        return "queued" if run.state == "QUEUED" else "running"
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


@dataclasses.dataclass(frozen=True)
class DagRun:
    """Airflow's own record of a DAG run: its state in the pages' words, and its times
    (None until it has them: a queued run has not started)."""

    state: str
    started_at: datetime | None = None
    ended_at: datetime | None = None


_Run = TypeVar("_Run", RunSummary, RunView)
_GOING = ("QUEUED", "RUNNING")  # Airflow's states of a DAG run that has not ended


def _as_airflow_has_it(run: _Run, dag_run: DagRun) -> _Run:
    """``run`` with Airflow's state and, once the DAG run has started, its start and end:
    the times Airflow's own pages show beside ours (a cleared run's are its rerun's). A run
    that has not ended has no end, whatever its earlier executions left."""
    going = dag_run.state in _GOING
    if dag_run.started_at is None:  # queued: lineage's start, if it has one
        ended_at = None if going else run.ended_at
        return dataclasses.replace(run, state=dag_run.state, ended_at=ended_at)
    ended_at = None if going else dag_run.ended_at
    return dataclasses.replace(
        run, state=dag_run.state, started_at=dag_run.started_at, ended_at=ended_at
    )


def with_dag_runs(
    runs: Sequence[RunSummary], dag_runs: Mapping[tuple[str, str], DagRun]
) -> list[RunSummary]:
    """``runs`` as Airflow has each DAG run (``dag_runs``: by dag id and run id), where it
    has one, newest start first again. Lineage sees only the steps that recorded something:
    between two tasks of a running DAG run every recorded step is done, and the run would
    read COMPLETE; a step that failed once and passed on its retry leaves a FAILED execution
    behind; and the run's first and last executions are not quite when Airflow started and
    ended it."""
    shown = [
        _as_airflow_has_it(r, dag_runs[r.pipeline, r.run_id])
        if r.pipeline and (r.pipeline, r.run_id) in dag_runs
        else r
        for r in runs
    ]
    return sorted(shown, key=lambda s: (s.started_at, s.run_id), reverse=True)


def not_yet_recorded(
    waiting: Mapping[tuple[str, str], tuple[DagRun, datetime]], runs: Sequence[RunSummary]
) -> list[RunSummary]:
    """The DAG runs Airflow has queued or started (``waiting``: by dag id and run id, with when
    each was queued) whose run id none of lineage's ``runs`` (all of them, readable or not)
    has yet, as runs of the list: with Airflow's state, started when queued until Airflow
    starts them, and no executions. A run id lineage has under another DAG is left out: its
    page would be that run's."""
    recorded = {r.run_id for r in runs}
    return [
        _as_airflow_has_it(
            RunSummary(run_id, dag_id, ExecutionState.RUNNING, queued_at, None, {}), dag_run
        )
        for (dag_id, run_id), (dag_run, queued_at) in waiting.items()
        if run_id not in recorded
    ]


RUNS_PER_PAGE = 200  # rows of the runs list: a year of nightly sweeps and triggers is thousands


def runs_page(
    runs: Sequence[RunSummary],
    base: str,
    filters: RunFilters | None = None,
    results: Mapping[str, RunResult] | None = None,
    page: int = 1,
) -> str:
    """The runs (``LineageStore.runs()``, newest first) that pass ``filters``, ``RUNS_PER_PAGE``
    a page (``page`` 1 is the newest; one past the last shows the last), each with its
    ``results`` (:func:`~operators.reports.view.run_results`, by run id) where it has some."""
    filters = filters or RunFilters()
    matching = [r for r in runs if filters.keep(r)]
    pages = max(1, -(-len(matching) // RUNS_PER_PAGE))
    page = min(max(page, 1), pages)
    first = (page - 1) * RUNS_PER_PAGE
    shown = matching[first : first + RUNS_PER_PAGE]
    query = {k: v for k, v in dataclasses.asdict(filters).items() if v}
    return _render(
        "runs.html",
        base,
        runs=shown,
        first=first,
        matching=len(matching),
        page=page,
        pages=pages,
        page_query=lambda n: {**query, "page": n},
        results=results or {},
        no_result=RunResult(),
        total=len(runs),
        filters=filters,
        pipelines=sorted({r.pipeline for r in runs if r.pipeline}),
        states=["QUEUED", *(str(s) for s in ExecutionState)],  # QUEUED: Airflow's alone
    )


# -- one run -------------------------------------------------------------------------------------


def run_page(
    store: LineageStore,
    run_id: str,
    base: str | None,
    *,
    loss_src: str | None = None,
    dag_run: DagRun | None = None,
    started_at: datetime | None = None,
    may_read_run: Callable[[str], bool] = lambda run_id: True,
) -> str:
    """The run page (and the static report, with ``base=None``): ``loss_src`` is the loss
    plot's URL; None draws it here, inline as a data URI. ``dag_run``: Airflow's record of
    the DAG run, whose state and times are shown instead of lineage's
    (:func:`with_dag_runs`); while Airflow says it is going, the page reloads itself.
    ``started_at``: Airflow's start of the DAG run when its record is not at hand (the static
    report, written by the run's last task). ``may_read_run``: whether the reader may see
    another run (the one whose promotion replaced this run's, named only if so). ``NotFound``
    for an unknown run."""
    view = run_view(store.run_graph(run_id))
    if dag_run is not None:
        view = _as_airflow_has_it(view, dag_run)
    elif started_at is not None:
        view = dataclasses.replace(view, started_at=started_at)
    unfinished = view.training is None and view.train_output is not None
    curve = loss_curve(view) if unfinished or loss_src is None else []  # read once
    if loss_src is None:
        loss_src = png_data_uri(loss_png(curve))
    replaced_by = promotion_replacing(store, view)
    return _render(
        "run.html",
        base,
        v=view,
        loss_src=loss_src,
        checkpoint_raw=checkpoint_raw_inputs(store, view),
        replaced_by=replaced_by,
        # how far a training without a final checkpoint got (failed, or still running)
        last_logged=curve[-1] if unfinished and curve else None,
        replaced_by_shown=bool(
            replaced_by and replaced_by.run_id and may_read_run(replaced_by.run_id)
        ),
        sweep_dag=SWEEP_DAG,
        live=base is not None and dag_run is not None and dag_run.state in _GOING,
        refresh_s=LIVE_REFRESH_S,
    )


def pending_page(
    run_id: str,
    dag_id: str,
    dag_run: DagRun,
    base: str,
    running: Sequence[str] = (),
    paused: bool | None = None,
) -> str:
    """A DAG run Airflow has but lineage does not yet (queued, or before its first task
    recorded anything): its state, reloading while it is going, and why a queued one waits
    where Airflow says: the DAG is ``paused``, or other runs of it are ``running`` (both
    Slipway DAGs run one DAG run at a time)."""
    return _render(
        "pending.html",
        base,
        run_id=run_id,
        dag_id=dag_id,
        dag_run=dag_run,
        going=dag_run.state in _GOING,
        refresh_s=LIVE_REFRESH_S,
        running=[r for r in running if r != run_id],
        paused=paused,
    )


def promotion_replacing(store: LineageStore, view: RunView) -> Promotion | None:
    """The model name's current promotion, when a later one replaced the model this run
    promoted (None when this run's promotion is still current, or it promoted nothing)."""
    gate = view.gate or {}
    if not (gate.get("promoted") and gate.get("model_name")):
        return None
    current = current_promotion(store, gate["model_name"])
    if current is None or current.version == gate.get("version"):
        return None
    return current


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


_OTHER_VERSIONS_SHOWN = 10


def trace_page(
    root: TraceNode,
    base: str,
    *,
    versions: Sequence[str] = (),
    asked_version: str | None = None,
) -> str:
    """An artifact traced back to its raw inputs (``LineageStore.trace``): which version was
    traced and who wrote it, a graph, the raw inputs with their content hashes, and the
    producers step by step with code version and container image. ``versions``: the
    recorded versions of the artifact's URI the reader may see, newest first (the newest
    others are linked); ``asked_version``: the version the request named, None for "the
    latest"."""
    others = [v for v in versions if v != root.artifact.version]
    shown = cut_at_earlier_promotions(root)
    leaves = shown.raw_inputs()
    raw = [a for a in leaves if a.type != PROMOTED_MODEL]
    return _render(
        "trace.html",
        base,
        root=root,
        raw=raw,
        # a version that is its content hash ("sha256:<hash>", as corpora's are) needs no column
        version_column=any(
            not (a.content_hash and a.version.endswith(a.content_hash)) for a in raw
        ),
        baselines=[a for a in leaves if a.type == PROMOTED_MODEL],
        graph_svg=lineage_svg(shown, base),
        producers=producers(shown),
        wrote=outputs_by_producer(shown),
        asked_version=asked_version,
        latest_version=versions[0] if versions else None,
        version_count=len(versions),
        other_versions=others[:_OTHER_VERSIONS_SHOWN],
        more_versions=max(0, len(others) - _OTHER_VERSIONS_SHOWN),
        facts=recorded_facts(root.artifact),
    )


def recorded_facts(artifact: ArtifactRecord) -> list[tuple[str, Any]]:
    """What its step recorded with the artifact, the plain values only (a checkpoint's steps
    and losses, an export's dtype and step, a promotion's run and checkpoint): counts first,
    then properties. Nested values (drop reasons, a promotion's metrics) have pages of their
    own: the run page."""
    plain = (str, int, float, bool)
    return [
        (key, value)
        for fields in (artifact.counts or {}, artifact.properties or {})
        for key, value in fields.items()
        if isinstance(value, plain) and value != ""
    ]


def cut_at_earlier_promotions(root: TraceNode) -> TraceNode:
    """The trace with every promoted model but ``root`` as a leaf. The gate reads the model it
    may replace, so each promotion's trace holds every earlier promotion's whole chain (141
    nodes after five): an earlier model is linked to its own trace instead."""
    memo: dict[int, TraceNode] = {}

    def cut(node: TraceNode, is_root: bool) -> TraceNode:
        if id(node) not in memo:
            if not is_root and node.artifact.type == PROMOTED_MODEL:
                memo[id(node)] = TraceNode(node.artifact, None, ())  # one node, linked
            else:
                inputs = tuple(cut(child, False) for child in node.inputs)
                memo[id(node)] = TraceNode(node.artifact, node.producer, inputs)
        return memo[id(node)]

    return cut(root, True)


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


def outputs_by_producer(root: TraceNode) -> dict[int, list[ArtifactRecord]]:
    """What each execution of the trace wrote that the trace passes through, by execution id
    (``fetch`` wrote every corpus file the trace reaches, not just the first)."""
    wrote: dict[int, dict[int, ArtifactRecord]] = {}
    seen: set[int] = set()

    def visit(node: TraceNode) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if node.producer is not None:
            wrote.setdefault(node.producer.id, {})[node.artifact.id] = node.artifact
        for child in node.inputs:
            visit(child)

    visit(root)
    return {ex: list(artifacts.values()) for ex, artifacts in wrote.items()}


_BOX_W, _BOX_H, _GAP_X, _GAP_Y = 270, 30, 14, 26
_LABEL_CHARS = 44  # what a box holds at 11 px; longer labels are cut (the tooltip has it all)


_STEP_FOLDER = re.compile(r".+-[0-9a-f]{8}")  # a step's output folder: <name>-<version[:8]>


def short_uri(uri: str) -> str:
    """An artifact's URI in a few words: from its step's folder on (``quality-4d81b2b6/output``,
    ``train-7c2015bf/…/step-000000200``), else its last part (``brown.tar.gz``)."""
    parts = uri.rstrip("/").split("/")
    folder = next(
        (i for i in range(len(parts) - 2, -1, -1) if _STEP_FOLDER.fullmatch(parts[i])), None
    )
    if folder is None:
        return parts[-1]
    return "/".join([parts[folder], *(["…"] if folder < len(parts) - 2 else []), parts[-1]])


def trace_href(base: str | None, uri: str, version: str | None = None) -> str | None:
    """The trace page of ``uri`` (at ``version``; None: the latest), or None without pages to
    link to (the static report). Every link to a trace is this one (the templates' too)."""
    if base is None:
        return None
    href = f"{base}/trace?uri={quote(uri, safe='')}"
    return href if version is None else f"{href}&version={quote(version, safe='')}"


def _trace_link(base: str | None, uri: str, version: str | None = None) -> Markup:
    """:func:`trace_href` for the templates: percent-encoded past the mount path, so nothing
    is left to escape, and its ``&`` stays as the pages always wrote it."""
    return Markup(trace_href(base, uri, version) or "")


def lineage_svg(root: TraceNode, base: str | None = None) -> str:
    """The trace as a top-down graph: raw inputs at the top, the artifact at the bottom, each
    producing execution between its inputs and its output. Drawn here as SVG: no
    script, no layout library; an artifact or execution reached twice is one node. With a
    ``base``, an artifact's node links to its own trace and a step's to its run."""
    nodes: dict[str, tuple[int, str, str]] = {}  # key -> (depth, label, css class)
    links: dict[str, str | None] = {}  # key -> where a click goes: its trace, its run
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
            label = f"{node.artifact.type}: {short_uri(node.artifact.uri)}"
            nodes[key] = (depth, label, kind)
            links[key] = trace_href(base, node.artifact.uri, node.artifact.version)
        if node.producer is not None:
            ex_key = f"e{node.producer.id}"
            ex_prev = nodes.get(ex_key)
            if ex_prev is None or ex_prev[0] < depth + 1:
                nodes[ex_key] = (depth + 1, f"{node.producer.name} ({node.producer.state})", "exec")
                run_id = node.producer.run_id
                linked = base is not None and run_id
                links[ex_key] = f"{base}/runs/{quote(run_id, safe='')}" if linked else None
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
        text = html.escape(label if len(label) <= _LABEL_CHARS else label[: _LABEL_CHARS - 1] + "…")
        node_svg = (
            f'<g class="node {kind}"><title>{html.escape(label)}</title>'
            f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="{4 if kind != "exec" else 12}" '
            f'fill="{fill[kind]}" stroke="#57606a"/>'
            f'<text x="{x + 8}" y="{y + _BOX_H / 2 + 4}">{text}</text></g>'
        )
        href = links.get(key)
        parts.append(f'<a href="{html.escape(href)}">{node_svg}</a>' if href else node_svg)
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
    """The sweep's nights (newest first, queued ones too), one night (``night_id``; by default
    the newest with a report, else the newest) with its grid, fits and plots, and every
    pre-registered forecast with its outcome, oldest night first. ``NotFound`` for a
    ``night_id`` that is no night."""
    nights = [Night(r, night_report(r.run_id)) for r in runs if r.pipeline == SWEEP_DAG]
    night = next((n for n in nights if n.run.run_id == night_id), None)
    if night_id is not None and night is None:  # a stale or mistyped link: never another night
        raise NotFound(f"no {SWEEP_DAG} night {night_id!r} recorded")
    # Tonight's night may be queued or early on: the last results are what a reader came for.
    night = night or next((n for n in nights if n.report), nights[0] if nights else None)
    # Each pre-registration once, under the night that made it, with its first outcome: a
    # later night that keeps it (the same grid, the same fit) lists it again in its report.
    kept: dict[str, dict[str, Any]] = {}
    for n in sorted(nights, key=lambda n: n.run.started_at):
        for f in (n.report or {}).get("forecasts") or []:
            row = kept.setdefault(f["sha256"], {"night": n.run.run_id, "f": f})
            if not row["f"].get("checked") and f.get("checked"):
                row["f"] = f
    forecasts = list(kept.values())
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
