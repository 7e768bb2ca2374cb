"""The nightly sweep's cells on the gke platform, against FakeKubernetesApiServer.

The sweep DAG's own tasks (``dags/slipway_scaling_sweep.py`` as a DagBag loads it): ``validate``
accepts the gke night, ``grid`` plans its cells, and each cell's ``train_cell`` task -- the
mapped task unmapped with the cell the grid gave it, as a worker runs it -- submits the cell's
JobSet and defers; the trigger (through a serialize round trip, as the triggerer rebuilds it)
follows the JobSet to the end the fake reports, and ``execute_complete`` on a fresh task
instance records the step and its lineage. Each cell's ``evaluate_cell`` task then runs its
evaluation JobSet (on a worker, not deferred) to the metric the fit reads. A cell whose lease
ran out while its JobSet trained is adopted by the next night, not trained twice.

The fake refuses what the API server would (:func:`tests.fakes.k8s_api.invalid_fields`: the
CRD's schema, label keys and values), as a cell's step label once was refused: its value held
the step name's '/', and every cell of a gke night failed at submit.

Not the whole DAG run: the data plane before ``grid`` is Beam over the corpora (minutes), a
deferred task needs a triggerer, and ``fit``/``check`` read only step markers and lineage,
whatever the backend (``test_sweep.py``, ``tests/e2e/test_sweep_standalone.py``); the
pipeline's gke train task is tested the same way (``test_gke_trigger.py``). In place of the
data plane, the tokenizer stage's manifest (the vocabulary ``grid`` plans with) is written
where ``train_tokenizer`` leaves it; the trainer's and the evaluation's results are written
into each step directory as their pods would.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.gke import IMAGE, NS, run_trigger, trainer_writes_results
from tests.support.tiny_pipeline import make_corpora, tiny_sweep_conf

REPO = Path(__file__).resolve().parents[2]
SWEEP_DAG = REPO / "dags" / "slipway_scaling_sweep.py"
VOCAB = 512  # the tiny sweep's train_tokenizer vocab_size
LOSS = 3.25  # what the evaluation pods score every cell (bits per byte too)
NIGHT_1 = "scheduled__2026-12-06T02:00:00+00:00"
NIGHT_2 = "scheduled__2026-12-07T02:00:00+00:00"


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(SWEEP_DAG))
    assert bag.import_errors == {}
    return bag.dags["slipway_scaling_sweep"]


@pytest.fixture
def params(dag, tmp_path, kubeconfig, home, gke_platform) -> dict[str, Any]:
    """A tiny gke night (two budgets x three sizes: six cells) through the DAG's own form."""
    conf = tiny_sweep_conf(make_corpora(tmp_path / "data"))
    conf.update(
        backend="gke",
        image=IMAGE,
        gke={"namespace": NS, "kubeconfig": str(kubeconfig), "service_account": "trainer"},
    )
    form = copy.deepcopy(dag.params)
    form.update(conf)
    return form.validate()


def _context(params, run_id, map_index=-1, try_number=1) -> dict[str, Any]:
    ti = SimpleNamespace(map_index=map_index, try_number=try_number)
    return {"params": params, "run_id": run_id, "ti": ti}


def _plan_night(dag, params, run_id) -> list[dict[str, Any]]:
    """``validate`` then ``grid``, with the tokenizer's manifest where the data plane leaves it;
    the grid's XCom (``[{"cell": ...}]``, what the cell tasks are mapped over)."""
    from operators.pipeline.graph import STAGE_OUT
    from operators.settings import steps_root
    from operators.steps import join, output_path
    from pipelines.manifest import Manifest

    dag.get_task("validate").execute(_context(params, run_id))
    graph = dag.get_task("grid").step_graph(_context(params, run_id))
    (tok,) = graph.stages["train_tokenizer"]
    out = join(output_path(steps_root(), tok.step), STAGE_OUT)
    Path(out).mkdir(parents=True, exist_ok=True)
    Manifest("train_tokenizer", {}, [], 0, 0, {}, [], [], extra={"vocab_size": VOCAB}).write(out)
    planned = dag.get_task("grid").execute(_context(params, run_id))
    assert planned and all(set(p) == {"cell"} for p in planned)
    return planned


def _cell_task(dag, planned: dict[str, Any]) -> Any:
    """The ``train_cell`` task instance a worker runs for one mapped index."""
    return dag.get_task("train_cell").unmap(planned)


def _defer(task, context) -> Any:
    from airflow.sdk.exceptions import TaskDeferred

    with pytest.raises(TaskDeferred) as deferred:
        task.execute(context)
    return deferred.value


def _as_triggerer_runs_it(trigger) -> Any:
    """The trigger as the triggerer rebuilds it from what it stored (plain data)."""
    from airflow.sdk.serde import deserialize, serialize

    from operators.triggers.jobset import JobSetTrigger

    classpath, kwargs = trigger.serialize()
    assert classpath == "operators.triggers.jobset.JobSetTrigger"
    return JobSetTrigger(**deserialize(json.loads(json.dumps(serialize(kwargs)))))


def _train_spec(task, context) -> Any:
    from operators.settings import steps_root
    from operators.steps import resolve

    return resolve(task.train_step(context), steps_root())


def _pod_spec(manifest) -> dict[str, Any]:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _evaluation_pods(fake) -> Any:
    """The controller and pods of an evaluation JobSet, at once: ``trainer.evaluate`` writes
    its result file (``--output``, a loss for each ``--store``), then the JobSet completes."""

    def run(namespace: str, jobset: dict[str, Any]) -> None:
        if not jobset["metadata"]["name"].startswith("slipway-eval-"):
            return
        args = _pod_spec(jobset)["containers"][0]["args"]
        flags: dict[str, list[str]] = {}
        for flag, value in zip(args[::2], args[1::2], strict=True):
            flags.setdefault(flag, []).append(value)
        scores = {"tokens": 512, "loss": LOSS, "perplexity": math.exp(LOSS), "bits_per_byte": LOSS}
        body = {
            "step": int(flags["--step"][0]),
            "results": [{"store": store, **scores} for store in flags["--store"]],
        }
        output = Path(flags["--output"][0])
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(body))
        fake.complete(namespace, jobset["metadata"]["name"])

    return run


def _outcomes(dag, params, run_id, cells) -> list[dict[str, Any]]:
    """Each cell as the night's fit reads it: its metric, or why it has none."""
    from operators.settings import steps_root
    from operators.sweep.grid import cell_steps, metric_stores
    from operators.sweep.outcomes import cell_outcome

    fit = dag.get_task("fit")
    context = _context(params, run_id)
    form, graph = fit.run_params(context), fit.step_graph(context)
    stores = metric_stores(form, list(graph.eval_stores))
    return [
        cell_outcome(steps_root(), c, *cell_steps(c, graph, form), stores, form["metric"])
        for c in cells
    ]


def _marker(spec) -> dict[str, Any]:
    """The step's status marker (RUNNING, SUCCESS, FAILED), as the step model reads it."""
    return json.loads(Path(spec.output_path, ".status.json").read_text())


def _lineage(run_id) -> Any:
    from operators.lineage import LineageStore, lineage_url

    with LineageStore(lineage_url()) as store:
        return store.run_graph(run_id)


def test_every_cell_of_a_gke_night_is_submitted_trained_and_recorded(dag, fake, params):
    from operators.jobset.gke import STEP_LABEL, STEP_VERSION_LABEL
    from operators.sweep.grid import cell_slug

    planned = _plan_night(dag, params, NIGHT_1)
    cells = [p["cell"] for p in planned]
    assert len(cells) == 6

    # Each cell's task submits its JobSet (the fake accepts it: 422 would fail the task) and
    # defers, holding no worker slot while it trains.
    deferred, specs = [], []
    for i, p in enumerate(planned):
        context = _context(params, NIGHT_1, map_index=i)
        task = _cell_task(dag, p)
        deferred.append(_defer(task, context))
        specs.append(_train_spec(task, context))
    assert len(fake.created) == len(cells)
    names = [m["metadata"]["name"] for m in fake.created]
    assert len(set(names)) == len(cells)  # one JobSet per cell, none sharing a name
    assert all((NS, name) in fake.jobsets for name in names)
    for cell, spec, sent, d in zip(cells, specs, fake.created, deferred, strict=True):
        assert d.method_name == "execute_complete"
        assert d.trigger.handle["name"] == sent["metadata"]["name"]
        # The JobSet trains this cell: its config is the cell's step directory's, which holds
        # the cell's model, and it is the manifest kept there.
        assert spec.name == f"sweep/train/{cell_slug(cell)}"
        assert sent == json.loads(Path(spec.output_path, "jobset.json").read_text())
        config = json.loads(Path(spec.output_path, "trainer_config.json").read_text())
        assert config["model"]["hidden_dim"] == cell["plan"]["model"]["hidden_dim"]
        assert config["steps"] == cell["plan"]["steps"]
        args = _pod_spec(sent)["containers"][0]["args"]
        assert args[:2] == ["--config", str(Path(spec.output_path, "trainer_config.json"))]
        labels = sent["metadata"]["labels"]
        assert labels[STEP_LABEL] == f"sweep.train.{cell_slug(cell)}"[:63]  # '/' is no label's
        assert labels[STEP_VERSION_LABEL] == spec.version[:63]
        assert sent["metadata"]["namespace"] == NS
        assert _pod_spec(sent)["serviceAccountName"] == "trainer"
        assert _marker(spec)["status"] == "RUNNING"  # claimed while its JobSet trains

    # The cluster runs them to the end; the trainer's pods leave their results; each task
    # resumes (on a fresh task instance) when its trigger fires.
    for i, (p, spec, d) in enumerate(zip(planned, specs, deferred, strict=True)):
        name = d.trigger.handle["name"]
        fake.complete(NS, name)
        trainer_writes_results(spec.output_path, steps=p["cell"]["plan"]["steps"])
        event = run_trigger(_as_triggerer_runs_it(d.trigger))
        assert event.payload["event"] == "terminal", event.payload
        assert event.payload["status"]["terminal_state"] == "Completed"
        result = _cell_task(dag, p).execute_complete(
            _context(params, NIGHT_1, map_index=i), event.payload, **d.kwargs
        )
        assert result["outcome"] == "RAN"
        assert result["steps"] == p["cell"]["plan"]["steps"]
        assert result["output"] == spec.output_path
    assert not fake.deletions  # nothing was cancelled

    # Every cell's step is SUCCESS (what the cell's evaluation, the fit and the check read) ...
    assert [_marker(spec)["status"] for spec in specs] == ["SUCCESS"] * len(cells)
    # ... and in the night's lineage: the grid, then each cell's train step COMPLETE under the
    # sweep's DAG, told apart by its map index.
    graph = _lineage(NIGHT_1)
    assert graph.run.pipeline == "slipway_scaling_sweep"
    trained = [n.execution for n in graph.steps if n.execution.name.startswith("sweep/train/")]
    assert sorted(e.name for e in trained) == sorted(s.name for s in specs)
    assert {str(e.state) for e in trained} == {"COMPLETE"}
    by_name = {e.name: e for e in trained}
    for i, spec in enumerate(specs):
        execution = by_name[spec.name]
        assert execution.step_version == spec.version
        assert execution.properties["task_id"] == "train_cell"
        assert execution.properties["map_index"] == i
        assert execution.properties["unversioned"]["backend"] == "gke"
    assert "grid" in [n.execution.name for n in graph.steps]

    # Each cell's evaluation: its JobSet on one slice, accepted too; the evaluation pods
    # score the final checkpoint, and the cell reaches the metric the fit reads.
    fake.on_create = _evaluation_pods(fake)
    for i, p in enumerate(planned):
        evaluated = dag.get_task("evaluate_cell").unmap(p)
        result = evaluated.execute(_context(params, NIGHT_1, map_index=i))
        assert result["outcome"] == "RAN"
    evaluations = fake.created[len(cells) :]
    assert [m["metadata"]["labels"][STEP_LABEL] for m in evaluations] == [
        f"sweep.evaluate.{cell_slug(c)}"[:63] for c in cells
    ]
    assert all(m["metadata"]["name"].startswith("slipway-eval-") for m in evaluations)
    outcomes = _outcomes(dag, params, NIGHT_1, cells)
    assert [(o["metric"], o["reason"]) for o in outcomes] == [(LOSS, None)] * len(cells)
    scored = [
        n.execution
        for n in _lineage(NIGHT_1).steps
        if n.execution.name.startswith("sweep/evaluate/")
    ]
    assert len(scored) == len(cells) and {str(e.state) for e in scored} == {"COMPLETE"}

    # The next night plans the same cells: every one a cache hit, nothing sent to the cluster.
    posts = len(fake.requests_to("POST"))
    for i, p in enumerate(_plan_night(dag, params, NIGHT_2)):
        again = _cell_task(dag, p).execute(_context(params, NIGHT_2, map_index=i))
        assert again["outcome"] == "CACHED"
    assert len(fake.requests_to("POST")) == posts
    cached = [n.execution for n in _lineage(NIGHT_2).steps if n.execution.name in by_name]
    assert len(cached) == len(cells) and {str(e.state) for e in cached} == {"CACHED"}


def test_a_cell_whose_lease_ran_out_is_adopted_by_the_next_night(dag, fake, params):
    """The triggerer was down for longer than a cell's lease: the next night reaches the same
    (content-addressed) cell, takes the step over and finds its JobSet still there -- same
    name, same step version in its labels, as the fake read them back -- so it follows that
    one instead of training the cell twice; the first night's trigger then ends without
    deleting it, and the cell completes once."""
    from operators.steps import LEASE_PREFIX, LeaseLost

    first = _plan_night(dag, params, NIGHT_1)[0]
    owner = _defer(_cell_task(dag, first), _context(params, NIGHT_1, map_index=0))
    spec = _train_spec(_cell_task(dag, first), _context(params, NIGHT_1))
    (sent,) = fake.created
    name = sent["metadata"]["name"]

    # Nobody renewed the lease (the triggerer was down): it expired.
    generation = owner.kwargs["lease"]["generation"]
    lease_file = Path(spec.output_path, f"{LEASE_PREFIX}{generation:06d}")
    lease = json.loads(lease_file.read_text())
    lease_file.write_text(json.dumps({**lease, "expires_at": lease["expires_at"] - 3600}))

    second = _plan_night(dag, params, NIGHT_2)[0]
    assert second == first
    adopter = _defer(_cell_task(dag, second), _context(params, NIGHT_2, map_index=0))
    assert len(fake.requests_to("POST")) == 2  # it did submit: the fake said 409 ...
    assert len(fake.created) == 1  # ... and it adopted the JobSet that was there
    assert adopter.trigger.handle == owner.trigger.handle  # the same JobSet, uid and all
    assert adopter.kwargs["lease"]["generation"] == generation + 1

    # The first night's trigger, back: its lease was taken over, so it stops following.
    lost = run_trigger(_as_triggerer_runs_it(owner.trigger))
    assert lost.payload["event"] == "lease_lost"
    with pytest.raises(LeaseLost):
        _cell_task(dag, first).execute_complete(
            _context(params, NIGHT_1, map_index=0), lost.payload, **owner.kwargs
        )
    assert (NS, name) in fake.jobsets and not fake.deletions

    fake.complete(NS, name)
    trainer_writes_results(spec.output_path, steps=first["cell"]["plan"]["steps"])
    event = run_trigger(_as_triggerer_runs_it(adopter.trigger))
    assert event.payload["status"]["terminal_state"] == "Completed"
    result = _cell_task(dag, second).execute_complete(
        _context(params, NIGHT_2, map_index=0), event.payload, **adopter.kwargs
    )
    assert result["outcome"] == "RAN"
    assert _marker(spec)["status"] == "SUCCESS"
    states = {
        run: [str(n.execution.state) for n in _lineage(run).steps if n.execution.name == spec.name]
        for run in (NIGHT_1, NIGHT_2)
    }
    assert states == {NIGHT_1: ["FAILED"], NIGHT_2: ["COMPLETE"]}


def test_a_failed_cell_fails_its_step_is_not_evaluated_and_its_retry_starts_afresh(
    dag, fake, params
):
    """The cluster reports a cell's JobSet Failed: that cell's step and lineage are FAILED
    with the reason, its sibling trains on, its evaluation refuses without a JobSet (the fit
    then leaves it out, saying why), and the cleared cell's retry replaces the failed JobSet
    (it resumes from the checkpoint) instead of adopting it."""
    from operators.launching import TrainingFailed

    planned = _plan_night(dag, params, NIGHT_1)[:2]
    bad, good = (
        _defer(_cell_task(dag, p), _context(params, NIGHT_1, map_index=i))
        for i, p in enumerate(planned)
    )
    failed_name = bad.trigger.handle["name"]
    fake.fail(NS, failed_name, reason="ReachedMaxRestarts", exit_code=42)
    fake.complete(NS, good.trigger.handle["name"])
    specs = [_train_spec(_cell_task(dag, p), _context(params, NIGHT_1)) for p in planned]
    trainer_writes_results(specs[1].output_path, steps=planned[1]["cell"]["plan"]["steps"])

    event = run_trigger(_as_triggerer_runs_it(bad.trigger))
    assert event.payload["status"]["terminal_state"] == "Failed"
    with pytest.raises(TrainingFailed, match="ReachedMaxRestarts"):
        _cell_task(dag, planned[0]).execute_complete(
            _context(params, NIGHT_1, map_index=0), event.payload, **bad.kwargs
        )
    event = run_trigger(_as_triggerer_runs_it(good.trigger))
    result = _cell_task(dag, planned[1]).execute_complete(
        _context(params, NIGHT_1, map_index=1), event.payload, **good.kwargs
    )
    assert result["outcome"] == "RAN"
    assert [_marker(spec)["status"] for spec in specs] == ["FAILED", "SUCCESS"]
    assert "ReachedMaxRestarts" in _marker(specs[0])["error"]
    by_name = {n.execution.name: n.execution for n in _lineage(NIGHT_1).steps}
    assert str(by_name[specs[0].name].state) == "FAILED"
    assert "ReachedMaxRestarts" in by_name[specs[0].name].error
    assert str(by_name[specs[1].name].state) == "COMPLETE"

    created = len(fake.created)
    with pytest.raises(TrainingFailed, match="training FAILED"):
        dag.get_task("evaluate_cell").unmap(planned[0]).execute(
            _context(params, NIGHT_1, map_index=0)
        )
    assert len(fake.created) == created  # nothing launched to score a failed run
    (outcome,) = _outcomes(dag, params, NIGHT_1, [planned[0]["cell"]])
    assert outcome["metric"] is None and "training FAILED" in outcome["reason"]

    # The failed cell cleared: its retry deletes the failed JobSet and submits a new one.
    retry = _defer(_cell_task(dag, planned[0]), _context(params, NIGHT_1, 0, try_number=2))
    assert [d["name"] for d in fake.deletions] == [failed_name]
    assert len(fake.created) == created + 1
    assert fake.jobset(NS, failed_name)["status"].get("terminalState") is None
    assert retry.trigger.handle["uid"] != bad.trigger.handle["uid"]
