"""Exact dedup's shard path: packed paragraph parts, and what ``shard_parts`` keeps and counts.

The whole path is compared with the harness's in tests/integration/test_exact_dedup.py; these
pin what a corpus there cannot easily show: documents whose paragraph scan fails.
"""

from __future__ import annotations

from apache_beam import pvalue

from pipelines import exact_dedup
from pipelines.configs import ExactDedupConfig
from pipelines.exact_dedup import (
    _ENTRY,
    ERRORS,
    EXCLUDED,
    PARTS,
    UNSCANNED,
    KeyShard,
    PartBuilder,
    document_decisions,
    part_occurrences,
    shard_parts,
)
from tests.support.sharded import write_id_sharded_output

A, B = b"a" * 16, b"b" * 16
KEY_X, KEY_Y = ("x", "0001"), ("y", "0002")


def _part(*occurrences: tuple[bytes, tuple[str, str], int, int]) -> tuple[list, bytes]:
    builder, slots = PartBuilder(), {}
    for digest, key, start, end in occurrences:
        if key not in slots:
            slots[key] = builder.add(key)
        builder.data += _ENTRY.pack(digest, slots[key], start, end)
    return builder.part()


def _split(outputs: list) -> tuple[list, list]:
    tagged = [o for o in outputs if isinstance(o, pvalue.TaggedOutput)]
    return [o for o in outputs if not isinstance(o, pvalue.TaggedOutput)], tagged


def test_a_packed_part_reads_back_its_occurrences_with_their_keys():
    part = _part((A, KEY_X, 0, 10), (B, KEY_Y, 5, 2**32 - 1), (B, KEY_X, 12, 30))
    assert list(part_occurrences(part)) == [
        (A, KEY_X, 0, 10),
        (B, KEY_Y, 5, 2**32 - 1),
        (B, KEY_X, 12, 30),
    ]
    # Coders may hand the keys back as lists: the occurrences still carry tuples.
    assert list(part_occurrences(([list(KEY_X)], part[1][:28]))) == [(A, KEY_X, 0, 10)]


def test_dropped_documents_leave_the_parts_and_an_emptied_part_is_not_sent():
    grouped = {
        PARTS: [(3, _part((A, KEY_X, 0, 10), (A, KEY_Y, 0, 10))), (7, _part((B, KEY_Y, 1, 2)))],
        EXCLUDED: [list(KEY_Y)],
        UNSCANNED: [],
        "decisions": [],
    }
    kept, tagged = _split(list(shard_parts((0, grouped), ExactDedupConfig())))
    assert tagged == []
    assert [(partition, list(part_occurrences(part))) for partition, part in kept] == [
        (3, [(A, KEY_X, 0, 10)])
    ]


def test_scan_errors_count_kept_documents_once():
    """A kept record is scanned once on the harness's path: its exact copies (same id and
    content) are not counted again, and a member dropped as a duplicate is not counted."""
    decisions = [("x", "c1", ("x", True)), ("x2", "c2", ("x", False))]
    unscanned = [("x", "c1"), ["x", "c1"], ("x2", "c2"), ("solo", "c3")]
    grouped = {PARTS: [], EXCLUDED: [], UNSCANNED: unscanned, "decisions": decisions}
    _, tagged = _split(list(shard_parts((0, grouped), ExactDedupConfig())))
    assert [(t.tag, t.value) for t in tagged] == [(ERRORS, 2)]  # x and solo

    # Without document dedup every record is kept, copies included: each one counts.
    config = ExactDedupConfig(dedup_documents=False)
    only = {**grouped, "decisions": [], UNSCANNED: [("x", None), ("x", None)]}
    _, tagged = _split(list(shard_parts((0, only), config)))
    assert [(t.tag, t.value) for t in tagged] == [(ERRORS, 2)]


def test_decisions_exclude_the_dropped_members_keys_but_never_the_canonicals():
    ranks = [("d", "c2", "k"), ("d", "c1", "k"), ("e", "c3", "m")]  # d twice: other metadata
    outputs = list(document_decisions(("hash", ranks), 3))
    excluded = [
        o.value[1] for o in outputs if isinstance(o, pvalue.TaggedOutput) and o.tag == EXCLUDED
    ]
    assert excluded == [("e", "m")]  # ("d", "k") is also the kept record's key
    decisions = [o[1] for o in outputs if not isinstance(o, pvalue.TaggedOutput)]
    assert decisions == [
        ("d", "c1", ("d", True)),
        ("d", "c2", ("d", False)),
        ("e", "c3", ("d", False)),
    ]


def test_a_text_too_long_for_32_bit_offsets_is_reported_unscanned(tmp_path, monkeypatch):
    monkeypatch.setattr(exact_dedup, "MAX_OFFSET", 20)
    docs = [
        {
            "id": "long",
            "text": "a paragraph well over twenty characters",
            "source": "s",
            "metadata": {},
        },
        {"id": "short", "text": "three words here", "source": "s", "metadata": {}},
    ]
    sharded = write_id_sharded_output(tmp_path / "in", docs, 1, {})
    paths = sorted(str(p) for p in (sharded / "data").glob("*.jsonl.gz"))
    outputs = list(KeyShard(ExactDedupConfig(), 1).process((0, paths)))
    unscanned = [
        o.value for o in outputs if isinstance(o, pvalue.TaggedOutput) and o.tag == UNSCANNED
    ]
    assert [(index, doc_id) for index, (doc_id, _) in unscanned] == [(0, "long")]
    parts = [o.value for o in outputs if isinstance(o, pvalue.TaggedOutput) and o.tag == PARTS]
    assert [key for _, (_, part) in parts for _, key, _, _ in part_occurrences(part)] == [
        ("short", exact_dedup.document_key(docs[1])[1])
    ]


def test_records_sharing_an_id_are_told_apart_from_those_alone():
    """Only records sharing an id need their whole record hashed to choose among them."""
    docs = [{"id": i} for i in ("a", "b", "b", "c", "d", "d", "d", "e")]
    shared = [(doc["id"], flag) for doc, flag in exact_dedup._with_shared_ids(docs)]
    assert shared == [
        ("a", False),
        ("b", True),
        ("b", True),
        ("c", False),
        ("d", True),
        ("d", True),
        ("d", True),
        ("e", False),
    ]
    assert list(exact_dedup._with_shared_ids([])) == []
