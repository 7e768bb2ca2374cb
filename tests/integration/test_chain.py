"""The whole data plane walked as the pipeline table orders it (``operators.pipeline.dataplane``, what
``make demo-data`` runs): nothing lost end to end, cache hits, byte-identical on recompute."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from pathlib import Path

import pytest

from operators.lineage import LineageStore
from operators.lineage.render import render_run
from operators.pipeline import DOCUMENT_STAGES, PIPELINE, STAGES, Role
from operators.pipeline.dataplane import StepRun, walk
from operators.pipeline.form import form_values
from operators.pipeline.graph import build_graph
from operators.steps import Outcome
from tokenstore import TokenStore

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "that",
    "it",
    "with",
    "as",
    "for",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "from",
    "have",
    "or",
    "an",
    "they",
    "which",
    "one",
    "river",
    "stone",
    "market",
    "winter",
    "garden",
    "letter",
    "engine",
    "harbor",
    "signal",
    "doctor",
    "window",
    "valley",
    "story",
]


def _prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        n = rng.randint(8, 16)
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return " ".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A data folder as ``fetch`` lays it out: one raw source, one eval set."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(7)
    docs = [{"id": f"web/{i}", "text": _prose(rng, 12), "source": "brown"} for i in range(120)]
    docs += [dict(d, id=d["id"] + "-copy") for d in docs[:10]]  # exact duplicates
    docs.append({"id": "short", "text": "Too short.", "source": "brown"})  # quality drop
    eval_text = _prose(rng, 3)
    docs.append({"id": "leak", "text": _prose(rng, 6) + " " + eval_text, "source": "brown"})
    lines = [json.dumps(d) for d in docs] + ['{"id": "broken"', '{"text": 3}']
    (root / "raw").mkdir()
    (root / "raw" / "brown.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    (root / "eval").mkdir()
    task = json.dumps({"id": "t/0", "text": eval_text, "source": "task"}) + "\n"
    (root / "eval" / "task.jsonl.gz").write_bytes(gzip.compress(task.encode(), mtime=0))
    return root


def _conf(data: Path) -> dict:
    configs = {stage: {} for stage in STAGES}
    configs["train_tokenizer"] = {"vocab_size": 400}
    return {
        "data_dir": str(data),
        "sources": [{"name": "brown", "weight": 1.0}],
        "stage_configs": configs,
        "num_shards": 2,
    }


def _lineage(root: Path) -> str:
    return f"sqlite:///{root.parent / (root.name + '-lineage.db')}"


def _walk(corpus: Path, root: Path, run_id: str = "walk-1") -> list[StepRun]:
    graph = build_graph(form_values(_conf(corpus)))
    return walk(graph, str(root), lineage_url=_lineage(root), run_id=run_id)


@pytest.fixture(scope="module")
def chain(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    return root, _walk(corpus, root)


def _by_task(runs: list[StepRun]) -> dict[str, list[StepRun]]:
    found: dict[str, list[StepRun]] = {}
    for r in runs:
        found.setdefault(r.task_id, []).append(r)
    return found


def test_the_walk_follows_the_pipeline_table(chain):
    _, runs = chain
    walked = [t.task_id for t in PIPELINE if t.role in (Role.BEAM, Role.SPLIT)]
    assert (
        list(_by_task(runs)) == walked == [*DOCUMENT_STAGES, "split", "train_tokenizer", "tokenize"]
    )
    assert {r.outcome for r in runs} == {Outcome.RAN}


def test_every_stage_and_the_chain_account_for_every_record(chain):
    _, runs = chain
    for r in runs:
        assert r.records_in == r.records_out + sum(r.dropped.values()), r.step
    doc_stages = [_by_task(runs)[t][0] for t in DOCUMENT_STAGES]
    for before, after in itertools.pairwise(doc_stages):
        assert after.records_in == before.records_out, after.step
    first, last = doc_stages[0], doc_stages[-1]
    all_dropped = sum(sum(r.dropped.values()) for r in doc_stages)
    assert first.records_in == 134
    assert first.records_in == last.records_out + all_dropped


def test_each_kind_of_bad_record_is_dropped_where_expected(chain):
    _, runs = chain
    dropped = {t: group[0].dropped for t, group in _by_task(runs).items()}
    assert dropped["ingest"] == {"invalid_json": 1, "non_string_text": 1}
    assert dropped["quality"].get("quality:min_words") == 1
    assert dropped["exact_dedup"] == {"exact_duplicate": 10}
    assert dropped["decontaminate"] == {"contamination": 1}


def test_token_stores_hold_every_surviving_document(chain):
    _, runs = chain
    by_task = _by_task(runs)
    clean = by_task["decontaminate"][0].records_out
    stores = {r.step.rsplit("-", 1)[0]: r for r in by_task["tokenize"]}
    assert set(stores) == {"tokens/train/brown", "tokens/heldout/brown"}
    docs = 0
    for r in stores.values():
        store = TokenStore.open(f"{r.output}/output")
        assert store.vocab_size == 400
        docs += store.num_docs
    assert docs == clean


def test_the_walk_is_recorded_and_printed_as_a_dag_run_is(chain, corpus):
    root, runs = chain
    with LineageStore(_lineage(root)) as store:
        graph = store.run_graph("walk-1")
        assert graph.run.pipeline == "slipway_dataplane"
        assert [n.execution.name for n in graph.steps] == [r.step.rsplit("-", 1)[0] for r in runs]
        text = render_run(graph)
        ingest_row = next(line for line in text.splitlines() if line.startswith("ingest "))
        assert ingest_row.split()[:5] == ["ingest", "COMPLETE", "134", "132", "2"]
        store_uri = next(r.output for r in runs if r.step.startswith("tokens/train/brown"))
        raw = {a.uri for a in store.trace(f"{store_uri}/output").raw_inputs()}
        assert str(corpus / "raw" / "brown.jsonl.gz") in raw


def test_a_second_walk_is_all_cache_hits_and_a_recomputed_one_byte_identical(chain, corpus, digest):
    # Same place, same inputs: manifests name their input paths, so a rerun elsewhere would
    # differ in exactly those strings and nothing else.
    root, _ = chain

    def outputs() -> dict[str, str]:  # the step model's own files hold times and owners
        return {k: v for k, v in digest(root).items() if "/.status" not in k and "/.lease" not in k}

    before = outputs()
    assert {r.outcome for r in _walk(corpus, root, "walk-2")} == {Outcome.CACHED}
    for marker in [*root.rglob(".status.json"), *root.rglob(".lease-*")]:
        marker.unlink()  # forget every result: every step runs again
    assert {r.outcome for r in _walk(corpus, root, "walk-3")} == {Outcome.RAN}
    assert outputs() == before
