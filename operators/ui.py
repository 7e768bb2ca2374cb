"""The Slipway pages inside the Airflow UI: a FastAPI app the plugin (``plugins/slipway_plugin.py``)
mounts on the Airflow API server at ``/slipway``, behind Airflow's own authentication.

Every route depends on Airflow's ``get_user`` (the UI's session cookie, or a bearer token from
``POST /auth/token``): a request without one is refused, 401, and a browser asking for a page
is sent to Airflow's login page, which brings it back. What a user sees is what Airflow's auth
manager lets them read (:func:`readable_dags`): the runs list shows the runs of the DAGs they
may read; a run, its plot and report, a trace (every run it passes through) and the sweep
pages need read access to their DAGs, else 403; and no page names a run of another DAG (a
replacing promotion's, another version's writer) unless the user may read it. The pages themselves are
``operators/reports``' (no Airflow there); this module only wires them to HTTP.

    /slipway/                       every run with its results and changed settings,
                                    filterable (?pipeline= &state= &q=), 200 a page (&page=)
    /slipway/runs/<run_id>          one run: settings, steps, loss curve, evaluation,
                                    benchmarks, samples, the promotion decision (and whether a
                                    later one replaced it); a failed run's cause and resume plan
                                    (?dag_id=: only that DAG's run, as Airflow's tabs ask)
    /slipway/runs/<run_id>/loss.png the loss curve (matplotlib, server-side; ETag, kept drawn)
    /slipway/runs/<run_id>/report.html  the run's static report, as the run wrote it
    /slipway/trace?uri=&version=    an artifact traced back to its raw inputs, as a graph; which
                                    version, who wrote it, its other versions
    /slipway/sweeps[?night=]        the scaling sweep: grid, plots, fits, forecasts vs outcomes
    /slipway/sweeps/<run_id>/<plot>.png  a night's IsoFLOP or scaling plot
"""

from __future__ import annotations

import hashlib
import html
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Annotated, Any, TypeVar
from urllib.parse import quote

from airflow.api_fastapi.core_api.security import get_user
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from operators.lineage import LineageStore, NotFound, RunSummary
from operators.reports import URL_PREFIX, pages
from operators.reports.plots import DPI, PLOT_VERSION, SIZE_IN, loss_png
from operators.reports.static import report_path
from operators.reports.view import (
    RESULT_STEPS,
    RESULT_TYPES,
    loss_curve,
    run_results,
    run_view,
)

log = logging.getLogger(__name__)

# Sweep plots change once a night: a minute's caching is fine. A loss plot changes while its
# run trains: always revalidated (its ETag makes that a cheap 304).
PNG_HEADERS = {"Cache-Control": "private, max-age=60"}
LOSS_PNG_HEADERS = {"Cache-Control": "private, no-cache"}
# report.html is read from the storage root, which tasks write: served from the Airflow UI's
# origin, a replaced file could run script there with the reader's session. The report needs
# only its inline styles and data: images (operators/reports/static.py), so it gets nothing
# else, and a sandbox (an opaque origin) besides.
STATIC_REPORT_HEADERS = {
    "Content-Security-Policy": "sandbox; default-src 'none'; img-src data:; "
    "style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
}

app = FastAPI(
    title="Slipway reports",
    description="Runs, lineage and sweeps recorded by Slipway, inside the Airflow UI.",
    dependencies=[Depends(get_user)],
)

_store: LineageStore | None = None
_store_lock = threading.Lock()


def store() -> LineageStore:
    """One lineage store per API-server process, opened on first use (never created here: a
    platform without runs yet has no database, and the pages say so)."""
    global _store
    with _store_lock:
        if _store is None:
            _store = LineageStore(create=False)
        return _store


Readable = Callable[[set[str]], set[str]]  # DAG ids -> those the user may read


def readable_dags(user: Annotated[Any, Depends(get_user)]) -> Readable:
    """The DAG ids, of those asked about, whose runs the signed-in user may read: Airflow's
    auth manager asked as its own DAG-run endpoints ask it (GET on the DAG's runs)."""

    def readable(dag_ids: set[str]) -> set[str]:
        from airflow.api_fastapi.app import get_auth_manager
        from airflow.api_fastapi.auth.managers.models.resource_details import (
            DagAccessEntity,
            DagDetails,
        )

        manager = get_auth_manager()
        return {
            dag_id
            for dag_id in dag_ids
            if manager.is_authorized_dag(
                method="GET",
                access_entity=DagAccessEntity.RUN,
                details=DagDetails(id=dag_id),
                user=user,
            )
        }

    return readable


Access = Annotated[Readable, Depends(readable_dags)]


def _require(readable: Readable, pipelines: Iterable[str | None]) -> None:
    """403 unless the user may read every one of ``pipelines`` (None: a run recorded without
    a DAG, e.g. from a shell, which any signed-in user may read)."""
    wanted = {p for p in pipelines if p}
    denied = sorted(wanted - readable(wanted)) if wanted else []
    if denied:
        raise HTTPException(403, f"not allowed to read the runs of {', '.join(denied)}")


def _run_owners(run_ids: Iterable[str]) -> set[str]:
    return {owner for found in store().owners_of(run_ids).values() for owner in found}


def _require_runs(readable: Readable, run_ids: Iterable[str]) -> None:
    """403 unless the user may read the DAG of every one of ``run_ids``."""
    _require(readable, _run_owners(run_ids))


def _may_read_run(readable: Readable, run_id: str) -> bool:
    owners = _run_owners([run_id])
    return owners <= readable(owners)


def _require_run_folder(readable: Readable, run_id: str) -> None:
    """:func:`_require_runs` of ``run_id`` and of every recorded run whose run folder it
    names: folder names are not one-to-one (``a:b`` and ``a_b``), so an unrecorded id could
    otherwise read a recorded run's files. (Pages read from lineage by the exact id need only
    that run's DAG.)"""
    from operators.settings import runs_sharing_folder

    _require_runs(readable, [run_id, *runs_sharing_folder(run_id, store().run_ids())])


def _base(request: Request) -> str:
    return request.scope.get("root_path", "").rstrip("/") or URL_PREFIX


@app.exception_handler(HTTPException)
async def _login_or_error(request: Request, exc: HTTPException) -> Response:
    """An unauthenticated browser goes to Airflow's login page and comes back here; API
    clients (and anything not asking for HTML) get the status."""
    wants_html = "text/html" in request.headers.get("accept", "")
    if exc.status_code == 401 and wants_html and request.method == "GET":
        from airflow.api_fastapi.app import get_auth_manager

        return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)), 302)
    if wants_html and exc.status_code != 401:
        body = pages.error_page(exc.status_code, str(exc.detail or ""), _base(request))
        return HTMLResponse(body, status_code=exc.status_code)
    return Response(exc.detail or "", status_code=exc.status_code, media_type="text/plain")


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """A bad query value (``?page=abc``) is an error like the others: a page for a browser,
    the reason as text for anything else, never FastAPI's JSON."""
    reasons = "; ".join(
        f"{'.'.join(str(part) for part in error['loc'][1:]) or 'request'}: {error['msg']}"
        for error in exc.errors()
    )
    return await _login_or_error(request, HTTPException(422, reasons))


def _no_lineage(exc: Exception) -> HTMLResponse:
    return HTMLResponse(f"<p>No lineage recorded yet: {html.escape(str(exc))}</p>", 404)


# Airflow's DagRun states in the words the pages use for runs.
_DAG_RUN_STATES = {
    "queued": "QUEUED",
    "running": "RUNNING",
    "success": "COMPLETE",
    "failed": "FAILED",
}
_IN_CHUNK = 500  # run ids per IN (...) query: SQLite caps a statement's parameters
_T = TypeVar("_T")


def _read_airflow(what: str, default: _T, read: Callable[[Any], _T]) -> _T:
    """``read(session)`` on Airflow's metadata database (the API server's), or ``default``
    where it cannot be read (logged): the pages then show what lineage has."""
    try:
        from airflow.utils.session import create_session

        with create_session() as session:
            return read(session)
    except Exception:
        log.warning("Airflow's %s could not be read", what, exc_info=True)
        return default


def _dag_run(state: Any, started: datetime | None, ended: datetime | None = None) -> pages.DagRun:
    return pages.DagRun(_DAG_RUN_STATES.get(str(state), str(state).upper()), started, ended)


def dag_runs(run_ids: Iterable[str]) -> dict[tuple[str, str], pages.DagRun]:
    """Airflow's own record of these DAG runs (state, start, end), by (dag id, run id). The
    run's lifecycle is Airflow's: see :func:`operators.reports.pages.with_dag_runs`. Empty
    where the database cannot be read: the pages then show lineage's states."""
    ids = sorted(set(run_ids))
    if not ids:
        return {}

    def read(session: Any) -> dict[tuple[str, str], pages.DagRun]:
        from airflow.models.dagrun import DagRun
        from sqlalchemy import select

        found: dict[tuple[str, str], pages.DagRun] = {}
        for at in range(0, len(ids), _IN_CHUNK):
            query = select(
                DagRun.dag_id, DagRun.run_id, DagRun.state, DagRun.start_date, DagRun.end_date
            ).where(DagRun.run_id.in_(ids[at : at + _IN_CHUNK]))
            for dag_id, run_id, state, started, ended in session.execute(query):
                if state:
                    found[dag_id, run_id] = _dag_run(state, started, ended)
        return found

    return _read_airflow("DAG runs", {}, read)


def waiting_dag_runs(
    dag_ids: Iterable[str],
) -> dict[tuple[str, str], tuple[pages.DagRun, datetime]]:
    """Airflow's DAG runs of these DAGs that are queued or running, by (dag id, run id), with
    when each was queued: the runs the list shows before their first task records anything
    (the pipeline runs one at a time, so the others wait queued). Empty where the database
    cannot be read."""
    dags = sorted(set(dag_ids))
    if not dags:
        return {}

    def read(session: Any) -> dict[tuple[str, str], tuple[pages.DagRun, datetime]]:
        from airflow.models.dagrun import DagRun
        from airflow.utils.state import DagRunState
        from sqlalchemy import select

        going = [DagRunState.QUEUED, DagRunState.RUNNING]
        query = select(
            DagRun.dag_id,
            DagRun.run_id,
            DagRun.state,
            DagRun.queued_at,
            DagRun.run_after,
            DagRun.start_date,
        ).where(DagRun.dag_id.in_(dags), DagRun.state.in_(going))
        return {
            (dag_id, run_id): (_dag_run(state, started), queued_at or run_after)
            for dag_id, run_id, state, queued_at, run_after, started in session.execute(query)
        }

    return _read_airflow("queued DAG runs", {}, read)


def dag_paused(dag_id: str) -> bool | None:
    """Whether Airflow has the DAG paused (None where its database cannot tell): why a run
    of it waits queued."""

    def read(session: Any) -> bool | None:
        from airflow.models.dag import DagModel
        from sqlalchemy import select

        query = select(DagModel.is_paused).where(DagModel.dag_id == dag_id)
        return session.execute(query).scalar_one_or_none()

    return _read_airflow(f"DAG {dag_id}", None, read)


def as_airflow_has_them(
    runs: Sequence[RunSummary], recorded: Sequence[RunSummary], dag_ids: Iterable[str]
) -> list[RunSummary]:
    """``runs`` in the states Airflow has them, and before them the DAG runs of ``dag_ids``
    that Airflow has queued or started but none of lineage's ``recorded`` runs has yet."""
    live = dag_runs(r.run_id for r in runs if r.pipeline)
    waiting = waiting_dag_runs(dag_ids)
    return pages.with_dag_runs([*runs, *pages.not_yet_recorded(waiting, recorded)], live)


@app.get("/", response_class=HTMLResponse)
def runs(
    request: Request,
    readable: Access,
    pipeline: str = Query("", max_length=250),
    state: str = Query("", max_length=20),
    q: str = Query("", max_length=250),
    page: int = Query(1, ge=1, le=1_000_000),
) -> Any:
    try:
        recorded = store().runs()
    except NotFound as exc:
        return _no_lineage(exc)
    allowed = readable({r.pipeline for r in recorded if r.pipeline})
    all_runs = as_airflow_has_them(
        [r for r in recorded if not r.pipeline or r.pipeline in allowed],
        recorded,
        readable({*allowed, *pages.SLIPWAY_DAGS}),
    )
    filters = pages.RunFilters(pipeline=pipeline, state=state, q=q)
    results = run_results(
        store().run_outputs(RESULT_STEPS, RESULT_TYPES), store().run_failures(["train"])
    )
    return pages.runs_page(all_runs, _base(request), filters, results, page)


@app.get("/runs/{run_id}", response_class=HTMLResponse)
def run(
    request: Request,
    run_id: str,
    readable: Access,
    dag_id: str | None = Query(None, max_length=250),
) -> Any:
    """``dag_id``: the DAG whose run this is, as Airflow's tabs link it. Scheduled run ids are
    the same in every DAG, so another DAG's run of the same id is not this one's (404)."""
    base = _base(request)
    loss_src = f"{base}/runs/{quote(run_id, safe='')}/loss.png"
    try:
        owners = store().run_owners(run_id)
        if dag_id is not None and dag_id not in owners:
            return _unrecorded_run(run_id, readable, base, dag_id)
        _require(readable, owners)
        live = dag_runs([run_id]) if owners else {}
        dag_run = next((live[o, run_id] for o in sorted(owners) if (o, run_id) in live), None)
        return pages.run_page(
            store(),
            run_id,
            base,
            loss_src=loss_src,
            dag_run=dag_run,
            may_read_run=lambda other: _may_read_run(readable, other),
        )
    except NotFound as exc:
        return _unrecorded_run(run_id, readable, base, dag_id, str(exc.args[0]))


def _records_lineage(dag_id: str) -> bool:
    """Whether runs of ``dag_id`` record Slipway lineage: one of Slipway's DAGs, or a DAG
    with a recorded run."""
    if dag_id in pages.SLIPWAY_DAGS:
        return True
    try:
        return any(r.pipeline == dag_id for r in store().runs())
    except NotFound:
        return False


def _unrecorded_run(
    run_id: str, readable: Readable, base: str, dag_id: str | None, why: str = ""
) -> str:
    """The page of a run lineage has nothing of (of ``dag_id``, where given): queued, or not
    yet at its first task, while Airflow has it; else 404."""
    records = dag_id is None or _records_lineage(dag_id)
    pending = {
        dag: r for (dag, _), r in dag_runs([run_id]).items() if records and dag_id in (None, dag)
    }
    shown = sorted(readable(set(pending)))
    if shown:
        dag, dag_run = shown[0], pending[shown[0]]
        if dag_run.state != "QUEUED":  # started: nothing holds it back
            return pages.pending_page(run_id, dag, dag_run, base)
        running = sorted(
            other for (_, other), (r, _) in waiting_dag_runs([dag]).items() if r.state == "RUNNING"
        )
        return pages.pending_page(
            run_id, dag, dag_run, base, running=running, paused=dag_paused(dag)
        )
    if not records:
        why = f"{dag_id} records no Slipway lineage: its runs have no Slipway report"
    elif dag_id is not None:
        why = f"no run {run_id!r} of {dag_id} recorded"
    raise HTTPException(404, why)


# The last loss plots drawn, by ETag: matplotlib takes ~80 ms a plot, and a run page is opened
# by many people (and reloaded) while its curve stays the same.
_LOSS_PNGS: OrderedDict[str, bytes] = OrderedDict()
_LOSS_PNGS_KEPT = 64
_LOSS_PNGS_LOCK = threading.Lock()


def _loss_etag(points: list[tuple[int, float]]) -> str:
    """The plot's ETag: the curve, the drawing's size and ``PLOT_VERSION``, so a new line in
    the log, or a plot drawn differently, is a new tag."""
    digest = hashlib.sha256(repr((points, SIZE_IN, DPI, PLOT_VERSION)).encode()).hexdigest()
    return f'"{digest[:32]}"'


def _etag_matches(if_none_match: str, etag: str) -> bool:
    """``If-None-Match`` against our tag by HTTP's weak comparison: a proxy may hand back our
    tag as ``W/"..."``; ``*`` matches any."""
    tags = (tag.strip() for tag in if_none_match.split(","))
    return any(tag == "*" or tag.removeprefix("W/") == etag for tag in tags)


def _cached_loss_png(etag: str, points: list[tuple[int, float]]) -> bytes:
    with _LOSS_PNGS_LOCK:
        png = _LOSS_PNGS.get(etag)
        if png is not None:
            _LOSS_PNGS.move_to_end(etag)
            return png
    png = loss_png(points)  # drawn outside the lock: two first requests may both draw
    with _LOSS_PNGS_LOCK:
        _LOSS_PNGS[etag] = png
        while len(_LOSS_PNGS) > _LOSS_PNGS_KEPT:
            _LOSS_PNGS.popitem(last=False)
    return png


@app.get("/runs/{run_id}/loss.png")
def loss(request: Request, run_id: str, readable: Access) -> Response:
    """The loss curve, with an ETag of the curve: a browser that has it gets 304, and a curve
    drawn before is served from memory."""
    try:
        _require_runs(readable, [run_id])
        view = run_view(store().run_graph(run_id))
    except NotFound as exc:
        raise HTTPException(404, str(exc.args[0])) from exc
    points = loss_curve(view)
    etag = _loss_etag(points)
    headers = {**LOSS_PNG_HEADERS, "ETag": etag}
    if _etag_matches(request.headers.get("if-none-match", ""), etag):
        return Response(status_code=304, headers=headers)
    return Response(_cached_loss_png(etag, points), media_type="image/png", headers=headers)


@app.get("/runs/{run_id}/report.html", response_class=HTMLResponse)
def static_report(run_id: str, readable: Access) -> Any:
    import fsspec

    try:
        _require_run_folder(readable, run_id)
    except NotFound as exc:  # no lineage database yet: no run has written a report
        raise HTTPException(404, str(exc.args[0])) from exc
    try:
        with fsspec.open(report_path(run_id), "r") as f:
            body = f.read()
    except FileNotFoundError as exc:
        raise HTTPException(
            404, f"run {run_id!r}: no report.html (not written yet, or since removed)"
        ) from exc
    return HTMLResponse(body, headers=STATIC_REPORT_HEADERS)


@app.get("/trace", response_class=HTMLResponse)
def trace(
    request: Request,
    readable: Access,
    uri: str = Query("", max_length=4096),
    version: str | None = Query(None, max_length=1024),
) -> Any:
    """``version``: that version ("" is an artifact recorded without one); none: the latest."""
    if not uri:
        raise HTTPException(
            400, "Which artifact? Give its URI: /slipway/trace?uri=<uri>[&version=<v>]"
        )
    try:
        root = store().trace(uri, version)
    except NotFound as exc:
        raise HTTPException(404, str(exc.args[0])) from exc
    # a trace passes through other runs (the sweep's cells read the pipeline's steps)
    _require_runs(readable, {n.producer.run_id for n in pages.producers(root) if n.producer.run_id})
    versions = _readable_versions(readable, store().version_writers(root.artifact.uri))
    return pages.trace_page(root, _base(request), versions=versions, asked_version=version)


def _readable_versions(readable: Readable, writers: list[tuple[str, set[str]]]) -> list[str]:
    """The versions (of ``LineageStore.version_writers``) whose every writing run belongs to
    a DAG the user may read: the others' names are not shown either."""
    owners = store().owners_of({run for _, runs in writers for run in runs})
    allowed = readable({o for found in owners.values() for o in found})
    return [
        version
        for version, runs in writers
        if all(owners.get(run, set()) <= allowed for run in runs)
    ]


@app.get("/sweeps", response_class=HTMLResponse)
def sweeps(request: Request, readable: Access, night: str = Query("", max_length=250)) -> Any:
    _require(readable, [pages.SWEEP_DAG])
    try:
        recorded = store().runs()
    except NotFound as exc:
        return _no_lineage(exc)
    nights = [r for r in recorded if r.pipeline == pages.SWEEP_DAG]
    nights = as_airflow_has_them(nights, recorded, [pages.SWEEP_DAG])
    try:
        return pages.sweeps_page(nights, _base(request), night or None)
    except NotFound as exc:
        raise HTTPException(404, str(exc.args[0])) from exc


@app.get("/sweeps/{run_id}/{plot}.png")
def sweep_plot(run_id: str, plot: str, readable: Access) -> Response:
    _require(readable, [pages.SWEEP_DAG])
    data = pages.sweep_plot(run_id, plot)
    if data is None:
        raise HTTPException(404, f"no {plot} plot for {run_id!r}")
    return Response(data, media_type="image/png", headers=PNG_HEADERS)
