"""An artifact is one version of what is at a URI: a refetch does not rewrite a trace.

A backfill that refetches the raw corpora after a training run records the same URIs again,
with new bytes (a new version) or the same bytes (the same artifact). Tracing the first run's
outputs must still reach the fetch that fed it, and the same content must be one artifact.
On SQLite and on a real PostgreSQL.
"""

from __future__ import annotations

import gzip
import json
from datetime import datetime
from pathlib import Path

import pytest

from operators import cli
from operators.lineage import ArtifactType, LineageStore

BROWN, SPAM = "gs://raw/brown.jsonl.gz", "gs://raw/spam.jsonl.gz"
INGEST_V, TRAIN_V = "a" * 64, "d" * 64
INGESTED, CKPT = "gs://b/ingest-aaaaaaaa/output", "gs://b/train-dddddddd/ckpt"


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path}/lineage.db"


def _fetch(store: LineageStore, run_id: str, brown: str, spam: str) -> int:
    """What the fetch task records: each raw file with its content id."""
    ex = store.start_execution("fetch", run_id=run_id, pipeline="p")
    store.record_output(ex, BROWN, ArtifactType.DATASET, content_hash=brown)
    store.record_output(ex, SPAM, ArtifactType.DATASET, content_hash=spam)
    store.finish_execution(ex)
    return ex


def _train_run(store: LineageStore, run_id: str, brown: str, spam: str) -> None:
    """ingest reads the raw files (the content ids its step version hashed) -> train."""
    ingest = store.start_execution("ingest", run_id=run_id, pipeline="p", step_version=INGEST_V)
    store.record_input(ingest, BROWN, ArtifactType.DATASET, content_hash=brown)
    store.record_input(ingest, SPAM, ArtifactType.DATASET, content_hash=spam)
    store.record_output(ingest, INGESTED, ArtifactType.DATASET, version=INGEST_V)
    store.finish_execution(ingest)
    train = store.start_execution("train", run_id=run_id, pipeline="p", step_version=TRAIN_V)
    store.record_input(train, INGESTED, ArtifactType.DATASET, version=INGEST_V)
    store.record_output(train, CKPT, ArtifactType.CHECKPOINT, version=TRAIN_V)
    store.finish_execution(train)


def test_a_later_refetch_does_not_become_the_producer(url):
    with LineageStore(url) as store:
        _fetch(store, "run-1", "sha256:brown-1", "sha256:spam")
        _train_run(store, "run-1", "sha256:brown-1", "sha256:spam")
        # The backfill, after the training: brown has new bytes, spam the same bytes.
        _fetch(store, "backfill", "sha256:brown-2", "sha256:spam")

        root = store.trace(CKPT)
        [ingested] = root.inputs
        raw = {n.artifact.uri: (n.artifact.version, n.producer.run_id) for n in ingested.inputs}
        assert raw == {BROWN: ("sha256:brown-1", "run-1"), SPAM: ("sha256:spam", "run-1")}

        # New bytes: a new artifact. The same bytes again: the same one, now with two producers.
        assert [a.version for a in store.artifact_versions(BROWN)] == [
            "sha256:brown-1",
            "sha256:brown-2",
        ]
        [spam] = store.artifact_versions(SPAM)
        assert spam.content_hash == "sha256:spam"
        # What is at the URI now (no consumer to follow): the latest version and producer.
        assert store.artifact(BROWN).version == "sha256:brown-2"
        assert store.trace(BROWN).producer.run_id == "backfill"
        assert store.trace(BROWN, "sha256:brown-1").producer.run_id == "run-1"
        assert store.trace(SPAM).producer.run_id == "backfill"


def test_a_consumer_without_a_version_reads_what_is_there(url):
    """An input recorded without a version links to the latest version at that moment."""
    with LineageStore(url) as store:
        _fetch(store, "run-1", "sha256:brown-1", "sha256:spam")
        ex = store.start_execution("ingest", run_id="run-1", pipeline="p")
        store.record_input(ex, BROWN, ArtifactType.DATASET)  # no content id given
        store.record_output(ex, INGESTED, ArtifactType.DATASET, version=INGEST_V)
        store.finish_execution(ex)
        _fetch(store, "backfill", "sha256:brown-2", "sha256:spam")
        [brown] = store.trace(INGESTED).inputs
        assert (brown.artifact.version, brown.producer.run_id) == ("sha256:brown-1", "run-1")
        assert len(store.artifact_versions(BROWN)) == 2  # the input created no third one


def test_rerecording_a_version_updates_it_and_a_cache_hit_links_it(url):
    with LineageStore(url) as store:
        first = store.record_artifact(INGESTED, "dataset", version=INGEST_V, counts={"n": 1})
        again = store.record_artifact(INGESTED, "dataset", version=INGEST_V, content_hash="h")
        assert first == again
        art = store.artifact(INGESTED)
        assert (art.version, art.counts, art.content_hash) == (INGEST_V, {"n": 1}, "h")
        ran = store.start_execution("ingest", run_id="r1")
        store.record_output(ran, INGESTED, "dataset", version=INGEST_V)
        store.finish_execution(ran)
        hit = store.start_execution("ingest", run_id="r2")
        store.record_output(hit, INGESTED, "dataset", version=INGEST_V)
        store.finish_execution(hit, "CACHED")
        assert len(store.artifact_versions(INGESTED)) == 1
        assert store.trace(INGESTED).producer.id == ran  # COMPLETE beats the cache hit


# -- through the operators: the fetch task, a Beam stage, the CLI -----------------------------


class _FakeBeam:
    """Stands in for BeamStageHook: writes a stage manifest, runs nothing."""

    def run_module(self, module, options):
        out = Path(options["output"])
        out.mkdir(parents=True, exist_ok=True)
        manifest = {
            "stage": "ingest",
            "config": {},
            "inputs": options["input"],
            "records_in": 10,
            "records_out": 10,
            "dropped": {},
            "shards": [],
            "dead_letter_shards": [],
            "extra": {},
        }
        (out / "manifest.json").write_text(json.dumps(manifest))
        return {}

    def on_kill(self):
        pass


def test_trace_of_a_run_reaches_the_fetch_that_fed_it(url, tmp_path, monkeypatch, capsys):
    from airflow.sdk.definitions.param import ParamsDict

    from operators.beam_stage import BeamStageOperator
    from operators.corpora import FetchCorporaOperator
    from operators.params import pipeline_params
    from operators.pipeline.graph import build_graph, content_id
    from tests.support.tiny_pipeline import make_corpora, tiny_conf

    home = tmp_path / "home"
    monkeypatch.setenv("SLIPWAY_HOME", str(home))
    monkeypatch.setenv("SLIPWAY_LINEAGE_DB", url)
    data = make_corpora(home / "data")  # below the storage root: an allowed data folder
    params = ParamsDict()
    params.update(pipeline_params())
    params.update(tiny_conf(data))
    params = params.validate()
    brown = build_graph(params).raw_inputs["brown"]
    fortunes = build_graph(params).raw_inputs["fortunes"]

    def run(run_id: str) -> str:
        context = {"params": params, "run_id": run_id, "ti": None}
        FetchCorporaOperator().execute(context)  # corpora present: records them, fetches none
        ingest = BeamStageOperator(stage_task="ingest")
        monkeypatch.setattr(ingest, "beam_hook", lambda runner, dataflow: _FakeBeam())
        [result] = ingest.execute(context)
        assert result["outcome"] == "RAN"
        return f"{result['output']}/output"

    old_brown = content_id(brown)
    first = run("run-1")
    # The backfill after the training: brown refetched with new bytes, fortunes unchanged.
    Path(brown).write_bytes(gzip.compress(b'{"id": "b1", "text": "new", "source": "brown"}\n'))
    second = run("backfill")
    assert content_id(brown) != old_brown

    with LineageStore(url) as store:
        raw = {n.artifact.uri: n for n in store.trace(first).inputs}
        assert raw[brown].artifact.version == old_brown
        assert raw[brown].producer.name == "fetch" and raw[brown].producer.run_id == "run-1"
        assert raw[fortunes].producer.run_id == "run-1"  # the same bytes, recorded again later
        again = {n.artifact.uri: n for n in store.trace(second).inputs}
        assert again[brown].artifact.version == content_id(brown)
        assert again[brown].producer.run_id == "backfill"
        assert len(store.artifact_versions(brown)) == 2
        assert len(store.artifact_versions(fortunes)) == 1  # one content, one artifact

    assert cli.main(["lineage", "trace", first, "--db", url]) == 0
    out = capsys.readouterr().out
    assert out.count("produced by fetch COMPLETE") == 2 and "run backfill" not in out
    assert f"dataset {brown} @{old_brown[:19]}" in out  # which bytes it read


# -- a database recorded before artifacts had versions ----------------------------------------


def _old_schema(url: str) -> int:
    """The schema as it was: ``artifacts.uri`` unique, no ``version`` column; one run in it."""
    from sqlalchemy import (
        JSON,
        Column,
        DateTime,
        Integer,
        MetaData,
        String,
        Table,
        create_engine,
        insert,
    )

    from operators.lineage.schema import Base

    old = MetaData()
    artifacts = Table(
        "artifacts",
        old,
        Column("id", Integer, primary_key=True),
        Column("uri", String(2048), unique=True, nullable=False),
        Column("type", String(64), nullable=False),
        Column("content_hash", String(128)),
        Column("counts", JSON),
        Column("config", JSON),
        Column("code_version", String(128)),
        Column("container_image", String(512)),
        Column("properties", JSON, nullable=False),
        Column("created_at", DateTime, nullable=False),
        Column("updated_at", DateTime, nullable=False),
    )
    for table in Base.metadata.sorted_tables:
        if table.name != "artifacts":
            table.to_metadata(old)
    engine = create_engine(url)
    old.create_all(engine)
    now = datetime(2026, 1, 1)
    with engine.begin() as conn:
        artifact = conn.execute(
            insert(artifacts).values(
                uri=BROWN,
                type="dataset",
                content_hash="sha256:brown-1",
                properties={},
                created_at=now,
                updated_at=now,
            )
        ).inserted_primary_key[0]
        execution = conn.execute(
            insert(old.tables["executions"]).values(
                name="fetch", run_id="old", state="COMPLETE", started_at=now, properties={}
            )
        ).inserted_primary_key[0]
        conn.execute(
            insert(old.tables["events"]).values(
                execution_id=execution, artifact_id=artifact, type="OUTPUT", created_at=now
            )
        )
    engine.dispose()
    return artifact
    engine.dispose()


@pytest.mark.parametrize("create", [True, False])
def test_a_database_from_before_versions_is_upgraded_in_place(url, create):
    recorded = _old_schema(url)
    with LineageStore(url, create=create) as store:  # the CLI (create=False) upgrades it too
        [old] = store.artifact_versions(BROWN)
        assert (old.id, old.version, old.content_hash) == (recorded, "", "sha256:brown-1")
        assert store.trace(BROWN).producer.run_id == "old"  # its events still point at it
        _fetch(store, "new", "sha256:brown-2", "sha256:spam")
        assert [a.version for a in store.artifact_versions(BROWN)] == ["", "sha256:brown-2"]
    with LineageStore(url) as store:  # and the next open finds nothing to do
        assert len(store.artifact_versions(BROWN)) == 2


# -- the operators' recording path (StepLineageMixin) ------------------------------------------


class _Task:
    """What StepLineageMixin needs of an operator."""

    def __init__(self, task_id: str) -> None:
        self.task_id, self.dag_id = task_id, "p"


def _mixin_task(task_id: str):
    from operators.step_lineage import StepLineageMixin

    return type("Task", (_Task, StepLineageMixin), {})(task_id)


def test_step_outputs_and_their_consumers_meet_on_the_step_version(url, tmp_path, monkeypatch):
    from operators.step_lineage import ArtifactRef
    from operators.steps import Step, StepRunner, join, output_of

    monkeypatch.setenv("SLIPWAY_LINEAGE_DB", url)
    runner = StepRunner(str(tmp_path / "steps"))
    up = Step("up", {"n": 1})
    down = Step("down", {"input": output_of(up, "data")})

    def outputs(spec, result):
        return [ArtifactRef(join(spec.output_path, "data"), "dataset")]

    for run_id in ("r1", "r2"):  # r2: both cache hits, linking the same artifacts
        for step, inputs in ((up, []), (down, [ArtifactRef(output_of(up, "data"), "dataset")])):
            _mixin_task(step.name).run_step(
                {"run_id": run_id},
                step,
                lambda spec: {},
                inputs=inputs,
                outputs=outputs,
                runner=runner,
            )
    with LineageStore(url) as store:
        made = join(runner.root, up.key, "data")
        [artifact] = store.artifact_versions(made)  # produced, read, cached: one artifact
        assert artifact.version == up.version
        node = store.trace(join(runner.root, down.key, "data"))
        assert node.producer.run_id == "r1" and node.producer.state == "COMPLETE"
        [read] = node.inputs
        assert read.artifact.id == artifact.id and read.producer.name == "up"


def test_a_raw_file_changed_by_hand_is_not_credited_to_the_fetch(url, tmp_path, monkeypatch):
    """The consumer records the content id of the bytes it read: bytes no fetch recorded are
    a raw input of their own, not the fetch's output."""
    from operators.pipeline.graph import content_id
    from operators.step_lineage import ArtifactRef
    from operators.steps import Step, StepRunner

    monkeypatch.setenv("SLIPWAY_LINEAGE_DB", url)
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"text": "fetched"}\n')
    fetched = content_id(str(raw))
    with LineageStore(url) as store:
        ex = store.start_execution("fetch", run_id="r1", pipeline="p")
        store.record_output(ex, str(raw), "dataset", content_hash=fetched)
        store.finish_execution(ex)
    raw.write_text('{"text": "edited by hand, much longer than before"}\n')
    step = Step("ingest", {"input_content": content_id(str(raw))})
    _mixin_task("ingest").run_step(
        {"run_id": "r1"},
        step,
        lambda spec: {},
        inputs=[ArtifactRef(str(raw), "dataset")],
        outputs=lambda spec, r: [ArtifactRef(spec.output_path, "dataset")],
        runner=StepRunner(str(tmp_path / "steps")),
    )
    with LineageStore(url) as store:
        [read] = store.run_graph("r1").steps[1].inputs
        assert read.artifact.version == content_id(str(raw)) != fetched
        [leaf] = store.trace(read.artifact.uri, read.artifact.version).raw_inputs()
        assert leaf.id == read.artifact.id  # no producer: nobody recorded making these bytes


# -- transactions Postgres rolls back are retried, whole ---------------------------------------


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
def test_a_transaction_postgres_rolls_back_is_retried(postgres_url, monkeypatch, sqlstate):
    """A real serialization failure / deadlock error from the server on the first attempt:
    the transaction runs again and the execution is recorded once; other errors are not
    retried."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError, OperationalError

    from operators.lineage import store as store_module

    calls = []
    contexts_for = LineageStore._contexts_for

    def failing_once(self, session, *args):
        calls.append(1)
        if len(calls) == 1:
            session.execute(
                text(
                    f"DO $$ BEGIN RAISE EXCEPTION 'lost a race' USING ERRCODE = '{sqlstate}'; END $$"
                )
            )
        return contexts_for(self, session, *args)

    monkeypatch.setattr(store_module, "_RETRY_FIRST_DELAY_S", 0.001)
    with LineageStore(postgres_url) as store:
        monkeypatch.setattr(LineageStore, "_contexts_for", failing_once)
        ex = store.start_execution("train", run_id="r1", pipeline="p")
        assert len(calls) == 2
        assert [e.id for e in store.executions("r1")] == [ex]  # the failed attempt left nothing

        def unique_violation(self, session, *args):
            session.execute(
                text("DO $$ BEGIN RAISE EXCEPTION 'dup' USING ERRCODE = '23505'; END $$")
            )

        monkeypatch.setattr(LineageStore, "_contexts_for", unique_violation)
        with pytest.raises((IntegrityError, OperationalError)):
            store.start_execution("train", run_id="r1", pipeline="p")
        assert len(store.executions("r1")) == 1
