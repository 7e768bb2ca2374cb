"""Map stages: document stages that keep, change or drop each document on its own.

Quality and decontamination look at one document at a time. When their inputs are documents
stage outputs already sharded by id into the stage's own shard count
(``beam_io.id_sharded_inputs``), output shard ``k`` holds exactly the kept documents of input
shard ``k``, so nothing needs to move between workers. :class:`MapDocuments` then runs one
element per shard: one worker reads shard ``k`` of every input, merges them by id (each is
sorted by id), applies the stage's per-document ``DoFn`` and streams output shard ``k``
(``beam_io.ShardFileWriter``). Its memory is a document at a time, not a collection, however
large the corpus; only dead letters travel through the runner.

Other inputs (files, globs, another shard count) take the harness's path, ``DocumentShards``:
read, the same ``DoFn`` as a ``ParDo``, a shuffle into shards. Both paths write byte-identical
shards, dead letters and manifests.

The pieces of a shard path are shared with the stages that need more than one pass over a
shard (exact and fuzzy dedup, train_tokenizer): ``input_shards`` (the shards, or None for the
harness's path), ``ShardDocuments`` (a shard's documents, merged and checked),
``write_shard`` (an output shard, streamed) and ``planned_shards`` (what the harness needs).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.typehints.decorators import no_annotations

from pipelines.beam_io import (
    DEAD,
    InputSource,
    ShardFileWriter,
    id_sharded_inputs,
    parse_record,
    read_source,
    shard_name,
    stable_shard,
)
from pipelines.documents import Document
from pipelines.stage import (
    DocumentShards,
    Planned,
    StageError,
    StageOutputs,
    write_document_manifest,
)

log = logging.getLogger(__name__)

INPUT_DEAD = "input_dead"  # unreadable or invalid input records, apart from the stage's letters
RECORDS_IN = "records_in"


@dataclasses.dataclass(frozen=True)
class MapParts:
    """What a map stage adds to its pipeline.

    ``dofn.process(doc, *side_values)`` yields the kept document (same id) and/or tagged
    ``DEAD`` letters; ``extra(letters)`` turns the stage's own dead letters into manifest
    extras (a PCollection of dicts), or is None.
    """

    dofn: beam.DoFn
    side_inputs: Sequence[Any] = ()
    extra: Callable[[beam.PCollection], beam.PCollection] | None = None


class ShardDocuments:
    """The valid documents of input shard ``index`` (its file in every input), merged in id
    order, each checked against the id-sharding contract.

    Reading and parsing make the same records and letters as the harness's ``ReadRecords``
    and ``ParseDocuments``: ``records`` counts what was read, ``take_letters`` hands over the
    letters of bad records (tagged ``INPUT_DEAD``) found so far.
    """

    def __init__(self, stage: str, index: int, paths: Sequence[str], num_shards: int) -> None:
        self.stage = stage
        self.index = index
        self.paths = paths
        self.num_shards = num_shards
        self.records = 0
        self._letters: list[pvalue.TaggedOutput] = []

    def __iter__(self) -> Iterator[Document]:
        return heapq.merge(*(self._file(path) for path in self.paths), key=_doc_id)

    def take_letters(self) -> list[pvalue.TaggedOutput]:
        letters, self._letters = self._letters, []
        return letters

    def _file(self, path: str) -> Iterator[Document]:
        previous = ""
        for record in read_source(InputSource("jsonl", path)):
            self.records += 1
            if isinstance(record, pvalue.TaggedOutput):
                self._letters.append(pvalue.TaggedOutput(INPUT_DEAD, record.value))
                continue
            for parsed in parse_record(record, self.stage):
                if isinstance(parsed, pvalue.TaggedOutput):
                    self._letters.append(pvalue.TaggedOutput(INPUT_DEAD, parsed.value))
                    continue
                doc_id = parsed["id"]
                # Never misplace or misorder a document silently: the input broke its contract.
                shard = stable_shard(doc_id, self.num_shards)
                if shard != self.index:
                    raise StageError(
                        f"{self.stage}: {path} is shard {self.index} of {self.num_shards} but"
                        f" holds document {doc_id!r} of shard {shard}"
                    )
                if doc_id < previous:
                    raise StageError(
                        f"{self.stage}: {path} is not sorted by id ({doc_id!r} after"
                        f" {previous!r}); stage outputs always are"
                    )
                previous = doc_id
                yield parsed


def input_shards(
    pipeline: beam.Pipeline, stage: str, inputs: list[str], num_shards: int, note: str
) -> beam.PCollection | None:
    """(index, files) per input shard when the inputs are id-sharded stage outputs with
    ``num_shards`` shards, one per worker on a distributed runner; None when they are not
    (the stage then takes the harness's path). Logs which path it is."""
    groups = id_sharded_inputs(inputs, num_shards)
    if groups is None:
        log.info("%s: inputs are not id-sharded stage outputs: shuffling by id", stage)
        return None
    log.info("%s: inputs already sharded by id: %s", stage, note)
    return (
        pipeline
        | "InputShards" >> beam.Create(sorted(groups.items()))
        | "SpreadShards" >> beam.Reshuffle()
    )


def planned_shards(
    records_in: beam.PCollection,
    dead: Sequence[beam.PCollection],
    shards: beam.PCollection,
    extra: beam.PCollection,
) -> Planned:
    """What a shard path hands the harness: per-shard record counts, every dead letter, the
    written shards' ``ShardInfo`` dicts and the manifest extras."""
    return Planned(
        records_in=records_in | "RecordsIn" >> beam.CombineGlobally(sum),
        dead=dead,
        finish=write_document_manifest,
        sides={"shards": beam.pvalue.AsList(shards), "extra": beam.pvalue.AsList(extra)},
    )


def _doc_id(doc: Document) -> str:
    return doc["id"]


class MapShard(beam.DoFn):
    """(shard index, input files) -> output shard ``index``: read, map, stream-write.

    Yields the shard's ``ShardInfo`` dict, the stage's dead letters (``DEAD``), reading and
    parsing letters (``INPUT_DEAD``) and the records read (``RECORDS_IN``).
    """

    def __init__(self, inner: beam.DoFn, stage: str, output: str, num_shards: int) -> None:
        self.inner = inner
        self.stage = stage
        self.output = output
        self.num_shards = num_shards

    def setup(self) -> None:
        self.inner.setup()

    def teardown(self) -> None:
        self.inner.teardown()

    @no_annotations  # Beam would read ``*sides: Any`` as a tuple-typed side input
    def process(self, item: tuple[int, list[str]], *sides: Any) -> Iterator[Any]:
        index, paths = item
        documents = ShardDocuments(self.stage, index, paths, self.num_shards)
        yield from write_shard(self.output, index, self.num_shards, self._map(documents, sides))
        yield pvalue.TaggedOutput(RECORDS_IN, documents.records)

    def _map(self, documents: ShardDocuments, sides: Sequence[Any]) -> Iterator[Any]:
        for doc in documents:
            yield from documents.take_letters()
            for out in self.inner.process(doc, *sides):
                if not isinstance(out, pvalue.TaggedOutput) and out["id"] != doc["id"]:
                    raise StageError(
                        f"{self.stage}: a map stage must keep ids ({doc['id']!r} became"
                        f" {out['id']!r})"
                    )
                yield out
        yield from documents.take_letters()


def write_shard(output: str, index: int, num_shards: int, outputs: Iterator[Any]) -> Iterator[Any]:
    """A shard path's outputs -> documents streamed into output shard ``index`` (they come in
    id order), tagged outputs passed on, then the shard's ``ShardInfo`` dict. A failure leaves
    no shard behind."""
    writer = ShardFileWriter(output, shard_name("data/part", index, num_shards))
    try:
        for out in outputs:
            if isinstance(out, pvalue.TaggedOutput):
                yield out
            else:
                writer.add_document(out)
    except BaseException:
        writer.abort()
        raise
    yield writer.close()


@dataclasses.dataclass(frozen=True)
class MapDocuments:
    """The output strategy of a map stage: ``parts(pipeline, config)`` says what it adds."""

    parts: Callable[[beam.Pipeline, Any], MapParts]

    def expand(
        self,
        pipeline: beam.Pipeline,
        stage: str,
        config: Any,
        inputs: list[str],
        output: str,
        num_shards: int,
    ) -> Planned:
        shards = input_shards(
            pipeline, stage, inputs, num_shards, "one output shard per input shard"
        )
        if shards is None:
            return DocumentShards(self.build).expand(
                pipeline, stage, config, inputs, output, num_shards
            )
        parts = self.parts(pipeline, config)
        mapped = shards | "MapShards" >> beam.ParDo(
            MapShard(parts.dofn, stage, output, num_shards), *parts.side_inputs
        ).with_outputs(DEAD, INPUT_DEAD, RECORDS_IN, main="shards")
        extra = (
            parts.extra(mapped[DEAD])
            if parts.extra is not None
            else pipeline | "NoExtra" >> beam.Create([], reshuffle=False)
        )
        return planned_shards(
            mapped[RECORDS_IN], [mapped[INPUT_DEAD], mapped[DEAD]], mapped["shards"], extra
        )

    def build(self, docs: beam.PCollection, config: Any) -> StageOutputs:
        """The harness's path: the same ``DoFn`` over a collection of documents."""
        parts = self.parts(docs.pipeline, config)
        mapped = docs | "Map" >> beam.ParDo(parts.dofn, *parts.side_inputs).with_outputs(
            DEAD, main="kept"
        )
        extra = parts.extra(mapped[DEAD]) if parts.extra is not None else None
        return StageOutputs(mapped["kept"], mapped[DEAD], extra)
