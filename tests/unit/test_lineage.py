"""The lineage store: round trips, failures, traces, concurrent writers and the CLI."""

from __future__ import annotations

import math
import multiprocessing
import sys

import pytest

from operators import cli
from operators.lineage import (
    ArtifactType,
    EventType,
    ExecutionState,
    LineageConfigError,
    LineageStore,
    NotFound,
    RunIdConflict,
    Superseded,
    code_version,
    lineage_url,
)
from operators.lineage.schema import Association, Attribution, Context
from operators.steps import Step, StepRunner, output_of


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path) -> str:
    """The same tests on SQLite (laptops, the demo) and on a real PostgreSQL (production)."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path}/lineage.db"


def _three_step_run(store: LineageStore, run_id: str = "manual__1", fail_train: bool = False):
    """ingest(raw brown + raw spam) -> tokenize(+ tokenizer) -> train: returns execution ids."""
    ingest = store.start_execution("ingest", run_id=run_id, pipeline="lm", step_version="a" * 64)
    store.record_input(ingest, "gs://raw/brown", ArtifactType.DATASET)
    store.record_input(ingest, "gs://raw/spam", ArtifactType.DATASET)
    store.record_output(
        ingest,
        "gs://b/ingest-aaaaaaaa",
        ArtifactType.DATASET,
        counts={"records_in": 510, "records_out": 500, "dropped": {"invalid_input": 10}},
        content_hash="sha256:1",
    )
    store.finish_execution(ingest)

    tokenize = store.start_execution("tokenize", run_id=run_id, pipeline="lm")
    store.record_input(tokenize, "gs://b/ingest-aaaaaaaa", ArtifactType.DATASET)
    store.record_input(tokenize, "gs://b/tok-cccc", ArtifactType.TOKENIZER, role="tokenizer")
    store.record_output(
        tokenize, "gs://b/tokenize-bbbb", ArtifactType.TOKEN_STORE, counts={"tokens": 9}
    )
    store.finish_execution(tokenize)

    train = store.start_execution("train", run_id=run_id, pipeline="lm", properties={"lr": 3e-4})
    store.record_input(train, "gs://b/tokenize-bbbb", ArtifactType.TOKEN_STORE, role="train_data")
    if fail_train:
        try:
            raise RuntimeError("NaN loss at step 120")
        except RuntimeError as exc:
            store.finish_execution(train, ExecutionState.FAILED, error=exc)
    else:
        store.record_output(train, "gs://b/train-dddd/ckpt", ArtifactType.CHECKPOINT)
        store.finish_execution(train, properties={"final_loss": 2.5})
    return ingest, tokenize, train


def test_round_trip_with_failed_execution(url):
    with LineageStore(url) as store:
        _, _, train = _three_step_run(store, fail_train=True)
    # A second store (another process, in effect) reads what the first wrote.
    with LineageStore(url) as store:
        failed = store.execution(train)
        assert failed.state is ExecutionState.FAILED
        assert failed.error == "RuntimeError: NaN loss at step 120"
        assert "raise RuntimeError" in failed.traceback
        assert failed.ended_at is not None and failed.ended_at >= failed.started_at
        assert failed.properties == {"lr": 3e-4}
        assert failed.code_version == code_version()

        [run] = store.runs()
        assert (run.run_id, run.pipeline, run.state) == ("manual__1", "lm", ExecutionState.FAILED)
        assert run.counts == {"COMPLETE": 2, "FAILED": 1}

        graph = store.run_graph("manual__1")
        assert [(s.execution.name, s.execution.state) for s in graph.steps] == [
            ("ingest", ExecutionState.COMPLETE),
            ("tokenize", ExecutionState.COMPLETE),
            ("train", ExecutionState.FAILED),
        ]
        first = graph.steps[0]
        assert [link.artifact.uri for link in first.inputs] == ["gs://raw/brown", "gs://raw/spam"]
        [out] = first.outputs
        assert out.artifact.counts["records_out"] == 500
        assert out.artifact.code_version == code_version()  # inherited from its producer


def test_contexts_associations_and_attributions(url):
    with LineageStore(url) as store:
        ingest, _, _ = _three_step_run(store)
        with store._read() as session:
            contexts = {(c.type, c.name) for c in session.query(Context)}
            assert {
                ("pipeline", "lm"),
                ("dag_run", "manual__1"),
                ("step", "ingest-aaaaaaaa"),
            } <= contexts
            assert session.query(Association).filter_by(execution_id=ingest).count() == 3
            assert session.query(Attribution).count() > 0


def test_a_run_id_belongs_to_the_pipeline_that_recorded_it_first(url):
    """Airflow keeps run ids unique per DAG only (two DAGs scheduled at one instant share
    ``scheduled__<date>``), and lineage runs are keyed by run id: a second DAG writing under
    it is refused with a clear error instead of merging the two runs."""
    with LineageStore(url) as store:
        store.start_execution("fetch", run_id="scheduled__2026-12-06", pipeline="slipway_pipeline")
        with pytest.raises(RunIdConflict, match="already recorded for pipeline 'slipway_pipeline'"):
            store.start_execution(
                "validate", run_id="scheduled__2026-12-06", pipeline="slipway_scaling_sweep"
            )
        assert store.run_owners("scheduled__2026-12-06") == {"slipway_pipeline"}
        assert [e.name for e in store.executions("scheduled__2026-12-06")] == ["fetch"]  # no leak
        assert store.owns_run("scheduled__2026-12-06", "slipway_pipeline")
        assert not store.owns_run("scheduled__2026-12-06", "slipway_scaling_sweep")
        assert store.owns_run("scheduled__2026-12-06", None)  # tools without a pipeline
        assert store.owns_run("never-recorded", "slipway_scaling_sweep")
        # the same pipeline, and writers that name none, keep writing to it
        store.start_execution("train", run_id="scheduled__2026-12-06", pipeline="slipway_pipeline")
        store.start_execution("note", run_id="scheduled__2026-12-06")
        assert len(store.executions("scheduled__2026-12-06")) == 3
        # a run first recorded without a pipeline is claimed by the first that names one
        store.start_execution("fetch", run_id="manual__2")
        store.start_execution("fetch", run_id="manual__2", pipeline="slipway_scaling_sweep")
        with pytest.raises(RunIdConflict):
            store.start_execution("fetch", run_id="manual__2", pipeline="slipway_pipeline")


def test_a_run_merged_before_the_guard_keeps_both_owners(url):
    """Runs that two pipelines recorded before run ids were guarded: each may still write to
    and close its own, and a third is refused."""
    from operators.lineage.schema import ContextParent

    with LineageStore(url) as store:
        store.start_execution("fetch", run_id="r", pipeline="a")
        store.start_execution("fetch", run_id="r2", pipeline="b")  # makes pipeline b's context

        def merge(session) -> None:  # what an unguarded second DAG's first write left behind
            run = session.query(Context).filter_by(type="dag_run", name="r").one()
            b = session.query(Context).filter_by(type="pipeline", name="b").one()
            session.add(ContextParent(child_id=run.id, parent_id=b.id))

        store._transact(merge)
        assert store.run_owners("r") == {"a", "b"}
        assert store.owns_run("r", "a") and store.owns_run("r", "b")
        store.start_execution("train", run_id="r", pipeline="a")
        store.start_execution("train", run_id="r", pipeline="b")
        with pytest.raises(RunIdConflict, match="'a, b'"):
            store.start_execution("train", run_id="r", pipeline="c")


def test_cached_canceled_and_running_states(url):
    with LineageStore(url) as store:
        done = store.start_execution("ingest", run_id="r2")
        store.finish_execution(done, ExecutionState.CACHED)
        store.start_execution("train", run_id="r2")
        assert store.runs()[0].state is ExecutionState.RUNNING
        assert store.runs()[0].ended_at is None
        # The all_done closer: a task killed from outside never reported.
        assert store.cancel_running("r2", "killed from outside") == 1
        [run] = store.runs()
        assert run.state is ExecutionState.CANCELED
        assert run.counts == {"CACHED": 1, "CANCELED": 1}
        with pytest.raises(ValueError):
            store.finish_execution(done, ExecutionState.RUNNING)


def test_record_artifact_upserts_and_link_is_idempotent(url):
    with LineageStore(url) as store:
        first = store.record_artifact("gs://x", "dataset", content_hash="h1")
        second = store.record_artifact("gs://x", "dataset", counts={"n": 1})
        assert first == second
        art = store.artifact("gs://x")
        assert (art.content_hash, art.counts) == ("h1", {"n": 1})
        run = store.start_execution("s")
        store.link(run, "gs://x", EventType.OUTPUT)
        store.link(run, first, "OUTPUT")
        made = store.trace("gs://x")
        assert made.producer.id == run and made.inputs == ()
        # Produced from nothing recorded (as fetch records the corpora it found): a raw input.
        assert made.raw_inputs() == [made.artifact]
        with pytest.raises(NotFound):
            store.link(run, "gs://never-recorded", EventType.INPUT)


def test_a_diverged_runs_non_finite_numbers_are_recorded_and_read_back(url, tmp_path):
    """A NaN loss is a result, not a recording error: Postgres refuses JSON's NaN token, so
    the store writes standard JSON and reads the floats back, on both databases."""
    import math
    import sqlite3

    with LineageStore(url) as store:
        train = store.start_execution("train", run_id="diverged", pipeline="lm")
        store.record_output(
            train,
            "gs://b/train-dddd/ckpt",
            ArtifactType.CHECKPOINT,
            counts={"loss_end": float("nan"), "grad_norms": [1.5, float("inf")]},
            properties={"note": {"$float": "nan?"}, "label": "NaN"},  # look-alikes stay as they are
        )
        store.finish_execution(train, properties={"worst": float("-inf")})
    with LineageStore(url) as store:
        ckpt = store.artifact("gs://b/train-dddd/ckpt")
        assert math.isnan(ckpt.counts["loss_end"])
        assert ckpt.counts["grad_norms"] == [1.5, math.inf]
        assert ckpt.properties == {"note": {"$float": "nan?"}, "label": "NaN"}
        assert store.execution(train).properties == {"worst": -math.inf}
    if url.startswith("sqlite"):  # a file written before the codec, with bare NaN tokens
        path = url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            db.execute("UPDATE artifacts SET counts = '{\"loss_end\": NaN}'")
        with LineageStore(url) as store:
            assert math.isnan(store.artifact("gs://b/train-dddd/ckpt").counts["loss_end"])


def test_trace_across_three_steps_to_raw_inputs(url):
    with LineageStore(url) as store:
        _three_step_run(store)
        root = store.trace("gs://b/train-dddd/ckpt")
    assert root.producer is not None and root.producer.name == "train"
    [tokens] = root.inputs
    assert tokens.producer.name == "tokenize"
    assert [n.artifact.uri for n in tokens.inputs] == ["gs://b/ingest-aaaaaaaa", "gs://b/tok-cccc"]
    assert tokens.inputs[0].producer.name == "ingest"
    assert sorted(a.uri for a in root.raw_inputs()) == [
        "gs://b/tok-cccc",
        "gs://raw/brown",
        "gs://raw/spam",
    ]


def test_trace_prefers_the_complete_producer_over_cache_hits(url):
    with LineageStore(url) as store:
        _three_step_run(store, run_id="first")
        # A later run hits the cache for ingest: it links the same output, with no inputs.
        cached = store.start_execution("ingest", run_id="second", pipeline="lm")
        store.link(cached, "gs://b/ingest-aaaaaaaa", EventType.OUTPUT)
        store.finish_execution(cached, ExecutionState.CACHED)
        node = store.trace("gs://b/ingest-aaaaaaaa")
    assert node.producer.run_id == "first"
    assert {a.uri for a in node.raw_inputs()} == {"gs://raw/brown", "gs://raw/spam"}


def test_a_shared_ancestor_is_traced_and_printed_once(url):
    """A ladder of diamonds: each level's artifact is read by two steps whose outputs the next
    level reads, so 2**12 paths lead from the top to the raw input. The trace is a graph of
    the 37 recorded artifacts, each producer printed once, not once per path."""
    from operators.lineage.render import render_trace

    levels = 12
    with LineageStore(url) as store:
        store.record_artifact("gs://raw/corpus", "dataset", content_hash="c0")
        below = "gs://raw/corpus"
        for level in range(levels):
            sides = []
            for side in ("left", "right"):
                ex = store.start_execution(f"{side}-{level}", run_id="r", pipeline="p")
                store.link(ex, below, EventType.INPUT)
                sides.append(f"gs://b/{side}-{level}")
                store.record_output(ex, sides[-1], "dataset")
                store.finish_execution(ex)
            ex = store.start_execution(f"join-{level}", run_id="r", pipeline="p")
            for side in sides:
                store.link(ex, side, EventType.INPUT)
            below = f"gs://b/join-{level}"
            store.record_output(ex, below, "dataset")
            store.finish_execution(ex)
        root = store.trace(below)
    left, right = root.inputs
    assert left.inputs[0] is right.inputs[0]  # the level below: one node, shared
    assert [a.uri for a in root.raw_inputs()] == ["gs://raw/corpus"]
    text = render_trace(root)
    assert text.count("produced by") == 3 * levels  # every execution once
    # each level's second way down, but the lowest, whose shared input is the raw corpus
    assert text.count("(traced above)") == levels - 1
    assert text.count("[raw input]") == 2  # the corpus, under both sides of level 0


def _writer(url: str, worker: int) -> None:
    store = LineageStore(url)
    for i in range(15):
        run = store.start_execution(f"step{i}", run_id=f"run-{worker}", pipeline="p")
        store.record_output(run, f"mem://shared/{i}", "dataset")  # same URIs across workers
        store.finish_execution(run)
    store.close()


def test_several_processes_write_one_sqlite_file(url):
    # spawn, not fork: a fork beside the suite's JAX and gRPC threads can deadlock the child.
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with LineageStore(url) as store:
        runs = store.runs()
        assert len(runs) == 4
        assert all(r.counts == {"COMPLETE": 15} for r in runs)
        with store._read() as session:
            assert session.query(Context).filter_by(type="pipeline").count() == 1


def test_a_conditional_output_is_recorded_only_over_the_version_its_writer_read(url):
    uri, promoted = "slipway://models/m", ArtifactType.PROMOTED_MODEL
    with LineageStore(url) as store:
        first = store.start_execution("gate", run_id="run-1", pipeline="lm")
        store.record_output(first, uri, promoted, version="p1", if_latest=None)
        second = store.start_execution("gate", run_id="run-2", pipeline="lm")
        with pytest.raises(Superseded) as err:  # it read "no model yet", and p1 came meanwhile
            store.record_output(second, uri, promoted, version="p2", if_latest=None)
        assert (err.value.uri, err.value.expected, err.value.found) == (uri, None, "p1")
        assert str(err.value) == f"{uri} changed meanwhile: its latest version is p1, not none"
        # Nothing recorded: no version, no event of the refused execution.
        assert [a.version for a in store.artifact_versions(uri)] == ["p1"]
        assert store.run_graph("run-2").steps[0].outputs == ()
        store.record_output(second, uri, promoted, version="p2", if_latest="p1")
        assert [a.version for a in store.artifact_versions(uri)] == ["p1", "p2"]
        with pytest.raises(Superseded, match="its latest version is p2, not p1"):
            store.record_output(first, uri, promoted, version="p3", if_latest="p1")


def _conditional_writer(url: str, worker: int, rounds: int, barrier, wins) -> None:
    store = LineageStore(url)
    execution = store.start_execution("gate", run_id=f"run-{worker}", pipeline="p")
    for r in range(rounds):
        barrier.wait(60)  # every worker read "nothing there yet"; now all write at once
        try:
            store.record_output(
                execution,
                f"slipway://models/m{r}",
                "promoted_model",
                version=f"w{worker}",
                if_latest=None,
            )
            wins.put((r, worker))
        except Superseded:
            pass
    store.close()


def test_of_writers_racing_on_one_version_exactly_one_wins(url):
    # Without the URI's advisory lock, Postgres at READ COMMITTED lets several writers see no
    # version and all record theirs; SQLite's BEGIN IMMEDIATE serializes them anyway.
    ctx = multiprocessing.get_context("spawn")
    workers, rounds = 4, 8
    barrier, wins = ctx.Barrier(workers), ctx.Queue()
    LineageStore(url).close()  # the schema, before the workers race for it
    procs = [
        ctx.Process(target=_conditional_writer, args=(url, w, rounds, barrier, wins))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * workers
    won = sorted(wins.get(timeout=5) for _ in range(rounds))
    assert [r for r, _ in won] == list(range(rounds))  # one winner a round
    assert wins.empty()
    with LineageStore(url) as store:
        for r, worker in won:
            versions = store.artifact_versions(f"slipway://models/m{r}")
            assert [a.version for a in versions] == [f"w{worker}"]


def test_lineage_url_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIPWAY_LINEAGE_DB", "postgresql://db/lineage")
    assert lineage_url() == "postgresql://db/lineage"
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB")
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    assert lineage_url() == f"sqlite:///{tmp_path}/lineage.db"
    monkeypatch.setenv("SLIPWAY_HOME", f"file://{tmp_path}")
    assert lineage_url() == f"sqlite:///{tmp_path}/lineage.db"
    monkeypatch.delenv("SLIPWAY_HOME")
    monkeypatch.chdir(tmp_path)
    assert lineage_url() == f"sqlite:///{tmp_path}/out/lineage.db"
    # A bucket cannot hold a SQLite file: say what to set instead of inventing a path.
    monkeypatch.setenv("SLIPWAY_HOME", "gs://bucket/slipway")
    with pytest.raises(LineageConfigError, match="SLIPWAY_LINEAGE_DB"):
        lineage_url()


def test_code_version_override(monkeypatch):
    code_version.cache_clear()
    monkeypatch.setenv("SLIPWAY_CODE_VERSION", "abc123")
    try:
        assert code_version() == "abc123"
    finally:
        code_version.cache_clear()


def test_step_runner_and_lineage_together(tmp_path, url):
    # The shape an operator follows: run the step, record whatever happened.
    root = str(tmp_path / "out")
    ingest = Step("ingest", {"inputs": ["gs://raw/brown"]})
    tokenize = Step("tokenize", {"input": output_of(ingest)})

    def record(store: LineageStore, run_id: str, step: Step, inputs: list[str]) -> str:
        execution = store.start_execution(step.name, run_id=run_id, step_version=step.version)
        for uri in inputs:
            store.record_input(execution, uri, "dataset")
        result = StepRunner(root).run(step, lambda spec: {"records_out": 1})
        state = ExecutionState.CACHED if result.outcome == "CACHED" else ExecutionState.COMPLETE
        store.record_output(execution, result.spec.output_path, "dataset", counts=result.result)
        store.finish_execution(execution, state, properties={"outcome": str(result.outcome)})
        return result.spec.output_path

    with LineageStore(url) as store:
        for run_id in ("run-1", "run-2"):
            ingested = record(store, run_id, ingest, ["gs://raw/brown"])
            record(store, run_id, tokenize, [ingested])
        states = {r.run_id: r.state for r in store.runs()}
        assert states == {"run-1": ExecutionState.COMPLETE, "run-2": ExecutionState.CACHED}
        trace = store.trace(str(tmp_path / "out" / tokenize.key))
        assert [a.uri for a in trace.raw_inputs()] == ["gs://raw/brown"]


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_runs_show_trace(url, capsys):
    with LineageStore(url) as store:
        _three_step_run(store, run_id="manual__1", fail_train=True)
        _three_step_run(store, run_id="scheduled__2")

    assert cli.main(["lineage", "runs", "--db", url]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == [
        "RUN",
        "PIPELINE",
        "STATE",
        "STARTED",
        "(UTC)",
        "ENDED",
        "(UTC)",
        "STEPS",
    ]
    assert lines[1].startswith("scheduled__2") and "COMPLETE" in lines[1]
    assert lines[2].startswith("manual__1") and "FAILED" in lines[2]
    assert "COMPLETE=2 FAILED=1" in lines[2]

    assert cli.main(["lineage", "--db", url, "show", "manual__1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("run manual__1 (lm) FAILED  [COMPLETE=2 FAILED=1]")
    # The one run printer: the step table (counts, drop reasons), failures, then the tree.
    ingest_row = next(line for line in out.splitlines() if line.startswith("ingest "))
    assert ingest_row.split()[:5] == ["ingest", "COMPLETE", "510", "500", "10"]
    assert "failures:" in out and "train: FAILED RuntimeError: NaN loss at step 120" in out
    assert "├── ingest [aaaaaaaa] COMPLETE" in out
    assert "│   ├── in  dataset gs://raw/brown" in out
    assert (
        "│   └── out dataset gs://b/ingest-aaaaaaaa @sha256:1  (records 510 in, 500 out, 10 dropped)"
        in out
    )
    assert "│   ├── in  tokenizer: tokenizer gs://b/tok-cccc" in out
    assert "└── train FAILED" in out and "RuntimeError: NaN loss at step 120" in out
    # the newest run, and a run named as its folder is (`:` spelled `_`)
    assert cli.main(["lineage", "show", "latest", "--db", url]) == 0
    assert capsys.readouterr().out.startswith("run scheduled__2 (lm)")
    with LineageStore(url) as store:
        _three_step_run(store, run_id="manual__2026-12-06T16:25:35+00:00")
    assert cli.main(["lineage", "show", "manual__2026-12-06T16_25_35+00_00", "--db", url]) == 0
    assert capsys.readouterr().out.startswith("run manual__2026-12-06T16:25:35+00:00 (lm)")

    assert cli.main(["lineage", "trace", "gs://b/train-dddd/ckpt", "--db", url]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "checkpoint gs://b/train-dddd/ckpt"
    assert "└── produced by train COMPLETE" in out
    assert "dataset gs://raw/brown  [raw input]" in out
    assert "raw inputs (3):" in out
    print(out, file=sys.stderr)  # visible with -s: the tree as a person sees it


def test_a_run_refused_before_any_output_prints_tidily(url):
    """validate's error lists one problem per line: the failures keep the lines, indented
    under the step; the tree keeps one line per execution; no empty outputs heading."""
    from operators.lineage.render import render_run

    error = "RunConfigError: invalid run configuration:\n  step: not a field\n  lr: not a field"
    with LineageStore(url) as store:
        ex = store.start_execution("validate", run_id="typo", pipeline="lm")
        store.finish_execution(ex, ExecutionState.FAILED, error=error)
        text = render_run(store.run_graph("typo"), artifacts=True)
    lines = text.splitlines()
    at = lines.index("failures:")
    assert lines[at + 1 : at + 4] == [
        "  validate: FAILED RunConfigError: invalid run configuration:",
        "      step: not a field",
        "      lr: not a field",
    ]
    assert not [line for line in lines if line.startswith("outputs")]
    (tree,) = [line for line in lines if line.startswith("└── validate")]
    assert tree.endswith("invalid run configuration: | step: not a field | lr: not a field")


def test_cli_traces_a_local_path_as_typed(tmp_path, monkeypatch, capsys):
    """Lineage records local paths absolute; a path relative to where the user is works."""
    url = f"sqlite:///{tmp_path}/lineage.db"
    with LineageStore(url) as store:
        ex = store.start_execution("export", run_id="r", pipeline="p")
        store.record_output(ex, str(tmp_path / "out" / "hf"), "hf_export")
        store.finish_execution(ex)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["lineage", "trace", "out/hf", "--db", url]) == 0
    assert capsys.readouterr().out.startswith(f"hf_export {tmp_path}/out/hf")


def test_cli_errors_and_default_db(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    assert cli.main(["lineage", "runs"]) == 1
    assert "no lineage database at" in capsys.readouterr().err
    assert not (tmp_path / "lineage.db").exists()  # reading never creates a database

    LineageStore(f"sqlite:///{tmp_path}/lineage.db").close()
    assert cli.main(["lineage", "runs"]) == 0
    assert capsys.readouterr().out.strip() == "no runs recorded"
    assert cli.main(["lineage", "show", "nope"]) == 1
    assert "no run 'nope'" in capsys.readouterr().err
    assert cli.main(["lineage", "trace", "gs://nope"]) == 1
    with pytest.raises(SystemExit):
        cli.main(["lineage"])
    from operators import summary

    capsys.readouterr()
    assert summary.main(["nope"]) == 1  # `python -m operators.summary RUN_ID`
    assert capsys.readouterr().err.strip() == "slipway: no run 'nope'"

    # What cannot be opened is one line saying why, never a traceback.
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("not sqlite")
    for db, why in [
        ("bogus", "bogus is not a database URL"),
        ("mysql://x@localhost/db", "its driver MySQLdb is not installed"),
        (f"sqlite:///{not_a_db}", "file is not a database"),
    ]:
        assert cli.main(["lineage", "runs", "--db", db]) == 1
        assert why in capsys.readouterr().err
    monkeypatch.setenv("SLIPWAY_LINEAGE_DB", "bogus")
    assert summary.main([]) == 1
    assert capsys.readouterr().err.startswith("slipway: bogus is not a database URL")


def test_describe_documents_reads_the_stage_manifest(tmp_path):
    from operators.lineage.describe import describe_documents
    from pipelines.manifest import Manifest, ShardInfo

    assert describe_documents(str(tmp_path)) == {}  # unfinished stage: nothing to claim

    def manifest(sha: str) -> Manifest:
        return Manifest(
            stage="quality",
            config={"min_words": 5},
            inputs=["in"],
            records_in=10,
            records_out=7,
            dropped={"too_short": 3},
            shards=[ShardInfo("data/part-0.jsonl.gz", 7, 100, sha)],
            dead_letter_shards=[ShardInfo("dead_letter/part-0.jsonl.gz", 3, 50, "d")],
        )

    manifest("a").write(str(tmp_path))
    described = describe_documents(str(tmp_path))
    assert described["counts"] == {"records_in": 10, "records_out": 7, "dropped": {"too_short": 3}}
    assert described["config"] == {"min_words": 5}
    manifest("b").write(str(tmp_path))
    assert describe_documents(str(tmp_path))["content_hash"] != described["content_hash"]


def test_run_failures_are_the_runs_whose_latest_attempt_of_a_step_failed(url):
    """What the runs list reads for a failed training: the latest attempt's properties, and
    never a failure that a later attempt (passed, or still running) has replaced."""
    with LineageStore(url) as store:

        def attempt(run_id: str, name: str, state: str | None, **properties: object) -> None:
            ex = store.start_execution(name, run_id=run_id, pipeline="lm")
            if state is not None:
                store.finish_execution(ex, state, properties=properties or None)

        attempt("passed-on-retry", "train", "FAILED", last_logged_loss=4.0)
        attempt("passed-on-retry", "train", "COMPLETE")
        attempt("failed-twice", "train", "FAILED", last_logged_loss=5.0)
        attempt("failed-twice", "train", "FAILED", last_logged_loss=float("nan"))
        attempt("retrying", "train", "FAILED", last_logged_loss=3.0)
        attempt("retrying", "train", None)  # running
        attempt("killed", "train", "CANCELED", last_logged_loss=2.5)
        attempt("eval-failed", "evaluate", "FAILED")
        failed, killed = store.run_failures(["train"])
        assert (failed.run_id, failed.step) == ("failed-twice", "train")
        assert math.isnan(failed.properties["last_logged_loss"])  # the latest, NaN kept
        assert (killed.run_id, killed.properties) == ("killed", {"last_logged_loss": 2.5})
        both = store.run_failures(["train", "evaluate"])
        assert [(f.run_id, f.step) for f in both] == [
            ("failed-twice", "train"),
            ("killed", "train"),
            ("eval-failed", "evaluate"),
        ]
        assert both[2].properties == {}
        # A run's state is its steps' latest attempts': a retry that passed repairs it (as the
        # run summary and Airflow say), while the earlier failure is still counted.
        states = {r.run_id: (str(r.state), r.counts.get("FAILED", 0)) for r in store.runs()}
        assert states == {
            "passed-on-retry": ("COMPLETE", 1),
            "failed-twice": ("FAILED", 2),
            "retrying": ("RUNNING", 1),
            "killed": ("CANCELED", 0),
            "eval-failed": ("FAILED", 1),
        }
        for run_id, (state, _) in states.items():
            assert str(store.run_graph(run_id).run.state) == state
