"""Sorted runs on local disk: the local runner's bounded-memory shuffle.

The in-process runner keeps every GroupByKey's values in memory, so a stage that groups the
corpus (ingest by id; writing shards of documents it did not read as shards; every stage's
dead letters) would hold the corpus. On a local runner (``runs_locally``) these shuffles spill
instead, like an external merge sort:

1. ``SpillRuns`` buffers up to ``RUN_BYTES`` of encoded entries, then writes them
   as sorted *runs*, one file per partition (an output shard, a key range), under a temporary
   directory, and yields ``(partition, run path)``;
2. a GroupByKey moves only the run paths;
3. a partition's consumer merges its runs (``merge_runs``) in sorted order, holding one entry
   per run (at most ``MAX_FAN_IN`` runs at once), and deletes them.

Distributed runners (Dataflow) have a real shuffle, and their workers share no disk, so there
the same transforms are a plain GroupByKey. Both give the same groups in the same order, hence
the same bytes downstream.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import heapq
import itertools
import os
import pickle
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import apache_beam as beam
import xxhash
from apache_beam.transforms.window import GlobalWindows

# Encoded entries one spilling step buffers before it writes a run. A stage has a few such steps
# (fuzzy dedup's signing feeds three), so this bounds its peak together with the runner's own.
RUN_BYTES = 16 << 20
MAX_FAN_IN = 128  # runs merged at once; more are first merged into longer runs
GROUP_PARTITIONS = 16  # key ranges of ``GroupByKey``: merged in parallel on a multi-worker runner
# Runners whose workers are this process or its children, so they share this machine's disk.
_LOCAL_RUNNERS = {"SwitchingDirectRunner", "DirectRunner", "BundleBasedDirectRunner", "FnApiRunner"}


_PREFIX = "slipway-spill-"
OWNER = "OWNER"  # in each spill directory: locked by the process that made it
_HELD: list[Any] = []  # the owner files' handles, open (so locked) until the process exits


def runs_locally(pipeline: beam.Pipeline) -> bool:
    """True when ``pipeline`` runs on a direct runner (every worker on this machine)."""
    return type(pipeline.runner).__name__ in _LOCAL_RUNNERS


def spill_directory(label: str) -> str:
    """A fresh directory for one transform's runs (``label``: its name, for whoever looks in
    ``TMPDIR``), removed when this process exits (the in-process runner's workers are this
    process; consumers delete runs as they merge them).

    A process that is killed cannot remove its directories, so each holds an ``flock`` on its
    ``OWNER`` file for as long as the process (or a forked worker) lives, and every new one
    first (once per process) removes the directories whose lock nobody holds any more.
    """
    _remove_abandoned_once(tempfile.gettempdir())
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", label)
    directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{safe}-")
    # Locked before it gets its name: a sweeper never sees an owner file that is not held.
    pending = os.path.join(directory, OWNER + ".new")
    handle = open(pending, "w")  # noqa: SIM115 - held open (and locked) until exit
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(pending, os.path.join(directory, OWNER))
    _HELD.append(handle)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


@functools.cache
def _remove_abandoned_once(parent: str) -> None:
    # Once per process and directory: a stage makes a dozen spill directories while it builds.
    remove_abandoned(parent)


def remove_abandoned(parent: str) -> list[str]:
    """Remove the spill directories under ``parent`` whose owner lock is free (their process
    was killed); returns them. Directories without an owner file are left alone."""
    removed = []
    for entry in os.scandir(parent):
        if not entry.name.startswith(_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            handle = open(os.path.join(entry.path, OWNER))  # noqa: SIM115 - closed below
        except OSError:
            continue  # no owner file: not ours to judge
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live process holds it
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def write_run(path: str, entries: Iterable[Any]) -> None:
    with open(path, "wb") as handle:
        pickler = pickle.Pickler(handle, protocol=pickle.HIGHEST_PROTOCOL)
        for entry in entries:
            pickler.dump(entry)
            pickler.clear_memo()  # entries are independent; the memo would only grow


def read_run(path: str) -> Iterator[Any]:
    with open(path, "rb") as handle:
        unpickler = pickle.Unpickler(handle)
        while True:
            try:
                yield unpickler.load()
            except EOFError:
                return


def merge_runs(paths: Iterable[str], key: Callable[[Any], Any] | None = None) -> Iterator[Any]:
    """The entries of sorted runs in sorted order; each run is deleted once read to its end.
    More than ``MAX_FAN_IN`` runs are first merged in groups into longer runs (so a merge never
    holds more than ``MAX_FAN_IN`` files open)."""
    paths = list(paths)
    while len(paths) > MAX_FAN_IN:
        longer = []
        for start in range(0, len(paths), MAX_FAN_IN):
            group = paths[start : start + MAX_FAN_IN]
            longer.append(f"{group[0]}.{uuid.uuid4().hex[:8]}")
            write_run(longer[-1], _merge(group, key))
        paths = longer
    return _merge(paths, key)


def _merge(paths: list[str], key: Callable[[Any], Any] | None) -> Iterator[Any]:
    def consume(path: str) -> Iterator[Any]:
        yield from read_run(path)
        os.remove(path)

    return heapq.merge(*(consume(p) for p in paths), key=key)


class SpillRuns(beam.DoFn):
    """Elements -> ``(partition, run path)``: ``entry(element)`` gives ``(partition, entry,
    size in bytes)``; each run holds one partition's entries sorted by ``sort_key``."""

    def __init__(
        self,
        directory: str,
        entry: Callable[[Any], tuple[int, Any, int]],
        sort_key: Callable[[Any], Any] | None = None,
    ) -> None:
        self.directory = directory
        self.entry = entry
        self.sort_key = sort_key
        self.run_bytes = RUN_BYTES

    def start_bundle(self) -> None:
        self._buffer: dict[int, list[Any]] = {}
        self._bytes = 0

    def process(self, element: Any) -> Iterator[tuple[int, str]]:
        partition, entry, size = self.entry(element)
        self._buffer.setdefault(partition, []).append(entry)
        self._bytes += size
        if self._bytes >= self.run_bytes:
            yield from self._flush()

    def finish_bundle(self) -> Iterator[Any]:
        for run in self._flush():
            yield GlobalWindows.windowed_value(run)

    def _flush(self) -> Iterator[tuple[int, str]]:
        run_id = uuid.uuid4().hex
        for partition in sorted(self._buffer):
            path = os.path.join(self.directory, f"{partition:05d}-{run_id}.run")
            write_run(path, sorted(self._buffer[partition], key=self.sort_key))
            yield (partition, path)
        self._buffer = {}
        self._bytes = 0


def _group_entry(item: tuple[Any, Any]) -> tuple[int, tuple[Any, bytes], int]:
    key, value = item
    encoded_key = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
    encoded = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    # A key range, not an output shard: any stable hash will do (beam_io imports this module).
    partition = xxhash.xxh64_intdigest(encoded_key) % GROUP_PARTITIONS
    return partition, (key, encoded), len(encoded_key) + len(encoded)


def _entry_key(entry: tuple[Any, bytes]) -> Any:
    return entry[0]


def _merge_groups(item: tuple[int, Iterable[str]]) -> Iterator[tuple[Any, list[Any]]]:
    _, paths = item
    merged = merge_runs(paths, key=_entry_key)
    for key, entries in itertools.groupby(merged, key=_entry_key):
        yield (key, [pickle.loads(encoded) for _, encoded in entries])


def spill_each(
    parts: Sequence[beam.PCollection],
    directory: str,
    entry: Callable[[Any], tuple[int, Any, int]],
    sort_key: Callable[[Any], Any] | None = None,
) -> list[beam.PCollection]:
    """``SpillRuns`` on each collection where it is made: a Flatten of the collections
    themselves would make the in-process runner materialize them, the very thing spilling
    avoids. Flatten the returned ``(partition, run path)`` collections instead."""
    return [
        part | f"SpillRuns{i}" >> beam.ParDo(SpillRuns(directory, entry, sort_key))
        for i, part in enumerate(parts)
    ]


def _spill_groups(pcolls: Sequence[beam.PCollection], directory: str) -> beam.PCollection:
    """``(key, value)`` collections -> ``(key, [value, ...])`` merged from spilled runs."""
    return (
        spill_each(pcolls, directory, _group_entry, _entry_key)
        | "AllRuns" >> beam.Flatten()
        | "GroupRuns" >> beam.GroupByKey()
        | "MergeRuns" >> beam.FlatMap(_merge_groups)
    )


class GroupByKey(beam.PTransform):
    """``beam.GroupByKey`` that, on a local runner, holds one run's buffer and one key's values
    at a time instead of every value (see the module). Keys must order among themselves (one
    type per collection: str, int, tuples of them) and pickle the same way every time."""

    def expand(self, pairs: beam.PCollection) -> beam.PCollection:
        if not runs_locally(pairs.pipeline):
            return pairs | "Group" >> beam.GroupByKey()
        return _spill_groups([pairs], spill_directory(self.label))


def _untag(item: tuple[Any, list[tuple[str, Any]]], tags: tuple[str, ...]) -> tuple[Any, dict]:
    key, tagged = item
    grouped: dict[str, list[Any]] = {tag: [] for tag in tags}
    for tag, value in tagged:
        grouped[tag].append(value)
    return key, grouped


class CoGroupByKey(beam.PTransform):
    """``beam.CoGroupByKey`` of a dict of collections, spilled like ``GroupByKey`` on a local
    runner: ``(key, {tag: [values]})`` for every key of any input."""

    def expand(self, inputs: dict[str, beam.PCollection]) -> beam.PCollection:
        pipeline = next(iter(inputs.values())).pipeline
        if not runs_locally(pipeline):
            return inputs | "CoGroup" >> beam.CoGroupByKey()
        tagged = [
            pcoll | f"Tag[{tag}]" >> beam.MapTuple(lambda k, v, tag=tag: (k, (tag, v)))
            for tag, pcoll in inputs.items()
        ]
        return _spill_groups(tagged, spill_directory(self.label)) | "Untag" >> beam.Map(
            _untag, tuple(inputs)
        )
