"""``slipway``: the command line.

    slipway lineage runs  [--db URL]           list recorded runs, newest first
    slipway lineage show  RUN_ID [--db URL]    a run as a tree of steps and artifacts
    slipway lineage trace URI [--db URL]       an artifact back to its raw inputs

The database is ``--db``, else ``$SLIPWAY_LINEAGE_DB``, else
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
    return parser


def _lineage(args: argparse.Namespace) -> int:
    from operators.lineage import render
    from operators.lineage.store import LineageStore, NotFound, default_url

    url = args.db or default_url()
    try:
        store = LineageStore(url, create=False)
    except NotFound as exc:
        print(f"slipway: {exc.args[0]}", file=sys.stderr)
        return 1
    with store:
        try:
            if args.action == "runs":
                print(render.render_runs(store.runs()))
            elif args.action == "show":
                print(render.render_run(store.run_graph(args.run_id)))
            else:
                print(render.render_trace(store.trace(args.uri)))
        except NotFound as exc:
            print(f"slipway: {exc.args[0]}", file=sys.stderr)
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "lineage":
        return _lineage(args)
    raise AssertionError(args.command)  # argparse refuses unknown commands first


if __name__ == "__main__":
    sys.exit(main())
