"""The whole data plane, chained: nothing lost end to end, and byte-identical on rerun."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from pathlib import Path

import pytest

from pipelines.demo import format_summary, run_data_plane
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
def corpus(tmp_path_factory) -> tuple[dict[str, str], dict[str, str]]:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(7)
    docs = [{"id": f"web/{i}", "text": _prose(rng, 12), "source": "web"} for i in range(120)]
    docs += [dict(d, id=d["id"] + "-copy") for d in docs[:10]]  # exact duplicates
    docs.append({"id": "short", "text": "Too short.", "source": "web"})  # quality drop
    eval_text = _prose(rng, 3)
    docs.append({"id": "leak", "text": _prose(rng, 6) + " " + eval_text, "source": "web"})
    lines = [json.dumps(d) for d in docs] + ['{"id": "broken"', '{"text": 3}']
    raw = root / "web.jsonl.gz"
    raw.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    evals = root / "task.jsonl"
    evals.write_text(json.dumps({"id": "t/0", "text": eval_text, "source": "task"}) + "\n")
    return {"web": str(raw)}, {"task": str(evals)}


CONFIG = {"train_tokenizer": {"vocab_size": 400}}


def _run(corpus, out: Path):
    raw, evals = corpus
    return run_data_plane(out, out, CONFIG, raw=raw, eval_sets=evals)


@pytest.fixture(scope="module")
def chain(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("chain")
    return out, _run(corpus, out)


def test_every_stage_and_the_chain_account_for_every_record(chain):
    _, results = chain
    for r in results:
        m = r.manifest
        assert m.records_in == m.records_out + sum(m.dropped.values()), r.name
    doc_stages = results[:5]
    for before, after in itertools.pairwise(doc_stages):
        assert after.manifest.records_in == before.manifest.records_out, after.name
    first, last = doc_stages[0].manifest, doc_stages[-1].manifest
    all_dropped = sum(sum(r.manifest.dropped.values()) for r in doc_stages)
    assert first.records_in == 134
    assert first.records_in == last.records_out + all_dropped


def test_each_kind_of_bad_record_is_dropped_where_expected(chain):
    _, results = chain
    dropped = {r.name: r.manifest.dropped for r in results}
    assert dropped["ingest"] == {"invalid_json": 1, "non_string_text": 1}
    assert dropped["quality"].get("quality:min_words") == 1
    assert dropped["exact_dedup"] == {"exact_duplicate": 10}
    assert dropped["decontaminate"] == {"contamination": 1}


def test_token_store_holds_every_surviving_document(chain):
    out, results = chain
    store = TokenStore.open(str(out / "tokens"))
    assert store.num_docs == results[4].manifest.records_out
    assert store.vocab_size == 400
    assert "tokenize" in format_summary(results)


def test_rerun_is_byte_identical(chain, corpus, digest):
    # Same place, same inputs: manifests name their input paths, so a rerun elsewhere would
    # differ in exactly those strings and nothing else.
    out, _ = chain
    before = digest(out)
    _run(corpus, out)
    assert digest(out) == before
