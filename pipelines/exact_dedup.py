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

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import apache_beam as beam
import xxhash
from apache_beam import pvalue

from pipelines.beam_io import DEAD
from pipelines.configs import ExactDedupConfig
from pipelines.documents import Document, dead_letter, dumps
from pipelines.stage import StageOutputs, StageRun, stage_main
from pipelines.text import dedup_key_text, line_spans, paragraph_spans

log = logging.getLogger(__name__)

STAGE = "exact_dedup"
CHARS = "chars"
ERRORS = "errors"
GROUPS = "groups"  # a text hash shared by several documents
SHARED = "shared"  # a paragraph hash shared by several documents

Span = tuple[int, int]
# A document's place in the choice of canonical copy: its id, then its content, so that even
# two records with one id resolve the same way on every runner.
Rank = tuple[str, str]
DocKey = tuple[str, str]  # (id, text hash)


def text_hash(text: str) -> str:
    """128-bit hash of text as exact dedup compares it (hex, so it sorts and prints well)."""
    return xxhash.xxh3_128_hexdigest(dedup_key_text(text).encode("utf-8", "surrogatepass"))


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
    twice, the smallest rank first (a GroupByKey's values are re-iterable and streamed, so a
    hash shared by millions of copies is never held in memory).
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
            yield pvalue.TaggedOutput(
                DEAD,
                dead_letter("exact_duplicate", STAGE, doc["id"], doc, duplicate_of=canonical[0]),
            )


def dedup_documents(docs: beam.PCollection) -> tuple[Any, Any, Any]:
    """Documents -> (kept, dead letters, manifest extra)."""
    keyed = docs | "KeyByTextHash" >> beam.FlatMap(key_by_text_hash).with_outputs(
        DEAD, main="keyed"
    )
    resolved = (
        keyed["keyed"]
        | "GroupByTextHash" >> beam.GroupByKey()
        | "Resolve" >> beam.FlatMap(resolve_duplicates).with_outputs(DEAD, GROUPS, main="kept")
    )
    groups = (
        resolved[GROUPS]
        | "CountGroups" >> beam.combiners.Count.Globally()
        | "GroupsExtra" >> beam.Map(lambda n: {"exact_duplicate_groups": n})
    )
    dropped = (keyed[DEAD], resolved[DEAD]) | "DocumentDropped" >> beam.Flatten()
    return resolved["kept"], dropped, groups


# --- paragraph level --------------------------------------------------------------------------


def unit_spans(text: str, unit: str) -> list[Span]:
    return line_spans(text) if unit == "line" else paragraph_spans(text)


def document_key(doc: Document) -> DocKey:
    """Which document a span belongs to: its id, and its text's hash in case ids repeat."""
    return (doc["id"], xxhash.xxh3_64_hexdigest(doc["text"].encode("utf-8", "surrogatepass")))


def paragraph_occurrences(doc: Document, config: ExactDedupConfig) -> Iterator[Any]:
    """(paragraph hash, (doc key, start, end)) for each paragraph worth comparing.

    A document that cannot be scanned keeps its text unmarked (it is still counted, under
    ``paragraph_scan_errors``): dropping it here would lose it from the kept side.
    """
    try:
        found = []
        key = document_key(doc)
        text = doc["text"]
        for start, end in unit_spans(text, config.paragraph_unit):
            normalized = dedup_key_text(text[start:end])
            if normalized and normalized.count(" ") + 1 >= config.min_paragraph_words:
                digest = xxhash.xxh3_128_hexdigest(normalized.encode("utf-8", "surrogatepass"))
                found.append((digest, (key, start, end)))
    except Exception:  # one bad record must never take the pipeline down
        log.exception("paragraph scan failed for %r", doc.get("id"))
        yield pvalue.TaggedOutput(ERRORS, 1)
        return
    yield from found


def repeated_spans(item: tuple[str, Iterable[Any]]) -> Iterator[Any]:
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
    """The text without the spans; the remaining units are re-joined by their separator."""
    removed = set(spans)
    kept = [text[s:e] for s, e in unit_spans(text, unit) if (s, e) not in removed]
    return ("\n" if unit == "line" else "\n\n").join(kept)


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


def dedup_paragraphs(docs: beam.PCollection, config: ExactDedupConfig) -> tuple[Any, Any, Any]:
    """Documents -> (kept with spans marked or removed, dead letters, manifest extras)."""
    occurrences = docs | "Paragraphs" >> beam.FlatMap(paragraph_occurrences, config).with_outputs(
        ERRORS, main="occurrences"
    )
    spans = (
        occurrences["occurrences"]
        | "GroupByParagraph" >> beam.GroupByKey()
        | "RepeatedSpans" >> beam.FlatMap(repeated_spans).with_outputs(SHARED, main="spans")
    )
    attached = (
        {
            "docs": docs | "KeyByDoc" >> beam.Map(lambda d: (document_key(d), d)),
            "spans": spans["spans"],
        }
        | "JoinSpans" >> beam.CoGroupByKey()
        | "Attach" >> beam.FlatMap(attach_spans, config).with_outputs(DEAD, CHARS, main="kept")
    )
    shared = (
        spans[SHARED]
        | "CountShared" >> beam.combiners.Count.Globally()
        | "SharedExtra" >> beam.Map(lambda n: {"duplicate_paragraphs": n})
    )
    chars_key = (
        "duplicate_chars_removed"
        if config.remove_duplicate_paragraphs
        else ("duplicate_chars_marked")
    )
    chars = (
        attached[CHARS]
        | "SumChars" >> beam.CombineGlobally(sum)
        | "CharsExtra" >> beam.Map(lambda n: {chars_key: n})
    )
    marked_docs = (
        spans["spans"]
        | "SpanDocIds" >> beam.Keys()
        | "DistinctDocIds" >> beam.Distinct()
        | "CountMarkedDocs" >> beam.combiners.Count.Globally()
        | "MarkedDocsExtra" >> beam.Map(lambda n: {"docs_with_duplicate_spans": n})
    )
    errors = (
        occurrences[ERRORS]
        | "CountScanErrors" >> beam.combiners.Count.Globally()
        | "ScanErrorsExtra" >> beam.Map(lambda n: {"paragraph_scan_errors": n})
    )
    extra = (shared, chars, marked_docs, errors) | "ParagraphExtra" >> beam.Flatten()
    return attached["kept"], attached[DEAD], extra


# --- the stage --------------------------------------------------------------------------------


def build(docs: beam.PCollection, config: ExactDedupConfig) -> StageOutputs:
    kept = docs
    dropped: list[Any] = []
    extras: list[Any] = []
    if config.dedup_documents:
        kept, doc_dropped, doc_extra = dedup_documents(kept)
        dropped.append(doc_dropped)
        extras.append(doc_extra)
    if config.dedup_paragraphs:
        kept, paragraph_dropped, paragraph_extra = dedup_paragraphs(kept, config)
        dropped.append(paragraph_dropped)
        extras.append(paragraph_extra)
    pipeline = docs.pipeline
    if not dropped:
        dropped.append(pipeline | "NothingDropped" >> beam.Create([], reshuffle=False))
    if not extras:
        extras.append(pipeline | "NoExtras" >> beam.Create([], reshuffle=False))
    return StageOutputs(
        kept,
        dropped | "AllDropped" >> beam.Flatten(),
        extras | "AllExtras" >> beam.Flatten(),
    )


def main(argv: Sequence[str] | None = None) -> StageRun:
    return stage_main(STAGE, __doc__ or STAGE, ExactDedupConfig, build, argv)


if __name__ == "__main__":
    main()
