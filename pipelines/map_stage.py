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
from pipelines.documents import Document, dumps
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


class MapShard(beam.DoFn):
    """(shard index, input files) -> output shard ``index``: read, map, stream-write.

    Yields the shard's ``ShardInfo`` dict, the stage's dead letters (``DEAD``), reading and
    parsing letters (``INPUT_DEAD``) and the records read (``RECORDS_IN``), the same records
    and letters as the harness's ``ReadRecords`` and ``ParseDocuments``.
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
        letters: list[pvalue.TaggedOutput] = []
        counts = [0]
        documents = [self._documents(index, path, letters, counts) for path in paths]
        writer = ShardFileWriter(self.output, shard_name("data/part", index, self.num_shards))
        try:
            run_id: str | None = None
            run: list[str] = []  # kept lines of the documents with id ``run_id``
            for doc in heapq.merge(*documents, key=_doc_id):
                yield from letters
                letters.clear()
                if doc["id"] != run_id:
                    for line in sorted(run):
                        writer.write(line)
                    run_id, run = doc["id"], []
                for out in self.inner.process(doc, *sides):
                    if isinstance(out, pvalue.TaggedOutput):
                        yield out
                    elif out["id"] != doc["id"]:
                        raise StageError(
                            f"{self.stage}: a map stage must keep ids ({doc['id']!r} became"
                            f" {out['id']!r})"
                        )
                    else:
                        run.append(dumps(out))
            for line in sorted(run):
                writer.write(line)
            yield from letters
        except BaseException:
            writer.abort()
            raise
        yield pvalue.TaggedOutput(RECORDS_IN, counts[0])
        yield writer.close()

    def _documents(
        self, index: int, path: str, letters: list[pvalue.TaggedOutput], counts: list[int]
    ) -> Iterator[Document]:
        """One input file's valid documents, in id order; its bad records go to ``letters``."""
        previous = ""
        for record in read_source(InputSource("jsonl", path)):
            counts[0] += 1
            if isinstance(record, pvalue.TaggedOutput):
                letters.append(pvalue.TaggedOutput(INPUT_DEAD, record.value))
                continue
            for parsed in parse_record(record, self.stage):
                if isinstance(parsed, pvalue.TaggedOutput):
                    letters.append(pvalue.TaggedOutput(INPUT_DEAD, parsed.value))
                    continue
                doc_id = parsed["id"]
                # Never misplace or misorder a document silently: the input broke its contract.
                if stable_shard(doc_id, self.num_shards) != index:
                    raise StageError(
                        f"{self.stage}: {path} is shard {index} of {self.num_shards} but holds"
                        f" document {doc_id!r} of shard"
                        f" {stable_shard(doc_id, self.num_shards)}"
                    )
                if doc_id < previous:
                    raise StageError(
                        f"{self.stage}: {path} is not sorted by id ({doc_id!r} after"
                        f" {previous!r}); stage outputs always are"
                    )
                previous = doc_id
                yield parsed


def _doc_id(doc: Document) -> str:
    return doc["id"]


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
        groups = id_sharded_inputs(inputs, num_shards)
        if groups is None:
            log.info("%s: inputs are not id-sharded stage outputs: shuffling by id", stage)
            return DocumentShards(self.build).expand(
                pipeline, stage, config, inputs, output, num_shards
            )
        log.info("%s: inputs already sharded by id: one output shard per input shard", stage)
        parts = self.parts(pipeline, config)
        mapped = (
            pipeline
            | "InputShards" >> beam.Create(sorted(groups.items()))
            | "SpreadShards" >> beam.Reshuffle()  # one shard per worker on a distributed runner
            | "MapShards"
            >> beam.ParDo(
                MapShard(parts.dofn, stage, output, num_shards), *parts.side_inputs
            ).with_outputs(DEAD, INPUT_DEAD, RECORDS_IN, main="shards")
        )
        extra = (
            parts.extra(mapped[DEAD])
            if parts.extra is not None
            else pipeline | "NoExtra" >> beam.Create([], reshuffle=False)
        )
        return Planned(
            records_in=mapped[RECORDS_IN] | "RecordsIn" >> beam.CombineGlobally(sum),
            dead=[mapped[INPUT_DEAD], mapped[DEAD]],
            finish=write_document_manifest,
            sides={
                "shards": beam.pvalue.AsList(mapped["shards"]),
                "extra": beam.pvalue.AsList(extra),
            },
        )

    def build(self, docs: beam.PCollection, config: Any) -> StageOutputs:
        """The harness's path: the same ``DoFn`` over a collection of documents."""
        parts = self.parts(docs.pipeline, config)
        mapped = docs | "Map" >> beam.ParDo(parts.dofn, *parts.side_inputs).with_outputs(
            DEAD, main="kept"
        )
        extra = parts.extra(mapped[DEAD]) if parts.extra is not None else None
        return StageOutputs(mapped["kept"], mapped[DEAD], extra)
