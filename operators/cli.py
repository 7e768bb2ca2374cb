"""``slipway``: the command line.

    slipway lineage runs  [--db URL]           list recorded runs, newest first
    slipway lineage show  RUN_ID|latest [--db URL]
                                               a run as a tree of steps and artifacts
    slipway lineage trace URI [--version V] [--db URL]
                                               an artifact (its latest version, or V)
                                               back to its raw inputs
    slipway plan [--conf JSON|@FILE]           dry run: which steps a DAG run with this
                                               conf would run, skip (cache hit) or wait for
    slipway sweep list [--db URL]              the scaling sweep's nights, newest first
    slipway sweep show RUN_ID|latest [--db URL]
                                               one night: grid, fits, forecasts, checks
    slipway sweep forecasts [--db URL]         every forecast against its outcome, by night

The database is ``--db``, else :func:`operators.lineage.lineage_url` (the resolver the
operators, the listener and the run summary use too): ``$SLIPWAY_LINEAGE_DB``, else
``sqlite:///<$SLIPWAY_HOME or ./out>/lineage.db``. No Airflow import: it runs anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipway",
        description="Slipway's command line: the lineage store, dry-run plans of a DAG run, "
        "and the scaling sweep's nights. See docs/steps_and_lineage.md and docs/scaling.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    lineage = commands.add_parser("lineage", help="query the lineage store")
    db = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a --db given before the subcommand is not overwritten by the subcommand default.
    db.add_argument(
        "--db",
        default=argparse.SUPPRESS,
        help="SQLAlchemy URL (default: $SLIPWAY_LINEAGE_DB or sqlite:///<$SLIPWAY_HOME|./out>/lineage.db)",
    )
    lineage.add_argument("--db", default=None, help=argparse.SUPPRESS)
    actions = lineage.add_subparsers(dest="action", required=True)
    actions.add_parser("runs", parents=[db], help="list runs, newest first")
    show = actions.add_parser("show", parents=[db], help="print a run as a tree")
    show.add_argument("run_id", help="a run id, its run folder's name, or latest")
    trace = actions.add_parser("trace", parents=[db], help="trace an artifact to raw inputs")
    trace.add_argument("uri", help="an artifact's URI, or a local path (relative ones too)")
    trace.add_argument(
        "--version",
        default=None,
        help="which version of the artifact (a content id or step version; default: the latest)",
    )

    sweep = commands.add_parser("sweep", help="the nightly scaling sweep's records")
    sweep.add_argument("--db", default=None, help=argparse.SUPPRESS)
    sweep_actions = sweep.add_subparsers(dest="action", required=True)
    sweep_actions.add_parser("list", parents=[db], help="the sweep's nights, newest first")
    sweep_show = sweep_actions.add_parser(
        "show", parents=[db], help="one night: grid, fits, forecasts"
    )
    sweep_show.add_argument("run_id", help="a night's run id, or latest")
    sweep_actions.add_parser(
        "forecasts", parents=[db], help="every forecast against its outcome, oldest first"
    )

    plan = commands.add_parser(
        "plan", help="dry run of slipway_pipeline for a run conf: run / skip / wait, and why"
    )
    plan.add_argument(
        "--conf", default="{}", help="DAG run conf as JSON, or @path to a JSON file (form values)"
    )
    return parser


def _plan(args: argparse.Namespace) -> int:
    """The same plan the DAG's first task logs, without running anything."""
    import json

    from operators.pipeline.form import RunConfigError, form_values
    from operators.pipeline.graph import build_graph
    from operators.settings import HOME_ENV, steps_root
    from operators.steps import format_plan, plan

    text = args.conf
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            print(f"slipway: --conf {args.conf}: cannot read it: {exc.strerror}", file=sys.stderr)
            return 2
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as exc:
        print(f"slipway: --conf is not valid JSON: {exc}", file=sys.stderr)
        return 2
    try:
        graph = build_graph(form_values(conf))
    except FileNotFoundError as exc:  # the steps' versions hash the corpora
        print(
            f"slipway: {exc.filename or exc} is missing: fetch the corpora first (make "
            "corpora), or point $SLIPWAY_DATA_DIR (or the form's data_dir) at them",
            file=sys.stderr,
        )
        return 2
    except (RunConfigError, ValueError) as exc:
        print(f"slipway: {exc}", file=sys.stderr)
        return 2
    if not os.environ.get(HOME_ENV):
        print(
            f"slipway: planning against {steps_root()} (${HOME_ENV} is not set; the platform's "
            "Airflow Variable slipway_home is read by tasks only)",
            file=sys.stderr,
        )
    print(format_plan(plan(graph.all_steps(), steps_root())))
    return 0


def _open_store(args: argparse.Namespace) -> Any:
    """The lineage store, or None after saying why it cannot be opened."""
    from operators.lineage.store import NotFound, open_for_reading
    from operators.lineage.url import LineageConfigError, lineage_url

    try:
        return open_for_reading(args.db or lineage_url())
    except (NotFound, LineageConfigError) as exc:
        print(f"slipway: {exc.args[0]}", file=sys.stderr)
    return None


def _sweep(args: argparse.Namespace) -> int:
    from operators.sweep import report

    if args.action == "show":
        if args.run_id == "latest":
            args.run_id = _latest_night(args)
            if args.run_id is None:
                return 1
        record, checks = report.read_night(args.run_id)
        if record is None and not _night_recorded(args):
            return 1
        print(report.render_night(args.run_id, record, checks))
        if record is None:
            return 1
        from operators.settings import run_folder
        from operators.steps import join
        from operators.sweep.figures import REPORT_FOLDER

        print(f"\nreport (plots and report.json): {join(run_folder(args.run_id), REPORT_FOLDER)}")
        return 0
    store = _open_store(args)
    if store is None:
        return 1
    with store:
        runs = store.runs()
    print(report.render_nights(runs) if args.action == "list" else report.render_forecasts(runs))
    return 0


def _nights(args: argparse.Namespace) -> list[str] | None:
    """The sweep's nights lineage has, newest first; None (said why) without a store."""
    from operators.sweep.report import SWEEP_DAG

    store = _open_store(args)
    if store is None:
        return None
    with store:
        return [r.run_id for r in store.runs() if r.pipeline == SWEEP_DAG]


def _night_recorded(args: argparse.Namespace) -> bool:
    """Whether lineage has the sweep night ``args.run_id``; if not, say so (a night without a
    fit yet is a night; a mistyped id is none)."""
    from operators.sweep.report import SWEEP_DAG

    nights = _nights(args)
    if nights is None:
        return False
    if args.run_id not in nights:
        print(
            f"slipway: no {SWEEP_DAG} night {args.run_id!r} recorded "
            "(`slipway sweep list` shows the nights)",
            file=sys.stderr,
        )
        return False
    return True


def _latest_night(args: argparse.Namespace) -> str | None:
    """The newest sweep night's run id (``slipway sweep show latest``), or None, saying why."""
    from operators.sweep.report import SWEEP_DAG

    nights = _nights(args)
    if nights is None:
        return None
    if not nights:
        print(f"slipway: no {SWEEP_DAG} runs recorded", file=sys.stderr)
        return None
    return nights[0]


def _run_id(store: Any, given: str) -> str:
    """``latest`` (the newest run recorded), a run id, or a run folder's name (``runs/<name>``
    spells ``:`` as ``_``), as the one run id lineage has for it."""
    from operators.settings import runs_sharing_folder

    if given == "latest":
        runs = store.runs()
        return runs[0].run_id if runs else given
    recorded = store.run_ids()
    if given in recorded:
        return given
    named = runs_sharing_folder(given, recorded)
    return named[0] if len(named) == 1 else given


def _lineage(args: argparse.Namespace) -> int:
    from operators.lineage import render
    from operators.lineage.store import NotFound

    store = _open_store(args)
    if store is None:
        return 1
    with store:
        try:
            if args.action == "runs":
                print(render.render_runs(store.runs()))
            elif args.action == "show":
                run_id = _run_id(store, args.run_id)
                print(render.render_run(store.run_graph(run_id), artifacts=True))
            else:
                # lineage records local paths absolute: `out/steps/...` as typed in the repo
                uri = args.uri if "://" in args.uri else os.path.abspath(args.uri)
                print(render.render_trace(store.trace(uri, args.version)))
        except NotFound as exc:
            print(f"slipway: {exc.args[0]}", file=sys.stderr)
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"lineage": _lineage, "plan": _plan, "sweep": _sweep}
    try:
        return commands[args.command](args)
    except BrokenPipeError:
        # The reader stopped early (`slipway lineage trace ... | head`): no traceback, and
        # stdout pointed at devnull so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
