"""``slipway``: the command line.

    slipway lineage runs  [--db URL]           list recorded runs, newest first
    slipway lineage show  RUN_ID [--db URL]    a run as a tree of steps and artifacts
    slipway lineage trace URI [--version V] [--db URL]
                                               an artifact (its latest version, or V)
                                               back to its raw inputs
    slipway plan [--conf JSON|@FILE]           dry run: which steps a DAG run with this
                                               conf would run, skip (cache hit) or wait for

The database is ``--db``, else :func:`operators.lineage.lineage_url` (the resolver the
operators, the listener and the run summary use too): ``$SLIPWAY_LINEAGE_DB``, else
``sqlite:///<$SLIPWAY_HOME or ./out>/lineage.db``. No Airflow import: it runs anywhere.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipway", description=__doc__.split("\n\n")[0])
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
    show.add_argument("run_id")
    trace = actions.add_parser("trace", parents=[db], help="trace an artifact to raw inputs")
    trace.add_argument("uri")
    trace.add_argument(
        "--version",
        default=None,
        help="which version of the artifact (a content id or step version; default: the latest)",
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
    from operators.settings import steps_root
    from operators.steps import format_plan, plan

    text = args.conf
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as handle:
            text = handle.read()
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as exc:
        print(f"slipway: --conf is not valid JSON: {exc}", file=sys.stderr)
        return 2
    try:
        graph = build_graph(form_values(conf))
    except (RunConfigError, FileNotFoundError, ValueError) as exc:
        print(f"slipway: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan(graph.all_steps(), steps_root())))
    return 0


def _lineage(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from operators.lineage import render
    from operators.lineage.store import LineageStore, NotFound
    from operators.lineage.url import LineageConfigError, lineage_url, redacted

    try:
        url = args.db or lineage_url()
        store = LineageStore(url, create=False)
    except (NotFound, LineageConfigError) as exc:
        print(f"slipway: {exc.args[0]}", file=sys.stderr)
        return 1
    except OperationalError as exc:  # unreachable server, bad credentials
        print(f"slipway: cannot open {redacted(url)}: {exc.orig}", file=sys.stderr)
        return 1
    with store:
        try:
            if args.action == "runs":
                print(render.render_runs(store.runs()))
            elif args.action == "show":
                print(render.render_run(store.run_graph(args.run_id), artifacts=True))
            else:
                print(render.render_trace(store.trace(args.uri, args.version)))
        except NotFound as exc:
            print(f"slipway: {exc.args[0]}", file=sys.stderr)
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "lineage":
        return _lineage(args)
    if args.command == "plan":
        return _plan(args)
    raise AssertionError(args.command)  # argparse refuses unknown commands first


if __name__ == "__main__":
    sys.exit(main())
