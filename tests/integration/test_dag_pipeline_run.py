"""`airflow dags test slipway_pipeline` on tiny synthetic corpora, in a throwaway Airflow home.

One scenario: a first run (every step COMPLETE in lineage, OpenLineage events from the
provider's file transport, the gate promoting the model with the default criteria: lineage and
the Asset event), a second (every step CACHED, nothing recomputed), then ``slices: 2`` with
``topology: "2"`` from the form (four processes) trains and evaluates with the one-process
loss curve. (A run failed by fault injection, cleared and resumed is
``tests/e2e/test_airflow_standalone.py``'s, on a real ``airflow standalone``.)

Costs: ``airflow db migrate`` ~7 s; the first run ~2 min on two shared cores (ten short Beam
jobs, a JAX compile), cached runs ~30 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_pipeline import TINY_STEPS, make_corpora, tiny_conf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
STEPS = set(TINY_STEPS)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("dag")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(base / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "SLIPWAY_HOME": str(base / "home"),
        # The OpenLineage provider's real file transport: one JSON event per line.
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "slipway-test",
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
            {"type": "file", "log_file_path": str(base / "openlineage.jsonl"), "append": True}
        ),
    }
    env.pop("SLIPWAY_LINEAGE_DB", None)
    env.pop("OPENLINEAGE_URL", None)
    env.pop("AIRFLOW__OPENLINEAGE__DISABLED", None)
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True)
    env["_DATA"] = str(make_corpora(base / "data"))
    return env


def dags_test(env, **overrides) -> tuple[str, str]:
    conf = tiny_conf(Path(env["_DATA"]), **overrides)
    out = subprocess.run(
        [AIRFLOW, "dags", "test", "slipway_pipeline", "-c", json.dumps(conf)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    log = out.stdout + out.stderr
    from operators.lineage import LineageStore

    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        run_id = store.runs()[0].run_id  # newest first
    return run_id, log


def states(env, run_id) -> tuple[dict[str, str], dict]:
    from operators.lineage import LineageStore

    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        graph = store.run_graph(run_id)
    latest = {}
    for node in graph.steps:
        latest[node.execution.name] = node
    return {name: str(node.execution.state) for name, node in latest.items()}, latest


def openlineage_events(env, run_id: str) -> list[dict]:
    """The task-level events the provider wrote for one DAG run (through the file transport)."""
    path = Path(env["AIRFLOW_HOME"]).parent / "openlineage.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        e
        for e in events
        if e["job"]["name"].startswith("slipway_pipeline.")
        and e["run"]["facets"].get("airflow", {}).get("dagRun", {}).get("run_id") == run_id
    ]


def model_asset_events(env, name: str = "slipway-demo") -> list[dict]:
    """The Airflow Asset events of ``slipway://models/<name>`` (the gate's, through its alias),
    read from the Airflow home's metadata database."""
    import sqlite3

    db = sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db")
    try:
        rows = db.execute(
            "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "WHERE a.uri = ? ORDER BY e.id",
            (f"slipway://models/{name}",),
        ).fetchall()
    finally:
        db.close()
    return [json.loads(extra) if isinstance(extra, str) else extra for (extra,) in rows]


def _first_run_completes(env):
    run1, log = dags_test(env)
    s1, nodes = states(env, run1)
    assert {k: v for k, v in s1.items() if k in STEPS} == dict.fromkeys(STEPS, "COMPLETE"), log[
        -5000:
    ]
    assert s1["fetch"] == "COMPLETE" and s1["record"] == "COMPLETE"

    # The gate, with the form's default criteria (none): passed and promoted the trained run,
    # in lineage and as an event of the Asset slipway://models/slipway-demo.
    assert s1["gate"] == "COMPLETE", log[-5000:]
    (promoted,) = [o.artifact for o in nodes["gate"].outputs]
    assert (promoted.uri, promoted.type) == ("slipway://models/slipway-demo", "promoted_model")
    assert promoted.properties["run_id"] == run1
    assert promoted.properties["model"] == nodes["train"].execution.properties["output"]
    from operators.lineage import LineageStore
    from operators.promotion import current_promotion

    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        assert current_promotion(store, "slipway-demo").version == promoted.version
    events = model_asset_events(env)
    assert [e.get("version") for e in events] == [promoted.version], events
    summary = next(o.artifact.properties for o in nodes["record"].outputs)
    assert summary["gate"]["promoted"] and summary["gate"]["version"] == promoted.version
    # The run's self-contained report, recorded beside the summary and named by the
    # end-of-run summary that `make demo` prints.
    (report,) = [o.artifact for o in nodes["record"].outputs if o.artifact.type == "run_report"]
    body = Path(report.uri).read_text()
    assert 'id="loss-plot"' in body and "data:image/png;base64," in body
    # Every task's "Slipway step" tab (#step-<task id>) opens at an element of the page.
    from operators.pipeline.definition import PIPELINE

    missing = [t.task_id for t in PIPELINE if f'id="step-{t.task_id}"' not in body]
    assert not missing, missing
    # validate recorded the values the run was triggered with on the run, for the page.
    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        run = store.run_graph(run1).run
    assert run.properties["params"]["steps"] == 6 and run.properties["params"]["batch_size"] == 4
    # what tiny_conf sets, against the DAG's defaults; model_preset was left alone
    changed = set(run.properties["changed"])
    assert {"steps", "batch_size", "sources", "stage_configs"} <= changed, changed
    assert "model_preset" not in changed, changed
    # and Airflow's run type, which decides the page's backfill hint (a run by hand: none)
    assert run.properties["run_type"] == "manual"
    assert 'id="settings"' in body
    printed = subprocess.run(
        [sys.executable, "-m", "operators.summary", run1],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert f"report: {report.uri}" in printed.stdout, printed.stdout[-3000:]
    rows = [line.split()[:2] for line in printed.stdout.splitlines()]
    assert ["evaluate", "COMPLETE"] in rows and ["export", "COMPLETE"] in rows, printed.stdout
    # The UI reads the run's state from Airflow's own DagRun record (lineage alone cannot
    # tell a finished run from one between two tasks): this Airflow home's database.
    dag_runs = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys\n"
            "from operators.ui import dag_runs\n"
            "found = dag_runs([sys.argv[1], 'no-such-run'])\n"
            "print(json.dumps([[*k, v.state, v.started_at < v.ended_at] for k, v in found.items()]))",
            run1,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert json.loads(dag_runs.stdout.splitlines()[-1]) == [
        ["slipway_pipeline", run1, "COMPLETE", True]
    ], dag_runs.stderr[-3000:]
    ckpt = [o.artifact for o in nodes["train"].outputs if o.artifact.type == "checkpoint"]
    assert ckpt and ckpt[0].counts["loss_end"] is not None
    evals = {o.role: o.artifact.counts for o in nodes["evaluate"].outputs}
    # Besides the stores, one result per benchmark task of the form (benchmark-<task>) and the
    # fixed prompts' samples.
    stores = {r: c for r, c in evals.items() if not r.startswith("benchmark-") and r != "samples"}
    assert set(stores) == {"heldout-brown", "heldout-fortunes", "eval-lambada"}
    assert {r for r in evals if r.startswith("benchmark-")} == {
        "benchmark-piqa",
        "benchmark-lambada_openai",
    }
    assert evals["benchmark-piqa"]["n"] == 10 and evals["benchmark-piqa"]["chance"] == 0.5
    (samples,) = [o.artifact for o in nodes["evaluate"].outputs if o.role == "samples"]
    assert len(samples.properties["completions"]) == 5, samples.properties
    # The export: a Hugging Face folder of the checkpoint, named in the promotion.
    (hf,) = [o.artifact for o in nodes["export"].outputs]
    assert hf.type == "hf_export" and (Path(hf.uri) / "model.safetensors").is_file()
    # in the form's weight type (tiny_conf asks for bfloat16), as transformers reads it
    hf_config = json.loads((Path(hf.uri) / "config.json").read_text())
    assert hf_config["torch_dtype"] == "bfloat16" == hf.properties["dtype"]
    assert promoted.properties["export"] == hf.uri
    # Lineage links the export through the checkpoint and the tokenizer that train and
    # train_tokenizer recorded, on through training, down to the corpora's raw files.
    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        for uri in (hf.uri, promoted.uri):
            traced = store.trace(uri)
            raw = {a.uri for a in traced.raw_inputs()}
            assert raw and all(u.startswith(env["_DATA"]) for u in raw), (uri, sorted(raw))
            assert all(a.content_hash for a in traced.raw_inputs()), uri
    ckpt_uri = ckpt[0].uri
    export_inputs = {link.role: link.artifact.uri for link in nodes["export"].inputs}
    assert export_inputs["trained_run"] == ckpt_uri
    (tokenizer,) = [o.artifact.uri for o in nodes["train_tokenizer"].outputs]
    assert export_inputs["tokenizer"] == tokenizer
    assert all(c["loss"] > 0 for c in stores.values())
    # The gate judged what evaluate recorded: every task's acc is in the promotion's metrics.
    tasks = {r.removeprefix("benchmark-") for r in evals if r.startswith("benchmark-")}
    assert set(promoted.properties["metrics"]["accuracy"]) == tasks
    counts = next(o.artifact.counts for o in nodes["ingest"].outputs)
    assert counts["records_in"] == 120

    # OpenLineage: START and COMPLETE per task, with our operators' datasets, in the namespace
    # configured above.
    events = openlineage_events(env, run1)
    by_task: dict[str, dict[str, dict]] = {}
    for e in events:
        by_task.setdefault(e["job"]["name"].split(".", 1)[1], {})[e["eventType"]] = e
    assert {"ingest", "train", "evaluate", "record"} <= set(by_task), sorted(by_task)
    for task, kinds in by_task.items():
        assert {"START", "COMPLETE"} <= set(kinds), (task, sorted(kinds))
        assert kinds["COMPLETE"]["job"]["namespace"] == "slipway-test"
    ingest = by_task["ingest"]["COMPLETE"]
    assert ingest["outputs"] and ingest["outputs"][0]["namespace"] == "file"
    assert any("ingest-" in d["name"] for d in ingest["outputs"]), ingest["outputs"]
    train = by_task["train"]["COMPLETE"]
    assert any("tokens" in d["name"] or "tokenize" in d["name"] for d in train["inputs"]), train
    assert any("train-" in d["name"] for d in train["outputs"]), train["outputs"]

    return run1, nodes


def _losses(output: str) -> list[float]:
    by_step = {}
    for line in (Path(output) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]  # the last line per step wins (resumes)
    return [by_step[s] for s in sorted(by_step)]


def test_first_run_completes_second_is_cached_and_multislice_matches(env):
    """One tiny corpus through the DAG, three times:

    1. every step COMPLETE (and the OpenLineage events);
    2. the same form again: every step CACHED, nothing recomputed;
    3. ``slices: 2`` x 2 hosts on the local backend (the JobSet's four pods as processes,
       MEGASCALE_* as GKE sets them, ``replica`` across the slices and ``data`` within):
       train and evaluate to the end with the loss curve of the one-process run. Slices are
       how, not what: the step keeps its version, so its outputs are removed to train it
       again. (One host per slice is the trainer's multislice test, started without the
       DAG; the manifests of 1, 2 and 4 slices are the JobSet tests'.)
    """
    import shutil

    run1, _ = _first_run_completes(env)
    curves: dict[tuple[int, str], list[float]] = {}
    for slices, topology in ((1, "1"), (2, "2")):
        run, log = dags_test(env, slices=slices, topology=topology)
        s, nodes = states(env, run)
        if slices == 1:  # the first run's form again
            assert run != run1
            cached = {k: v for k, v in s.items() if k in STEPS}
            assert cached == dict.fromkeys(STEPS, "CACHED"), log[-5000:]
        else:
            assert (s.get("train"), s.get("evaluate")) == ("COMPLETE", "COMPLETE"), (
                s,
                slices,
                topology,
                log[-5000:],
            )
        output = nodes["train"].execution.properties["output"]
        config = json.loads((Path(output) / "config.json").read_text())
        hosts = slices * int(topology)
        assert config["mesh"]["replica"] == slices, config["mesh"]
        assert config["mesh"]["replica"] * config["mesh"]["data"] == hosts, config["mesh"]
        result = json.loads((Path(output) / "result.json").read_text())
        assert result["status"] == "succeeded" and result["steps"] == 6
        curves[(slices, topology)] = _losses(output)
        evals = {
            o.role: o.artifact.counts["loss"]
            for o in nodes["evaluate"].outputs
            if not o.role.startswith("benchmark-") and o.role != "samples"
        }
        assert all(v > 0 for v in evals.values()), evals
        for name in ("train", "evaluate"):
            shutil.rmtree(nodes[name].execution.properties["output"])
    single = curves[(1, "1")]
    assert len(single) == 6
    assert curves[(2, "2")] == pytest.approx(single, rel=2e-4), curves

    # A run triggered while none runs here (no scheduler) stays queued, with nothing in
    # lineage: the UI's runs list reads it from Airflow's database (ui.waiting_dag_runs).
    subprocess.run(
        [AIRFLOW, "dags", "trigger", "slipway_pipeline", "-r", "still-queued"],
        env=env,
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    waiting = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json\n"
            "from operators.ui import dag_paused, waiting_dag_runs\n"
            "found = waiting_dag_runs(['slipway_pipeline', 'slipway_scaling_sweep'])\n"
            "print(json.dumps([[*k, r.state, at is not None] for k, (r, at) in found.items()]))\n"
            "print(json.dumps([dag_paused('slipway_pipeline'), dag_paused('no_such_dag')]))",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    listed, paused = waiting.stdout.splitlines()[-2:]
    assert json.loads(listed) == [["slipway_pipeline", "still-queued", "QUEUED", True]], (
        waiting.stderr[-3000:]
    )
    assert json.loads(paused) == [True, None]  # new DAGs start paused; no such DAG: unknown
