"""Stage 7, tokenize: documents -> a token store (``tokenstore``), written by the workers.

    python -m pipelines.tokenize --input out/decontaminate --tokenizer out/tokenizer \\
        --output out/tokens [--num_shards 64] [beam pipeline options]

Documents go to ``num_shards`` token-store shards by a stable hash of their id and are sorted
by (id, text) inside each shard, so the store does not depend on the runner or on the order
of the input. Each worker encodes its shard with SentencePiece in batches (one C++ call per
``batch_docs`` documents, ``encode_threads`` threads, numpy output, EOS appended) and appends
each batch to the shard (``tokenstore.ShardWriter``). A final single-element step writes the store's ledger
(``tokenstore.finalize``: vocabulary size, EOS id, tokenizer sha256, and this run's counts,
among them ``metadata.num_bytes``, the UTF-8 bytes of the tokenized documents' texts),
then the stage manifest. When the inputs are stage outputs sharded like the store (not the
DAG's case: its ``split`` writes one file per source), a worker merges them as it reads and
holds one batch at a time; otherwise it holds one shard's documents (after the shuffle), never
the corpus: choose ``--num_shards`` so that a shard fits a worker comfortably.

The output directory is the store root: ``shards/``, ``ledger.json``, plus ``dead_letter/``
and ``manifest.json`` (``pipelines.artifact_stage``). ``records_out`` is the number of
documents in the store; ``dropped`` counts unreadable/invalid input lines and documents that
cannot be tokenized (``empty_text``, ``empty_encoding``, ``encode_error``), each with a dead
letter.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import apache_beam as beam
import numpy as np
import sentencepiece as sentencepiece_lib
from apache_beam import pvalue

import tokenstore
from pipelines import spm
from pipelines.artifact_stage import (
    Accounting,
    ArtifactOutputs,
    ArtifactResult,
    ArtifactTarget,
    artifact_main,
    run_artifact_stage,
    tree_info,
)
from pipelines.beam_io import (
    DEAD,
    InputSource,
    id_sharded_inputs,
    parse_record,
    read_source,
    stable_shard,
)
from pipelines.configs import TokenizeConfig
from pipelines.documents import DeadLetter, Document, dead_letter
from pipelines.manifest import ShardInfo
from pipelines.stage import StageError, StageRun, run_as_command

log = logging.getLogger(__name__)

STAGE = "tokenize"
KIND = "token-store"

Row = tuple[str, str]  # (id, text): all that tokenization needs crosses the shuffle


def token_shard_name(index: int, num_shards: int) -> str:
    return f"part-{index:05d}-of-{num_shards:05d}"


def _letter(reason: str, row: Row, detail: str = "") -> DeadLetter:
    # After parsing, a document's origin is its id; the record keeps what was tokenized.
    return dead_letter(reason, STAGE, row[0], {"id": row[0], "text": row[1]}, detail)


def encode_rows(
    sp: sentencepiece_lib.SentencePieceProcessor,
    rows: Sequence[Row],
    threads: int,
    batch_docs: int,
) -> tuple[list[np.ndarray], list[DeadLetter]]:
    """Token arrays (EOS included) of the rows that tokenize, and letters for the rest."""
    kept, letters = _encode(sp, rows, threads, batch_docs)
    return [ids for _, ids in kept], letters


def _encode(
    sp: sentencepiece_lib.SentencePieceProcessor,
    rows: Sequence[Row],
    threads: int,
    batch_docs: int,
) -> tuple[list[tuple[Row, np.ndarray]], list[DeadLetter]]:
    """``encode_rows``, each token array with its row."""
    kept: list[tuple[Row, np.ndarray]] = []
    letters: list[DeadLetter] = []
    for start in range(0, len(rows), batch_docs):
        batch = rows[start : start + batch_docs]
        try:
            encoded: list[np.ndarray | BaseException] = list(
                spm.encode_with_eos(sp, [text for _, text in batch], threads)
            )
        except Exception:
            # Find the culprit: one bad document must not take its batch with it.
            encoded = [_encode_one(sp, text) for _, text in batch]
        for row, ids in zip(batch, encoded, strict=True):
            if isinstance(ids, BaseException):
                letters.append(_letter("encode_error", row, f"{type(ids).__name__}: {ids}"))
            elif len(ids) <= 1:  # EOS alone: nothing left of the text
                letters.append(_letter("empty_encoding", row))
            else:
                kept.append((row, ids))
    return kept, letters


def _encode_one(
    sp: sentencepiece_lib.SentencePieceProcessor, text: str
) -> np.ndarray | BaseException:
    try:
        return spm.encode_with_eos(sp, [text], 1)[0]
    except Exception as err:
        return err


class EncodeShard(beam.DoFn):
    """(shard index, rows) -> the shard written to the store, its ledger entry, dead letters."""

    def __init__(
        self, info: spm.TokenizerInfo, output: str, num_shards: int, config: TokenizeConfig
    ) -> None:
        super().__init__()
        self.info = info
        self.output = output
        self.num_shards = num_shards
        self.threads = spm.resolve_threads(config.encode_threads)
        self.batch_docs = config.batch_docs
        self._sp: sentencepiece_lib.SentencePieceProcessor | None = None

    def setup(self) -> None:
        # Loaded once per worker; the sha256 check pins it to the model the run was planned with.
        self._sp = spm.processor(spm.load_model_bytes(self.info.path, self.info.sha256))

    def encode_and_write(self, index: int, rows: Iterable[Row]) -> Iterator[Any]:
        """Encode rows already in store order, ``batch_docs`` at a time, straight into the shard."""
        assert self._sp is not None
        name = token_shard_name(index, self.num_shards)
        writer = tokenstore.ShardWriter(self.output, name)
        letters: list[DeadLetter] = []
        num_bytes = 0  # UTF-8 bytes of the texts whose tokens the shard holds
        rows = iter(rows)
        while batch := list(itertools.islice(rows, self.batch_docs)):
            tokens, batch_letters = _encode(self._sp, batch, self.threads, self.batch_docs)
            for (_, text), ids in tokens:
                writer.add(ids)
                num_bytes += len(text.encode("utf-8"))
            letters.extend(batch_letters)
        ledger = writer.close()
        info = tree_info(self.output, f"shards/{name}", ledger.num_docs)
        yield {"ledger": asdict(ledger), "info": asdict(info), "num_bytes": num_bytes}
        for letter in letters:
            yield pvalue.TaggedOutput(DEAD, letter)

    def process(self, item: tuple[int, Iterable[Row | None]]) -> Iterator[Any]:
        index, rows = item
        yield from self.encode_and_write(index, sorted(r for r in rows if r is not None))


class _Unsorted(Exception):
    """An input shard not in (id, text) order: the shard cannot be merged as it is read."""


class ReadEncodeShard(EncodeShard):
    """(shard index, input files) -> store shard: read, parse, encode and write in one worker.

    For inputs already partitioned by ``stable_shard(id, n)`` (``id_sharded_inputs``): shard
    ``k`` of the store is read from shard ``k`` of every input, so no shuffle moves the corpus,
    and the store is byte-identical to what the shuffle path writes. Reading and parsing turn
    bad records into the same dead letters as the harness's ``ReadRecords``/``ParseDocuments``.

    Stage outputs are sorted by id, so the input files are merged as they are read and the
    shard is encoded and written ``batch_docs`` documents at a time: a worker holds a batch,
    not the shard. An input out of (id, text) order is read again and sorted in memory.
    """

    def process(self, item: tuple[int, list[str]]) -> Iterator[Any]:
        index, paths = item
        letters: list[Any] = []
        counted = [0]
        try:
            merged = heapq.merge(
                *(_in_order(self._rows(index, p, letters, counted), p) for p in paths)
            )
            outputs = list(self.encode_and_write(index, merged))
        except _Unsorted as err:
            log.info("%s: %s; sorting shard %d in memory", STAGE, err, index)
            letters, counted = [], [0]
            rows = sorted(row for p in paths for row in self._rows(index, p, letters, counted))
            outputs = list(self.encode_and_write(index, rows))
        outputs[0]["records_in"] = counted[0]
        yield from letters
        yield from outputs

    def _rows(self, index: int, path: str, letters: list[Any], counted: list[int]) -> Iterator[Row]:
        """The rows of one input file; its bad records go to ``letters``."""
        for record in read_source(InputSource("jsonl", path)):
            counted[0] += 1
            if isinstance(record, pvalue.TaggedOutput):
                letters.append(record)
                continue
            for parsed in parse_record(record, STAGE):
                if isinstance(parsed, pvalue.TaggedOutput):
                    letters.append(parsed)
                    continue
                doc: Document = parsed
                for keyed in key_by_shard(doc, self.num_shards):
                    if isinstance(keyed, pvalue.TaggedOutput):
                        letters.append(keyed)
                    elif keyed[0] != index:
                        # Never misplace a document silently: the input broke its contract.
                        raise StageError(
                            f"{STAGE}: {path} is shard {index} of {self.num_shards} but holds"
                            f" document {doc['id']!r} of shard {keyed[0]}"
                        )
                    else:
                        yield keyed[1]


def _in_order(rows: Iterator[Row], path: str) -> Iterator[Row]:
    previous: Row | None = None
    for row in rows:
        if previous is not None and row < previous:
            raise _Unsorted(f"{path} is not in (id, text) order at {row[0]!r}")
        previous = row
        yield row


def key_by_shard(doc: Document, num_shards: int) -> Iterator[Any]:
    if not doc["text"]:
        yield pvalue.TaggedOutput(DEAD, dead_letter("empty_text", STAGE, doc["id"], doc))
        return
    yield (stable_shard(doc["id"], num_shards), (doc["id"], doc["text"]))


def finalize_store(
    output: str,
    parts: list[dict[str, Any]],
    accounting: Accounting,
    *,
    info: spm.TokenizerInfo,
    num_shards: int,
) -> ArtifactResult:
    """Write the ledger: from now on the store is readable. Returns the manifest's shards."""
    shards = [tokenstore.ShardLedger(**p["ledger"]) for p in parts]
    expected = {token_shard_name(i, num_shards) for i in range(num_shards)}
    if {s.name for s in shards} != expected or len(shards) != num_shards:
        raise StageError(f"{STAGE}: expected exactly one ledger entry per shard {sorted(expected)}")
    ledger = tokenstore.finalize(
        output,
        shards,
        vocab_size=info.vocab_size,
        eos_id=info.eos_id,
        tokenizer_sha256=info.sha256,
        metadata={
            "stage": STAGE,
            "records_in": accounting.records_in,
            "records_out": accounting.records_out,
            "dropped": accounting.dropped,
            "special_ids": dict(spm.SPECIAL_IDS),
            # UTF-8 bytes of the documents whose tokens the store holds: bits per byte for a
            # store evaluated without its tokenizer (trainer.evaluate)
            "num_bytes": sum(p["num_bytes"] for p in parts),
        },
    )
    extra = {
        "ledger": tokenstore.LEDGER_NAME,
        "num_docs": ledger.num_docs,
        "num_tokens": ledger.num_tokens,
        "vocab_size": ledger.vocab_size,
        "eos_id": ledger.eos_id,
        "tokenizer_sha256": ledger.tokenizer_sha256,
        "shard_tokens": {s.name: s.num_tokens for s in ledger.shards},
    }
    return ArtifactResult([ShardInfo(**p["info"]) for p in parts], extra)


def build(
    docs: beam.PCollection, config: TokenizeConfig, target: ArtifactTarget
) -> ArtifactOutputs:
    if not config.tokenizer:
        raise StageError(f"{STAGE}: a tokenizer is required (--tokenizer DIR_OR_MODEL)")
    info = spm.describe(config.tokenizer)
    n = target.num_shards
    keyed = docs | "KeyByShard" >> beam.FlatMap(key_by_shard, n).with_outputs(DEAD, main="rows")
    # Every shard is written, empty or not, so the store's file set depends only on n.
    empties = docs.pipeline | "AllTokenShards" >> beam.Create([(i, None) for i in range(n)])
    encoded = (
        (keyed["rows"], empties)
        | "WithEmptyTokenShards" >> beam.Flatten()
        | "GroupTokenShard" >> beam.GroupByKey()
        | "EncodeShard"
        >> beam.ParDo(EncodeShard(info, target.output, n, config)).with_outputs(DEAD, main="shards")
    )
    return ArtifactOutputs(
        records_out=encoded["shards"] | "ShardDocs" >> beam.Map(lambda s: s["ledger"]["num_docs"]),
        dropped=(keyed[DEAD], encoded[DEAD]) | "TokenizeDropped" >> beam.Flatten(),
        parts=encoded["shards"],
        finalize=functools.partial(finalize_store, info=info, num_shards=n),
    )


def build_from_shards(
    pipeline: beam.Pipeline, inputs: list[str], config: TokenizeConfig, target: ArtifactTarget
) -> ArtifactOutputs | None:
    """The no-shuffle path, when the inputs are documents already sharded by id (see module)."""
    if config.shuffle:
        return None
    groups = id_sharded_inputs(inputs, target.num_shards)
    if groups is None:
        log.info("%s: inputs are not id-sharded stage outputs: shuffling by id", STAGE)
        return None
    if not config.tokenizer:
        raise StageError(f"{STAGE}: a tokenizer is required (--tokenizer DIR_OR_MODEL)")
    info = spm.describe(config.tokenizer)
    n = target.num_shards
    log.info("%s: inputs already sharded by id into %d: one store shard per input shard", STAGE, n)
    encoded = (
        pipeline
        | "InputShards" >> beam.Create(sorted(groups.items()))
        | "SpreadShards" >> beam.Reshuffle()  # one shard per worker on a distributed runner
        | "ReadEncodeShard"
        >> beam.ParDo(ReadEncodeShard(info, target.output, n, config)).with_outputs(
            DEAD, main="shards"
        )
    )
    shards = encoded["shards"]
    return ArtifactOutputs(
        records_out=shards | "ShardDocs" >> beam.Map(lambda s: s["ledger"]["num_docs"]),
        dropped=encoded[DEAD],
        parts=shards,
        finalize=functools.partial(finalize_store, info=info, num_shards=n),
        records_in=shards | "ShardRecordsIn" >> beam.Map(lambda s: s["records_in"]),
    )


def _add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (train_tokenizer output) or .model"
    )


def _apply_arguments(config: TokenizeConfig, args: Any) -> TokenizeConfig:
    if args.tokenizer:
        config = dataclasses.replace(config, tokenizer=args.tokenizer)
    return config


def run(
    config: TokenizeConfig,
    inputs: Sequence[str],
    output: str,
    *,
    num_shards: int,
    beam_args: Sequence[str] = (),
) -> StageRun:
    """The stage as its command line runs it (the no-shuffle path when the inputs allow)."""
    return run_artifact_stage(
        STAGE,
        KIND,
        build,
        config,
        list(inputs),
        output,
        num_shards=num_shards,
        beam_args=beam_args,
        read_build=build_from_shards,
    )


def main(argv: Sequence[str] | None = None) -> StageRun:
    return artifact_main(
        STAGE,
        KIND,
        __doc__ or STAGE,
        TokenizeConfig,
        build,
        argv,
        add_arguments=_add_arguments,
        apply_arguments=_apply_arguments,
        read_build=build_from_shards,
    )


if __name__ == "__main__":
    run_as_command(main)
