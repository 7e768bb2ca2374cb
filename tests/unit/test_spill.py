"""The local runner's spilled shuffles: same groups and same shard bytes as Beam's GroupByKey,
with bounded buffers (tiny runs here, so every shuffle is many runs), and no runs left."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipelines import beam_io, spill


@pytest.fixture()
def tiny_runs(monkeypatch, tmp_path):
    """Runs of ~1 KB, spilled under tmp_path (to see what is left behind): (directories, runs)."""
    monkeypatch.setattr(spill, "RUN_BYTES", 1024)
    made: list[Path] = []

    def directory(label: str) -> str:
        made.append(tmp_path / f"spill-{len(made)}")
        made[-1].mkdir()
        return str(made[-1])

    monkeypatch.setattr(spill, "spill_directory", directory)
    write_run = spill.write_run

    def counted(path: str, entries) -> None:
        runs.append(path)
        write_run(path, entries)

    runs: list[str] = []
    monkeypatch.setattr(spill, "write_run", counted)
    return made, runs


def _pairs(n: int) -> list[tuple[str, dict]]:
    rng = random.Random(3)
    return [
        (f"key-{rng.randrange(n // 3):04d}", {"i": i, "pad": "x" * rng.randrange(80)})
        for i in range(n)
    ]


def test_spilled_group_by_key_gives_beams_groups(tiny_runs):
    pairs = _pairs(600)
    expected = defaultdict(list)
    for key, value in pairs:
        expected[key].append(value["i"])
    with beam.Pipeline() as pipeline:
        assert spill.runs_locally(pipeline)
        grouped = (
            pipeline
            | beam.Create(pairs)
            | spill.GroupByKey()
            | beam.MapTuple(lambda key, values: (key, sorted(v["i"] for v in values)))
        )
        assert_that(grouped, equal_to(sorted(expected.items())))
    (directory,), runs = tiny_runs
    assert len(runs) > 20
    assert not list(directory.iterdir())  # every run was merged, then deleted


@pytest.mark.parametrize("fan_in", [128, 3])
def test_sorted_runs_merge_in_order(fan_in, monkeypatch, tmp_path):
    """Eight runs merged at once, or (fan-in 3) through two levels of longer runs."""
    monkeypatch.setattr(spill, "MAX_FAN_IN", fan_in)
    rng = random.Random(5)
    entries = [(rng.randrange(100), str(i)) for i in range(500)]
    paths = []
    for k in range(0, 500, 70):  # 8 runs, each sorted on its own
        paths.append(str(tmp_path / f"run-{k}"))
        spill.write_run(paths[-1], sorted(entries[k : k + 70]))
    assert list(spill.merge_runs(paths)) == sorted(entries)
    assert not list(tmp_path.iterdir())


def _letters(n: int) -> list[dict]:
    rng = random.Random(7)
    return [
        {
            "origin": f"file-{rng.randrange(4)}.jsonl:{rng.randrange(50)}",
            "record": {"id": f"doc-{rng.randrange(n // 2)}", "text": "t" * rng.randrange(200)},
            "reason": rng.choice(["a", "b"]),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("spilled", [True, False])
def test_written_shards_are_the_bytes_of_the_records_sorted(
    spilled, tiny_runs, monkeypatch, tmp_path
):
    """Spilled or grouped by Beam, a shard is ``_write_shard`` of the shard's records."""
    if not spilled:
        monkeypatch.setattr(spill, "runs_locally", lambda pipeline: False)
    letters = _letters(400)
    out = tmp_path / "out"
    with beam.Pipeline() as pipeline:
        beam_io.write_dead_letters(pipeline | beam.Create(letters), str(out), 3)
    by_shard = defaultdict(list)
    for letter in letters:
        by_shard[beam_io.stable_shard(letter["origin"], 3)].append(letter)
    reference = tmp_path / "reference"
    for index in range(3):
        beam_io._write_shard(
            (index, by_shard[index]),
            str(reference),
            "dead_letter/part",
            3,
            beam_io.dead_letter_sort_key,
        )
        name = beam_io.shard_name("dead_letter/part", index, 3)
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    directories, runs = tiny_runs
    if spilled:
        assert len(runs) > 3 * 10  # ~1 KB runs: the shards were merged from many
        assert not list(directories[0].iterdir())
    else:
        assert not directories and not runs


def test_spilled_co_group_by_key_gives_beams_groups(tiny_runs):
    rng = random.Random(11)
    left = [((rng.randrange(40), f"n{rng.randrange(3)}"), i) for i in range(300)]
    right = [((rng.randrange(60), f"n{rng.randrange(3)}"), f"r{i}") for i in range(200)]

    def canonical(item):
        key, grouped = item  # as text, so that equal groups count as one element
        return json.dumps([key, {tag: sorted(values) for tag, values in grouped.items()}])

    with beam.Pipeline() as pipeline:
        inputs = {
            "left": pipeline | "L" >> beam.Create(left),
            "right": pipeline | "R" >> beam.Create(right),
        }
        ours = inputs | "Spilled" >> spill.CoGroupByKey() | "Ours" >> beam.Map(canonical)
        beams = inputs | beam.CoGroupByKey() | "Beams" >> beam.Map(canonical)
        assert_that(
            (ours, beams)
            | beam.Flatten()
            | beam.combiners.Count.PerElement()
            | beam.Map(lambda counted: counted[1]),
            equal_to([2] * len({k for k, _ in left} | {k for k, _ in right})),
        )
    _, runs = tiny_runs
    assert len(runs) > 10


_HOLDER = """
import sys, time
from pipelines import spill
print(spill.spill_directory(sys.argv[1]), flush=True)
time.sleep(120)
"""


def test_directories_of_killed_processes_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    """A killed process cannot clean up its spill directories; the next one made removes
    them, by their free owner lock, and leaves a live process's and foreign ones alone."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, label], env=env, stdout=subprocess.PIPE, text=True
        )
        for label in ("killed", "alive")
    ]
    try:
        killed, alive = (Path(h.stdout.readline().strip()) for h in holders)
        assert killed.parent == alive.parent == tmp_path
        (killed / "00000-run.run").write_bytes(b"left behind")
        foreign = tmp_path / "slipway-spill-made-by-hand"
        foreign.mkdir()
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        fresh = Path(spill.spill_directory("next"))
        assert not killed.exists()
        assert alive.is_dir() and foreign.is_dir() and (fresh / spill.OWNER).is_file()
        assert spill.remove_abandoned(str(tmp_path)) == []  # ours is held by this process
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert spill.remove_abandoned(str(tmp_path)) == [str(alive)]
