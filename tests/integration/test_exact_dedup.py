"""Exact dedup end to end: duplicate documents, repeated paragraphs, removal, determinism."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from pipelines import exact_dedup
from pipelines.beam_io import read_dead_letters, read_documents
from pipelines.exact_dedup import ExactDedupConfig
from pipelines.stage import StageError, config_from_mapping, run_stage
from tests.support.sharded import write_id_sharded_output

P1 = (
    "The committee met on Tuesday to review the budget for the coming year, and after a long"
    " discussion it agreed to fund the new library wing."
)
P2 = (
    "Rainfall in the northern hills was twice the seasonal average, and several bridges on the"
    " old coast road were closed while engineers inspected them."
)
P3 = "The recipe calls for two cups of flour, a pinch of salt and three fresh eggs."
P4 = "This paragraph appears twice in one document and nowhere else in the corpus at all."


def _doc(doc_id: str, text: str) -> dict:
    return {"id": doc_id, "text": text, "source": "web", "metadata": {}}


DOCS = [
    _doc("a", P1),
    _doc("b", P1.upper().replace(",", "").replace(".", "!")),  # same words, other case/punct
    _doc("c", "  " + P1.replace(" ", "   ") + "\n"),
    _doc("d", f"D starts with words of its own.\n\n{P2}\n\nThanks,\n\nD ends with its own line."),
    _doc("e", f"E opens with a unique sentence.\n\n{P2.upper()}\n\nThanks,"),
    _doc("c3", f"C3 has an introduction too.\n\n{P3}"),
    _doc("f", f"{P2}\n\n{P3}"),
    _doc("h", f"{P4}\n\n{P4}"),
    _doc("empty-1", ""),
    _doc("empty-2", ""),
    # No word character: no key text. Only the same text is a copy (sym-3 of sym-1).
    _doc("sym-1", "😀😀😀"),
    _doc("sym-2", "∑ ∫ ≠ → ∞"),
    _doc("sym-3", "😀😀😀"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dedup_in")
    lines = [json.dumps(d) for d in DOCS] + ["{broken", json.dumps({"text": "no id"})]
    (root / "in.jsonl").write_text("\n".join(lines) + "\n")
    return root / "in.jsonl"


def _run(inputs: Path, out: Path, beam_args: tuple[str, ...] = (), **config: object):
    run = run_stage(
        "exact_dedup",
        exact_dedup.build,
        ExactDedupConfig(**config),
        [str(inputs)],
        str(out),
        beam_args=beam_args,
    )
    kept = {d["id"]: d for d in read_documents(str(out))}
    letters = list(read_dead_letters(str(out)))
    return run.manifest, kept, letters


@pytest.fixture(scope="module")
def marked(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dedup") / "marked"
    return (out, *_run(inputs, out))


@pytest.fixture(scope="module")
def removed(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dedup") / "removed"
    return _run(inputs, out, remove_duplicate_paragraphs=True)


def _reasons(letters: list[dict]) -> dict[str, dict]:
    return {
        x["record"]["id"]: x
        for x in letters
        if isinstance(x["record"], dict) and "id" in x["record"]
    }


def test_accounting(marked, removed):
    for manifest, kept, letters in (marked[1:], removed):
        assert manifest.records_in == len(DOCS) + 2
        assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
        assert len(kept) == manifest.records_out
        assert Counter(x["reason"] for x in letters) == manifest.dropped
        assert manifest.dropped["invalid_json"] == 1
        assert manifest.dropped["missing_id"] == 1


def test_duplicates_differing_in_case_punctuation_and_space_keep_smallest_id(marked):
    _, manifest, kept, letters = marked
    assert "a" in kept and "b" not in kept and "c" not in kept
    by_id = _reasons(letters)
    for doc_id in ("b", "c"):
        assert by_id[doc_id]["reason"] == "exact_duplicate"
        assert by_id[doc_id]["duplicate_of"] == "a"
        assert by_id[doc_id]["origin"] == doc_id
    assert "empty-1" in kept and by_id["empty-2"]["duplicate_of"] == "empty-1"
    assert "sym-1" in kept and "sym-2" in kept and by_id["sym-3"]["duplicate_of"] == "sym-1"
    assert manifest.dropped["exact_duplicate"] == 4
    assert manifest.extra["exact_duplicate_groups"] == 3


def test_repeated_paragraphs_are_marked_outside_their_first_document(marked):
    _, manifest, kept, _ = marked
    assert "duplicate_spans" not in kept["d"]["metadata"]  # d is P2's first document
    assert "duplicate_spans" not in kept["c3"]["metadata"]
    e = kept["e"]
    [[start, end]] = e["metadata"]["duplicate_spans"]
    assert e["text"][start:end] == P2.upper()
    f = kept["f"]
    assert [f["text"][s:t] for s, t in f["metadata"]["duplicate_spans"]] == [P2, P3]
    assert f["text"] == f"{P2}\n\n{P3}"  # marking leaves the text alone
    # Repetition inside one document, and short paragraphs like "Thanks,", are not marked.
    assert "duplicate_spans" not in kept["h"]["metadata"]
    assert manifest.extra["duplicate_paragraphs"] == 2
    assert manifest.extra["docs_with_duplicate_spans"] == 2
    assert manifest.extra["duplicate_chars_marked"] == len(P2) * 2 + len(P3)


def test_remove_mode_cuts_spans_and_drops_emptied_docs(removed):
    manifest, kept, letters = removed
    assert kept["e"]["text"] == "E opens with a unique sentence.\n\nThanks,"
    assert kept["e"]["metadata"]["removed_duplicate_spans"]
    assert kept["d"]["text"].count(P2) == 1
    by_id = _reasons(letters)
    assert by_id["f"]["reason"] == "empty_after_paragraph_dedup"
    assert manifest.dropped["empty_after_paragraph_dedup"] == 1
    assert manifest.extra["duplicate_chars_removed"] == len(P2) * 2 + len(P3)


def test_multi_processing_run_is_byte_identical(marked, inputs, tmp_path, digest):
    out = marked[0]
    again = tmp_path / "mp"
    exact_dedup.main(
        [
            "--input",
            str(inputs),
            "--output",
            str(again),
            "--direct_running_mode=multi_processing",
            "--direct_num_workers=2",
        ]
    )
    assert digest(out) == digest(again)


def _mixed_corpus(seed: int, n: int) -> list[dict]:
    """Documents drawn from a few shared paragraphs and lines, with the records that make the
    shard path's choices differ from a plain reading: ids shared by several records, exact
    copies, copies in other case or metadata, and short lines never compared."""
    rng = random.Random(seed)
    pool = [P1, P2, P3, P4, "Thanks,", "Call 555 0100 today", "See you at the meeting soon."]
    docs: list[dict] = []
    for i in range(n):
        parts = [*rng.sample(pool, rng.randint(1, 3)), f"Mixed document {i} ends here alone."]
        text = ("\n" if rng.random() < 0.3 else "\n\n").join(parts)
        docs.append(_doc(f"m{rng.randint(0, n // 2):02d}", text))  # ids repeat
        roll = rng.random()
        if roll < 0.15:
            docs.append(dict(docs[-1]))  # an exact copy
        elif roll < 0.3:
            docs.append(_doc(f"m{rng.randint(0, n):02d}", text.upper()))  # a copy, other case
        elif roll < 0.4:
            docs.append({**docs[-1], "metadata": {"copy": i}})  # a copy, other metadata
    return docs


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"remove_duplicate_paragraphs": True},
        {"paragraph_unit": "line", "min_paragraph_words": 1},
        {"dedup_documents": False},
        {"dedup_paragraphs": False},
    ],
)
def test_the_shard_path_writes_what_the_shuffle_path_writes(config, tmp_path, digest, caplog):
    """An id-sharded stage output is read shard by shard (documents never shuffled; decisions
    and spans joined per shard), the same files as a glob through the harness: same bytes."""
    docs = [
        *DOCS,
        _doc("a", P1),  # an exact copy of a record: one is kept
        _doc("a", P1 + " Again."),  # another record with the same id
        # d's text under d's id, other metadata: one of the two is dropped, and the other
        # still owns P2 (the paragraph scan must not lose it with the dropped one)
        {**_doc("d", DOCS[3]["text"]), "metadata": {"v": 2}},
        _doc("g", f"G is new.\n\n{P3}\n\n{P2}"),
        *_mixed_corpus(seed=7, n=40),
    ]
    sharded = write_id_sharded_output(tmp_path / "in", docs, 3, {1: ["{broken\n"]})
    argv = ["--input", str(sharded), "--num_shards", "3", "--config", json.dumps(config)]
    caplog.set_level("INFO", logger="pipelines.map_stage")
    by_shard = exact_dedup.main([*argv, "--output", str(tmp_path / "by_shard")]).manifest
    assert "documents stay in their shard" in caplog.text
    files = str(sharded / "data" / "*.jsonl.gz")
    shuffled = run_stage(
        "exact_dedup",
        exact_dedup.build,
        config_from_mapping(ExactDedupConfig, config),
        [files],
        str(tmp_path / "shuffled"),
        num_shards=3,
    ).manifest
    for name in ("records_in", "records_out", "dropped", "extra"):
        assert getattr(by_shard, name) == getattr(shuffled, name), name
    for sub in ("data", "dead_letter"):
        assert digest(tmp_path / "by_shard" / sub) == digest(tmp_path / "shuffled" / sub), sub
    if config.get("dedup_documents", True):
        assert by_shard.dropped["exact_duplicate"] >= 3
    if config.get("dedup_paragraphs", True):
        assert by_shard.extra["duplicate_paragraphs"] >= 2


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"remove_duplicate_paragraph": True}, "remove_duplicate_paragraph"),
        ({"paragraph_unit": "sentence"}, "paragraph_unit"),
        ({"min_paragraph_words": 0}, "min_paragraph_words"),
        ({"remove_duplicate_paragraphs": "yes"}, "remove_duplicate_paragraphs"),
    ],
)
def test_bad_config_names_the_field(values, named):
    with pytest.raises(StageError, match=named):
        config_from_mapping(ExactDedupConfig, values)
