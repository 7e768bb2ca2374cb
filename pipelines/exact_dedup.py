"""Stage 3, exact dedup: whole documents first, then repeated paragraphs across documents.

Document level: documents whose normalized text (``pipelines.text.dedup_key_text``: case,
punctuation and whitespace ignored) has the same 128-bit xxh3 hash form a group; the document
with the smallest id is kept, the others are dropped with reason ``exact_duplicate`` and
``duplicate_of`` naming it.

Paragraph level, over the kept documents: a paragraph is a run of non-blank lines between
blank lines (``pipelines.text.paragraph_spans``; ``paragraph_unit="line"`` uses single lines
instead). Paragraphs are compared by the same normalized hash. A paragraph found in more
than one document belongs to the document with the smallest id; every other document that
contains it gets its ``[start, end)`` character span in ``metadata["duplicate_spans"]``. With
``remove_duplicate_paragraphs`` the spans are cut out instead (listed, in the coordinates of
the text before removal, in ``metadata["removed_duplicate_spans"]``), and a document with
nothing left is dropped with reason ``empty_after_paragraph_dedup``.

Everything is a shuffle keyed by hash (no step gathers the corpus on one worker), and each
choice depends only on ids and content, so the output does not depend on the runner.

    python -m pipelines.exact_dedup --input out/quality --output out/exact_dedup \\
        --config '{"remove_duplicate_paragraphs": true}'
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import apache_beam as beam
import xxhash
from apache_beam import pvalue

from pipelines import spill
from pipelines.beam_io import DEAD, stable_shard
from pipelines.configs import ExactDedupConfig
from pipelines.documents import Document, dead_letter, dumps
from pipelines.extra_totals import extra_totals
from pipelines.map_stage import (
    INPUT_DEAD,
    RECORDS_IN,
    ShardDocuments,
    input_shards,
    planned_shards,
    write_shard,
)
from pipelines.stage import (
    DocumentShards,
    Planned,
    StageOutputs,
    StageRun,
    run_as_command,
    stage_main,
)
from pipelines.text import dedup_key_text, line_spans, paragraph_spans, span_dedup_keys

log = logging.getLogger(__name__)

STAGE = "exact_dedup"
CHARS = "chars"
ERRORS = "errors"
GROUPS = "groups"  # a text hash shared by several documents
SHARED = "shared"  # paragraph hashes shared by several documents (summed)
SPAN_DOCS = "span_docs"  # documents with spans (summed; the shard path's count per shard)
FAILED = "failed"  # a document whose text hash failed (the shard path's later passes skip it)

Span = tuple[int, int]
MAX_OFFSET = 2**32 - 1  # a span's end: a text longer than that is not scanned for paragraphs
# A document's place in the choice of canonical copy: its id, then its content, so that even
# two records with one id resolve the same way on every runner.
Rank = tuple[str, str]
DocKey = tuple[str, str]  # (id, text hash)


def text_hash(text: str) -> str:
    """128-bit hash of text as exact dedup compares it (hex, so it sorts and prints well).

    A text with no word character (emoji, symbols, punctuation only) has an empty key, which
    would make every such document a copy of every other: it is compared as it is instead
    (the NUL prefix keeps it apart from any key, which never holds one)."""
    key = dedup_key_text(text) or "\x00" + text
    return xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogatepass"))


def document_rank(doc: Document) -> Rank:
    return (doc["id"], xxhash.xxh3_128_hexdigest(dumps(doc).encode("utf-8", "surrogatepass")))


def _processing_error(doc: Any, err: Exception) -> pvalue.TaggedOutput:
    origin = str(doc.get("id", "")) if isinstance(doc, dict) else ""
    return pvalue.TaggedOutput(
        DEAD,
        dead_letter("processing_error", STAGE, origin, doc, f"{type(err).__name__}: {err}"),
    )


# --- document level ---------------------------------------------------------------------------


def key_by_text_hash(doc: Document) -> Iterator[Any]:
    try:
        yield (text_hash(doc["text"]), doc)
    except Exception as err:  # one bad record must never take the pipeline down
        yield _processing_error(doc, err)


def resolve_duplicates(item: tuple[str, Iterable[Document]]) -> Iterator[Any]:
    """One text hash's documents -> the one with the smallest rank kept, the others
    dead-lettered; a tagged ``GROUPS`` count for a hash shared by several documents.

    A group of one (almost every document) is kept without ranking it. A larger group is read
    twice, the smallest rank first (on Dataflow a GroupByKey's values are re-iterable and
    streamed, so a hash shared by millions of copies is never held in memory; the local runner's
    spilled group holds one hash's documents at a time).
    """
    _, docs = item
    members = iter(docs)
    first = next(members, None)
    if first is None:
        return
    if next(members, None) is None:
        yield first
        return
    yield pvalue.TaggedOutput(GROUPS, 1)
    canonical = min(document_rank(doc) for doc in docs)
    kept = False
    for doc in docs:
        if not kept and document_rank(doc) == canonical:
            kept = True
            yield doc
        else:
            yield pvalue.TaggedOutput(DEAD, _duplicate_letter(doc, canonical[0]))


def _duplicate_letter(doc: Document, canonical_id: str) -> dict[str, Any]:
    return dead_letter("exact_duplicate", STAGE, doc["id"], doc, duplicate_of=canonical_id)


def dedup_documents(docs: beam.PCollection) -> tuple[Any, Any, list[Any]]:
    """Documents -> (kept, dead letters, manifest totals for ``extra_totals``)."""
    keyed = docs | "KeyByTextHash" >> beam.FlatMap(key_by_text_hash).with_outputs(
        DEAD, main="keyed"
    )
    resolved = (
        keyed["keyed"]
        | "GroupByTextHash" >> spill.GroupByKey()
        | "Resolve" >> beam.FlatMap(resolve_duplicates).with_outputs(DEAD, GROUPS, main="kept")
    )
    dropped = (keyed[DEAD], resolved[DEAD]) | "DocumentDropped" >> beam.Flatten()
    return resolved["kept"], dropped, [("exact_duplicate_groups", "count", resolved[GROUPS])]


# --- paragraph level --------------------------------------------------------------------------


def unit_spans(text: str, unit: str) -> list[Span]:
    return line_spans(text) if unit == "line" else paragraph_spans(text)


def document_key(doc: Document) -> DocKey:
    """Which document a span belongs to: its id, and its text's hash in case ids repeat."""
    return (doc["id"], xxhash.xxh3_64_hexdigest(doc["text"].encode("utf-8", "surrogatepass")))


def paragraph_digests(text: str, config: ExactDedupConfig) -> list[tuple[bytes, int, int]]:
    """(128-bit hash of the normalized paragraph, start, end) for each paragraph worth
    comparing: one with at least ``min_paragraph_words`` words. Offsets are 32-bit (the shard
    path packs them): a longer text is refused, on both paths alike."""
    if len(text) > MAX_OFFSET:
        raise ValueError(f"text of {len(text)} characters: span offsets are 32-bit")
    spans = unit_spans(text, config.paragraph_unit)
    return [
        (xxhash.xxh3_128_digest(normalized), start, end)
        for (start, end), normalized in zip(spans, span_dedup_keys(text, spans), strict=True)
        if normalized and normalized.count(b" ") + 1 >= config.min_paragraph_words
    ]


def paragraph_occurrences(doc: Document, config: ExactDedupConfig) -> Iterator[Any]:
    """(paragraph hash, (doc key, start, end)) for each paragraph worth comparing.

    A document that cannot be scanned keeps its text unmarked (it is still counted, under
    ``paragraph_scan_errors``): dropping it here would lose it from the kept side.
    """
    try:
        key = document_key(doc)
        found = paragraph_digests(doc["text"], config)
    except Exception:  # one bad record must never take the pipeline down
        log.exception("paragraph scan failed for %r", doc.get("id"))
        yield pvalue.TaggedOutput(ERRORS, 1)
        return
    for digest, start, end in found:
        yield (digest, (key, start, end))


def repeated_spans(item: tuple[bytes, Iterable[Any]]) -> Iterator[Any]:
    """One paragraph hash's occurrences -> (doc key, span) for every occurrence outside the
    owner (the smallest document key), and a tagged ``SHARED`` count when several documents
    have it.

    The owner keeps all its occurrences: repetition inside one document is the quality
    filter's business (its duplicate-paragraph rules), not cross-document dedup's. The group
    is read twice (owner first), streamed both times: a boilerplate paragraph in millions of
    documents costs no memory.
    """
    _, occurrences = item
    owner: DocKey | None = None
    shared = False
    for key, _, _ in occurrences:
        key = tuple(key)  # coders may hand a tuple back as a list
        if owner is None:
            owner = key
        elif key != owner:
            shared = True
            owner = min(owner, key)
    if not shared:
        return
    yield pvalue.TaggedOutput(SHARED, 1)
    for key, start, end in occurrences:
        key = tuple(key)
        if key != owner:
            yield (key, (start, end))


def remove_spans(text: str, spans: Sequence[Span], unit: str) -> str:
    """The text without the spans. Each unit (line or paragraph) owns the text from the start
    of its first line to the start of the next unit's: its indentation, then the separator
    after it. A removed unit goes with all of that, so what is left, indentation and blank
    lines included, reads as it did (code keeps its shape). When the last units go, the last
    kept one ends as the text did (its final newline, if any), not with their separator."""
    units = unit_spans(text, unit)
    removed = set(spans)
    if not units or not removed.intersection(units):
        return text
    starts = [text.rfind("\n", 0, start) + 1 for start, _ in units]
    ends = [*starts[1:], len(text)]
    kept = [i for i, span in enumerate(units) if span not in removed]
    pieces = [text[: starts[0]]]  # blank lines before the first unit
    for i in kept:
        pieces.append(text[starts[i] : ends[i]])
    if kept and kept[-1] != len(units) - 1:  # the text's last units were removed
        last = kept[-1]
        pieces[-1] = text[starts[last] : units[last][1]] + text[units[-1][1] :]
    return "".join(pieces)


def attach_spans(item: tuple[str, dict[str, list[Any]]], config: ExactDedupConfig) -> Iterator[Any]:
    """Join a document with its repeated spans: mark them, or cut them out."""
    _, grouped = item
    spans = sorted({tuple(span) for span in grouped["spans"]})
    for doc in grouped["docs"]:  # one, unless the input repeats a document exactly
        try:
            yield from _attach(doc, spans, config)
        except Exception as err:  # one bad record must never take the pipeline down
            yield _processing_error(doc, err)


def _attach(doc: Document, spans: list[Span], config: ExactDedupConfig) -> Iterator[Any]:
    # Everything is computed before the first yield, so a failure yields nothing but its letter.
    if not spans:
        yield doc
        return
    chars = sum(end - start for start, end in spans)
    metadata = dict(doc["metadata"])
    if not config.remove_duplicate_paragraphs:
        metadata["duplicate_spans"] = [list(span) for span in spans]
        yield {**doc, "metadata": metadata}
        yield pvalue.TaggedOutput(CHARS, chars)
        return
    metadata["removed_duplicate_spans"] = [list(span) for span in spans]
    text = remove_spans(doc["text"], spans, config.paragraph_unit)
    yield pvalue.TaggedOutput(CHARS, chars)
    if not text.strip():
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter(
                "empty_after_paragraph_dedup",
                STAGE,
                doc["id"],
                {**doc, "metadata": metadata},
                f"all {len(spans)} paragraph(s) repeat earlier documents",
            ),
        )
        return
    yield {**doc, "text": text, "metadata": metadata}


def dedup_paragraphs(
    docs: beam.PCollection, config: ExactDedupConfig
) -> tuple[Any, Any, list[Any]]:
    """Documents -> (kept with spans marked or removed, dead letters, manifest totals)."""
    occurrences = docs | "Paragraphs" >> beam.FlatMap(paragraph_occurrences, config).with_outputs(
        ERRORS, main="occurrences"
    )
    spans = (
        occurrences["occurrences"]
        | "GroupByParagraph" >> spill.GroupByKey()
        | "RepeatedSpans" >> beam.FlatMap(repeated_spans).with_outputs(SHARED, main="spans")
    )
    attached = (
        {
            "docs": docs | "KeyByDoc" >> beam.Map(lambda d: (document_key(d), d)),
            "spans": spans["spans"],
        }
        | "JoinSpans" >> spill.CoGroupByKey()
        | "Attach" >> beam.FlatMap(attach_spans, config).with_outputs(DEAD, CHARS, main="kept")
    )
    totals = _paragraph_totals(
        config,
        shared=spans[SHARED],
        span_docs=(
            spans["spans"]
            | "SpanDocKeys" >> beam.Keys()
            | "DistinctDocKeys" >> beam.Distinct()
            | "OneEach" >> beam.Map(lambda _: 1)
        ),
        errors=occurrences[ERRORS],
        chars=attached[CHARS],
    )
    return attached["kept"], attached[DEAD], totals


def _paragraph_totals(
    config: ExactDedupConfig,
    *,
    shared: beam.PCollection,
    span_docs: beam.PCollection,
    errors: beam.PCollection,
    chars: beam.PCollection,
) -> list[Any]:
    """Manifest totals of the paragraph level (for ``extra_totals``): repeated paragraphs,
    documents with spans, documents whose paragraphs could not be scanned, and the characters
    of the spans, removed or only marked: each a sum of partial counts."""
    chars_name = (
        "duplicate_chars_removed"
        if config.remove_duplicate_paragraphs
        else "duplicate_chars_marked"
    )
    return [
        ("duplicate_paragraphs", "sum", shared),
        ("docs_with_duplicate_spans", "sum", span_docs),
        ("paragraph_scan_errors", "sum", errors),
        (chars_name, "sum", chars),
    ]


# --- the stage --------------------------------------------------------------------------------


def build(docs: beam.PCollection, config: ExactDedupConfig) -> StageOutputs:
    kept = docs
    dropped: list[Any] = []
    totals: list[Any] = []
    if config.dedup_documents:
        kept, doc_dropped, doc_totals = dedup_documents(kept)
        dropped.append(doc_dropped)
        totals.extend(doc_totals)
    if config.dedup_paragraphs:
        kept, paragraph_dropped, paragraph_totals = dedup_paragraphs(kept, config)
        dropped.append(paragraph_dropped)
        totals.extend(paragraph_totals)
    pipeline = docs.pipeline
    if not dropped:
        dropped.append(pipeline | "NothingDropped" >> beam.Create([], reshuffle=False))
    return StageOutputs(kept, dropped | "AllDropped" >> beam.Flatten(), _extra(pipeline, totals))


def _extra(pipeline: beam.Pipeline, totals: list[Any]) -> beam.PCollection:
    """The manifest's extra: the levels' totals in one combine (none when both are off)."""
    if not totals:
        return pipeline | "NoExtras" >> beam.Create([], reshuffle=False)
    return extra_totals(pipeline, "Extra", totals)


# --- the shard path: id-sharded inputs, no shuffle of documents -------------------------------
#
# Two reads of each input shard, one worker per shard; only keys, decisions, paragraph
# occurrences and spans move:
# 1. ``KeyShard``: (text hash, (id, content hash, doc key's text hash)) per document ->
#    grouped by text hash -> ``document_decisions``: what happens to each member of a group of
#    several, and the doc keys of the members dropped. The same read scans every document's
#    paragraphs, as one part per paragraph partition; ``shard_parts`` takes the dropped
#    members' occurrences out of the shard's parts (they must neither own a paragraph nor
#    share one) -> ``partition_spans``: each repeated paragraph's spans outside its owner;
# 2. ``AttachShard``: each document with its decision and spans -> the output shard, streamed.

Decision = tuple[str, bool]  # (canonical id, this member is the canonical one)
# The content hash of a record whose id no other record of its shard has (all records of one
# id are in one shard): only ids decide between such records, so their whole record is not
# serialized and hashed (~5% of the stage). Ranks sort as ``document_rank``'s would.
UNIQUE_ID = ""
EXCLUDED = "excluded"  # (shard, doc key) of a document dropped at the document level
PARTS = "parts"  # (shard, (partition, packed part)): see ``PartBuilder``
UNSCANNED = "unscanned"  # (shard, (id, content hash)) of a document whose paragraphs failed
# One occurrence in a packed part: paragraph hash, document (its place in the part's keys),
# start, end (``MAX_OFFSET`` at most: ``paragraph_digests`` refuses longer texts).
_ENTRY = struct.Struct("<16sIII")
Part = tuple[list[DocKey], bytes]


class PartBuilder:
    """One paragraph partition's occurrences from one shard, packed: each document's key
    once, then an ``_ENTRY`` per occurrence. The parts are shuffled twice (to the shard's
    decisions, then to their partition), and a line-level run finds ~560k occurrences on the
    bench corpus: as tuples, coding them cost more than reading the corpus again."""

    __slots__ = ("data", "keys")

    def __init__(self) -> None:
        self.keys: list[DocKey] = []
        self.data = bytearray()

    def add(self, key: DocKey) -> int:
        """A new document's place among the keys."""
        self.keys.append(key)
        return len(self.keys) - 1

    def part(self) -> Part:
        """What travels: (keys, packed entries)."""
        return self.keys, bytes(self.data)


def part_occurrences(part: Part) -> Iterator[tuple[bytes, DocKey, int, int]]:
    """(digest, doc key, start, end) for each occurrence of a packed part."""
    keys = [tuple(key) for key in part[0]]  # coders may hand a tuple back as a list
    for digest, slot, start, end in _ENTRY.iter_unpack(part[1]):
        yield digest, keys[slot], start, end


def paragraph_partitions(num_shards: int) -> int:
    """Paragraph hashes are spread over 16 partitions per output shard (what users size)."""
    return 16 * num_shards


class KeyShard(beam.DoFn):
    """(index, files) -> (text hash, (id, content hash, the ``document_key``'s text hash)) per
    document when documents are deduplicated; tagged reading letters (``INPUT_DEAD``), records
    read (``RECORDS_IN``), processing letters (``DEAD``) and, for each of those, a ``FAILED``
    decision so that the later pass skips the document instead of keeping it too.

    With paragraphs deduplicated, also every hashed document's paragraph occurrences, as one
    packed ``PARTS`` element per paragraph partition, and ``UNSCANNED`` for a document whose
    scan failed. They are scanned before their fate is known: ``shard_parts`` applies it.
    """

    def __init__(self, config: ExactDedupConfig, num_shards: int) -> None:
        self.config = config
        self.num_shards = num_shards
        self.partitions = paragraph_partitions(num_shards)

    def process(self, item: tuple[int, list[str]]) -> Iterator[Any]:
        index, paths = item
        documents = ShardDocuments(STAGE, index, paths, self.num_shards)
        parts: dict[int, PartBuilder] = {}
        for doc, id_shared in _with_shared_ids(documents):
            yield from documents.take_letters()
            key = content = None
            if self.config.dedup_documents:
                try:
                    digest = text_hash(doc["text"])
                    content = document_rank(doc)[1] if id_shared else UNIQUE_ID
                    if self.config.dedup_paragraphs:
                        key = document_key(doc)
                except Exception as err:  # one bad record must never take the pipeline down
                    yield _processing_error(doc, err)
                    yield pvalue.TaggedOutput(FAILED, (index, (doc["id"], None, None)))
                    continue
                rank = (doc["id"], content)
                yield (digest, rank if key is None else (*rank, key[1]))
            if self.config.dedup_paragraphs and not self._scan(doc, key, parts):
                # Counted if the document is kept (``shard_parts``), which it is unmarked.
                yield pvalue.TaggedOutput(UNSCANNED, (index, (doc["id"], content)))
        yield from documents.take_letters()
        yield pvalue.TaggedOutput(RECORDS_IN, documents.records)
        for partition, builder in sorted(parts.items()):
            yield pvalue.TaggedOutput(PARTS, (index, (partition, builder.part())))

    def _scan(self, doc: Document, key: DocKey | None, parts: dict[int, PartBuilder]) -> bool:
        """Add the document's paragraphs to the parts; False if it could not be scanned."""
        try:
            key = key or document_key(doc)
            found = paragraph_digests(doc["text"], self.config)
        except Exception:  # one bad record must never take the pipeline down
            log.exception("paragraph scan failed for %r", doc.get("id"))
            return False
        slots: dict[int, int] = {}  # partition -> this document's place in its keys
        for digest, start, end in found:
            partition = int.from_bytes(digest[:4], "little") % self.partitions
            builder = parts.get(partition)
            if builder is None:
                builder = parts[partition] = PartBuilder()
            slot = slots.get(partition)
            if slot is None:
                slot = slots[partition] = builder.add(key)
            builder.data += _ENTRY.pack(digest, slot, start, end)
        return True


def _with_shared_ids(documents: Iterable[Document]) -> Iterator[tuple[Document, bool]]:
    """Each document, and whether another record of the shard has its id: a shard is read in
    id order, so those are its neighbours (a run of one id is held, never more)."""
    for _, run in itertools.groupby(documents, key=lambda doc: doc["id"]):
        records = list(run)
        for doc in records:
            yield doc, len(records) > 1


def document_decisions(item: tuple[str, Iterable[Any]], num_shards: int) -> Iterator[Any]:
    """One text hash's ranks (id, content hash[, doc key's text hash]) -> (shard, (id,
    content hash, decision)) for every member of a group of several (the smallest rank is
    canonical, as in ``resolve_duplicates``), and a tagged ``GROUPS`` count.

    With the doc keys' text hashes, also the ``EXCLUDED`` doc keys: those of the members
    dropped, less the canonical's (a member differing from it only in metadata has its text,
    so its key).
    """
    _, ranks = item
    members = [tuple(rank) for rank in ranks]
    if len(members) < 2:
        return
    yield pvalue.TaggedOutput(GROUPS, 1)
    canonical = min(members)  # members equal in (id, content) are one record: one doc key
    for member in sorted(set(members)):
        doc_id, content = member[:2]
        decision = (canonical[0], member[:2] == canonical[:2])
        yield (stable_shard(doc_id, num_shards), (doc_id, content, decision))
    if len(canonical) > 2:
        dropped = {(member[0], member[2]) for member in members} - {(canonical[0], canonical[2])}
        for key in sorted(dropped):
            yield pvalue.TaggedOutput(EXCLUDED, (stable_shard(key[0], num_shards), key))


class _DocumentVerdicts:
    """A shard's document-level decisions, applied in reading order: the first copy of the
    canonical record is kept, every other member of its group becomes a letter, and a
    document whose text could not be hashed (already a letter) is skipped."""

    def __init__(self, decisions: Iterable[Any]) -> None:
        self.by_id: dict[str, dict[str | None, Decision | None]] = {}
        for doc_id, content, decision in decisions:
            self.by_id.setdefault(doc_id, {})[content] = (
                None if decision is None else tuple(decision)
            )
        self.kept: set[Rank] = set()

    def verdict(self, doc: Document) -> dict[str, Any] | str:
        """``KEEP``, ``SKIP``, or the dead letter of a document dropped as a duplicate."""
        options = self.by_id.get(doc["id"])
        if options is None:
            return KEEP
        if None in options and _hash_fails(doc):
            return SKIP
        rank = (doc["id"], UNIQUE_ID) if UNIQUE_ID in options else document_rank(doc)
        decision = options.get(rank[1])
        if decision is None:
            return KEEP
        canonical, is_canonical = decision
        if is_canonical and rank not in self.kept:
            self.kept.add(rank)
            return KEEP
        return _duplicate_letter(doc, canonical)

    def dropped(self, rank: Rank) -> bool:
        """Whether the member with this rank is dropped as a copy of another record (an exact
        copy of the kept record has its rank: not dropped here, so the caller counts it once)."""
        decision = self.by_id.get(rank[0], {}).get(rank[1])
        return decision is not None and not decision[1]


# Compared with ==, never `is`: run as __main__, the DoFns are pickled with copies of these.
KEEP, SKIP = "keep", "skip"


def _hash_fails(doc: Document) -> bool:
    """Whether ``KeyShard`` failed on this record (and so made it a letter). Asked only where
    the id has a FAILED member: the record failed itself, or its id is shared and KeyShard
    hashed it whole, as here."""
    try:
        text_hash(doc["text"])
        document_rank(doc)
        document_key(doc)
    except Exception:
        return True
    return False


def shard_parts(item: tuple[int, dict[str, list[Any]]], config: ExactDedupConfig) -> Iterator[Any]:
    """One shard's paragraph parts, decisions and excluded doc keys -> (partition, part) with
    the occurrences of documents dropped at the document level taken out, and a tagged
    ``ERRORS`` count of the kept documents whose paragraphs could not be scanned.

    The occurrences left are those of the kept documents, except that an exact copy of a
    kept record (one key) repeats them: that changes no owner, and spans are sets.
    """
    _, grouped = item
    excluded = {tuple(key) for key in grouped[EXCLUDED]}
    unscanned = [tuple(rank) for rank in grouped[UNSCANNED]]
    if config.dedup_documents:  # a kept record is counted once, as it is scanned once
        verdicts = _DocumentVerdicts(grouped["decisions"])
        unscanned = [rank for rank in set(unscanned) if not verdicts.dropped(rank)]
    if unscanned:
        yield pvalue.TaggedOutput(ERRORS, len(unscanned))
    for partition, (keys, data) in grouped[PARTS]:
        gone = {slot for slot, key in enumerate(keys) if tuple(key) in excluded} if excluded else ()
        if gone:
            data = b"".join(
                _ENTRY.pack(*entry) for entry in _ENTRY.iter_unpack(data) if entry[1] not in gone
            )
        if data:
            yield (partition, (keys, data))


def partition_spans(item: tuple[int, Iterable[Part]], num_shards: int) -> Iterator[Any]:
    """One paragraph partition -> (shard, [(doc key, span), ...]) per output shard: every
    occurrence of a repeated paragraph outside its owner (the smallest document key), as
    ``repeated_spans`` does for one paragraph; a tagged ``SHARED`` count of the partition's
    repeated paragraphs.

    One batch per shard, not one element per span: a line-level run finds ~150k spans on the
    bench corpus, and every element costs each transform it passes (the join, the totals).
    """
    _, parts = item
    by_digest: dict[bytes, list[tuple[DocKey, int, int]]] = {}
    for part in parts:
        for digest, key, start, end in part_occurrences(part):
            by_digest.setdefault(digest, []).append((key, start, end))
    by_shard: dict[int, list[tuple[DocKey, Span]]] = {}
    shared = 0
    while by_digest:  # popped, so that the partition is not held twice (occurrences, spans)
        for out in repeated_spans(by_digest.popitem()):
            if isinstance(out, pvalue.TaggedOutput):
                shared += out.value
            else:
                key, span = out
                by_shard.setdefault(stable_shard(key[0], num_shards), []).append((key, span))
    if shared:
        yield pvalue.TaggedOutput(SHARED, shared)
    yield from sorted(by_shard.items())


class AttachShard(beam.DoFn):
    """(index, {"paths", "decisions", "spans"}) -> the output shard: each document's decision,
    then its repeated spans marked or removed (``_attach``); letters tagged, and the shard's
    ``CHARS`` and ``SPAN_DOCS`` as one sum each."""

    def __init__(self, config: ExactDedupConfig, output: str, num_shards: int) -> None:
        self.config = config
        self.output = output
        self.num_shards = num_shards

    def process(self, item: tuple[int, dict[str, list[Any]]]) -> Iterator[Any]:
        index, grouped = item
        (paths,) = grouped["paths"]
        verdicts = _DocumentVerdicts(grouped["decisions"])
        spans: dict[DocKey, list[Span]] = {}
        for batch in grouped["spans"]:
            for key, span in batch:
                spans.setdefault(tuple(key), []).append(span)
        documents = ShardDocuments(STAGE, index, paths, self.num_shards)
        yield from write_shard(
            self.output, index, self.num_shards, self._attach(documents, verdicts, spans)
        )
        if spans:
            yield pvalue.TaggedOutput(SPAN_DOCS, len(spans))

    def _attach(
        self,
        documents: ShardDocuments,
        verdicts: _DocumentVerdicts,
        spans: dict[DocKey, list[Span]],
    ) -> Iterator[Any]:
        chars = 0
        for doc in documents:
            verdict = verdicts.verdict(doc)
            if verdict == SKIP:
                continue
            if verdict != KEEP:
                yield pvalue.TaggedOutput(DEAD, verdict)
                continue
            mine = spans.get(document_key(doc), []) if spans else []
            for out in attach_spans((doc["id"], {"docs": [doc], "spans": mine}), self.config):
                if isinstance(out, pvalue.TaggedOutput) and out.tag == CHARS:
                    chars += out.value
                else:
                    yield out
        if chars:
            yield pvalue.TaggedOutput(CHARS, chars)


@dataclasses.dataclass(frozen=True)
class ExactDedup:
    """The stage's output strategy: the shard path for id-sharded stage outputs, else the
    harness's path (``build``). Both write the same bytes.

    On Dataflow the paragraph occurrences cross two shuffles (to their shard's decisions, then
    to their partition) where a third read of the corpus would cross one: an occurrence is
    28 bytes and its document's key, against the paragraph's text read and parsed again."""

    def expand(
        self,
        pipeline: beam.Pipeline,
        stage: str,
        config: ExactDedupConfig,
        inputs: list[str],
        output: str,
        num_shards: int,
    ) -> Planned:
        shards = input_shards(pipeline, stage, inputs, num_shards, "documents stay in their shard")
        if shards is None:
            return DocumentShards(build).expand(pipeline, stage, config, inputs, output, num_shards)
        keyed = shards | "KeyShards" >> beam.ParDo(KeyShard(config, num_shards)).with_outputs(
            DEAD, FAILED, INPUT_DEAD, RECORDS_IN, PARTS, UNSCANNED, main="keys"
        )
        totals: list[Any] = []
        decisions = keyed[FAILED]
        excluded = None
        if config.dedup_documents:
            decided = (
                keyed["keys"]
                | "GroupByTextHash" >> spill.GroupByKey()
                | "Decide"
                >> beam.FlatMap(document_decisions, num_shards).with_outputs(
                    GROUPS, EXCLUDED, main="decisions"
                )
            )
            decisions = (decided["decisions"], keyed[FAILED]) | "AllDecisions" >> beam.Flatten()
            excluded = decided[EXCLUDED]
            totals.append(("exact_duplicate_groups", "count", decided[GROUPS]))
        spans = pipeline | "NoSpans" >> beam.Create([], reshuffle=False)
        if config.dedup_paragraphs:
            scanned = (
                {
                    PARTS: keyed[PARTS],
                    UNSCANNED: keyed[UNSCANNED],
                    "decisions": decisions,
                    EXCLUDED: excluded
                    if excluded is not None
                    else pipeline | "NoneExcluded" >> beam.Create([], reshuffle=False),
                }
                | "JoinDecisions" >> spill.CoGroupByKey()
                | "KeptParts"
                >> beam.FlatMap(shard_parts, config).with_outputs(ERRORS, main="parts")
            )
            found = (
                scanned["parts"]
                | "GroupByPartition" >> spill.GroupByKey()
                | "RepeatedSpans"
                >> beam.FlatMap(partition_spans, num_shards).with_outputs(SHARED, main="spans")
            )
            spans = found["spans"]
        attached = (
            {"paths": shards, "decisions": decisions, "spans": spans}
            | "JoinShard" >> spill.CoGroupByKey()
            | "Attach"
            >> beam.ParDo(AttachShard(config, output, num_shards)).with_outputs(
                DEAD, CHARS, SPAN_DOCS, main="shards"
            )
        )
        if config.dedup_paragraphs:
            totals.extend(
                _paragraph_totals(
                    config,
                    shared=found[SHARED],
                    span_docs=attached[SPAN_DOCS],
                    errors=scanned[ERRORS],
                    chars=attached[CHARS],
                )
            )
        return planned_shards(
            keyed[RECORDS_IN],
            [keyed[INPUT_DEAD], keyed[DEAD], attached[DEAD]],
            attached["shards"],
            _extra(pipeline, totals),
        )


def main(argv: Sequence[str] | None = None) -> StageRun:
    return stage_main(STAGE, __doc__ or STAGE, ExactDedupConfig, ExactDedup(), argv)


if __name__ == "__main__":
    run_as_command(main)
