"""Stage 6, train tokenizer: documents -> a SentencePiece BPE model (byte fallback).

The workers choose and write a deterministic sample; one final step trains on it::

    python -m pipelines.train_tokenizer --input out/decontaminate --output out/tokenizer \\
        --config '{"vocab_size": 32000, "sample_rate": 0.1, "max_sample_chars": 200000000}'

Sample. A document is a *candidate* when ``xxh64(id, seed) < sample_rate * 2**64``. If the
candidates hold more characters than ``max_sample_chars``, the candidates with the smallest
``(hash, id)`` are kept until the budget is reached (the last one may cross it), so the sample
depends only on the documents, never on their order or on the runner. Sampled documents go
to ``num_shards`` gzipped text files (``sample/part-*.txt.gz``) by a stable hash of their id,
sorted by id inside each file, one training sentence per non-blank line (lines longer than
``max_line_chars`` are cut into pieces, so the trainer never skips one silently).

Training. SentencePiece runs on one worker (inherent: it needs the whole sample), fed through
``sentence_iterator`` in shard order with ``shuffle_input_sentence=False`` and
``input_sentence_size=0`` (take every sentence, no random reservoir), and writes through
``model_writer`` so no temporary file path ends up in the model. The model file embeds its
trainer options, ``num_threads`` included, so that is a fixed config value rather than the
machine's CPU count. Same documents + same config -> byte-identical ``tokenizer.model``.

Normalization. ``identity`` with ``remove_extra_whitespaces=False`` and
``add_dummy_prefix=False`` by default: documents are already NFC-normalized by ingest, and
whitespace is content (code indentation), so decoding tokens gives back the document text
exactly, but for U+2581 (sentencepiece's own space mark), which decodes as a space. ``nfkc``
is available but then decoding gives the NFKC form of the text.

Ids: pad 0, unk 1, bos 2, eos 3 (``pipelines.spm``), then 256 byte pieces, then merges.

Accounting (``manifest.json``, ``pipelines.artifact_stage``). ``records_out`` counts the valid
documents the sampler considered; each one was either sampled, not chosen by the rate, or
cut by the budget (``extra.sample``: ``docs_sampled + docs_not_sampled + docs_over_budget
== records_out``). Being left out of a sample is not a drop: the document was read and
decided on. ``dropped`` holds only records that could not be used at all (unreadable or
invalid input), each with a dead letter. The manifest's one shard is ``tokenizer.model``,
accounting for ``records_out`` documents: the model is what they all went into.
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import apache_beam as beam
import sentencepiece as sentencepiece_lib
import xxhash
from apache_beam import pvalue

from pipelines import spm, storage
from pipelines.artifact_stage import (
    Accounting,
    ArtifactOutputs,
    ArtifactResult,
    ArtifactTarget,
    artifact_main,
    file_info,
)
from pipelines.beam_io import stable_shard
from pipelines.configs import TrainTokenizerConfig
from pipelines.documents import Document
from pipelines.map_stage import INPUT_DEAD, RECORDS_IN, ShardDocuments, input_shards
from pipelines.stage import StageError, StageRun, run_as_command

log = logging.getLogger(__name__)

STAGE = "train_tokenizer"
KIND = "tokenizer"
DOCS = "docs"  # valid documents of a shard: what the sampler decides on (records_out)
HASH_SPACE = 1 << 64
# Candidates are (hash, id, characters); the budget accumulator is re-trimmed this often.
COMPACT_EVERY = 1 << 16

SAMPLED = "sampled"
NOT_SAMPLED = "not_sampled"
OVER_BUDGET = "over_budget"
DECISIONS = (SAMPLED, NOT_SAMPLED, OVER_BUDGET)
DECISION = "decision"

Candidate = tuple[int, str, int]
CutKey = tuple[int, str]


# --- sample selection ------------------------------------------------------------------------


def sample_hash(doc_id: str, seed: int) -> int:
    return xxhash.xxh64_intdigest(doc_id.encode("utf-8"), seed=seed)


def rate_limit(rate: float) -> int:
    """Hashes below this are candidates; rate 1.0 admits every hash."""
    return HASH_SPACE if rate >= 1.0 else int(rate * HASH_SPACE)


def trim_to_budget(candidates: list[Candidate], budget: int) -> list[Candidate]:
    """The smallest candidates, in order, until their characters reach ``budget`` (in place).

    A candidate is kept when the characters before it are still under the budget, so a
    non-empty input keeps at least one and the sample overshoots by at most one document.
    Trimming parts and then the union keeps the same prefix as trimming the whole: a
    candidate's characters-before within a part never exceed those within the whole.
    """
    candidates.sort()
    total = 0
    for index, candidate in enumerate(candidates):
        if total >= budget:
            del candidates[index:]
            break
        total += candidate[2]
    return candidates


class BudgetCut(beam.CombineFn):
    """Candidates -> the ``(hash, id)`` of the last one within budget, or None (all fit).

    Holds only (hash, id, length) triples of at most a budget's worth of documents, never text.
    """

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget

    def create_accumulator(self) -> list[Candidate]:
        return []

    def add_input(self, accumulator: list[Candidate], candidate: Candidate) -> list[Candidate]:
        accumulator.append(candidate)
        if len(accumulator) % COMPACT_EVERY == 0:
            trim_to_budget(accumulator, self.budget)
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[list[Candidate]]) -> list[Candidate]:
        merged = [c for accumulator in accumulators for c in accumulator]
        return trim_to_budget(merged, self.budget)

    def extract_output(self, accumulator: list[Candidate]) -> CutKey | None:
        kept = trim_to_budget(list(accumulator), self.budget)
        if sum(c[2] for c in kept) < self.budget:
            return None  # nothing was (or had to be) cut
        return (kept[-1][0], kept[-1][1])


def decide(doc: Document, limit: int, seed: int, cut: CutKey | None) -> Iterator[Any]:
    """Sampled documents as (id, text); every decision as a tagged output for the counts."""
    key = (sample_hash(doc["id"], seed), doc["id"])
    if key[0] >= limit:
        yield pvalue.TaggedOutput(DECISION, NOT_SAMPLED)
    elif cut is not None and key > cut:
        yield pvalue.TaggedOutput(DECISION, OVER_BUDGET)
    else:
        yield pvalue.TaggedOutput(DECISION, SAMPLED)
        yield (doc["id"], doc["text"])


# --- sample files ------------------------------------------------------------------------------


def training_lines(text: str, max_line_chars: int) -> Iterator[str]:
    """Non-blank lines, each cut into pieces of at most ``max_line_chars`` characters: the
    sample file's lines exactly as the trainer reads them back (``storage.iter_lines`` skips
    blank lines and a final carriage return), so the manifest counts what it trains on."""
    for line in text.split("\n"):
        for start in range(0, len(line), max_line_chars):
            piece = line[start : start + max_line_chars].removesuffix("\r")
            if piece.strip():  # a cut inside a long run of spaces is a blank line too
                yield piece


def sample_shard_name(index: int, num_shards: int) -> str:
    return f"sample/part-{index:05d}-of-{num_shards:05d}.txt.gz"


def write_sample_shard(
    item: tuple[int, Iterable[tuple[str, str] | None]],
    output: str,
    num_shards: int,
    max_line_chars: int,
) -> tuple[str, dict[str, Any]]:
    index, rows = item
    docs = sorted(r for r in rows if r is not None)
    lines = [line for _, text in docs for line in training_lines(text, max_line_chars)]
    data = storage.gzip_bytes("".join(line + "\n" for line in lines).encode("utf-8"))
    relative = sample_shard_name(index, num_shards)
    storage.makedirs(storage.join(output, "sample"))
    storage.write_bytes_atomic(storage.join(output, relative), data)
    info = {
        "path": relative,
        "docs": len(docs),
        "doc_chars": sum(len(text) for _, text in docs),
        "lines": len(lines),
        "line_chars": sum(len(line) for line in lines),
        "bytes": len(data),
        "sha256": storage.sha256_hex(data),
    }
    return ("shard", info)


# --- training ----------------------------------------------------------------------------------


def trainer_options(config: TrainTokenizerConfig) -> dict[str, Any]:
    """SentencePiece trainer flags; every one that affects the model is pinned here."""
    return {
        "model_type": "bpe",
        "vocab_size": config.vocab_size,
        "byte_fallback": True,
        "character_coverage": config.character_coverage,
        "normalization_rule_name": config.normalization,
        "remove_extra_whitespaces": False,
        "add_dummy_prefix": False,
        "allow_whitespace_only_pieces": True,  # indentation runs become single pieces
        "split_digits": config.split_digits,
        "max_sentencepiece_length": config.max_piece_length,
        "max_sentence_length": 4 * config.max_line_chars,  # bytes: 4 per character at most
        "shuffle_input_sentence": False,
        "input_sentence_size": 0,
        "num_threads": config.num_threads,
        "pad_id": spm.PAD_ID,
        "unk_id": spm.UNK_ID,
        "bos_id": spm.BOS_ID,
        "eos_id": spm.EOS_ID,
        "minloglevel": 1,
    }


def iter_sample(output: str, shard_paths: Sequence[str]) -> Iterator[str]:
    for relative in shard_paths:
        for raw in storage.iter_lines(storage.join(output, relative)):
            yield raw.decode("utf-8")


def train_model(sentences: Iterable[str], config: TrainTokenizerConfig) -> bytes:
    model = io.BytesIO()
    try:
        sentencepiece_lib.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, **trainer_options(config)
        )
    except RuntimeError as err:  # e.g. "Vocabulary size too high" for a tiny sample
        raise StageError(f"{STAGE}: sentencepiece training failed: {err}") from None
    return model.getvalue()


def finalize_tokenizer(
    output: str, parts: list[Any], accounting: Accounting, *, config: TrainTokenizerConfig
) -> ArtifactResult:
    """Train on the sample shards and write the model; returns the manifest's shards/extra."""
    shards = sorted((info for kind, info in parts if kind == "shard"), key=lambda s: s["path"])
    decisions = {name: 0 for name in DECISIONS}
    for kind, value in parts:
        if kind == DECISION:
            decisions[value[0]] += value[1]
    if sum(decisions.values()) != accounting.records_out:
        raise StageError(f"{STAGE}: sample decisions do not add up to the documents read")
    if sum(s["docs"] for s in shards) != decisions[SAMPLED]:
        raise StageError(f"{STAGE}: sample shards do not hold every sampled document")
    if sum(s["lines"] for s in shards) == 0:
        raise StageError(f"{STAGE}: the sample is empty: no document text to train on")
    model = train_model(iter_sample(output, [s["path"] for s in shards]), config)
    sp = spm.processor(model)
    storage.write_bytes_atomic(storage.join(output, spm.MODEL_NAME), model)
    storage.write_bytes_atomic(
        storage.join(output, spm.VOCAB_NAME), spm.vocab_text(sp).encode("utf-8")
    )
    # The model is what every document the sampler decided on went into (see the docstring).
    model_info = file_info(spm.MODEL_NAME, model, accounting.records_out)
    return ArtifactResult(
        [model_info],
        {
            "model": spm.MODEL_NAME,
            "model_sha256": storage.sha256_hex(model),
            "model_bytes": len(model),
            "vocab": spm.VOCAB_NAME,
            "vocab_size": sp.vocab_size(),
            "eos_id": sp.eos_id(),
            "special_ids": dict(spm.SPECIAL_IDS),
            "sentencepiece_version": sentencepiece_lib.__version__,
            "trainer_options": trainer_options(config),
            "sample": {
                "docs_sampled": decisions[SAMPLED],
                "docs_not_sampled": decisions[NOT_SAMPLED],
                "docs_over_budget": decisions[OVER_BUDGET],
                "doc_chars": sum(s["doc_chars"] for s in shards),
                "lines": sum(s["lines"] for s in shards),
                "line_chars": sum(s["line_chars"] for s in shards),
                "shards": shards,
            },
        },
    )


# --- pipeline ----------------------------------------------------------------------------------


def _candidate(doc: Document, seed: int) -> Candidate:
    return (sample_hash(doc["id"], seed), doc["id"], len(doc["text"]))


def build(
    docs: beam.PCollection, config: TrainTokenizerConfig, target: ArtifactTarget
) -> ArtifactOutputs:
    """The harness's path: the documents are read once and kept for the second pass, which
    needs the budget cut the first one computes."""
    limit = rate_limit(config.sample_rate)
    seed = config.seed
    cut = (
        docs
        | "Candidates" >> beam.Map(_candidate, seed)
        | "ByRate" >> beam.Filter(lambda c: c[0] < limit)
        | "BudgetCut" >> beam.CombineGlobally(BudgetCut(config.max_sample_chars))
    )
    decided = docs | "Decide" >> beam.FlatMap(
        decide, limit, seed, pvalue.AsSingleton(cut)
    ).with_outputs(DECISION, main="sampled")
    records_out = docs | "OneDoc" >> beam.Map(lambda _: 1)
    return _sample_outputs(decided, records_out, None, config, target)


def _sample_outputs(
    decided: Any,
    records_out: beam.PCollection,
    dropped: beam.PCollection | None,
    config: TrainTokenizerConfig,
    target: ArtifactTarget,
) -> ArtifactOutputs:
    """Decisions and sampled (id, text) -> the sample shards, the decision counts, and the
    final step that trains on them. ``dropped``: dead letters the stage made itself."""
    pipeline = records_out.pipeline
    n = target.num_shards
    counts = (
        decided[DECISION]
        | "CountDecisions" >> beam.combiners.Count.PerElement()
        | "AsPart" >> beam.Map(lambda kv: (DECISION, kv))
    )
    keyed = decided["sampled"] | "SampleShard" >> beam.Map(lambda r: (stable_shard(r[0], n), r))
    empties = pipeline | "AllSampleShards" >> beam.Create([(i, None) for i in range(n)])
    shards = (
        (keyed, empties)
        | "WithEmptySampleShards" >> beam.Flatten()
        | "GroupSampleShard" >> beam.GroupByKey()
        | "WriteSample" >> beam.Map(write_sample_shard, target.output, n, config.max_line_chars)
    )
    return ArtifactOutputs(
        records_out=records_out,
        dropped=dropped if dropped is not None else pipeline | "NoDrops" >> beam.Create([]),
        parts=(shards, counts) | "Parts" >> beam.Flatten(),
        finalize=functools.partial(finalize_tokenizer, config=config),
    )


# --- the shard path: id-sharded inputs, read twice instead of held -------------------------------


class ShardCandidates(beam.DoFn):
    """(index, files) -> the shard's candidates under the sample rate, its valid documents
    (``DOCS``) and records read (``RECORDS_IN``), and reading letters (``INPUT_DEAD``)."""

    def __init__(self, config: TrainTokenizerConfig, num_shards: int) -> None:
        self.limit = rate_limit(config.sample_rate)
        self.seed = config.seed
        self.num_shards = num_shards

    def process(self, item: tuple[int, list[str]]) -> Iterator[Any]:
        index, paths = item
        documents = ShardDocuments(STAGE, index, paths, self.num_shards)
        valid = 0
        for doc in documents:
            valid += 1
            yield from documents.take_letters()
            candidate = _candidate(doc, self.seed)
            if candidate[0] < self.limit:
                yield candidate
        yield from documents.take_letters()
        yield pvalue.TaggedOutput(DOCS, valid)
        yield pvalue.TaggedOutput(RECORDS_IN, documents.records)


class ShardDecisions(beam.DoFn):
    """(index, files), the budget cut -> ``decide`` for each document of the shard, read again
    (its bad records were dead-lettered by ``ShardCandidates``)."""

    def __init__(self, config: TrainTokenizerConfig, num_shards: int) -> None:
        self.limit = rate_limit(config.sample_rate)
        self.seed = config.seed
        self.num_shards = num_shards

    def process(self, item: tuple[int, list[str]], cut: CutKey | None) -> Iterator[Any]:
        index, paths = item
        for doc in ShardDocuments(STAGE, index, paths, self.num_shards):
            yield from decide(doc, self.limit, self.seed, cut)


def build_from_shards(
    pipeline: beam.Pipeline,
    inputs: list[str],
    config: TrainTokenizerConfig,
    target: ArtifactTarget,
) -> ArtifactOutputs | None:
    """The shard path, when the inputs are id-sharded stage outputs: the documents are read
    shard by shard twice (candidates, then decisions) instead of held between the passes, so
    the stage's memory is the sample (``max_sample_chars``), not the corpus. None otherwise."""
    shards = input_shards(pipeline, STAGE, inputs, target.num_shards, "read twice, not held")
    if shards is None:
        return None
    n = target.num_shards
    candidates = shards | "CandidateShards" >> beam.ParDo(ShardCandidates(config, n)).with_outputs(
        DOCS, RECORDS_IN, INPUT_DEAD, main="candidates"
    )
    cut = candidates["candidates"] | "BudgetCut" >> beam.CombineGlobally(
        BudgetCut(config.max_sample_chars)
    )
    decided = shards | "DecideShards" >> beam.ParDo(
        ShardDecisions(config, n), pvalue.AsSingleton(cut)
    ).with_outputs(DECISION, main="sampled")
    outputs = _sample_outputs(decided, candidates[DOCS], candidates[INPUT_DEAD], config, target)
    outputs.records_in = candidates[RECORDS_IN]
    return outputs


def main(argv: Sequence[str] | None = None) -> StageRun:
    return artifact_main(
        STAGE,
        KIND,
        __doc__ or STAGE,
        TrainTokenizerConfig,
        build,
        argv,
        read_build=build_from_shards,
    )


if __name__ == "__main__":
    run_as_command(main)
