"""The pipeline's one table (operators/pipeline/definition.py) against the DAG and the step graph.

Every DAG edge is an edge of the table; every table edge between tasks that hold steps is an
upstream some step of the downstream task reads (another task's step output, or a corpus file
the ``fetch`` task provides), and every such upstream is a table edge.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from operators.pipeline import PIPELINE, Role, edges
from tests.support.tiny_pipeline import make_corpora, tiny_conf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    from operators.pipeline.form import form_values
    from operators.pipeline.graph import build_graph

    data = make_corpora(tmp_path_factory.mktemp("data"))
    return build_graph(form_values(tiny_conf(data)))


def _step_edges(graph) -> set[tuple[str, str]]:
    """(upstream task, task) for every input of every step, from the steps themselves."""
    owner = {id(step): task for task, steps in graph.task_steps().items() for step in steps}
    corpora = {*graph.raw_inputs.values(), *graph.eval_sets.values()}
    found = set()
    for task, steps in graph.task_steps().items():
        for step in steps:
            found |= {(owner[id(up)], task) for up in step.upstream}
            for group in graph.stages.get(task, ()):
                if group.step is step and any(u in corpora for u, _, _ in group.inputs):
                    found.add(("fetch", task))
    return found


def test_step_upstreams_are_exactly_the_table_edges(graph):
    stepped = set(graph.task_steps())
    table = {(u, d) for u, d in edges() if d in stepped}
    assert _step_edges(graph) == table
    # The tasks without steps: the form's check first, the corpora next, the promotion gate
    # (never cached: it depends on what is promoted now), the summary last.
    assert [t.task_id for t in PIPELINE if t.task_id not in stepped] == [
        "validate",
        "fetch",
        "gate",
        "record",
    ]
    assert {d for u, d in edges() if u == "validate"} == {"fetch"}
    assert [t.upstream for t in PIPELINE if t.role is Role.GATE] == [("evaluate", "export")]
    assert [t.upstream for t in PIPELINE if t.role is Role.RECORD] == [
        ("evaluate", "export", "gate")
    ]
    assert PIPELINE[-1].role is Role.RECORD


def test_the_dag_is_built_from_the_table():
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["slipway_pipeline"]
    assert dag.task_ids == [t.task_id for t in PIPELINE]
    dag_edges = {(u, t.task_id) for t in dag.tasks for u in t.upstream_task_ids}
    assert dag_edges == set(edges())
    for task in PIPELINE:
        assert dag.get_task(task.task_id).doc_md == task.summary


def test_reordering_the_table_rewires_the_document_stages(graph, monkeypatch):
    """The document stages read what the table says: swap two and the graph follows."""
    from operators.pipeline import definition as pipeline
    from operators.pipeline.form import form_values
    from operators.pipeline.graph import build_graph

    order = {"ingest": 0, "exact_dedup": 1, "quality": 2, "fuzzy_dedup": 3}
    rows = {
        "exact_dedup": pipeline.TaskDef("exact_dedup", Role.BEAM, ("ingest",)),
        "quality": pipeline.TaskDef("quality", Role.BEAM, ("exact_dedup",)),
        "fuzzy_dedup": pipeline.TaskDef("fuzzy_dedup", Role.BEAM, ("quality",)),
    }
    swapped = [rows.get(t.task_id, t) for t in pipeline.PIPELINE]
    swapped.sort(
        key=lambda t: order.get(t.task_id, -1 if t.task_id in ("validate", "fetch") else 9)
    )
    monkeypatch.setattr(pipeline, "PIPELINE", tuple(swapped))
    monkeypatch.setattr(pipeline, "TASKS", {t.task_id: t for t in swapped})
    pipeline.check_table()

    data = Path(graph.raw_inputs["brown"]).parents[1]
    rewired = build_graph(form_values(tiny_conf(data)))
    (quality,) = rewired.stages["quality"]
    (exact,) = rewired.stages["exact_dedup"]
    assert [u.name for u in exact.step.upstream] == ["ingest"]
    assert [u.name for u in quality.step.upstream] == ["exact_dedup"]
    (before,) = graph.stages["quality"]
    assert [u.name for u in before.step.upstream] == ["ingest"]


def test_a_table_out_of_order_is_refused(monkeypatch):
    from operators.pipeline import definition as pipeline

    bad = (*pipeline.PIPELINE[:2], pipeline.TaskDef("x", Role.BEAM, ("later",)))
    monkeypatch.setattr(pipeline, "PIPELINE", bad)
    with pytest.raises(ValueError, match="x: upstream \\['later'\\] not defined before it"):
        pipeline.check_table()
