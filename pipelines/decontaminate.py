"""Stage 4, decontamination: drop training documents that share long n-grams with eval sets.

A document is contaminated by an evaluation set when it shares at least ``min_overlap``
distinct word n-grams (``ngram`` = 13 by default, over ``pipelines.text.words``: lowercase,
punctuation ignored) with that set's texts. It is dropped with reason ``contamination``; the
dead letter names the matching eval set(s), the number of shared n-grams per set, and one
shared n-gram as an example. The manifest counts contaminated documents per eval set.

Eval sets are document JSONL(.gz) files, globs or stage outputs; a record's ``source`` names
its set (``data/eval/hellaswag.jsonl.gz`` holds documents with source ``hellaswag``). Eval
texts are normalized as ingest normalizes the corpus (``pipelines.text.normalize_text``) before
they are split into words.

Eval texts shorter than ``ngram`` words (a PIQA goal, an ARC question) would otherwise never
match anything: one with at least ``min_short_words`` words is used whole, as a single n-gram
of its own length, so a document containing it verbatim is contaminated. Shorter texts are
too generic to be evidence of leakage ("What is the capital of France?") and are skipped;
the manifest counts them.

The eval side is small (thousands of texts, a few million 64-bit hashes: megabytes) and the
corpus side huge, so the eval n-gram hashes are built in the pipeline and broadcast to every
worker as a side input of sorted ``uint64`` arrays; each document is checked locally with a
binary search, after a bitmap of the table's hashes (``HashPrefilter``) has ruled out all but a
few percent of its n-grams. A shuffle join would move every n-gram of the corpus (about one
record per word) across the network to save broadcasting a few megabytes.

    python -m pipelines.decontaminate --input out/exact_dedup --output out/decontaminate \\
        --eval_set 'data/eval/*.jsonl.gz' [--config '{"ngram": 13, "min_overlap": 1}']
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam import pvalue

from pipelines.beam_io import DEAD, RECORDS, ReadRecords
from pipelines.configs import DecontaminateConfig
from pipelines.documents import Document, InvalidRecord, dead_letter, validate_document
from pipelines.map_stage import MapDocuments, MapParts
from pipelines.stage import StageError, StageRun, run_as_command, stage_main
from pipelines.text import (
    ngram_hashes,
    ngram_hashes_by_length,
    normalize_text,
    sorted_unique,
    token_hashes,
    words,
)

STAGE = "decontaminate"
STATS = "stats"
INVALID = "invalid"

# ((eval set, n-gram length), sorted unique uint64 hashes)
EvalIndex = Mapping[tuple[str, int], np.ndarray]


# --- the eval side ----------------------------------------------------------------------------


def eval_set_name(doc: Document) -> str:
    return doc["source"] or "unknown"


def eval_ngrams(item: tuple[str, Any], config: DecontaminateConfig) -> Iterator[Any]:
    """One eval record -> ((set, n), its distinct n-gram hashes as a ``uint64`` array), plus
    per-set stats. One element per record, not per n-gram: a runner's cost is per element."""
    _, obj = item
    try:
        doc = validate_document(obj)
    except InvalidRecord:
        yield pvalue.TaggedOutput(INVALID, 1)
        return
    name = eval_set_name(doc)
    # Corpus documents went through ingest's normalize_text (NFC, zero-width and control
    # characters removed); an eval text must too, or its "café" in NFD never matches theirs.
    tokens = words(normalize_text(doc["text"]))
    if len(tokens) >= config.ngram:
        n = config.ngram
    elif len(tokens) >= config.min_short_words:
        n = len(tokens)  # the whole short text is one n-gram
    else:
        yield pvalue.TaggedOutput(STATS, (name, (1, 1)))
        return
    yield pvalue.TaggedOutput(STATS, (name, (1, 0)))
    yield ((name, n), ngram_hashes(token_hashes(tokens), n))  # made unique by UnionHashes


class UnionHashes(beam.CombineFn):
    """Arrays of hashes -> their sorted union (``uint64``). Accumulators are lists of arrays,
    so adding is O(1) and the sort happens once per key."""

    def create_accumulator(self) -> list[np.ndarray]:
        return []

    def add_input(self, acc: list[np.ndarray], hashes: np.ndarray) -> list[np.ndarray]:
        acc.append(hashes)
        return acc

    def merge_accumulators(self, accumulators: Iterable[list[np.ndarray]]) -> list[np.ndarray]:
        return [array for acc in accumulators for array in acc]

    def compact(self, acc: list[np.ndarray]) -> list[np.ndarray]:
        return [self.extract_output(acc)] if len(acc) > 1 else acc

    def extract_output(self, acc: list[np.ndarray]) -> np.ndarray:
        if not acc:
            return np.zeros(0, dtype=np.uint64)
        return sorted_unique(np.concatenate(acc))


def build_index(eval_docs: Iterable[Document], config: DecontaminateConfig) -> EvalIndex:
    """The eval index the pipeline broadcasts, built in plain Python (tests, tools)."""
    grouped: dict[tuple[str, int], list[np.ndarray]] = {}
    for doc in eval_docs:
        for out in eval_ngrams(("", doc), config):
            if not isinstance(out, pvalue.TaggedOutput):
                key, hashes = out
                grouped.setdefault(key, []).append(hashes)
    union = UnionHashes()
    return {key: union.extract_output(arrays) for key, arrays in sorted(grouped.items())}


def _add_pairs(pairs: Iterable[tuple[int, int]]) -> tuple[int, int]:
    texts = skipped = 0
    for t, s in pairs:
        texts += t
        skipped += s
    return (texts, skipped)


# --- the document side ------------------------------------------------------------------------


# A binary search of a table of millions of hashes is ~22 steps, most of them cache misses:
# 2.4 s of the demo's 11 s stage for one table of 3.0M 13-gram hashes. Tables this large get a
# bitmap that rules out most n-grams with one lookup each first (0.25 s there).
PREFILTER_MIN_HASHES = 4096
# 32-64 bits per hash once rounded up to a power of two: 1.5-3% of absent n-grams pass, more
# for tables past 4M hashes, where the bitmap stops growing
PREFILTER_BITS_PER_HASH = 32
PREFILTER_MAX_BITS = 27  # a 16 MiB bitmap at most, per n-gram length
PREFILTER_BUILD_CHUNK = 1 << 18  # hashes set at a time: temporaries of a few MiB, not the table's


class HashPrefilter:
    """Which of some uint64 hashes may be in a table: a bitmap over the top ``bits``
    bits of the table's hashes. Never wrong for a hash in the table; a hash not in it passes
    with probability about (table size / 2**bits). The hashes are uniform 64-bit values
    (``pipelines.text.ngram_hashes``), so their top bits are too."""

    def __init__(self, table: np.ndarray) -> None:
        wanted = max(len(table), 1) * PREFILTER_BITS_PER_HASH
        self.bits = min(PREFILTER_MAX_BITS, int(wanted - 1).bit_length())  # >= 5: whole bytes
        self.shift = np.uint64(64 - self.bits)
        self.bitmap = np.zeros(1 << (self.bits - 3), dtype=np.uint8)
        for start in range(0, len(table), PREFILTER_BUILD_CHUNK):
            slots = table[start : start + PREFILTER_BUILD_CHUNK] >> self.shift
            bit = np.left_shift(np.uint8(1), (slots & np.uint64(7)).astype(np.uint8))
            np.bitwise_or.at(self.bitmap, (slots >> np.uint64(3)).astype(np.intp), bit)

    def maybe(self, hashes: np.ndarray) -> np.ndarray:
        """bool [len(hashes)]: False where the hash is certainly not in the table."""
        slots = hashes >> self.shift
        byte = self.bitmap[(slots >> np.uint64(3)).astype(np.intp)]
        return ((byte >> (slots & np.uint64(7)).astype(np.uint8)) & np.uint8(1)).view(bool)


class EvalLookup:
    """The eval index arranged for lookups: per n-gram length, the union of every set's
    hashes (sorted) and which sets hold each one (bits, one per set), so a document needs one
    binary search per length however many eval sets there are; large tables are searched
    only for the n-grams their ``HashPrefilter`` lets through."""

    def __init__(self, index: EvalIndex) -> None:
        self.names = tuple(sorted({name for name, _ in index}))
        column = {name: i for i, name in enumerate(self.names)}
        self.tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> (hashes, owner bits)
        for n in sorted({n for _, n in index}):
            parts = [(column[name], t) for (name, size), t in index.items() if size == n]
            parts = [(c, t) for c, t in parts if len(t)]
            if not parts:
                continue
            union = sorted_unique(np.concatenate([t for _, t in parts]))
            owners = np.zeros((len(union), len(self.names)), dtype=bool)
            for c, table in parts:
                owners[np.searchsorted(union, table), c] = True
            self.tables[n] = (union, np.packbits(owners, axis=1))
        self.prefilters = {
            n: HashPrefilter(union)
            for n, (union, _) in self.tables.items()
            if len(union) >= PREFILTER_MIN_HASHES
        }
        self.lengths = sorted(self.tables)

    def matches(self, text: str, min_overlap: int) -> tuple[dict[str, int], str | None]:
        """Eval sets sharing >= min_overlap distinct n-grams with ``text`` ({set: count}),
        and an example shared n-gram (the earliest in the text), or ``({}, None)``."""
        tokens = words(text)
        if not tokens:
            return {}, None
        hashes = token_hashes(tokens)
        counts = np.zeros(len(self.names), dtype=np.int64)
        example: tuple[int, int] | None = None  # (position, n) of the earliest match
        for n, grams in ngram_hashes_by_length(hashes, self.lengths):
            table, owner_bits = self.tables[n]
            positions: np.ndarray | None = None  # of the searched n-grams in the text
            if n in self.prefilters:
                positions = np.flatnonzero(self.prefilters[n].maybe(grams))
                grams = grams[positions]
            slots = np.minimum(np.searchsorted(table, grams), len(table) - 1)
            hit = table[slots] == grams
            if not hit.any():
                continue
            distinct = sorted_unique(slots[hit])  # one slot per distinct shared n-gram
            owners = np.unpackbits(owner_bits[distinct], axis=1, count=len(self.names))
            counts += owners.sum(axis=0, dtype=np.int64)
            first = int(np.argmax(hit)) if positions is None else int(positions[np.argmax(hit)])
            if example is None or (first, n) < example:
                example = (first, n)
        matched = {
            name: int(c)
            for name, c in zip(self.names, counts, strict=True)
            if c and c >= min_overlap
        }
        if not matched or example is None:
            return {}, None
        position, n = example
        return matched, " ".join(tokens[position : position + n])


def find_matches(
    text: str, index: EvalIndex, min_overlap: int
) -> tuple[dict[str, int], str | None]:
    """:meth:`EvalLookup.matches` of ``text`` against ``index`` (tests, tools)."""
    return EvalLookup(index).matches(text, min_overlap)


class CheckDocuments(beam.DoFn):
    """Kept documents, and dead letters for contaminated ones; the lookup is built once per
    worker from the broadcast index, not per document."""

    def __init__(self, config: DecontaminateConfig) -> None:
        self.config = config
        self._index: EvalIndex | None = None
        self._lookup: EvalLookup | None = None

    def process(self, doc: Document, index: EvalIndex) -> Iterator[Any]:
        if self._lookup is None or index is not self._index:
            self._index, self._lookup = index, EvalLookup(index)
        yield from check_document(doc, self._lookup, self.config)


def check_document(doc: Document, lookup: EvalLookup, config: DecontaminateConfig) -> Iterator[Any]:
    try:
        matched, example = lookup.matches(doc["text"], config.min_overlap)
    except Exception as err:  # one bad record must never take the pipeline down
        origin = str(doc.get("id", "")) if isinstance(doc, dict) else ""
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter("processing_error", STAGE, origin, doc, f"{type(err).__name__}: {err}"),
        )
        return
    if not matched:
        yield doc
        return
    yield pvalue.TaggedOutput(
        DEAD,
        dead_letter(
            "contamination",
            STAGE,
            doc["id"],
            doc,
            f"shares {config.ngram}-grams with {', '.join(matched)}",
            eval_sets=sorted(matched),
            matching_ngrams=matched,
            example_ngram=example,
        ),
    )


# --- the stage --------------------------------------------------------------------------------


def _extra(
    _: Any,
    contaminated: Mapping[str, int],
    stats: Mapping[str, tuple[int, int]],
    index: EvalIndex,
    invalid: int,
) -> dict[str, Any]:
    ngrams: dict[str, int] = {}
    for (name, _n), table in index.items():
        ngrams[name] = ngrams.get(name, 0) + len(table)
    names = sorted(set(stats) | set(contaminated))
    return {
        "contamination_by_eval_set": {name: contaminated.get(name, 0) for name in names},
        "eval_sets": {
            name: {
                "texts": stats.get(name, (0, 0))[0],
                "short_texts_skipped": stats.get(name, (0, 0))[1],
                "ngrams": ngrams.get(name, 0),
            }
            for name in names
        },
        "eval_records_invalid": invalid,
    }


def parts(pipeline: beam.Pipeline, config: DecontaminateConfig) -> MapParts:
    """The eval index (built in the pipeline, broadcast) and the per-document check."""
    if not config.eval_sets:
        raise StageError(f"{STAGE}: at least one eval set is required (--eval_set PATH)")
    read = pipeline | "ReadEvalSets" >> ReadRecords(list(config.eval_sets))
    grams = read[RECORDS] | "EvalNgrams" >> beam.FlatMap(eval_ngrams, config).with_outputs(
        STATS, INVALID, main="grams"
    )
    index = grams["grams"] | "UnionEvalNgrams" >> beam.CombinePerKey(UnionHashes())
    stats = grams[STATS] | "EvalStats" >> beam.CombinePerKey(_add_pairs)
    invalid = (
        (grams[INVALID], read[DEAD] | "UnreadableEval" >> beam.Map(lambda _: 1))
        | "AllInvalidEval" >> beam.Flatten()
        | "CountInvalidEval" >> beam.CombineGlobally(sum)
    )

    def extra(letters: beam.PCollection) -> beam.PCollection:
        contaminated = (
            letters
            | "MatchedSets" >> beam.FlatMap(lambda letter: letter.get("eval_sets", []))
            | "CountPerSet" >> beam.combiners.Count.PerElement()
        )
        return (
            pipeline
            | "ExtraOnce" >> beam.Create([None])
            | "Extra"
            >> beam.Map(
                _extra,
                beam.pvalue.AsDict(contaminated),
                beam.pvalue.AsDict(stats),
                beam.pvalue.AsDict(index),
                beam.pvalue.AsSingleton(invalid),
            )
        )

    return MapParts(CheckDocuments(config), [beam.pvalue.AsDict(index)], extra)


build = MapDocuments(parts).build  # the harness's path, for callers that hold a collection


def _add_eval_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--eval_set",
        action="append",
        default=[],
        help="eval set documents: JSONL(.gz) file, glob or stage output; repeatable",
    )


def _apply_eval_set(config: DecontaminateConfig, args: argparse.Namespace) -> DecontaminateConfig:
    return dataclasses.replace(config, eval_sets=(*config.eval_sets, *args.eval_set))


def main(argv: Sequence[str] | None = None) -> StageRun:
    """The shared stage CLI plus ``--eval_set`` (repeatable), appended to ``eval_sets``."""
    return stage_main(
        STAGE,
        __doc__ or STAGE,
        DecontaminateConfig,
        MapDocuments(parts),
        argv,
        add_arguments=_add_eval_set,
        apply_arguments=_apply_eval_set,
    )


if __name__ == "__main__":
    run_as_command(main)
