"""Pipeline operators without Airflow's runner: step versions, cache hits, lineage records."""

from __future__ import annotations

import gzip
import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from tests.support.tiny_pipeline import tiny_params


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLIPWAY_LINEAGE_DB", raising=False)
    return tmp_path / "home"


@pytest.fixture
def params(tmp_path):
    return tiny_params(tmp_path / "data")


def _context(params, run_id="manual__1"):
    return {"params": params, "run_id": run_id, "ti": None}


def _store(home: Path):
    from operators.lineage import LineageStore

    return LineageStore(f"sqlite:///{home / 'lineage.db'}")


# -- step graph -------------------------------------------------------------------------------


def test_versions_are_a_function_of_what_is_computed(params):
    from operators.pipeline.graph import build_graph

    a, b = build_graph(params), build_graph(dict(params))
    assert [s.key for s in a.all_steps()] == [s.key for s in b.all_steps()]

    # How it runs is not versioned.
    how = build_graph({**params, "runner": "DataflowRunner", "accelerator": "v5p"})
    assert [s.key for s in how.all_steps()] == [s.key for s in a.all_steps()]

    # A stage config change re-versions that stage and everything downstream, nothing upstream.
    configs = {**params["stage_configs"], "exact_dedup": {"min_paragraph_chars": 7}}
    changed = build_graph({**params, "stage_configs": configs})
    assert changed.stages["quality"][0].step.key == a.stages["quality"][0].step.key
    assert changed.stages["exact_dedup"][0].step.key != a.stages["exact_dedup"][0].step.key
    assert changed.train.key != a.train.key

    # Training knobs re-version training and evaluation only.
    lr = build_graph({**params, "learning_rate": 1e-3})
    assert lr.stages["tokenize"][0].step.key == a.stages["tokenize"][0].step.key
    assert lr.train.key != a.train.key and lr.evaluate.key != a.evaluate.key

    # The export's weight type re-versions the export alone: the same model, other bytes.
    f32, bf16 = (build_graph({**params, "export_dtype": t}) for t in ("float32", "bfloat16"))
    assert bf16.export.key != f32.export.key and bf16.export.config["dtype"] == "bfloat16"
    assert [s.key for s in bf16.all_steps() if s.name != "export"] == [
        s.key for s in f32.all_steps() if s.name != "export"
    ]


def test_raw_inputs_are_versioned_by_content(params, tmp_path):
    from operators.pipeline.graph import build_graph

    before = build_graph(params).stages["ingest"][0].step.key
    raw = Path(params["data_dir"]) / "raw" / "brown.jsonl.gz"
    raw.write_bytes(gzip.compress(b'{"id": "x", "text": "new bytes", "source": "brown"}\n'))
    assert build_graph(params).stages["ingest"][0].step.key != before


def test_stages_write_below_the_step_directory(params):
    # A stage clears its --output: it must never be the directory holding the step marker.
    from operators.pipeline.graph import STAGE_OUT, build_graph

    for group in build_graph(params).stages.values():
        for s in group:
            assert "output" not in s.options
    assert STAGE_OUT


def test_fetch_resolves_the_graph_once_and_later_tasks_read_it(home, params, monkeypatch):
    """The ``fetch`` task hashes the corpora and writes the resolved graph to the run's folder
    and lineage; a later task (here: a fresh operator, as in a new process) rebuilds the same
    steps from it without hashing a corpus file, and trusts the recorded ids over the files."""
    from operators.beam_stage import BeamStageOperator
    from operators.corpora import FetchCorporaOperator
    from operators.pipeline import graph as graph_module
    from operators.settings import run_folder

    context = _context(params, run_id="manual__resolve")
    result = FetchCorporaOperator().execute(context)
    resolved = json.loads(Path(result["resolved_graph"]).read_text())
    assert Path(result["resolved_graph"]).parent == Path(run_folder("manual__resolve"))
    expected = graph_module.build_graph(params)
    assert resolved["steps"] == {s.name: s.key for s in expected.all_steps()}
    raw = expected.raw_inputs["brown"]
    assert resolved["content_ids"][raw] == graph_module.content_id(raw)
    with _store(home) as store:
        (fetch,) = [
            n for n in store.run_graph("manual__resolve").steps if n.execution.name == "fetch"
        ]
        roles = {link.role: link.artifact for link in fetch.outputs}
        assert roles["resolved_graph"].properties["steps"] == resolved["steps"]

    def no_hashing(path):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(graph_module, "content_id", no_hashing)
    later = BeamStageOperator(stage_task="ingest").step_graph(context)
    assert [s.key for s in later.all_steps()] == [s.key for s in expected.all_steps()]
    # Without the run's resolved graph (another run id) the files would be hashed.
    with pytest.raises(AssertionError, match="hashed again"):
        BeamStageOperator(stage_task="ingest").step_graph(_context(params, run_id="other"))


# -- Beam stage operator ----------------------------------------------------------------------


class _FakeBeam:
    """Stands in for BeamStageHook (no subprocess): writes a valid stage manifest."""

    calls: ClassVar[list[dict]] = []

    def __init__(self, fail=False):
        self.fail = fail

    def run_module(self, module, options):
        _FakeBeam.calls.append(options)
        if self.fail:
            raise RuntimeError("python -m pipelines.ingest exited with 2")
        out = Path(options["output"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").write_text(
            json.dumps(
                {
                    "stage": "ingest",
                    "config": {},
                    "inputs": options["input"],
                    "records_in": 10,
                    "records_out": 8,
                    "dropped": {"empty_text": 2},
                    "shards": [],
                    "dead_letter_shards": [],
                    "extra": {},
                }
            )
        )
        return {}

    def kill(self):
        pass


def _beam_operator(monkeypatch, fail=False):
    from operators.beam_stage import BeamStageOperator

    _FakeBeam.calls = []
    op = BeamStageOperator(stage_task="ingest")
    monkeypatch.setattr(op, "beam_hook", lambda runner, dataflow: _FakeBeam(fail))
    return op


def test_beam_stage_runs_then_hits_the_cache(home, params, monkeypatch):
    from operators.lineage import ExecutionState

    op = _beam_operator(monkeypatch)
    first = op.execute(_context(params, "run-1"))
    assert first[0]["outcome"] == "RAN" and len(_FakeBeam.calls) == 1
    call = _FakeBeam.calls[0]
    assert call["output"].endswith("/output")
    assert json.loads(call["config"]) == {}
    assert len(call["input"]) == 2  # brown and fortunes raw files

    second = op.execute(_context(params, "run-2"))
    assert second[0]["outcome"] == "CACHED" and len(_FakeBeam.calls) == 1  # no Beam job

    with _store(home) as store:
        (run1,) = store.run_graph("run-1").steps
        (run2,) = store.run_graph("run-2").steps
        assert run1.execution.state is ExecutionState.COMPLETE
        assert run2.execution.state is ExecutionState.CACHED
        out = run1.outputs[0].artifact
        assert out.type == "dataset"
        assert out.counts["records_in"] == 10 and out.counts["dropped"] == {"empty_text": 2}
        assert {i.artifact.uri.rsplit("/", 1)[-1] for i in run1.inputs} == {
            "brown.jsonl.gz",
            "fortunes.jsonl.gz",
        }


def test_beam_stage_failure_is_recorded_and_rerun(home, params, monkeypatch):
    from operators.lineage import ExecutionState

    op = _beam_operator(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="exited with 2"):
        op.execute(_context(params, "run-1"))
    with _store(home) as store:
        (node,) = store.run_graph("run-1").steps
        assert node.execution.state is ExecutionState.FAILED
        assert "exited with 2" in node.execution.error

    op = _beam_operator(monkeypatch)  # a FAILED step reruns
    assert op.execute(_context(params, "run-2"))[0]["outcome"] == "RAN"


def test_openlineage_facets_name_inputs_and_outputs(home, params, monkeypatch):
    op = _beam_operator(monkeypatch)
    op.execute(_context(params))
    facets = op.get_openlineage_facets_on_complete(None)
    assert {d.name.rsplit("/", 1)[-1] for d in facets.inputs} == {
        "brown.jsonl.gz",
        "fortunes.jsonl.gz",
    }
    assert all(d.namespace == "file" for d in facets.inputs + facets.outputs)
    assert facets.outputs[0].name.endswith("/output")


# -- split --------------------------------------------------------------------------------------


def _split_input(folder: Path, docs: list[dict]) -> Path:
    """A stage output of one shard holding ``docs``, as the split reads it."""
    from pipelines.manifest import Manifest, ShardInfo

    (folder / "data").mkdir(parents=True)
    body = "".join(json.dumps(d) + "\n" for d in docs).encode()
    (folder / "data" / "part-0.jsonl.gz").write_bytes(gzip.compress(body, mtime=0))
    shard = ShardInfo("data/part-0.jsonl.gz", len(docs), 0, "")
    manifest = Manifest("decontaminate", {}, [], len(docs), len(docs), {}, [shard], [])
    (folder / "manifest.json").write_text(manifest.to_json())
    return folder


def _split_docs(sources: tuple[str, ...], n: int, words: int = 50) -> list[dict]:
    return [
        {"id": f"{s}-{i}", "text": "word " * words, "source": s, "metadata": {}}
        for s in sources
        for i in range(n)
    ]


def _ids(path: Path) -> set[str]:
    return {json.loads(x)["id"] for x in gzip.decompress(path.read_bytes()).splitlines()}


def test_split_is_deterministic_and_disjoint(tmp_path):
    from pipelines.split import split_documents

    stage = _split_input(tmp_path / "stage", _split_docs(("a", "b"), 40))
    out1, out2 = tmp_path / "o1", tmp_path / "o2"
    r1 = split_documents(str(stage), str(out1), ["a", "b"], 0.1, 500)
    r2 = split_documents(str(stage), str(out2), ["a"], 0.1, 500)
    assert r1["sources"]["a"]["train"] + r1["sources"]["a"]["heldout"] == 40
    # every document is accounted for: b's, not trained on in the second split, are counted
    assert (r1["records_in"], r1["other_sources"]) == (80, {})
    assert (r2["records_in"], r2["other_sources"]) == (80, {"b": 40})
    assert json.loads((out2 / "split.json").read_text())["other_sources"] == {"b": 40}
    assert "other_sources" not in json.loads((out1 / "split.json").read_text())  # bytes as before
    # 500 chars needs 2 documents of 250; the fraction asks for 4.
    assert r1["sources"]["a"]["heldout"] == 4

    held, train = _ids(out1 / "heldout" / "a.jsonl.gz"), _ids(out1 / "train" / "a.jsonl.gz")
    assert not held & train
    assert held == _ids(out2 / "heldout" / "a.jsonl.gz")  # same documents, same split


def test_split_sizes_the_heldout_part_by_chars_and_caps_it_at_half(tmp_path):
    from pipelines.split import split_documents

    stage = _split_input(tmp_path / "stage", _split_docs(("a",), 40))  # 250 chars each
    by_chars = split_documents(str(stage), str(tmp_path / "o1"), ["a"], 0.1, 2000)
    assert by_chars["sources"]["a"] == {"train": 32, "heldout": 8}  # 2000 chars: 8, not 4
    capped = split_documents(str(stage), str(tmp_path / "o2"), ["a"], 0.1, 10**9)
    assert capped["sources"]["a"] == {"train": 20, "heldout": 20}  # never more than half
    # the smallest sha1(id) first: the 8 held out are among the 20
    assert _ids(tmp_path / "o1" / "heldout" / "a.jsonl.gz") < _ids(
        tmp_path / "o2" / "heldout" / "a.jsonl.gz"
    )


def test_split_does_not_depend_on_the_input_order(tmp_path):
    from pipelines.split import split_documents

    docs = _split_docs(("a", "b"), 30)
    forward = _split_input(tmp_path / "forward", docs)
    backward = _split_input(tmp_path / "backward", docs[::-1])
    r1 = split_documents(str(forward), str(tmp_path / "o1"), ["a", "b"], 0.2, 0)
    r2 = split_documents(str(backward), str(tmp_path / "o2"), ["a", "b"], 0.2, 0)
    assert r1 == r2
    for kind in ("train", "heldout"):
        for source in ("a", "b"):
            name = f"{kind}/{source}.jsonl.gz"
            assert _ids(tmp_path / "o1" / name) == _ids(tmp_path / "o2" / name), name


def test_split_refuses_a_source_too_small_to_split(tmp_path):
    from pipelines.split import split_documents

    stage = _split_input(tmp_path / "stage", _split_docs(("a",), 40) + _split_docs(("tiny",), 1))
    with pytest.raises(ValueError, match=r"source 'tiny': 1 clean documents; need >= 2"):
        split_documents(str(stage), str(tmp_path / "out"), ["a", "tiny"], 0.1, 500)


# -- training config and record -----------------------------------------------------------------


def test_trainer_config_is_valid_for_the_trainer(params, tmp_path):
    from operators.pipeline.graph import build_graph
    from operators.steps import resolve
    from operators.training import trainer_config
    from trainer.config import TrainConfig, from_dict, validate

    spec = resolve(build_graph(params).train, str(tmp_path))
    body = trainer_config(spec)
    cfg = from_dict(TrainConfig, body)
    validate(cfg)
    assert cfg.output_dir == spec.output_path
    assert [s.weight for s in cfg.data.sources] == [0.7, 0.3]
    assert cfg.model.preset == "nano" and cfg.steps == 6


def test_record_summarises_a_failed_run(home, params, monkeypatch):
    from operators.record import RecordRunOperator

    op = _beam_operator(monkeypatch, fail=True)
    with pytest.raises(RuntimeError):
        op.execute(_context(params, "run-f"))
    record = RecordRunOperator()
    # The DAG run as Airflow has it (a cleared run's: its rerun's start), other than lineage's
    # first record: the static report shows Airflow's, as the live run page does.
    rerun = SimpleNamespace(start_date=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    summary = record.summarize({**_context(params, "run-f"), "dag_run": rerun})
    report = Path(summary["report_path"]).read_text()
    assert f"started {rerun.start_date:%Y-%m-%d %H:%M:%S} UTC" in report
    assert summary["state"] == "FAILED"
    assert summary["failed"][0]["step"] == "ingest"
    assert "exited with 2" in summary["failed"][0]["error"]
    assert Path(summary["summary_path"]).exists()
    assert any(k.startswith("ingest-") for k in summary["resume"]["rerun"])

    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="failed at ingest"):
        record.execute(_context(params, "run-f"))


def test_record_refuses_a_run_id_another_dag_recorded(home, params):
    """``record`` runs ``all_done``, even after the run's first task was refused because
    another DAG owns the run id: it must neither summarize nor write into that run."""
    from operators.lineage import ExecutionState, RunIdConflict
    from operators.record import RecordRunOperator
    from operators.settings import run_folder

    with _store(home) as store:
        other = store.start_execution("fetch", run_id="shared", pipeline="slipway_scaling_sweep")
    with pytest.raises(RunIdConflict, match="'slipway_scaling_sweep'"):
        RecordRunOperator().execute(_context(params, "shared"))
    assert not Path(run_folder("shared"), "summary.json").exists()
    with _store(home) as store:
        assert store.execution(other).state == ExecutionState.RUNNING  # not closed by record
        assert [e.name for e in store.executions("shared")] == ["fetch"]


@pytest.mark.parametrize(
    "twin", ["scheduled__2026-01-01T02_00_00+00_00", "scheduled__2026-01-01T02~00~00+00~00"]
)
def test_a_run_id_naming_another_runs_folder_is_refused(home, params, twin):
    """Run folders are named after the run id with ``:`` and other characters replaced, so
    an id given through the REST API can name a recorded run's folder: validate refuses it
    before recording anything, and the all_done tasks (record) write nothing into it."""
    from operators.record import RecordRunOperator
    from operators.settings import RunFolderTaken, run_folder
    from operators.validate import ValidateRunOperator

    night = "scheduled__2026-01-01T02:00:00+00:00"
    with _store(home) as store:
        store.start_execution("fetch", run_id=night, pipeline=RecordRunOperator().dag_id)
    assert run_folder(twin) == run_folder(night)
    for task in (ValidateRunOperator(), RecordRunOperator()):
        with pytest.raises(RunFolderTaken, match=re.escape(repr(night))):
            task.execute(_context(params, twin))
    assert not Path(run_folder(night), "summary.json").exists()
    with _store(home) as store:
        assert store.run_ids() == {night}  # nothing recorded under the twin
    ValidateRunOperator().execute(_context(params, night))  # the folder's own run goes on


@pytest.mark.parametrize(
    "run_id",
    [
        "scheduled__2026-01-01T02:00:00+00:00\n",  # Airflow lets its own shape end in one
        "scheduled__２０２６-０１-０１T０２:００:００+00:00",  # and its \\d matches these
        "night/1",
        "x" * 251,
    ],
)
def test_validate_refuses_a_run_id_outside_the_plain_pattern(home, params, run_id):
    """Airflow checks an id of its scheduled shape with its own looser pattern before the one
    a deployment sets: validate refuses what is not plain ASCII, naming it, before anything
    is recorded; the run folder's name keeps to ASCII either way."""
    from operators.settings import RunIdNotAllowed, run_folder_name
    from operators.validate import ValidateRunOperator

    with pytest.raises(RunIdNotAllowed, match=re.escape(repr(run_id))):
        ValidateRunOperator().execute(_context(params, run_id))
    with _store(home) as store:
        assert store.run_ids() == set()
    assert run_folder_name(run_id).isascii()


def test_jobset_hook_backends():
    from operators.hooks.jobset import BackendUnavailable, JobSetHook

    assert JobSetHook("local").get_conn().name == "local"
    # gke: tested against a fake API server in tests/unit/test_gke_backend.py
    gke = JobSetHook("gke", cluster={"namespace": "train", "kubeconfig": "/nonexistent"})
    assert gke.get_conn().name == "gke"  # credentials load lazily, on the first call
    with pytest.raises(BackendUnavailable, match="unknown JobSet backend"):
        JobSetHook("k8s").get_conn()


class _TaskInstance:
    """What ``record`` asks of its task instance: the states of the run's tasks."""

    def __init__(self, run_id: str, states: dict[str, str]) -> None:
        self.dag_id, self.run_id, self._states = "slipway_pipeline", run_id, states

    def get_task_states(self, dag_id: str, run_ids: list[str]) -> dict:
        return {self.run_id: self._states}


def test_record_closes_what_killed_tasks_left_running(home, params, tmp_path, monkeypatch):
    """A task process killed while its supervisor lives (SIGKILL, OOM) reports no ending and
    no listener hook fires: ``record`` closes its execution FAILED, and what a task left
    RUNNING without failing CANCELED. A killed train without a live lease is not waited for."""
    from operators.lineage import ExecutionState
    from operators.record import RecordRunOperator

    with _store(home) as store:
        killed = store.start_execution(
            "train", run_id="run-k", properties={"task_id": "train", "output": str(tmp_path)}
        )
        store.finish_execution(  # the listener in the scheduler closed it (heartbeat timeout)
            killed, ExecutionState.FAILED, properties={"closed_by": "listener"}
        )
        died = store.start_execution("evaluate", run_id="run-k", properties={"task_id": "evaluate"})
        left = store.start_execution(
            "tokens/train/brown", run_id="run-k", properties={"task_id": "tokenize"}
        )
    context = {
        **_context(params, "run-k"),
        "ti": _TaskInstance(
            "run-k", {"train": "failed", "evaluate": "failed", "tokenize": "success"}
        ),
    }

    def waited(*args):
        raise AssertionError("no lease is live: nobody is still recording train")

    monkeypatch.setattr(RecordRunOperator, "_wait_for_train_ending", waited)
    summary = RecordRunOperator().summarize(context)
    assert (summary["failed_unreported_executions"], summary["canceled_executions"]) == (1, 1)
    with _store(home) as store:
        evaluate, tokens = store.execution(died), store.execution(left)
        assert not store.executions("run-k", state=ExecutionState.RUNNING)
    assert str(evaluate.state) == "FAILED" and evaluate.properties["closed_by"] == "record"
    assert "without reporting its end" in evaluate.error
    assert str(tokens.state) == "CANCELED" and "Airflow: success" in tokens.error


def _killed_train(home: Path, run_id: str, output: Path, holder: str | None = None) -> int:
    """A train execution the listener closed (its task was killed from the UI) while the
    trainer, still ending, holds the step's live lease in ``output`` (renewed by ``holder``)."""
    from operators.lineage import ExecutionState
    from operators.steps import LEASE_PREFIX, Lease

    output.mkdir(parents=True)
    lease = Lease(0, "trainer-ending", time.time() + 600, holder=holder)
    (output / f"{LEASE_PREFIX}000000").write_text(json.dumps(lease.__dict__))
    with _store(home) as store:
        killed = store.start_execution(
            "train", run_id=run_id, properties={"task_id": "train", "output": str(output)}
        )
        store.finish_execution(
            killed, ExecutionState.FAILED, error="killed", properties={"closed_by": "listener"}
        )
    return killed


def _record_context(params, run_id: str) -> dict:
    return {**_context(params, run_id), "ti": _TaskInstance(run_id, {"train": "failed"})}


def _train_row(summary: dict) -> dict:
    (row,) = [r for r in summary["steps"] if r["step"].startswith("train-")]
    return row


def test_record_waits_for_a_killed_train_to_record_its_ending(home, params, tmp_path):
    """The trainer's own report (CANCELED, its last checkpoint) arrives after the listener
    closed the execution: ``record`` waits for it and summarizes it, not the listener's."""
    import threading

    from operators.lineage import ExecutionState
    from operators.record import RecordRunOperator

    killed = _killed_train(home, "run-w", tmp_path / "train")

    def trainer_reports():
        time.sleep(0.5)
        with _store(home) as store:
            store.finish_execution(
                killed,
                ExecutionState.CANCELED,
                error="AirflowTaskTerminated: terminated",
                properties={"resumable": True, "last_checkpoint_step": 40},
            )

    reporter = threading.Thread(target=trainer_reports)
    reporter.start()
    try:
        summary = RecordRunOperator().summarize(_record_context(params, "run-w"))
    finally:
        reporter.join()
    row = _train_row(summary)
    assert (row["state"], row["error"]) == ("CANCELED", "AirflowTaskTerminated: terminated")


def test_record_stops_waiting_for_a_killed_train_after_its_grace(
    home, params, tmp_path, monkeypatch
):
    """A trainer that never reports (a lease held, nothing recorded) delays the summary by
    ``KILLED_TRAIN_GRACE_S`` at most; the summary then has what the listener recorded."""
    from structlog.testing import capture_logs

    from operators import record
    from operators.record import RecordRunOperator

    _killed_train(home, "run-g", tmp_path / "train")
    monkeypatch.setattr(record, "KILLED_TRAIN_GRACE_S", 0.1)
    with capture_logs() as logs:  # operators log through structlog
        summary = RecordRunOperator().summarize(_record_context(params, "run-g"))
    warned = [e for e in logs if "did not record its ending" in e["event"]]
    assert [e["log_level"] for e in warned] == ["warning"], logs
    row = _train_row(summary)
    assert (row["state"], row["error"]) == ("FAILED", "killed")
    assert summary["failed"][0]["step"] == "train"


def test_record_waits_for_a_dead_workers_trainer_only_until_it_writes_its_result(
    home, params, tmp_path
):
    """A training task whose worker was killed (SIGKILL: its task process will record
    nothing) left a live lease naming that process, which is gone. Its trainer, signalled by
    the kernel, may still be saving a checkpoint: ``record`` waits for the trainer's result,
    not for the lease to expire, and once the result is there it does not wait at all."""
    import subprocess
    import sys
    import threading

    from structlog.testing import capture_logs

    from operators.record import RecordRunOperator
    from operators.steps import this_process

    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    worker.wait()
    dead = f"{this_process().rpartition(':')[0]}:{worker.pid}"
    output = tmp_path / "train"
    _killed_train(home, "run-d", output, holder=dead)

    def trainer_saves_and_ends():
        time.sleep(0.5)
        (output / "result.json").write_text('{"status": "preempted"}')

    trainer = threading.Thread(target=trainer_saves_and_ends)
    trainer.start()
    try:
        with capture_logs() as logs:
            summary = RecordRunOperator().summarize(_record_context(params, "run-d"))
    finally:
        trainer.join()
    events = [e["event"] for e in logs]
    assert any("waiting for it" in e for e in events), events
    assert not any("did not record its ending" in e for e in events), events  # not the grace
    row = _train_row(summary)
    assert (row["state"], row["error"]) == ("FAILED", "killed")

    # the trainer's result already written: nothing to wait for
    _killed_train(home, "run-e", tmp_path / "train-e", holder=dead)
    (tmp_path / "train-e" / "result.json").write_text('{"status": "preempted"}')
    with capture_logs() as logs:
        RecordRunOperator().summarize(_record_context(params, "run-e"))
    assert not [e for e in logs if "waiting for it" in e["event"]], logs


class _RecordingBackend:
    """A fake JobSet backend (no cluster, no processes) that, like the local backend, knows
    only the runs it submitted itself; records the calls. ``script``: what successive polls
    do: "running", "done", "fail" (raise), or "kill" (the task's on_kill, mid-run)."""

    name = "fake"

    def __init__(self, calls: list[str], script: list[str], runner=None) -> None:
        self.calls, self.script, self.runner = calls, list(script), runner
        self.submitted: dict[str, str] = {}  # uid -> state

    def submit(self, manifest):
        from operators.jobset import JobSetHandle

        self.calls.append("submit")
        handle = JobSetHandle("fake", "ns", manifest["metadata"]["name"], "uid-1")
        self.submitted[handle.uid] = "running"
        return handle

    def _state(self, handle) -> str:
        from operators.jobset.backend import JobSetNotFound

        if handle.uid not in self.submitted:
            raise JobSetNotFound(f"{handle.name}: not a run of this backend")
        return self.submitted[handle.uid]

    def poll(self, handle):
        from operators.jobset.backend import JobSetStatus

        self.calls.append("poll")
        step = self.script.pop(0) if self.script else "running"
        if step == "fail":
            raise ConnectionError("API went away")
        if step == "kill":  # on_kill, from the signal handler, just after this poll's read
            self._state(handle)
            self.runner.cancel()
            return JobSetStatus(handle)
        if step == "done" and self._state(handle) == "running":
            self.submitted[handle.uid] = "Completed"
        state = self._state(handle)
        if state == "running":
            return JobSetStatus(handle)
        reason = "AllJobsCompleted" if state == "Completed" else "Cancelled"
        return JobSetStatus(handle, terminal_state=state, reason=reason)

    def cancel(self, handle):
        from operators.jobset.backend import JobSetStatus

        self.calls.append("cancel")
        self._state(handle)
        self.submitted[handle.uid] = "Failed"
        return JobSetStatus(handle, terminal_state="Failed", reason="Cancelled")

    def close(self) -> None:
        self.calls.append("close")


@pytest.mark.parametrize(
    ("script", "calls", "reason"),
    [
        (["running", "done"], ["submit", "poll", "poll", "close"], "AllJobsCompleted"),
        (["fail"], ["submit", "poll", "cancel", "close"], None),
        # killed mid-run: cancelled through the open client, and run sees the JobSet end
        (["kill", "running"], ["submit", "poll", "cancel", "poll", "close"], "Cancelled"),
    ],
)
def test_jobset_runner_closes_its_client_when_the_run_ends(script, calls, reason):
    """The hook's client (a Kubernetes API client on gke; the runs themselves on the local
    backend) is released once ``run`` returns or raises, never before: a kill during the run
    cancels through it. After ``run``, the JobSet is no longer the runner's to cancel."""
    import logging
    from types import SimpleNamespace

    from operators.launching import JobSetRunner

    recorded: list[str] = []
    runner = JobSetRunner(SimpleNamespace(log=logging.getLogger("test")), "local")
    runner.hook._build = lambda: _RecordingBackend(recorded, script, runner)
    manifest = {"metadata": {"name": "slipway-eval-0123abcd"}}
    if reason is None:
        with pytest.raises(ConnectionError):
            runner.run(manifest, poll_seconds=0)
    else:
        assert runner.run(manifest, poll_seconds=0).reason == reason
    assert recorded == calls and runner.hook._conn is None
    runner.cancel()  # a kill after the run: nothing of this runner's is left to cancel
    assert recorded == calls and runner.hook._conn is None


def test_fault_injection_counts_only_this_attempts_steps(tmp_path):
    """An earlier attempt logged past fail_at_step and then lost its checkpoint: the retry
    starts below it, and must not be cancelled before its own trainer gets there."""
    from operators.training import fault_watch

    out = tmp_path / "train"
    out.mkdir()
    log = out / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 61)))
    watch = fault_watch(str(out), fail_at=50, start_step=None)
    assert watch is not None and watch() is None  # steps 1..60 are the earlier attempt's
    with log.open("a") as f:
        f.write("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 50)))
    assert watch() is None
    with log.open("a") as f:
        f.write(json.dumps({"step": 50, "loss": 1.0}) + "\n")
    assert watch() == (
        "fault injection: fail_at_step=50 reached (trainer at 50 when cancelled; it "
        "checkpoints where it stops, which can be a few steps later)"
    )
    assert fault_watch(str(out), fail_at=50, start_step=50) is None  # resumes past it
    assert fault_watch(str(out), fail_at=0, start_step=None) is None


def test_a_raw_file_replaced_after_fetch_stops_the_run_with_what_to_clear(home, params):
    """fetch resolved the corpora's content ids; a raw file repaired afterwards (and only the
    failed tasks cleared) would run under the old bytes' id, and new ids would move every
    step downstream: the run's tasks refuse, naming the file and what to clear."""
    import os

    from operators.pipeline.graph import (
        CorpusChanged,
        build_graph,
        graph_for_run,
        raw_path,
        write_resolved,
    )

    first = build_graph(params)
    write_resolved(first, "manual__1")
    assert graph_for_run(params, "manual__1").stages["ingest"][0].step.key == (
        first.stages["ingest"][0].step.key
    )
    raw = raw_path(params["data_dir"], params["sources"][0]["name"])
    body = gzip.decompress(Path(raw).read_bytes()) + b'{"id": "new", "text": "repaired"}\n'
    Path(raw).write_bytes(gzip.compress(body, mtime=0))
    os.utime(raw, ns=(1, 1))  # whatever its modification time
    with pytest.raises(CorpusChanged, match="clear fetch with its downstream") as err:
        graph_for_run(params, "manual__1")
    assert raw in str(err.value)


def test_an_object_rewritten_after_fetch_has_a_new_stamp(monkeypatch):
    """On an object store the stamp is the object's write (GCS generation, etag, update time):
    a rewrite with the same size is seen."""
    import fsspec

    from operators.pipeline import graph

    monkeypatch.setattr(graph, "_OBJECT_STAMP_KEYS", ("generation", "created"))  # memory://
    fs = fsspec.filesystem("memory")
    fs.pipe("/corpora/raw/brown.jsonl.gz", b"abc")
    before = graph._file_stamp("memory://corpora/raw/brown.jsonl.gz")
    assert before is not None and before[0] == 3
    time.sleep(0.01)
    fs.pipe("/corpora/raw/brown.jsonl.gz", b"abd")
    after = graph._file_stamp("memory://corpora/raw/brown.jsonl.gz")
    assert after is not None and after != before
    assert json.loads(json.dumps(after)) == after  # as graph.json keeps it
    assert graph._file_stamp("memory://corpora/raw/missing.jsonl.gz") is None


def test_an_eval_set_a_benchmark_needs_makes_eval_missing(params, tmp_path):
    # A data folder from an older fetch, or a partial copy, with LAMBADA but not the set of
    # one of the form's benchmarks: fetch must fetch it, not leave evaluate to fail after
    # training.
    from operators.pipeline.graph import missing_corpora

    assert missing_corpora(params) == []
    (Path(params["data_dir"]) / "eval" / "piqa.jsonl.gz").unlink()
    assert missing_corpora(params) == ["eval"]
    assert missing_corpora({**params, "eval_tasks": ["lambada_openai"]}) == []


def test_the_same_benchmarks_in_another_order_are_the_same_evaluation(params):
    from operators.pipeline.graph import build_graph

    forward = build_graph(params).evaluate
    backward = build_graph({**params, "eval_tasks": list(reversed(params["eval_tasks"]))})
    assert backward.evaluate.key == forward.key
    assert list(forward.config["tasks"]) == ["piqa", "lambada_openai"]  # the catalogue's order
