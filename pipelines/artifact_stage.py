"""The artifact output strategy of the one harness (:mod:`pipelines.stage`): a tokenizer model,
a token store.

Same contract as every stage: read inputs, turn every record that is not used into a counted
dead letter, and prove in a manifest that nothing was lost (the harness does those). What
differs is the output: not document shards (copying the corpus would be waste) but files that
the stage's workers write (``parts``) and that one final, single-element step assembles
(``finalize``: train the tokenizer, write the token store's ledger). A single-element step is
how "run once after everything else" is expressed on any runner, Dataflow included.

The manifest is a ``pipelines.manifest.Manifest`` (so ``read_manifest`` and the lineage's
``describe_documents`` read it like any other stage's), with ``format`` ``slipway-artifact/v1``:
its ``shards`` list the artifact's files or directories (each with the records it accounts
for, its bytes and a sha256) instead of JSONL documents, and ``extra`` describes the artifact
(``extra.kind``: "tokenizer" | "token-store"). What ``records_out`` means is the stage's to say;
see each stage's docstring. ``records_in == records_out + sum(dropped)`` is checked before the
artifact is finalized, and again (with the shard counts) before the manifest is written.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
import fsspec

from pipelines import storage
from pipelines.beam_io import DEAD, RECORDS, ParseDocuments, ReadRecords
from pipelines.manifest import AccountingError, Manifest, ShardInfo
from pipelines.stage import (
    DEFAULT_SHARDS,
    Planned,
    StageRun,
    run_pipeline,
    stage_main,
)

log = logging.getLogger(__name__)

FORMAT = "slipway-artifact/v1"


@dataclass(frozen=True)
class Accounting:
    """The counts the final step sees; checked before any artifact is finalized."""

    records_in: int
    records_out: int
    dropped: dict[str, int]

    def check(self, stage: str) -> None:
        lost = self.records_in - self.records_out - sum(self.dropped.values())
        if lost:
            raise AccountingError(
                f"stage {stage!r}: {self.records_in} records in, but {self.records_out} out"
                f" + {sum(self.dropped.values())} dropped {self.dropped}"
            )


def file_info(relative: str, data: bytes, records: int) -> ShardInfo:
    return ShardInfo(relative, records, len(data), storage.sha256_hex(data))


def tree_info(output: str, relative: str, records: int) -> ShardInfo:
    """A directory as one manifest shard: total bytes, sha256 over (path, sha256) of its files.

    Files are read back after writing: cheap locally (page cache); on an object store it is one
    read per chunk, the price of a content hash that names the bytes actually stored.
    """
    fs, base = fsspec.core.url_to_fs(storage.join(output, relative))
    base = base.rstrip("/")
    digest = hashlib.sha256()
    size = 0
    for path in sorted(fs.find(base)):
        data = fs.cat_file(path)
        size += len(data)
        digest.update(f"{path[len(base) + 1 :]}\0{storage.sha256_hex(data)}\n".encode())
    return ShardInfo(relative, records, size, digest.hexdigest())


@dataclass(frozen=True)
class ArtifactResult:
    """What ``finalize`` returns: the manifest's shards and its ``extra`` description."""

    shards: list[ShardInfo]
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ArtifactTarget:
    """Where the stage's workers write, handed to ``build``."""

    output: str
    num_shards: int


# finalize(output, parts, accounting) -> the manifest's shards and extra. Runs once, last.
Finalize = Callable[[str, list[Any], Accounting], ArtifactResult]


@dataclass
class ArtifactOutputs:
    """What an artifact stage's ``build`` returns."""

    records_out: beam.PCollection  # ints whose sum is the stage's records_out
    dropped: beam.PCollection  # dead letters
    parts: beam.PCollection  # what the workers wrote; handed to ``finalize`` as a list
    finalize: Finalize
    # Only from a ``read_build``, which reads the inputs itself: ints summing to records_in.
    records_in: beam.PCollection | None = None


# build(documents, config, target): the harness has read and parsed the inputs.
ArtifactBuild = Callable[[beam.PCollection, Any, ArtifactTarget], ArtifactOutputs]
# read_build(pipeline, inputs, config, target): a stage that can do better than the harness's
# read -> parse -> (its own shuffle) reads the inputs itself, counting records_in and turning
# unreadable or invalid records into dead letters exactly as the harness would; it returns
# None when it cannot (the harness then reads as usual).
ArtifactReadBuild = Callable[
    [beam.Pipeline, list[str], Any, ArtifactTarget], ArtifactOutputs | None
]


def _finish(
    _: Any,
    *,
    finalize: Finalize,
    output: str,
    stage: str,
    kind: str,
    config: Mapping[str, Any],
    inputs: list[str],
    records_in: int,
    records_out: int,
    reasons: Mapping[str, int],
    dead_shards: list[dict[str, Any]],
    parts: list[Any],
) -> None:
    accounting = Accounting(records_in, records_out, dict(sorted(reasons.items())))
    # Refuse to publish an artifact built from an unaccounted-for corpus.
    accounting.check(stage)
    result = finalize(output, parts, accounting)
    Manifest(
        stage=stage,
        config=dict(config),
        inputs=list(inputs),
        records_in=records_in,
        records_out=records_out,
        dropped=accounting.dropped,
        shards=sorted(result.shards, key=lambda s: s.path),
        dead_letter_shards=sorted((ShardInfo(**s) for s in dead_shards), key=lambda s: s.path),
        extra={"kind": kind, **result.extra},
        format=FORMAT,
    ).write(output)


def _total(pcoll: beam.PCollection, label: str) -> beam.PCollection:
    return pcoll | label >> beam.CombineGlobally(sum)


@dataclass(frozen=True)
class FinalizedArtifact:
    """The artifact stages' output strategy: parts written by the workers, finalized once.

    With ``read_build``, the stage is first offered the inputs to read itself; ``build`` runs
    on the harness's parsed documents when it declines.
    """

    kind: str  # the manifest's extra.kind: "tokenizer" | "token-store"
    build: ArtifactBuild
    read_build: ArtifactReadBuild | None = None

    def expand(
        self,
        pipeline: beam.Pipeline,
        stage: str,
        config: Any,
        inputs: list[str],
        output: str,
        num_shards: int,
    ) -> Planned:
        target = ArtifactTarget(output, num_shards)
        built = self.read_build(pipeline, inputs, config, target) if self.read_build else None
        if built is not None and built.records_in is not None:
            records_in = _total(built.records_in, "RecordsIn")
            dead: list[beam.PCollection] = [built.dropped]
        else:
            read = pipeline | "ReadInputs" >> ReadRecords(inputs)
            ones_in = (
                read[RECORDS] | "OneRecord" >> beam.Map(lambda _: 1),
                read[DEAD] | "OneUnreadable" >> beam.Map(lambda _: 1),
            ) | "InOnes" >> beam.Flatten()
            records_in = _total(ones_in, "RecordsIn")
            parsed = read[RECORDS] | "Parse" >> ParseDocuments(stage)
            built = self.build(parsed[RECORDS], config, target)
            dead = [read[DEAD], parsed[DEAD], built.dropped]
        return Planned(
            records_in=records_in,
            dead=dead,
            finish=functools.partial(_finish, finalize=built.finalize, kind=self.kind),
            sides={
                "records_out": beam.pvalue.AsSingleton(_total(built.records_out, "RecordsOut")),
                "parts": beam.pvalue.AsList(built.parts),
            },
        )


def run_artifact_stage(
    stage: str,
    kind: str,
    build: ArtifactBuild,
    config: Any,
    inputs: list[str],
    output: str,
    *,
    num_shards: int = DEFAULT_SHARDS,
    beam_args: Sequence[str] = (),
    read_build: ArtifactReadBuild | None = None,
) -> StageRun:
    """Run an artifact stage (:class:`FinalizedArtifact`) and return its manifest."""
    return run_pipeline(
        stage,
        FinalizedArtifact(kind, build, read_build),
        config,
        inputs,
        output,
        num_shards=num_shards,
        beam_args=beam_args,
    )


def artifact_main(
    stage: str,
    kind: str,
    description: str,
    config_type: type,
    build: ArtifactBuild,
    argv: Sequence[str] | None = None,
    *,
    add_arguments: Callable[[Any], None] | None = None,
    apply_arguments: Callable[[Any, Any], Any] | None = None,
    read_build: ArtifactReadBuild | None = None,
) -> StageRun:
    """Command line of an artifact stage (the harness's :func:`~pipelines.stage.stage_main`)."""
    return stage_main(
        stage,
        description,
        config_type,
        FinalizedArtifact(kind, build, read_build),
        argv,
        add_arguments=add_arguments,
        apply_arguments=apply_arguments,
    )
