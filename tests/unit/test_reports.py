"""The report pages from a real lineage store (SQLite): what each page shows is read back
from what was recorded (``tests/support/report_runs.py``), parsed from the HTML, not grepped."""

from __future__ import annotations

import base64
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import pytest

from operators.lineage import LineageStore, NotFound
from operators.reports import pages
from operators.reports.static import write_run_report
from operators.reports.view import loss_curve, run_view
from tests.support.report_runs import SETTINGS, TRAIN_STEPS, record_run


class Cells(HTMLParser):
    """Every table row as (row attributes, [cell texts]), and every element's id -> text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[dict, list[str]]] = []
        self.images: list[dict] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr":
            self._row = []
            self.rows.append((a, self._row))
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "img":
            self.images.append(a)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)

    def step_rows(self) -> dict[str, list[str]]:
        return {a["data-step"]: cells for a, cells in self.rows if "data-step" in a}


def _words(html: Cells) -> str:
    """The page's text as a reader sees it: one space between words, none before , or ."""
    return re.sub(r" ([.,])", r"\1", " ".join(" ".join(html.text).split()))


def _outputs_of(graph, step: str) -> list:
    """The artifacts the run's ``step`` recorded as its outputs."""
    return [o.artifact for n in graph.steps if n.execution.name == step for o in n.outputs]


def parse(body: str) -> Cells:
    parser = Cells()
    parser.feed(body)
    return parser


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    with LineageStore(f"sqlite:///{tmp_path}/lineage.db") as s:
        record_run(s, "good", tmp_path)
        record_run(s, "bad <script>", tmp_path, fail_train=True)
        yield s


def test_the_run_page_shows_what_lineage_recorded(store):
    body = pages.run_page(store, "good", "/slipway", loss_src="/slipway/runs/good/loss.png")
    html = parse(body)
    graph = store.run_graph("good")
    rows = html.step_rows()
    assert set(rows) == {n.execution.name for n in graph.steps} - {"record"}
    for node in graph.steps:
        for out in node.outputs:
            c = out.artifact.counts or {}
            if "records_in" in c:
                cells = rows[node.execution.name]
                assert str(c["records_in"]) in cells and str(c["records_out"]) in cells
                assert str(sum(c["dropped"].values())) in cells
                for reason, n in c["dropped"].items():
                    assert f"{reason}={n}" in " ".join(cells)
    assert rows["quality"][1] == "CACHED" and 'title="a cache hit' in body
    assert "51,200" in rows["tokenize"]  # thousands separated
    (img,) = [i for i in html.images if i.get("id") == "loss-plot"]
    assert img["src"] == "/slipway/runs/good/loss.png"
    # the gate's measure, as the runs list shows it: the mean over the held-out stores
    (mean,) = [c for a, c in html.rows if a.get("id") == "heldout-mean"]
    assert mean[3] == "2.3100"
    text = " ".join(html.text)
    assert "Promoted" in text and "slipway://models/demo" in text
    bench = [cells for a, cells in html.rows if a.get("data-task") == "piqa"]
    assert bench and "~chance" in bench[0][-1]
    # the contexts cut to fit seq_len, as the printed table says them
    piqa = next(
        o.artifact.counts for n in graph.steps for o in n.outputs if o.role == "benchmark-piqa"
    )
    assert bench[0][-1] == f"~chance · {piqa['truncated']} of {piqa['n']} contexts cut to fit"
    # Samples are model output: shown as text, never as markup.
    assert "The &lt;b&gt;" in body and "The <b>" not in body
    assert "trace it to its raw inputs" in text
    raw = [cells for _, cells in html.rows if cells and cells[0] == "dataset"]
    assert any("brown.tar.gz" in c[1] and c[2] == "ab" * 32 for c in raw), raw
    # the export, with the weights' type its step recorded
    (export,) = _outputs_of(graph, "export")
    shown = f"{export.uri} (Hugging Face folder, {export.properties['dtype']} weights)"
    assert shown in _words(html)


def test_the_run_page_and_the_runs_list_show_the_settings_a_run_was_triggered_with(store):
    """validate records the form's values on the run: the run page lists them all (those
    not at their defaults marked) and names the changed ones up top; the runs list names
    them too, which tells a run from its neighbours."""
    html = parse(pages.run_page(store, "good", "/s"))
    text = " ".join(" ".join(html.text).split())
    # an object's value is named, not inlined; scalars are shown
    assert "Changed from the form's defaults: learning_rate=0.01, stage_configs, steps=20" in text
    settings = {a["data-setting"]: (a.get("class"), c) for a, c in html.rows if "data-setting" in a}
    params = SETTINGS["params"]
    assert set(settings) == set(params)
    for name, (css, _) in settings.items():
        assert (css == "changed") is (name in SETTINGS["changed"])
    assert {name: cells[1] for name, (_, cells) in settings.items()} == {
        "model_preset": "nano",  # strings bare
        "steps": "20",
        "learning_rate": "0.01",
        "seed": "0",
        "model_name": "demo",
        # objects as JSON, keys sorted
        "stage_configs": '{"quality": {"sources": {"brown": {"min_words": 3}}}, "tokenize": {}}',
    }
    assert json.loads(settings["stage_configs"][1][1]) == params["stage_configs"]
    listed = parse(pages.runs_page(store.runs(), "/s"))
    header = listed.rows[0][1]
    column = header.index("changed settings")
    assert {c[0]: c[column] for _, c in listed.rows[1:]} == {
        "good": "learning_rate=0.01, stage_configs, steps=20",
        "bad <script>": "learning_rate=0.01, stage_configs, steps=20",
    }


def test_a_run_without_recorded_settings_shows_none(store):
    """Runs recorded before validate recorded settings (or by a shell): no settings block."""
    ex = store.start_execution("ingest", run_id="old", pipeline="slipway_pipeline")
    store.finish_execution(ex)
    body = pages.run_page(store, "old", "/s")
    assert 'id="settings"' not in body and "Changed from" not in body
    at_defaults = {"params": {"steps": 200}, "changed": []}
    ex = store.start_execution("validate", run_id="plain", pipeline="p", run_properties=at_defaults)
    store.finish_execution(ex)
    assert "Every setting at the form's default." in pages.run_page(store, "plain", "/s")
    listed = parse(pages.runs_page(store.runs(), "/s"))
    column = listed.rows[0][1].index("changed settings")
    shown = {c[0]: c[column] for _, c in listed.rows[1:]}
    assert (shown["plain"], shown["old"]) == ("defaults", "")  # at defaults / not recorded
    none = pages.runs_page(store.runs(), "/s", pages.RunFilters(q="no-such-run"))
    assert "none matches the filter" in none
    many = {"params": {f"f{i}": i for i in range(9)}, "changed": [f"f{i}" for i in range(9)]}
    assert pages.changed_settings(many, most=6) == "f0=0, f1=1, f2=2, f3=3, f4=4, f5=5 and 3 more"


def test_the_printed_summary_names_the_exports_weight_type(store):
    from operators.lineage.render import render_run

    graph = store.run_graph("good")
    (export,) = _outputs_of(graph, "export")
    (line,) = [line for line in render_run(graph).splitlines() if export.uri in line]
    assert line.split() == ["export", "(Hugging", "Face,", "bfloat16)", export.uri]


def test_a_failed_runs_page_says_which_step_failed_why_and_what_a_rerun_resumes(store):
    body = pages.run_page(store, "bad <script>", "/slipway", loss_src="x.png")
    assert "bad <script>" not in body and "bad &lt;script&gt;" in body  # the run id is text
    html = parse(body)
    text = " ".join(" ".join(html.text).split())
    assert "Failed at train" in text and "preempted at step 12" in text
    assert "3 steps are cache hits (ingest, quality, tokenize)" in text
    assert "2 run again (train, evaluate), then gate and record." in text
    assert "Training resumes from its checkpoint at step 10" in text
    # a backfill reprocesses scheduled runs only: this one, triggered by hand, is not told to
    assert "backfill" not in text
    rows = html.step_rows()
    assert rows["train"][1].startswith("FAILED")
    # the error spans the table in a row of its own, under the step's
    assert rows["train"][-1] == "failed: see below"
    error = next(c for a, c in html.rows if a.get("data-error-for") == "train")
    assert "preempted" in error[0] and "last checkpoint: step 10" in error[0]
    assert "traceback" in error[0]
    # the steps after the failure are listed, as not run (the summary's rerun list)
    assert rows["evaluate"] == [
        "evaluate",
        "not run",
        "Airflow: upstream_failed; runs on a clear-and-rerun",
    ]
    # and the tasks without steps that Airflow did not run, with the state it gave them
    assert rows["gate"] == [
        "gate",
        "not run",
        "Airflow: upstream_failed; runs on a clear-and-rerun",
    ]
    assert list(rows)[-2:] == ["evaluate", "gate"]
    # No final checkpoint, but the loss logged before the failure is drawn.
    assert "FAILED: no final checkpoint recorded; the loss the trainer logged before it " in text
    # how far it got: the last logged step of the run's steps, and its loss
    assert f"Step {TRAIN_STEPS} of {TRAIN_STEPS}, loss 6.0000." in text
    (img,) = [i for i in html.images if i.get("id") == "loss-plot"]
    assert img["src"] == "x.png"
    view = run_view(store.run_graph("bad <script>"))
    assert view.training is None and len(loss_curve(view)) == TRAIN_STEPS


def test_a_sweep_nights_page_shows_no_gate_measure(store):
    """The mean over the held-out stores is the pipeline gate's measure: a sweep night has no
    gate, and its cells' stores averaged together measure nothing."""
    from operators.sweep.report import SWEEP_DAG

    for cell in ("0", "1"):
        ex = store.start_execution(
            "evaluate_cell", run_id="night", pipeline=SWEEP_DAG, step_version=cell * 8
        )
        store.record_output(
            ex,
            f"/steps/evaluate-{cell * 8}/heldout-brown.json",
            "eval_result",
            role="heldout-brown",
            counts={"loss": 6.1, "perplexity": 445.9, "bits_per_byte": 2.3, "tokens": 4096},
        )
        store.finish_execution(ex)
    html = parse(pages.run_page(store, "night", "/slipway"))
    assert [a for a, _ in html.rows if a.get("id") == "heldout-mean"] == []
    assert "gate's measure" not in " ".join(html.text)


def test_a_run_refused_at_validate_is_told_to_trigger_anew(store):
    """Clearing a run whose values validate refused checks the same values again: the page
    says to trigger a new run, not to clear and rerun."""
    error = "RunConfigError: step: not a field of slipway_pipeline's form"
    ex = store.start_execution("validate", run_id="typo", pipeline="slipway_pipeline")
    store.finish_execution(ex, "FAILED", error=error)
    summary = {
        "run_id": "typo",
        "state": "FAILED",
        "failed": [{"step": "validate", "error": error}],
        "resume": {
            "skipped_on_rerun": [],
            "rerun": ["train-44444444", "evaluate-55555555", "tokens/train/brown-66666666"],
        },
        # as record writes them: in the DAG's order
        "task_states": {
            "validate": "failed",
            "fetch": "upstream_failed",
            "train": "upstream_failed",
            "evaluate": "upstream_failed",
            "gate": "upstream_failed",
        },
    }
    ex = store.start_execution("record", run_id="typo", pipeline="slipway_pipeline")
    store.record_output(ex, "/runs/typo/summary.json", "run_summary", properties=summary)
    store.finish_execution(ex)
    html = parse(pages.run_page(store, "typo", "/slipway"))
    text = " ".join(" ".join(html.text).split())
    assert "Failed at validate" in text and "step: not a field" in text
    assert "trigger a new run with corrected values" in text
    assert "Clear the failed task" not in text
    # and no row below contradicts it
    rows = html.step_rows()
    # in the pipeline's order, each saying what Airflow made of it; a step without a task of
    # its own after them
    assert list(rows)[-5:] == ["fetch", "train", "evaluate", "gate", "tokens/train/brown"]
    assert rows["train"] == ["train", "not run", "Airflow: upstream_failed"]
    assert rows["gate"] == ["gate", "not run", "Airflow: upstream_failed"]
    assert rows["tokens/train/brown"] == ["tokens/train/brown", "not run", "not run"]
    assert "clear-and-rerun" not in text


def test_a_failed_scheduled_run_may_also_be_backfilled(store, tmp_path):
    run_id = "scheduled__2026-12-06T00:00:00+00:00"
    record_run(store, run_id, tmp_path, fail_train=True)
    text = " ".join(" ".join(parse(pages.run_page(store, run_id, "/slipway")).text).split())
    assert "Clear the failed task and rerun (or backfill with reprocess_behavior=failed" in text


@pytest.mark.parametrize(
    ("run_id", "run_type", "backfill"),
    [
        # a trigger may choose any run id Airflow's pattern allows, this one included
        ("scheduled__2026-12-06T00:00:00+00:00", "manual", False),
        ("nightly-rerun", "scheduled", True),
        ("backfill__2026-12-06T00:00:00+00:00", "backfill", True),
    ],
)
def test_the_backfill_hint_follows_airflows_run_type(store, tmp_path, run_id, run_type, backfill):
    from operators.reports.view import run_view

    record_run(store, run_id, tmp_path, fail_train=True, run_type=run_type)
    view = run_view(store.run_graph(run_id))
    assert view.run_properties["run_type"] == run_type and view.scheduled is backfill
    text = " ".join(" ".join(parse(pages.run_page(store, run_id, "/slipway")).text).split())
    assert ("backfill with reprocess_behavior=failed" in text) is backfill


def test_a_rerun_after_the_run_summary_shows_the_rerun_not_the_failure_it_summed_up(store):
    """Cleared after it failed, the run trains again (what its page told the reader to do).
    The summary record wrote of the failure (failed at train, the resume plan, evaluate and
    gate not run, FAILED, its end) is an earlier attempt's: the page shows the rerun as its
    executions have it, what that summary had as not run as not started yet, and, once it
    fails again, that failure."""
    from datetime import timedelta

    graph = store.run_graph("bad <script>")
    summarized = next(n.execution for n in graph.steps if n.execution.name == "record")
    again = summarized.started_at + timedelta(minutes=5)
    train = store.start_execution(
        "train",
        run_id="bad <script>",
        pipeline="slipway_pipeline",
        step_version="44444444",
        started_at=again,
        properties={"output": run_view(graph).train_output},
    )
    body = pages.run_page(store, "bad <script>", "/s", dag_run=pages.DagRun("RUNNING", again))
    html = parse(body)
    text = _words(html)
    assert 'id="failure"' not in body and "Training resumes" not in text
    rows = html.step_rows()
    assert rows["train"][1] == "RUNNING"
    # what the earlier summary had as not run stays listed until the rerun starts it
    assert rows["evaluate"] == ["evaluate", "not run", "not started yet in this rerun"]
    assert rows["gate"] == ["gate", "not run", "not started yet in this rerun"]
    assert list(rows)[-2:] == ["evaluate", "gate"]
    assert "RUNNING: no final checkpoint recorded yet; the loss the trainer logged so far" in text
    # without Airflow's state, the executions': running, so no end and no duration
    view = run_view(store.run_graph("bad <script>"))
    assert (str(view.state), view.ended_at) == ("RUNNING", None)
    assert (view.resume, view.task_states, view.summary_failed) == (None, {}, ())
    assert "· running" in _words(parse(pages.run_page(store, "bad <script>", "/s")))

    store.finish_execution(
        train,
        "FAILED",
        error="TrainerFailed: out of memory",
        ended_at=again + timedelta(seconds=30),
    )
    body = pages.run_page(store, "bad <script>", "/s", dag_run=pages.DagRun("RUNNING", again))
    text = _words(parse(body))
    assert "Failed at train" in text and "TrainerFailed: out of memory" in text
    assert "preempted" not in text  # the first attempt's failure, the summary's
    assert "(record) has not written its summary yet" in text


def test_a_run_airflow_failed_without_a_failed_step_says_so_and_where_to_look(store):
    """A DAG-run timeout with tasks queued, a run marked failed by hand, a task that failed
    before recording: Airflow says FAILED and no recorded step failed. The page says that
    and points to the task logs, instead of "Failed at :" and a plan with "0 run again"."""
    from datetime import UTC, datetime

    failed = pages.DagRun(
        "FAILED", datetime(2026, 12, 1, 2, 0, tzinfo=UTC), datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
    )
    body = pages.run_page(store, "good", "/s", dag_run=failed)
    text = _words(parse(body))
    assert "Airflow marks the run failed, but none of its recorded steps failed" in text
    assert "Failed at" not in text and "run again" not in text and 'id="resume-plan"' not in body
    (box,) = re.findall(r'<div class="failure" id="failure">.*?</div>', body, re.S)
    assert "The task logs say why:" in _words(parse(box))
    assert 'href="/dags/slipway_pipeline/runs/good" target="_top"' in box
    static = pages.run_page(store, "good", None, dag_run=failed)  # no Airflow to link
    assert "none of its recorded steps failed" in static and 'href="/dags/' not in static


def test_a_worse_promotion_many_drop_reasons_and_multiline_samples_read_well(store):
    """A model promoted with no criterion over a better one is flagged, not shown as plain
    success; a step's drop reasons show the top four, the rest folded; a completion's
    newlines show as ⏎ (an all-newline completion would look empty)."""
    ex = store.start_execution("quality", run_id="wide", pipeline="slipway_pipeline")
    dropped = {f"rule_{i}": 10 - i for i in range(6)}
    counts = {"records_in": 100, "records_out": 55, "dropped": dropped}
    store.record_output(ex, "/steps/quality-wide", "dataset", counts=counts)
    store.finish_execution(ex)
    ex = store.start_execution("evaluate", run_id="wide", pipeline="slipway_pipeline")
    samples = {"completions": [{"prompt": "def f():\n", "completion": "\n\n"}]}
    store.record_output(
        ex, "/steps/evaluate-wide/samples.json", "eval_result", role="samples", properties=samples
    )
    store.finish_execution(ex)
    warning = "held-out bits/byte 3.0000 (mean of 2 stores) is worse than 2.2000"
    ex = store.start_execution("gate", run_id="wide", pipeline="slipway_pipeline")
    gate = {"summary": "passed: no criterion set (worse than the model it replaces)"}
    store.finish_execution(
        ex,
        properties={
            "model_name": "demo",
            "promoted": {"uri": "slipway://models/demo", "version": "promotion:9"},
            "gate": {**gate, "warning": warning},
        },
    )
    body = pages.run_page(store, "wide", "/slipway")
    assert '<div class="warn" id="promoted">' in body and f"Warning:</strong> {warning}" in body
    html = parse(body)
    reasons = html.step_rows()["quality"][5]
    # the top four, then a folded "+2 more" holding the rest (cell text joined as parsed)
    assert reasons == "rule_0=10, rule_1=9, rule_2=8, rule_3=7+2 morerule_4=6, rule_5=5"
    assert ["def f():⏎", "⏎⏎"] in [cells for _, cells in html.rows]


def test_a_score_well_under_chance_is_flagged_apart_from_one_at_chance(store):
    """boolq's answers are 62% yes: a model answering "no" to all scores 0.38, which is no
    skill in reverse. The page and the printed table mark it "below chance", apart from
    "~chance", and say why; a task above chance gets neither."""
    from operators.lineage.render import render_benchmarks

    results = {
        "boolq": {"n": 200, "acc": 0.38, "acc_stderr": 0.034, "chance": 0.5},
        "piqa": {"n": 200, "acc": 0.52, "acc_stderr": 0.035, "chance": 0.5},
        "arc_easy": {"n": 200, "acc": 0.41, "acc_stderr": 0.035, "chance": 0.25},
    }
    ex = store.start_execution("evaluate", run_id="odd", pipeline="slipway_pipeline")
    for task, counts in results.items():
        role = f"benchmark-{task}"
        store.record_output(
            ex, f"/steps/evaluate-odd/{role}.json", "eval_result", role=role, counts=counts
        )
    store.finish_execution(ex)
    html = parse(pages.run_page(store, "odd", "/s"))
    notes = {a["data-task"]: c[-1] for a, c in html.rows if "data-task" in a}
    assert notes == {"boolq": "below chance", "piqa": "~chance", "arc_easy": ""}
    assert "Below chance: more than two standard errors under it" in _words(html)
    printed = render_benchmarks(list(results.items()))
    marks = {line.split()[0]: line for line in printed[2:5]}
    assert marks["boolq"].endswith("below chance") and marks["piqa"].endswith("~chance")
    assert not marks["arc_easy"].endswith("chance")
    assert printed[5].startswith("  1 of 3 within 2 standard errors of chance")
    assert printed[6].startswith("  1 of 3 more than 2 standard errors under chance")
    # how many contexts were cut to fit seq_len (the harness does it silently) is printed
    cut = render_benchmarks([("mmlu_5shot", {"n": 200, "acc": 0.3, "truncated": 150})])
    assert cut[2].endswith("150 of 200 contexts cut to fit")
    assert "cut" not in render_benchmarks([("mmlu", {"n": 200, "acc": 0.3, "truncated": 0})])[2]


def test_airflows_record_of_a_dag_run_is_the_one_shown(store):
    """Between two tasks of a running DAG run every step lineage has is done: the runs list
    and the run page show Airflow's state of the run (``ui.dag_runs``) where it has one, and
    filter by it; once Airflow has started the run, its start and end are the ones shown
    (lineage's first and last executions are not quite them)."""
    from datetime import UTC, datetime

    runs = store.runs()
    began = datetime(2026, 12, 1, 1, 59, 30, tzinfo=UTC)
    live = {
        ("slipway_pipeline", "good"): pages.DagRun("RUNNING", began),
        ("slipway_pipeline", "bad <script>"): pages.DagRun("QUEUED"),  # not started
    }
    shown = {r.run_id: r for r in pages.with_dag_runs(runs, live)}
    assert {k: str(r.state) for k, r in shown.items()} == {
        "good": "RUNNING",
        "bad <script>": "QUEUED",
    }
    assert (shown["good"].started_at, shown["good"].ended_at) == (began, None)
    lineage_start = next(r.started_at for r in runs if r.run_id == "bad <script>")
    # queued (cleared, say): lineage's start, and no end: it has not ended
    assert (shown["bad <script>"].started_at, shown["bad <script>"].ended_at) == (
        lineage_start,
        None,
    )
    # newest start first, as shown: Airflow's start of "good" is before lineage's of "bad"
    assert began < lineage_start
    assert [r.run_id for r in pages.with_dag_runs(runs, live)] == ["bad <script>", "good"]
    listed = parse(pages.runs_page(list(shown.values()), "/s"))
    good = next(c for _, c in listed.rows[1:] if c[0] == "good")
    assert good[3:5] == ["2026-12-01 01:59:30", "running"]
    running = parse(pages.runs_page(list(shown.values()), "/s", pages.RunFilters(state="QUEUED")))
    assert [c[0] for _, c in running.rows[1:]] == ["bad <script>"]
    page = pages.run_page(store, "good", "/s", dag_run=live["slipway_pipeline", "good"])
    assert '<span class="state state-RUNNING" id="run-state">RUNNING</span>' in page
    assert "started 2026-12-01 01:59:30 UTC · running" in page
    # a running run's page reloads itself, and says so; a finished one and a file do not
    assert f'<meta http-equiv="refresh" content="{pages.LIVE_REFRESH_S}">' in page
    assert "refreshes every 30 s while the run is going" in page
    for done in (pages.run_page(store, "good", "/s"), pages.run_page(store, "good", None)):
        assert 'http-equiv="refresh"' not in done
    # a run lineage thinks is running, with no DAG run to say so (a shell's run, or a stale
    # RUNNING execution): no endless reloads
    store.start_execution("ingest", run_id="shell", pipeline=None)
    assert "RUNNING" in pages.run_page(store, "shell", "/s")
    assert 'http-equiv="refresh"' not in pages.run_page(store, "shell", "/s")
    assert 'http-equiv="refresh"' not in pages.run_page(
        store, "good", None, dag_run=pages.DagRun("RUNNING")
    )
    ended = datetime(2026, 12, 1, 2, 1, 30, tzinfo=UTC)
    page = pages.run_page(store, "good", "/s", dag_run=pages.DagRun("COMPLETE", began, ended))
    assert "started 2026-12-01 01:59:30 UTC · 2 min 00 s" in page


def test_each_tasks_tab_opens_at_its_row(store):
    """Airflow's "Slipway step" tab links #step-<task id>. A step named after its task is its
    own anchor; the tokenize task's steps are named tokens/<kind>/<source> (and the sweep's
    mapped cells cell/<label>), so the task's first row carries the task's anchor too; the
    record task's output is the run's summary, at the top."""
    for name, task in (
        ("train", "train"),
        ("tokens/train/brown", "tokenize"),
        ("tokens/heldout/brown", "tokenize"),
    ):
        ex = store.start_execution(
            name, run_id="tok", pipeline="slipway_pipeline", properties={"task_id": task}
        )
        store.finish_execution(ex)
    body = pages.run_page(store, "tok", "/s")
    assert body.count('id="step-tokenize"') == 1 and body.count('id="step-train"') == 1
    assert body.index('id="step-tokenize"') < body.index('id="step-tokens/heldout/brown"')
    assert body.index('id="step-tokens/train/brown"') < body.index('id="step-tokenize"')
    assert '<h1 id="step-record">' in body


def test_the_runs_list_filters(store):
    runs = store.runs()
    every = parse(pages.runs_page(runs, "/slipway"))
    listed = [c[0] for _, c in every.rows[1:]]
    assert sorted(listed) == sorted(r.run_id for r in runs)
    failed = parse(pages.runs_page(runs, "/slipway", pages.RunFilters(state="FAILED")))
    assert [c[0] for _, c in failed.rows[1:]] == ["bad <script>"]
    assert [
        c[0] for _, c in parse(pages.runs_page(runs, "/s", pages.RunFilters(q="GOO"))).rows[1:]
    ] == ["good"]
    good = next(c for _, c in every.rows[1:] if c[0] == "good")
    assert good[6] == "1"  # one cache hit (quality)


def test_the_runs_list_is_paged_and_its_links_keep_the_filters(client, store, monkeypatch):
    """``RUNS_PER_PAGE`` rows a page, newest first; the links to newer and older pages keep the
    filters; a page past the last shows the last, and page 0 is refused."""
    for name in ("night-a", "night-b"):
        store.finish_execution(store.start_execution("fetch", run_id=name, pipeline="p"))
    newest_first = [r.run_id for r in store.runs() if r.run_id.startswith("night-")]
    assert 'class="pager"' not in client.get("/").text  # 4 runs: one page, no pager

    monkeypatch.setattr(pages, "RUNS_PER_PAGE", 1)
    first = client.get("/", params={"q": "night-", "state": "COMPLETE"}).text
    html = parse(first)
    assert [c[0] for _, c in html.rows[1:]] == newest_first[:1]
    assert "1-1 of 2 matching, 4 runs" in _words(html)
    assert 'href="/slipway/?state=COMPLETE&amp;q=night-&amp;page=2" rel="next"' in first
    assert 'rel="prev"' not in first  # the newest page has no newer one
    second = client.get("/", params={"q": "night-", "state": "COMPLETE", "page": 2}).text
    assert [c[0] for _, c in parse(second).rows[1:]] == newest_first[1:]
    assert "2-2 of 2 matching, 4 runs" in _words(parse(second))
    assert 'href="/slipway/?state=COMPLETE&amp;q=night-&amp;page=1" rel="prev"' in second
    assert 'rel="next"' not in second
    past = client.get("/", params={"q": "night-", "state": "COMPLETE", "page": 9}).text
    assert [c[0] for _, c in parse(past).rows[1:]] == newest_first[1:]
    assert client.get("/", params={"page": 0}).status_code == 422


def test_the_runs_list_shows_each_runs_results(store):
    """Train loss, held-out bits/byte (the gate's mean) and the promoted model, read in one
    query for every run, from each step's last attempt."""
    from operators.promotion import model_uri
    from operators.reports.view import RESULT_STEPS, RESULT_TYPES, run_results

    # good's evaluate again, with a second held-out store: the last attempt is the one shown
    ex = store.start_execution("evaluate", run_id="good", pipeline="slipway_pipeline")
    for role, bpb in (("heldout-brown", 2.0), ("heldout-fortunes", 3.0)):
        counts = {"bits_per_byte": bpb}
        store.record_output(
            ex, f"/steps/evaluate-2/{role}.json", "eval_result", role=role, counts=counts
        )
    store.finish_execution(ex)
    results = run_results(
        store.run_outputs(RESULT_STEPS, RESULT_TYPES), store.run_failures(["train"])
    )
    promoted = f"demo @{store.artifact(model_uri('demo')).version}"  # good's, the only one
    assert results["good"].train_loss == 6.0  # the checkpoint's loss_end, as recorded
    assert results["good"].heldout_bits_per_byte == 2.5
    assert results["good"].promoted == promoted
    # failed in training: the loss it last logged, as its failed execution recorded it
    (failed,) = store.run_failures(["train"])
    assert failed.run_id == "bad <script>" and failed.step == "train"
    loss, step = (failed.properties[k] for k in ("last_logged_loss", "last_logged_loss_step"))
    assert (loss, step) == loss_curve(run_view(store.run_graph("bad <script>")))[-1][::-1]
    bad = results["bad <script>"]
    assert (bad.train_loss, bad.train_failed_at, bad.heldout_bits_per_byte) == (loss, step, None)
    html = parse(pages.runs_page(store.runs(), "/s", results=results))
    header = html.rows[0][1]
    rows = {c[0]: c for _, c in html.rows[1:]}
    shown = [
        rows["good"][header.index(h)] for h in ("train loss", "held-out bits/byte", "promoted")
    ]
    assert shown == ["6.0000", "2.5000", f"{promoted} current"]  # good's is the latest
    shown = [rows["bad <script>"][header.index(h)] for h in ("train loss", "promoted")]
    assert shown == [f"{loss:.4f} at step {step}", ""]


def test_the_runs_list_reads_each_steps_latest_attempt_even_without_results(store):
    """A train rerun that failed, or runs still, has no checkpoint: the list shows no loss,
    as the run page shows no training, not the earlier attempt's. A held-out store whose
    bits/byte is not finite shows as nan, not blank (which reads "not evaluated")."""
    from operators.reports.view import RESULT_STEPS, RESULT_TYPES, run_results

    ex = store.start_execution("train", run_id="good", pipeline="slipway_pipeline")
    store.finish_execution(ex, "FAILED", error="preempted")
    ex = store.start_execution("evaluate", run_id="good", pipeline="slipway_pipeline")
    for role, bpb in (("heldout-brown", 2.0), ("heldout-fortunes", float("nan"))):
        store.record_output(
            ex, f"/e/{role}.json", "eval_result", role=role, counts={"bits_per_byte": bpb}
        )
    store.finish_execution(ex)
    results = run_results(
        store.run_outputs(RESULT_STEPS, RESULT_TYPES), store.run_failures(["train"])
    )
    assert run_view(store.run_graph("good")).training is None
    # it failed before it logged a loss (no last_logged_loss): no loss at all
    assert results["good"].train_loss is None and results["good"].train_failed_at is None
    assert math.isnan(results["good"].heldout_bits_per_byte)
    html = parse(pages.runs_page(store.runs(), "/s", results=results))
    header = html.rows[0][1]
    good = next(c for _, c in html.rows[1:] if c[0] == "good")
    assert [good[header.index(h)] for h in ("train loss", "held-out bits/byte")] == ["", "nan"]
    # a training that diverged and was then killed: its NaN, not a blank
    ex = store.start_execution("train", run_id="good", pipeline="slipway_pipeline")
    diverged = {"last_logged_loss": float("nan"), "last_logged_loss_step": 7}
    store.finish_execution(ex, "CANCELED", properties=diverged)
    results = run_results(
        store.run_outputs(RESULT_STEPS, RESULT_TYPES), store.run_failures(["train"])
    )
    html = parse(pages.runs_page(store.runs(), "/s", results=results))
    good = next(c for _, c in html.rows[1:] if c[0] == "good")
    assert good[header.index("train loss")] == "nan at step 7"


def test_the_trace_reaches_the_raw_corpus_with_its_hash(store):
    view = run_view(store.run_graph("good"))
    root = store.trace(view.training.checkpoint, view.training.checkpoint_version)
    body = pages.trace_page(root, "/s")
    html = parse(body)
    raw = [c for _, c in html.rows if c and c[0] == "dataset"]
    # versions that are their content hash ("sha256:<hash>") need no column of their own
    assert raw == [["dataset", "file:///data/brown/brown.tar.gz", "ab" * 32]]
    assert html.rows[[c for _, c in html.rows].index(raw[0]) - 1][1] == [
        "type",
        "input",
        "content hash",
    ]
    assert "<svg" in body and body.count('class="node exec"') == 4  # ingest..train
    producers = [c for _, c in html.rows if len(c) == 7][1:]  # each execution once, in order
    assert [r[0] for r in producers] == ["ingest", "quality", "tokenize", "train"]
    # The graph's nodes say which step's output they are, and lead on: an artifact to its
    # own trace, a step to its run.
    titles = re.findall(r"<title>([^<]*)</title>", body)
    assert "dataset: quality-22222222" in titles and "dataset: brown.tar.gz" in titles
    assert f"checkpoint: train-44444444/…/step-{TRAIN_STEPS:09d}" in titles, titles
    links = re.findall(r'<a href="([^"]*)"><g class="node (\w+)">', body)
    assert sorted(kind for _, kind in links) == ["artifact"] * 4 + ["exec"] * 4 + ["raw"]
    assert ("/s/runs/good", "exec") in links
    corpus = "/s/trace?uri=file%3A%2F%2F%2Fdata%2Fbrown%2Fbrown.tar.gz&amp;version=sha256%3A"
    assert any(href.startswith(corpus) for href, _ in links), links
    assert "<a " not in pages.lineage_svg(root)  # no base (the static report): no links
    with pytest.raises(NotFound):
        store.trace("file:///nothing", None)


def test_a_trace_says_what_was_recorded_with_the_artifact(store):
    """The traced artifact's own plain facts: an export's dtype, a checkpoint's losses."""
    graph = store.run_graph("good")
    traced = []
    for node in graph.steps:
        for out in node.outputs:
            if out.artifact.type not in ("hf_export", "checkpoint"):
                continue
            a = out.artifact
            text = _words(parse(pages.trace_page(store.trace(a.uri, a.version), "/s")))
            shown = {**(a.counts or {}), **(a.properties or {})}
            assert shown and all(f"{k}={v}" in text for k, v in shown.items()), text
            traced.append(a.type)
    assert sorted(traced) == ["checkpoint", "hf_export"]  # the export's dtype among them


def test_a_promotions_trace_links_the_model_it_replaced_instead_of_tracing_it_again(store):
    """The gate reads the model it may replace: each promotion's trace would hold every
    earlier promotion's whole chain. The page draws the earlier model as one linked node,
    names it as what the model was judged against, and leaves its chain to its own page."""
    from operators.promotion import PROMOTED_MODEL, model_uri

    def run(run_id: str, baseline: str | None) -> str:
        ex = store.start_execution("train", run_id=run_id, pipeline="slipway_pipeline")
        store.record_input(ex, "file:///data/brown/brown.tar.gz", "dataset")
        store.record_output(ex, f"/steps/train-{run_id}/ckpt", "checkpoint", version=run_id)
        store.finish_execution(ex)
        gate = store.start_execution("gate", run_id=run_id, pipeline="slipway_pipeline")
        store.record_input(gate, f"/steps/train-{run_id}/ckpt", "checkpoint", version=run_id)
        if baseline:
            store.record_input(gate, model_uri("demo"), PROMOTED_MODEL, version=baseline)
        version = f"promotion:{gate}"
        store.record_output(gate, model_uri("demo"), PROMOTED_MODEL, version=version)
        store.finish_execution(gate)
        return version

    first = run("p1", None)
    second = run("p2", first)
    body = pages.trace_page(store.trace(model_uri("demo"), second), "/s")
    html = parse(body)
    producers = [c for _, c in html.rows if len(c) == 7][1:]
    assert [(r[0], r[2]) for r in producers] == [("train", "p2"), ("gate", "p2")]
    assert f"Judged against the model promoted before it: @{first}" in _words(html)
    assert f"version={quote(first, safe='')}" in body
    raw = [c[1] for _, c in html.rows if c and c[0] == "dataset"]
    assert raw == ["file:///data/brown/brown.tar.gz"]  # the earlier model is no raw input
    assert store.trace(model_uri("demo"), second).inputs[1].inputs  # lineage keeps the chain


def test_a_step_that_wrote_several_inputs_lists_each(store):
    """fetch records every corpus file as its output: its row in the producers table lists
    each one the trace reaches, not only the first."""
    fetch = store.start_execution("fetch", run_id="f", pipeline="slipway_pipeline")
    for name in ("a.txt", "b.txt"):
        store.record_output(fetch, f"file:///data/{name}", "dataset", version=name)
    store.finish_execution(fetch)
    ingest = store.start_execution("ingest", run_id="f", pipeline="slipway_pipeline")
    for name in ("a.txt", "b.txt"):
        store.record_input(ingest, f"file:///data/{name}", "dataset", version=name)
    store.record_output(ingest, "/steps/ingest-f", "dataset", version="i")
    store.finish_execution(ingest)
    html = parse(pages.trace_page(store.trace("/steps/ingest-f"), "/s"))
    rows = {c[0]: c for _, c in html.rows if len(c) == 7}
    # (the cell text as parsed: one <div> per artifact, joined without a space)
    assert rows["fetch"][6] == "dataset file:///data/a.txt @a.txtdataset file:///data/b.txt @b.txt"


def test_the_static_report_is_self_contained(store, tmp_path):
    path = write_run_report(store, "good")
    assert path == f"{tmp_path}/runs/good/report.html"
    body = Path(path).read_text()
    html = parse(body)
    (img,) = [i for i in html.images if i.get("id") == "loss-plot"]
    png = base64.b64decode(img["src"].removeprefix("data:image/png;base64,"))
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert "http://" not in body and "https://" not in body and 'src="/' not in body
    assert "trace it to its raw inputs" not in body  # no links out of the file


def test_the_run_page_links_a_static_report_only_once_one_is_written(client, store):
    """The link appears once ``record`` has written the file and recorded it, never as a link
    to a 404: a sweep night writes none, and its page links the night's sweep report instead."""
    from operators.record import RecordRunOperator

    assert "/runs/good/report.html" not in client.get("/runs/good").text
    execution = store.start_execution("record", run_id="good", pipeline=pages.PIPELINE_DAG)
    RecordRunOperator(task_id="record")._write_report(store, "good", execution)
    store.finish_execution(execution)
    page = client.get("/runs/good").text
    assert 'href="/slipway/runs/good/report.html" id="static-report"' in page
    assert client.get("/runs/good/report.html").status_code == 200
    assert 'id="sweep-night"' not in page

    night = store.start_execution("check", run_id="night-1", pipeline=pages.SWEEP_DAG)
    store.finish_execution(night)
    night_page = client.get("/runs/night-1").text
    assert "/runs/night-1/report.html" not in night_page
    assert 'href="/slipway/sweeps?night=night-1" id="sweep-night"' in night_page


def test_the_loss_curve_is_read_from_the_metrics_log(store):
    view = run_view(store.run_graph("good"))
    curve = loss_curve(view)
    assert [s for s, _ in curve] == list(range(1, TRAIN_STEPS + 1))
    assert curve[0][1] == pytest.approx(8.85)


@pytest.fixture
def client(store, monkeypatch):
    """The plugin's app (operators/ui.py) over the fixture's store, signed in: Airflow's own
    authentication of these routes is tested against a real API server in
    tests/e2e/test_airflow_standalone.py (401 and the login redirect)."""
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.testclient import TestClient

    from operators import ui

    monkeypatch.setattr(ui, "_store", store)
    # Airflow's DagRun states come from the API server's metadata database: read for real in
    # tests/integration/test_dag_pipeline_run.py; here there is none (lineage's states show)
    monkeypatch.setattr(ui, "dag_runs", lambda run_ids: {})
    monkeypatch.setattr(ui, "waiting_dag_runs", lambda dag_ids: {})
    monkeypatch.setattr(ui, "dag_paused", lambda dag_id: None)
    ui.app.dependency_overrides[get_user] = lambda: object()
    # a user who may read every DAG (the auth manager's answer is the test's to give below)
    ui.app.dependency_overrides[ui.readable_dags] = lambda: set
    try:
        yield TestClient(ui.app, root_path="/slipway")
    finally:
        ui.app.dependency_overrides.clear()


def test_the_app_serves_pages_plots_and_reports(client, store):
    r = client.get("/runs/good")
    assert r.status_code == 200 and 'src="/slipway/runs/good/loss.png"' in r.text
    assert 'href="/dags/slipway_pipeline/runs/good"' in r.text  # back to the DAG run
    png = client.get("/runs/good/loss.png")
    assert png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
    assert client.get("/runs/nothing").status_code == 404
    assert client.get("/runs/good/report.html").status_code == 404  # not written yet
    write_run_report(store, "good")
    assert "data:image/png;base64," in client.get("/runs/good/report.html").text
    listed = client.get("/", params={"state": "FAILED"})
    assert "bad &lt;script&gt;" in listed.text and ">good<" not in listed.text
    assert client.get("/trace", params={"uri": "file:///nothing"}).status_code == 404
    assert client.get("/", params={"q": "x" * 300}).status_code == 422  # bounded input
    # No sweep recorded: the page says so; a plot that does not exist is a 404, and a run id
    # cannot name a folder outside the runs (run_folder makes it one safe path segment).
    empty = client.get("/sweeps").text
    assert "make sweep-demo runs one night locally" in _words(parse(empty))
    assert "No forecast pre-registered yet" in empty and 'id="forecasts"' not in empty
    # a night that is not recorded is a 404 naming it, never another night's page
    missing = client.get("/sweeps", params={"night": "scheduled__nope"})
    assert missing.status_code == 404 and "night 'scheduled__nope'" in missing.text
    assert client.get("/sweeps/..%2F..%2Fetc/isoflop.png").status_code == 404
    assert client.get("/sweeps/good/passwd.png").status_code == 404


def _promote(store, run_id: str, version: str) -> None:
    """A gate of ``run_id`` promoting model ``demo`` as the gate records it (the promoted
    model's artifact, a new version of its URI; operators/promotion.py)."""
    from operators.promotion import PROMOTED_MODEL, model_uri

    ex = store.start_execution("gate", run_id=run_id, pipeline="slipway_pipeline")
    props = {"name": "demo", "run_id": run_id}
    store.record_output(ex, model_uri("demo"), PROMOTED_MODEL, version=version, properties=props)
    promoted = {"uri": model_uri("demo"), "version": version}
    store.finish_execution(ex, properties={"model_name": "demo", "promoted": promoted})


def test_a_replaced_promotion_says_so_and_a_trace_names_the_version_it_resolved(client, store):
    """A run whose model a later run replaced says so, linking the run now promoted; the
    trace of the model's URI (no version asked: the latest) names the version, its run and
    the other versions."""
    from operators.promotion import model_uri

    good = store.artifact(model_uri("demo")).version  # the fixture's run "good" promoted it
    _promote(store, "first", "promotion:901")
    _promote(store, "second", "promotion:902")
    first = parse(client.get("/runs/first").text)
    text = _words(first)
    assert "No longer the current model: the current one is @promotion:902, from run second" in text
    assert '<div class="superseded" id="promoted">' in client.get("/runs/first").text
    assert 'href="/slipway/runs/second"' in client.get("/runs/first").text
    assert "No longer the current model" not in client.get("/runs/second").text

    page = client.get("/trace", params={"uri": "slipway://models/demo"}).text
    text = _words(parse(page))
    assert "Version @promotion:902 (the latest of 3), written by gate of run second" in text
    assert f"Other versions, newest first: @promotion:901, @{good}." in text
    assert "version=promotion%3A901" in page
    asked = client.get(
        "/trace", params={"uri": "slipway://models/demo", "version": "promotion:901"}
    )
    text = _words(parse(asked.text))
    assert (
        "Version @promotion:901 (not the latest: @promotion:902 is), written by gate of run first"
        in text
    )
    assert f"Other versions, newest first: @promotion:902, @{good}." in text


def test_runs_of_unreadable_dags_are_not_named_through_promotions_or_versions(client, store):
    """A promotion by a run of a DAG the user may not read replaces their run's model: the
    page says so without naming that run, and the model's versions list leaves its version
    out (its trace is refused as ever)."""
    from operators import ui

    ui.app.dependency_overrides[ui.readable_dags] = lambda: lambda dags: dags - {"secret_dag"}
    ex = store.start_execution("gate", run_id="secret-42", pipeline="secret_dag")
    props = {"name": "demo", "run_id": "secret-42"}
    store.record_output(
        ex, "slipway://models/demo", "promoted_model", version="promotion:secret", properties=props
    )
    store.finish_execution(ex)
    page = client.get("/runs/good").text
    assert "No longer the current model: a later promotion replaced it." in _words(parse(page))
    assert "secret-42" not in page and "promotion:secret" not in page
    assert client.get("/trace", params={"uri": "slipway://models/demo"}).status_code == 403
    mine = store.artifact("slipway://models/demo", None)  # the latest: the secret one
    assert mine.version == "promotion:secret"
    good = store.executions("good")
    gate = next(e for e in good if e.name == "gate")
    version = gate.properties["promoted"]["version"]
    traced = client.get("/trace", params={"uri": "slipway://models/demo", "version": version})
    assert traced.status_code == 200 and "promotion:secret" not in traced.text
    assert "(the latest of" not in traced.text  # one version visible: its own


def test_an_unversioned_record_is_linked_as_such(client, store):
    """An artifact recorded without a version ("") and later with one: the link to the
    unversioned record opens it, not the latest."""
    ex = store.start_execution("make", run_id="good", pipeline="slipway_pipeline")
    store.record_output(ex, "/x/thing", "dataset")  # version ""
    store.record_output(ex, "/x/thing", "dataset", version="v2")
    store.finish_execution(ex)
    latest = client.get("/trace", params={"uri": "/x/thing"}).text
    assert "the unversioned record</a>" in latest and "version=&" not in latest
    link = re.search(r'href="([^"]*)">the unversioned record</a>', latest).group(1)
    assert link.endswith("&version=")
    unversioned = client.get("/trace", params={"uri": "/x/thing", "version": ""}).text
    assert "The unversioned record" in unversioned and "Version @v2" not in unversioned


def test_a_run_airflow_has_but_lineage_not_yet_is_a_page_that_waits(client, monkeypatch):
    """A queued DAG run has recorded nothing: its "Slipway report" tab says so and reloads,
    instead of "Not found"; a run of a DAG the user may not read stays a 404."""
    from operators import ui

    queued = {
        ("slipway_pipeline", "waiting"): pages.DagRun("QUEUED"),
        ("secret_dag", "hidden"): pages.DagRun("QUEUED"),
    }
    monkeypatch.setattr(
        ui, "dag_runs", lambda ids: {k: v for k, v in queued.items() if k[1] in set(ids)}
    )
    ui.app.dependency_overrides[ui.readable_dags] = lambda: lambda dags: dags - {"secret_dag"}
    page = client.get("/runs/waiting")
    assert page.status_code == 200
    assert "none of its steps has recorded anything yet" in page.text
    assert f'<meta http-equiv="refresh" content="{pages.LIVE_REFRESH_S}">' in page.text
    assert 'id="run-state">QUEUED</span>' in page.text
    assert 'id="paused"' not in page.text and 'id="running-now"' not in page.text
    assert client.get("/runs/hidden").status_code == 404
    assert client.get("/runs/nothing").status_code == 404
    # Why it waits, where Airflow says: the DAG is paused, and another run of it is running.
    running = {("slipway_pipeline", "ahead <1>"): (pages.DagRun("RUNNING"), None)}
    monkeypatch.setattr(
        ui, "waiting_dag_runs", lambda dags: running if "slipway_pipeline" in dags else {}
    )
    monkeypatch.setattr(ui, "dag_paused", lambda dag_id: dag_id == "slipway_pipeline")
    page = parse(client.get("/runs/waiting").text)
    words = _words(page)
    assert "slipway_pipeline is paused" in words
    assert "Airflow starts none of its runs until it is unpaused" in words, words
    assert "Running now in slipway_pipeline: ahead <1>." in words, words
    assert 'href="/slipway/runs/ahead%20%3C1%3E"' in client.get("/runs/waiting").text


def test_the_runs_list_shows_the_runs_airflow_queued_before_they_record(client, monkeypatch):
    """The pipeline runs one DAG run at a time: the others wait queued, with nothing in
    lineage yet. The list shows them (Airflow's state, queued when, no executions), linked to
    their waiting page; not a run of a DAG the user may not read, and not twice a run lineage
    already has."""
    from datetime import UTC, datetime

    from operators import ui

    asked: list[set[str]] = []
    queued_at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)  # newer than every recorded run
    waiting = {
        ("slipway_pipeline", "waiting-1"): (pages.DagRun("QUEUED"), queued_at),
        (pages.SWEEP_DAG, "night-hidden"): (pages.DagRun("QUEUED"), queued_at),
        ("slipway_pipeline", "good"): (pages.DagRun("RUNNING", queued_at), queued_at),
    }

    def fake_waiting(dag_ids):
        asked.append(set(dag_ids))
        return {k: v for k, v in waiting.items() if k[0] in asked[-1]}

    monkeypatch.setattr(ui, "waiting_dag_runs", fake_waiting)
    ui.app.dependency_overrides[ui.readable_dags] = lambda: lambda dags: dags - {pages.SWEEP_DAG}
    listed = parse(client.get("/").text)
    assert asked == [{"slipway_pipeline"}]  # the readable ones of Slipway's DAGs
    rows = [cells for _, cells in listed.rows[1:]]
    first = rows[0]
    assert first[:6] == [
        "waiting-1",
        "slipway_pipeline",
        "QUEUED",
        "queued 2030-01-02 03:04:05",
        "queued",
        "0",
    ], first
    assert [r[0] for r in rows].count("good") == 1 and "night-hidden" not in [r[0] for r in rows]
    page = client.get("/").text
    assert 'href="/slipway/runs/waiting-1"' in page
    only = parse(client.get("/", params={"state": "QUEUED"}).text)
    assert [cells[0] for _, cells in only.rows[1:]] == ["waiting-1"]


def test_the_sweeps_page_lists_nights_as_airflow_has_them(client, store, monkeypatch, tmp_path):
    """A night between two tasks reads COMPLETE in lineage: the page shows Airflow's RUNNING.
    Tonight's night, queued, is listed before anything records it; the page still opens on
    the newest night with a report, and the queued one's says why it has none."""
    from datetime import UTC, datetime

    from operators import ui
    from operators.sweep.figures import summary

    cell = {"index": 0, "label": "h64-d2", "budget": 1e15, "params": 10, "tokens": 20}
    done = store.start_execution("fit", run_id="night-1", pipeline=pages.SWEEP_DAG)
    store.finish_execution(done)
    report = tmp_path / "runs" / "night-1" / "report" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps(summary("night-1", {"cells": [{**cell, "metric": 3.5}]}, {})))
    tonight = datetime(2030, 1, 2, 2, 0, tzinfo=UTC)
    monkeypatch.setattr(
        ui, "dag_runs", lambda ids: {(pages.SWEEP_DAG, "night-1"): pages.DagRun("RUNNING")}
    )
    monkeypatch.setattr(
        ui,
        "waiting_dag_runs",
        # Airflow's going nights: tonight's, queued, and night-1, which lineage already has
        lambda dags: {
            (pages.SWEEP_DAG, "night-2"): (pages.DagRun("QUEUED"), tonight),
            (pages.SWEEP_DAG, "night-1"): (pages.DagRun("RUNNING"), tonight),
        },
    )
    page = parse(client.get("/sweeps").text)
    rows = [cells for _, cells in page.rows]
    assert [r[0] for r in rows[1:3]] == ["night-2", "night-1 ◀"]  # each night once
    assert rows[1] == ["night-2", "QUEUED", "queued 2030-01-02 02:00", "0", "0"]
    assert rows[2][:2] == ["night-1 ◀", "RUNNING"] and rows[2][3:] == ["1", "0"]
    assert "Night night-1" in _words(page)  # the newest night with a report
    assert rows[4] == ["[0] h64-d2", "1e+15", "10", "20", "3.5000", ""]
    queued = client.get("/sweeps", params={"night": "night-2"}).text
    assert "Airflow has queued this night and not started it yet" in queued
    assert 'href="/slipway/runs/night-2"' in queued


def test_a_browser_gets_error_pages_and_an_api_client_text(client):
    """A person who mistypes a run id or opens /trace bare gets a page with the way back;
    anything not asking for HTML gets the status and the reason as text."""
    html = {"accept": "text/html"}
    missing = client.get("/runs/nothing", headers=html)
    assert missing.status_code == 404 and missing.headers["content-type"].startswith("text/html")
    page = parse(missing.text)
    assert "Not found" in page.text and "no run 'nothing'" in " ".join(page.text)
    assert 'href="/slipway/"' in missing.text
    bare = client.get("/trace", headers=html)
    assert bare.status_code == 400 and "Give its URI: /slipway/trace?uri=" in bare.text
    text = client.get("/runs/nothing", headers={"accept": "application/json"})
    assert text.headers["content-type"].startswith("text/plain") and text.text == "no run 'nothing'"


def test_a_bad_query_value_is_an_error_page_not_json(client):
    """``?page=abc`` or ``?page=0`` from a browser is the error page, as every other error;
    anything not asking for HTML gets the reason as text."""
    for page in ("abc", "0"):
        shown = client.get("/", params={"page": page}, headers={"accept": "text/html"})
        assert shown.status_code == 422, page
        assert shown.headers["content-type"].startswith("text/html")
        html = parse(shown.text)
        assert "Bad request" in html.text and 'href="/slipway/"' in shown.text
        assert _words(html).count("page: Input should be") == 1
        text = client.get("/", params={"page": page})
        assert text.status_code == 422 and text.headers["content-type"].startswith("text/plain")
        assert text.text.startswith("page: Input should be"), text.text


def test_a_dag_runs_tab_opens_that_dags_run_and_no_other_dags(client, store, tmp_path, monkeypatch):
    """Airflow shows the plugin's tabs on every DAG run and task of every DAG, and scheduled
    run ids are the same across DAGs: the tabs name the DAG, and another DAG's tab says it
    records no Slipway lineage (404) instead of showing the Slipway run of that id, or a page
    waiting for a validate that never comes. A link without the DAG (the pages' own) opens
    the run as before."""
    import importlib.util
    from datetime import UTC, datetime

    from operators import ui

    plugin_file = Path(__file__).resolve().parents[2] / "plugins" / "slipway_plugin.py"
    spec = importlib.util.spec_from_file_location("slipway_plugin", plugin_file)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    hrefs = {v["destination"]: v["href"] for v in plugin.SlipwayPlugin.external_views}
    assert hrefs["dag_run"] == "/slipway/runs/{RUN_ID}?dag_id={DAG_ID}"
    assert hrefs["task_instance"] == "/slipway/runs/{RUN_ID}?dag_id={DAG_ID}#step-{TASK_ID}"

    def tab(dag_id: str, run_id: str) -> str:
        """The tab's address as Airflow's UI fills it in (each value percent-encoded)."""
        href = hrefs["dag_run"].removeprefix("/slipway")
        return href.replace("{RUN_ID}", quote(run_id, safe="")).replace("{DAG_ID}", dag_id)

    scheduled = "scheduled__2026-12-06T00:00:00+00:00"
    record_run(store, scheduled, tmp_path, fail_train=True)
    began = datetime(2026, 12, 6, tzinfo=UTC)
    airflow_has = {
        ("slipway_pipeline", scheduled): pages.DagRun("FAILED", began, began),
        ("etl_daily", scheduled): pages.DagRun("COMPLETE", began, began),
        ("etl_daily", "manual__etl"): pages.DagRun("RUNNING", began),
        ("slipway_pipeline", "waiting"): pages.DagRun("RUNNING", began),
    }
    monkeypatch.setattr(
        ui, "dag_runs", lambda ids: {k: v for k, v in airflow_has.items() if k[1] in set(ids)}
    )
    html = {"accept": "text/html"}
    mine = client.get(tab("slipway_pipeline", scheduled), headers=html)
    assert mine.status_code == 200 and "preempted at step 12" in mine.text
    assert client.get(f"/runs/{quote(scheduled, safe='')}").text == mine.text
    other = client.get(tab("etl_daily", scheduled), headers=html)
    assert other.status_code == 404 and "preempted" not in other.text
    assert "etl_daily records no Slipway lineage" in _words(parse(other.text))
    # a run of it Airflow has, that lineage has under no DAG: not a page waiting for validate
    running = client.get(tab("etl_daily", "manual__etl"), headers=html)
    assert running.status_code == 404 and 'id="pending"' not in running.text
    # a Slipway DAG's run not recorded yet still waits, and is no other Slipway DAG's
    assert 'id="pending"' in client.get(tab("slipway_pipeline", "waiting")).text
    sweep = client.get(tab(pages.SWEEP_DAG, scheduled))
    assert sweep.status_code == 404 and f"of {pages.SWEEP_DAG} recorded" in sweep.text


def test_report_html_is_a_404_not_a_500_without_lineage_or_beside_executions_of_no_run(
    client, store, tmp_path, monkeypatch
):
    """An execution recorded without a run id (the store allows it) is no run: it does not
    break the run-folder check of every report; and before any lineage database exists the
    report is a 404, as every other page."""
    from operators import ui

    write_run_report(store, "good")
    store.finish_execution(store.start_execution("adhoc"))
    assert client.get("/runs/good/report.html").status_code == 200
    assert store.run_ids() == {"good", "bad <script>"}

    monkeypatch.setattr(ui, "_store", None)
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "fresh"))
    missing = client.get("/runs/good/report.html")
    assert missing.status_code == 404 and "no lineage database" in missing.text


def test_report_html_is_served_sandboxed_with_only_what_it_needs(client, store):
    """The report is read from the storage root, which tasks write, and served from the
    Airflow UI's origin: it runs no script and loads nothing but its inline styles and data:
    images, so that is all a replaced file could do. The report itself needs no more."""
    for run_id in ("good", "bad <script>"):
        write_run_report(store, run_id)
        served = client.get(f"/runs/{quote(run_id, safe='')}/report.html")
        assert served.status_code == 200 and served.headers["content-type"].startswith("text/html")
        assert served.headers["content-security-policy"] == (
            "sandbox; default-src 'none'; img-src data:; style-src 'unsafe-inline'"
        )
        assert served.headers["x-content-type-options"] == "nosniff"
        body = served.text
        images = parse(body).images
        assert images and all(i["src"].startswith("data:image/png;base64,") for i in images)
        for needs_more in ("<script", "<link", "<iframe", "<object", "url(", "@import", "@font"):
            assert needs_more not in body, needs_more


def test_a_user_sees_only_the_runs_of_the_dags_the_auth_manager_lets_them_read(client, store):
    """Signed in is not enough: a user who may read slipway_pipeline but not the sweep sees
    the pipeline's runs and no sweep; one who may read neither sees no run at all."""
    from operators import ui

    store.start_execution("check", run_id="night-1", pipeline=pages.SWEEP_DAG)
    ui.app.dependency_overrides[ui.readable_dags] = lambda: lambda ids: ids & {"slipway_pipeline"}
    listed = client.get("/").text
    assert ">good<" in listed and "night-1" not in listed
    assert client.get("/runs/good").status_code == 200
    assert client.get("/runs/good/loss.png").status_code == 200
    refused = client.get("/runs/night-1")
    assert refused.status_code == 403 and pages.SWEEP_DAG in refused.text
    assert client.get("/runs/night-1/report.html").status_code == 403
    # nor through an unrecorded id that names the same run folder
    store.start_execution("check", run_id="night:2", pipeline=pages.SWEEP_DAG)
    assert client.get("/runs/night_2/report.html").status_code == 403
    assert client.get("/sweeps").status_code == 403
    assert client.get("/sweeps/night-1/isoflop.png").status_code == 403
    ui.app.dependency_overrides[ui.readable_dags] = lambda: lambda ids: set()
    listed = client.get("/").text
    assert ">good<" not in listed and "night-1" not in listed
    for path in ("/runs/good", "/runs/good/loss.png", "/runs/good/report.html"):
        assert client.get(path).status_code == 403, path
    graph = store.run_graph("good")
    uri = next(o.artifact.uri for n in graph.steps for o in n.outputs)
    assert client.get("/trace", params={"uri": uri}).status_code == 403


def test_the_loss_plot_is_drawn_once_per_curve_and_revalidated_by_etag(client, store, monkeypatch):
    """A run page's plot is drawn once per curve: a browser that has it gets 304, another
    request the kept drawing; a new line in the run's log is a new curve, a new ETag."""
    from operators import ui
    from operators.reports.view import run_view

    drawn = []
    monkeypatch.setattr(ui, "loss_png", lambda points: drawn.append(points) or b"\x89PNG fake")
    monkeypatch.setattr(ui, "_LOSS_PNGS", type(ui._LOSS_PNGS)())
    first = client.get("/runs/good/loss.png")
    etag = first.headers["etag"]
    assert first.status_code == 200 and first.content == b"\x89PNG fake" and len(drawn) == 1
    again = client.get("/runs/good/loss.png", headers={"If-None-Match": f'"other", {etag}'})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    for header in (f"W/{etag}", "*"):  # a proxy's weakened tag; any
        assert (
            client.get("/runs/good/loss.png", headers={"If-None-Match": header}).status_code == 304
        )
    assert client.get("/runs/good/loss.png", headers={"If-None-Match": '"x"'}).status_code == 200
    monkeypatch.setattr(ui, "PLOT_VERSION", ui.PLOT_VERSION + 1)  # the plot drawn differently
    assert client.get("/runs/good/loss.png").headers["etag"] != etag
    monkeypatch.setattr(ui, "PLOT_VERSION", ui.PLOT_VERSION - 1)
    assert client.get("/runs/good/loss.png").content == b"\x89PNG fake"
    assert len(drawn) == 2  # drawn again once, for the new version's tag
    log = run_view(store.run_graph("good")).training.output_dir + "/metrics.jsonl"
    with open(log, "a") as f:
        f.write(json.dumps({"step": 99, "loss": 1.5}) + "\n")
    grown = client.get("/runs/good/loss.png", headers={"If-None-Match": etag})
    assert grown.status_code == 200 and grown.headers["etag"] != etag and len(drawn) == 3
    assert drawn[2][-1] == (99, 1.5)


def test_the_reports_benchmark_still_runs():
    """``make bench`` stops at the first benchmark that fails: this one, through the app's
    routes, broke unseen when they gained authorization. Run small, for its exit status and
    its lines, never its times."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_reports", "--runs", "12", "--repeat", "1"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GET / (12 runs)" in done.stdout and "runs list with 12 runs:" in done.stdout
    # it times the pages alone: no failing read of an Airflow database it does not have
    assert "could not be read" not in done.stdout + done.stderr, done.stderr[-3000:]


def test_the_sweeps_page_lists_a_kept_pre_registration_once(client, store, monkeypatch, tmp_path):
    """A night that keeps the last night's pre-registration (the same grid and fit) lists it
    again in its report: the forecasts table shows it once, under the night that made it,
    with the outcome a later night checked."""
    from operators import ui

    def forecast(checked: bool) -> dict:
        return {
            "budget": 3e13,
            "label": "forecast C=3e+13",
            "fit": "approach3",
            "sha256": "ab" * 32,
            "predicted": 3.2,
            "interval": [3.0, 3.4],
            "checked": checked,
            "outcome": 3.1 if checked else None,
            "relative_error": -0.03 if checked else None,
            "inside_interval": True if checked else None,
            "post_hoc": False,
        }

    for night, checked in (("night-1", False), ("night-2", True)):
        done = store.start_execution("fit", run_id=night, pipeline=pages.SWEEP_DAG)
        store.finish_execution(done)
        report = tmp_path / "runs" / night / "report" / "report.json"
        report.parent.mkdir(parents=True)
        report.write_text(json.dumps({"cells": [], "fits": {}, "forecasts": [forecast(checked)]}))
    monkeypatch.setattr(ui, "dag_runs", lambda ids: {})
    monkeypatch.setattr(ui, "waiting_dag_runs", lambda dags: {})
    page = parse(client.get("/sweeps").text)
    rows = [cells for _, cells in page.rows if cells and cells[-1].startswith("ab" * 6)]
    assert len(rows) == 1
    assert rows[0][0] == "night-1" and "3.1000" in rows[0]


def test_breakable_text_is_escaped_and_wraps_only_between_parts(store):
    """Step names and drop reasons are data: escaped first, then given line-break chances."""
    shown = pages.breakable("tokens/train/<b>x</b>_y:z")
    assert str(shown) == "tokens/<wbr>train/<wbr>&lt;b&gt;x&lt;/<wbr>b&gt;_<wbr>y:<wbr>z"
    ex = store.start_execution("tokens/train/a&b", run_id="wbr", pipeline="slipway_pipeline")
    store.finish_execution(ex)
    body = pages.run_page(store, "wbr", "/slipway", loss_src="x.png")
    assert "tokens/<wbr>train/<wbr>a&amp;b" in body
    assert parse(body).step_rows()["tokens/train/a&b"][0] == "tokens/train/a&b"  # as read
