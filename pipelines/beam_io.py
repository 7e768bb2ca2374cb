"""Beam transforms that read and write documents, shared by every stage.

Reading never crashes on bad input: a record that cannot be decoded becomes a dead letter
with its reason. Writing is deterministic: records are assigned to a fixed number of shards by a
stable hash, sorted inside each shard, and gzipped without timestamps, so the same records give
byte-identical files on any runner and in any execution order.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import apache_beam as beam
import fsspec
import xxhash
from apache_beam import pvalue

from pipelines import spill, storage
from pipelines.documents import (
    DeadLetter,
    Document,
    InvalidRecord,
    dead_letter,
    dead_letter_sort_key,
    decode_line,
    dumps,
    validate_document,
)
from pipelines.manifest import FORMAT as DOCUMENTS_FORMAT
from pipelines.manifest import MANIFEST_NAME, ShardInfo, has_manifest, read_manifest

RECORDS = "records"
DEAD = "dead_letter"  # the tag of every dead-letter output, in every stage
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet",)
HF_PREFIX = "hf:"
DEAD_LETTER_FOLDER = "dead_letter"  # where every stage writes its dead-letter shards
_SHARD_PART = re.compile(r"part-.*-of-")  # a stage's shard, finished or still a temporary file


class InputError(ValueError):
    """An input spec that cannot be read as documents."""


@dataclass(frozen=True)
class InputSource:
    """One unit of reading work: a file, or one shard of a Hugging Face dataset."""

    kind: str  # "jsonl" | "parquet" | "hf"
    path: str
    hf_config: str | None = None
    hf_split: str = "train"
    shard: int = 0
    num_shards: int = 1
    # An "hf" source named as a Hub repository (``hf_hub_name``): read from the Hub only, never
    # from a local folder of that name that appeared later (such as the stage's own output).
    hub: bool = False


def _supported(path: str) -> str | None:
    if path.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if path.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


HF_HUB_DATASETS = "hf://datasets/"  # what ``datasets`` reads from the Hub only, never locally


def _holds_files(path: str) -> bool:
    if os.path.isfile(path):
        return True
    return any(files for _, _, files in os.walk(path))


def parse_hf_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``hf:NAME[:CONFIG][@SPLIT]`` -> (NAME, CONFIG, SPLIT); a NAME that is a URL keeps its
    colons (no CONFIG)."""
    name, _, split = spec[len(HF_PREFIX) :].partition("@")
    name, _, config = name.partition(":") if "://" not in name else (name, "", "")
    return name, config or None, split or None


def hf_hub_name(name: str) -> bool:
    """Whether ``hf:NAME`` names a dataset on the Hugging Face Hub, not a local one or a URL.

    As ``datasets`` decides: a relative name with at most one ``/`` (``org/name``) is a Hub
    repository, unless a local path of that name holds files (``datasets`` reads a local
    folder first). Neither an empty folder nor a finished stage output (its manifest) is a
    dataset the user meant: a stage that wrote ``./org/name`` from ``hf:org/name`` may run
    again.
    """
    if not name or "://" in name or os.path.isabs(name) or name.startswith((".", "~")):
        return False
    return name.count("/") <= 1 and (not _holds_files(name) or has_manifest(name))


def glob_files(spec: str) -> list[str]:
    """The files a glob or file input names, sorted. A wildcard's matches inside a
    ``dead_letter/`` folder and those named ``manifest.json`` (a stage output's) are left out,
    as a folder input leaves them out: neither is documents, and read as such every dead
    letter, or every line of the manifest, would be dropped as invalid. A file named without
    a wildcard is read as named."""
    files = storage.expand_glob(spec)
    if not storage.is_glob(spec):
        return files
    # Only folders the wildcards match count: a dead_letter/ in the glob's fixed part is the
    # user's own folder (as a folder input given there would be read)
    fixed = []
    for part in spec.split("/"):
        if storage.is_glob(part):
            break
        fixed.append(part)
    base = storage.strip_protocol("/".join(fixed) or ".").rstrip("/")
    kept = []
    for path in files:
        *below, name = storage.strip_protocol(path)[len(base) :].split("/")
        if DEAD_LETTER_FOLDER not in below and name != MANIFEST_NAME:
            kept.append(path)
    return kept


def no_files_message(spec: str) -> str:
    """Why an input names nothing: no match at all, or (a glob) matches of dead letters and
    stage manifests only."""
    if storage.is_glob(spec) and storage.expand_glob(spec):
        return (
            f"input {spec!r} matches only files in {DEAD_LETTER_FOLDER}/ folders or named"
            f" {MANIFEST_NAME} (dead letters and stage manifests are not documents)"
        )
    return f"input {spec!r} matches no files"


def resolve_inputs(specs: Iterable[str], hf_shards: int = 8) -> list[InputSource]:
    """Expand input specs into reading units, in a stable order.

    A spec is a finished stage output directory (its manifest's shards), any other directory
    (every JSONL/Parquet file below it), a glob or file (local or ``gs://``), or
    ``hf:NAME[:CONFIG][@SPLIT]`` for a Hugging Face dataset (a hub name or a local dataset
    folder), read through the ``datasets`` library.
    """
    sources: list[InputSource] = []
    for spec in specs:
        if spec.startswith(HF_PREFIX):
            name, config, split = parse_hf_spec(spec)
            hub = hf_hub_name(name)
            sources.extend(
                InputSource("hf", name, config, split or "train", i, hf_shards, hub)
                for i in range(hf_shards)
            )
            continue
        if has_manifest(spec):
            manifest = read_manifest(spec)
            if manifest.format != DOCUMENTS_FORMAT:
                raise InputError(
                    f"input {spec!r} is a {manifest.format} output of stage {manifest.stage!r},"
                    " not documents"
                )
            sources.extend(InputSource("jsonl", p) for p in manifest.shard_paths(spec))
            continue
        is_folder = storage.filesystem(spec).isdir(spec)
        files = _folder_files(spec) if is_folder else glob_files(spec)
        if not files:
            raise FileNotFoundError(no_files_message(spec))
        for path in files:
            kind = _supported(path)
            if kind is None:
                # Unknown extensions are read as JSON lines: a wrong file then shows up as
                # counted dead letters instead of vanishing.
                kind = "jsonl"
            sources.append(InputSource(kind, path))
    return sources


def _folder_files(spec: str) -> list[str]:
    """The JSONL/Parquet files below a folder input that has no manifest, sorted.

    Stage outputs inside it are read by their ``data/`` shards only: their ``dead_letter/``
    files are JSONL too, and read as documents they would all be dropped as invalid. One
    without its manifest (a crashed or running stage) is refused: its shards may be partial.
    """
    fs, root = fsspec.core.url_to_fs(spec)
    root = root.rstrip("/")
    protocol = spec.split("://", 1)[0] + "://" if "://" in spec else ""
    listed = {
        path.rstrip("/"): info for path, info in fs.find(root, withdirs=True, detail=True).items()
    }
    files: list[str] = []
    outputs: set[str] = set()  # folders that look like stage outputs
    for path in sorted(listed):
        if not path.startswith(root + "/"):
            continue  # the folder itself
        parts = path[len(root) + 1 :].split("/")
        is_file = listed[path].get("type") == "file"
        folders = parts[:-1] if is_file else parts
        if DEAD_LETTER_FOLDER in folders:
            outputs.add("/".join([root, *folders[: folders.index(DEAD_LETTER_FOLDER)]]))
            continue
        if is_file and parts[-2:-1] == ["data"] and _SHARD_PART.match(parts[-1]):
            outputs.add("/".join([root, *parts[:-2]]))
        if is_file and _supported(path):
            files.append(path if path.startswith(protocol) else protocol + path)
    for output in sorted(outputs):
        if f"{output}/{MANIFEST_NAME}" not in listed:
            shown = output if output.startswith(protocol) else protocol + output
            raise InputError(
                f"input {spec!r}: {shown!r} is an unfinished stage output (data/part-* shards"
                f" or a {DEAD_LETTER_FOLDER}/ folder, but no {MANIFEST_NAME}): its stage crashed"
                " or is still running; rerun it, or give a finished output"
            )
    return files


def _read_jsonl(source: InputSource) -> Iterator[Any]:
    line_no = 0
    try:
        for line_no, raw in storage.iter_numbered_lines(source.path):
            origin = f"{source.path}:{line_no}"
            try:
                yield (origin, decode_line(raw))
            except InvalidRecord as err:
                yield pvalue.TaggedOutput(
                    DEAD, dead_letter(err.reason, "read", origin, raw, err.detail)
                )
    except (OSError, EOFError, ValueError) as err:
        # Truncated or corrupt compressed file: what was read is kept, the rest is one letter.
        origin = f"{source.path}:{line_no + 1}"
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter(
                "unreadable_file", "read", origin, source.path, f"{type(err).__name__}: {err}"
            ),
        )


def _read_parquet(source: InputSource) -> Iterator[Any]:
    import fsspec
    import pyarrow.parquet as pq

    row = 0
    try:
        with fsspec.open(source.path, "rb") as handle:
            for batch in pq.ParquetFile(handle).iter_batches(batch_size=1024):
                for record in batch.to_pylist():
                    yield (f"{source.path}#{row}", record)
                    row += 1
    except Exception as err:  # pyarrow raises several unrelated types for corrupt files
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter(
                "unreadable_file",
                "read",
                f"{source.path}#{row}",
                source.path,
                f"{type(err).__name__}: {err}",
            ),
        )


def _read_hf(source: InputSource) -> Iterator[Any]:
    import datasets

    if source.hub:
        dataset = datasets.load_dataset(
            HF_HUB_DATASETS + source.path, source.hf_config, split=source.hf_split
        )
    elif os.path.isdir(source.path) and os.path.exists(
        os.path.join(source.path, "dataset_info.json")
    ):
        dataset = datasets.load_from_disk(source.path)
    elif os.path.isdir(source.path) and os.path.exists(
        os.path.join(source.path, "dataset_dict.json")
    ):
        dataset = datasets.load_from_disk(source.path)[source.hf_split]
    else:
        dataset = datasets.load_dataset(source.path, source.hf_config, split=source.hf_split)
    # Contiguous row ranges by arithmetic: datasets' own shard() rejects empty shards.
    begin = len(dataset) * source.shard // source.num_shards
    end = len(dataset) * (source.shard + 1) // source.num_shards
    for row in range(begin, end):
        yield (f"hf:{source.path}@{source.hf_split}#{row}", dict(dataset[row]))


def read_source(source: InputSource) -> Iterator[Any]:
    if source.kind == "jsonl":
        yield from _read_jsonl(source)
    elif source.kind == "parquet":
        yield from _read_parquet(source)
    else:
        yield from _read_hf(source)


class ReadRecords(beam.PTransform):
    """Inputs -> tagged outputs ``records`` ((origin, decoded object)) and ``dead_letter``."""

    def __init__(self, specs: list[str]) -> None:
        super().__init__()
        self.sources = resolve_inputs(specs)

    def expand(self, pbegin: beam.pvalue.PBegin) -> pvalue.DoOutputsTuple:
        return (
            pbegin
            | "Sources" >> beam.Create(self.sources)
            | "Spread" >> beam.Reshuffle()
            | "Read" >> beam.FlatMap(read_source).with_outputs(DEAD, main=RECORDS)
        )


def parse_record(item: tuple[str, Any], stage: str) -> Iterator[Any]:
    """(origin, object) -> the valid document, or a tagged dead letter."""
    origin, obj = item
    try:
        yield validate_document(obj)
    except InvalidRecord as err:
        yield pvalue.TaggedOutput(DEAD, dead_letter(err.reason, stage, origin, obj, err.detail))


class ParseDocuments(beam.PTransform):
    """(origin, object) -> valid documents, and dead letters for everything else."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def expand(self, records: beam.PCollection) -> pvalue.DoOutputsTuple:
        return records | "Validate" >> beam.FlatMap(parse_record, self.stage).with_outputs(
            DEAD, main=RECORDS
        )


_SHARD_FILE = re.compile(r"part-([0-9]{5})-of-([0-9]{5})\.jsonl\.gz$")


def id_sharded_inputs(specs: Iterable[str], num_shards: int) -> dict[int, list[str]] | None:
    """Files by shard index, when every spec is a documents stage output with ``num_shards``.

    Document stages write shard ``k`` of ``n`` with exactly the documents whose
    ``stable_shard(id, n) == k`` (``write_documents``). A consumer that wants the same
    partition can then read shard ``k`` of every input instead of shuffling by id. Returns
    None when any input is something else (a glob, a file, another shard count).
    """
    groups: dict[int, list[str]] = {i: [] for i in range(num_shards)}
    for spec in specs:
        if spec.startswith(HF_PREFIX) or not has_manifest(spec):
            return None
        manifest = read_manifest(spec)
        if manifest.format != DOCUMENTS_FORMAT or len(manifest.shards) != num_shards:
            return None
        for shard, path in zip(manifest.shards, manifest.shard_paths(spec), strict=True):
            match = _SHARD_FILE.search(shard.path)
            if match is None or int(match.group(2)) != num_shards:
                return None
            groups[int(match.group(1))].append(path)
    if any(len(paths) != len(groups[0]) for paths in groups.values()):
        return None
    return groups


def stable_shard(key: str, num_shards: int) -> int:
    return xxhash.xxh64_intdigest(key.encode("utf-8")) % num_shards


def shard_name(prefix: str, index: int, num_shards: int) -> str:
    return f"{prefix}-{index:05d}-of-{num_shards:05d}.jsonl.gz"


class ShardFileWriter:
    """One output shard, written as its lines come: deterministic gzipped JSONL (``GzipStream``)
    under a temporary name until ``close`` (``storage.atomic_writer``). The caller hands either
    the lines in the shard's order (``write``) or the documents in id order (``add_document``);
    ``close`` returns the shard's ``ShardInfo`` as a dict.
    """

    def __init__(self, output_dir: str, relative: str) -> None:
        self.relative = relative
        path = storage.join(output_dir, relative)
        storage.makedirs(os.path.dirname(path) if "://" not in path else path.rsplit("/", 1)[0])
        self._file = storage.atomic_writer(path)
        handle = self._file.__enter__()
        self._gzip = storage.GzipStream(handle.write, threaded=True)
        self.records = 0
        self._run_id: str | None = None
        self._run: list[str] = []

    def add_document(self, doc: Document) -> None:
        """Documents in id order: each run of one id is sorted by line, as ``_write_shard``
        orders a shard (``document_sort_key``, then the line)."""
        doc_id = doc["id"]
        if doc_id != self._run_id:
            if self._run_id is not None and doc_id < self._run_id:
                raise ValueError(f"documents out of id order: {doc_id!r} after {self._run_id!r}")
            self._flush_run()
            self._run_id = doc_id
        self._run.append(dumps(doc))

    def _flush_run(self) -> None:
        for line in sorted(self._run):
            self.write(line)
        self._run = []

    def write(self, line: str) -> None:
        self._gzip.write((line + "\n").encode("utf-8"))
        self.records += 1

    def close(self) -> dict[str, Any]:
        self._flush_run()
        self._gzip.finish()
        self._file.__exit__(None, None, None)
        return asdict(
            ShardInfo(
                self.relative,
                self.records,
                self._gzip.compressed_bytes,
                self._gzip.sha256.hexdigest(),
            )
        )

    def abort(self) -> None:
        """Drop the unfinished shard (its temporary file) after a failure."""
        self._gzip.abandon()
        self._file.__exit__(RuntimeError, RuntimeError("shard abandoned"), None)


def _write_shard(
    item: tuple[int, Iterable[Any]],
    output_dir: str,
    prefix: str,
    num_shards: int,
    sort_key: Callable[[Any], Any],
) -> dict[str, Any]:
    index, records = item
    # Each record is encoded once: its line is both the tie-break of the order and the output.
    rows = sorted((sort_key(r), dumps(r)) for r in records if r is not None)
    writer = ShardFileWriter(output_dir, shard_name(prefix, index, num_shards))
    for _, line in rows:
        writer.write(line)
    return writer.close()


def _shard_entry(
    record: Any,
    shard_key: Callable[[Any], str],
    sort_key: Callable[[Any], Any],
    num_shards: int,
) -> tuple[int, tuple[Any, str], int]:
    """A record's spill entry: its shard, then (sort key, line), the order ``_write_shard``
    writes."""
    line = dumps(record)
    return stable_shard(shard_key(record), num_shards), (sort_key(record), line), len(line)


def _write_runs(
    item: tuple[int, Iterable[str | None]], output_dir: str, prefix: str, num_shards: int
) -> dict[str, Any]:
    """A shard from its spilled runs: the bytes ``_write_shard`` writes from the records."""
    index, paths = item
    writer = ShardFileWriter(output_dir, shard_name(prefix, index, num_shards))
    for _, line in spill.merge_runs(p for p in paths if p is not None):
        writer.write(line)
    return writer.close()


def document_sort_key(doc: Document) -> str:
    """Documents in a shard: by id, then by their JSON line (``_write_shard`` adds it)."""
    return doc["id"]


class WriteShards(beam.PTransform):
    """Records -> ``num_shards`` deterministic gzipped JSONL shards; outputs one ShardInfo each.

    Every shard is written, empty or not, so the file set depends only on ``num_shards``.
    """

    def __init__(
        self,
        output_dir: str,
        prefix: str,
        num_shards: int,
        shard_key: Callable[[Any], str],
        sort_key: Callable[[Any], Any],
    ) -> None:
        super().__init__()
        self.output_dir = output_dir
        self.prefix = prefix
        self.num_shards = num_shards
        self.shard_key = shard_key
        self.sort_key = sort_key

    def expand(self, records: beam.PCollection | tuple[beam.PCollection, ...]) -> beam.PCollection:
        n = self.num_shards
        parts = records if isinstance(records, tuple) else (records,)
        pipeline = parts[0].pipeline
        empties = pipeline | "AllShards" >> beam.Create([(i, None) for i in range(n)])
        if spill.runs_locally(pipeline):
            # The local runner would hold every record: sort in runs on disk instead (spill).
            entry = functools.partial(
                _shard_entry, shard_key=self.shard_key, sort_key=self.sort_key, num_shards=n
            )
            runs = spill.spill_each(parts, spill.spill_directory(self.prefix), entry)
            return (
                (*runs, empties)
                | "WithEmpty" >> beam.Flatten()
                | "GroupShard" >> beam.GroupByKey()
                | "Write" >> beam.Map(_write_runs, self.output_dir, self.prefix, n)
            )
        if isinstance(records, tuple):
            records = records | "Parts" >> beam.Flatten()
        keyed = records | "Key" >> beam.Map(lambda r, k=self.shard_key: (stable_shard(k(r), n), r))
        return (
            (keyed, empties)
            | "WithEmpty" >> beam.Flatten()
            | "GroupShard" >> beam.GroupByKey()
            | "Write" >> beam.Map(_write_shard, self.output_dir, self.prefix, n, self.sort_key)
        )


def write_documents(
    docs: beam.PCollection, output_dir: str, num_shards: int, label: str = "WriteDocs"
) -> beam.PCollection:
    return docs | label >> WriteShards(
        output_dir, "data/part", num_shards, lambda d: d["id"], document_sort_key
    )


def _dead_letter_shard_key(letter: DeadLetter) -> str:
    return letter["origin"]


def write_dead_letters(
    letters: beam.PCollection | tuple[beam.PCollection, ...],
    output_dir: str,
    num_shards: int,
    label: str = "WriteDead",
) -> beam.PCollection:
    return letters | label >> WriteShards(
        output_dir,
        f"{DEAD_LETTER_FOLDER}/part",
        num_shards,
        _dead_letter_shard_key,
        dead_letter_sort_key,
    )


def read_documents(path: str) -> Iterator[Document]:
    """Plain-Python reader of a finished stage output (tests, tools, the trainer's eval sets)."""
    manifest = read_manifest(path)
    for shard in manifest.shard_paths(path):
        for raw in storage.iter_lines(shard):
            yield validate_document(decode_line(raw))


def read_dead_letters(path: str) -> Iterator[DeadLetter]:
    import json

    manifest = read_manifest(path)
    for shard in manifest.dead_letter_paths(path):
        for raw in storage.iter_lines(shard):
            yield json.loads(raw)
