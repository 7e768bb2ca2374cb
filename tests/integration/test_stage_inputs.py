"""What a stage reads and writes at its edges: glob inputs over stage outputs, ``hf:`` Hub
names, and strict JSON out whatever floats came in."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines import ingest, quality
from pipelines.beam_io import read_dead_letters, read_documents
from pipelines.stage import StageError, overlaps, run_stage


def _line(obj: object) -> str:
    return json.dumps(obj) + "\n"


def _ingest(inputs: list[str], output: Path | str, num_shards: int = 2):
    return run_stage(
        "ingest",
        ingest.build,
        ingest.IngestConfig(source="web"),
        inputs,
        str(output),
        num_shards=num_shards,
        raw_records=True,
    )


@pytest.fixture
def ingested(tmp_path) -> Path:
    """A finished stage output with documents and one dead letter (a line that is not JSON)."""
    src = tmp_path / "raw.jsonl"
    src.write_text(
        _line({"id": "a", "text": "the first document"})
        + "not json\n"
        + _line({"id": "b", "text": "the second document"})
    )
    out = tmp_path / "out" / "ingest"
    run = _ingest([str(src)], out)
    assert (run.manifest.records_out, run.manifest.dropped) == (2, {"invalid_json": 1})
    return out


def test_a_glob_over_a_stage_output_does_not_read_its_dead_letters(ingested, tmp_path):
    """``out/ingest/**/*.jsonl.gz`` matches ``dead_letter/`` shards too: read as documents,
    each letter would be dropped as a record without text."""
    run = _ingest([str(ingested / "**" / "*.jsonl.gz")], tmp_path / "again")
    assert (run.manifest.records_in, run.manifest.records_out, run.manifest.dropped) == (2, 2, {})


def test_a_glob_over_a_whole_stage_output_reads_its_documents_only(ingested, tmp_path):
    """``out/ingest/**`` also matches the output's manifest.json, whose lines are no
    documents: left out as the dead letters are (named without a wildcard, it is read)."""
    run = _ingest([str(ingested / "**")], tmp_path / "again")
    assert (run.manifest.records_in, run.manifest.records_out, run.manifest.dropped) == (2, 2, {})
    named = _ingest([str(ingested / "manifest.json")], tmp_path / "named")
    assert named.manifest.records_out == 0 and named.manifest.records_in > 0


def test_a_glob_matching_only_dead_letters_is_refused_before_the_output_is_cleared(
    ingested, tmp_path
):
    out = tmp_path / "again"
    out.mkdir()
    (out / "last-run.txt").write_text("kept")
    pattern = str(ingested / "dead_lette?" / "*.jsonl.gz")  # a wildcard reaches them
    with pytest.raises(StageError, match="matches only files in dead_letter/ folders") as refused:
        _ingest([pattern], out)
    assert repr(pattern) in str(refused.value)
    assert (out / "last-run.txt").read_text() == "kept"


def _strict_lines(folder: Path) -> list[object]:
    """Every JSON line of every shard below ``folder``, parsed as strict JSON."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"not JSON: {constant}")

    return [
        json.loads(line, parse_constant=refuse)
        for path in sorted(folder.rglob("*.jsonl.gz"))
        for line in gzip.decompress(path.read_bytes()).decode().splitlines()
    ]


def test_non_finite_floats_are_written_as_strict_json_by_ingest(tmp_path):
    """NaN and infinities (JSON lines with Python's NaN, a Parquet float column) reach
    documents and dead letters as the strings "NaN", "Infinity", "-Infinity"; no record is
    lost for them."""
    (tmp_path / "raw.jsonl").write_text(
        '{"id": "n1", "text": "not a number", "score": NaN, "hi": Infinity,'
        ' "metadata": {"lo": -Infinity, "ok": 1.5}}\n'
        '{"id": "n2", "score": NaN}\n'  # no text: a dead letter that holds the NaN
    )
    pq.write_table(
        pa.table({"text": ["a parquet row"], "x": pa.array([float("nan")], pa.float64())}),
        tmp_path / "rows.parquet",
    )
    out = tmp_path / "out"
    run = _ingest([str(tmp_path / "raw.jsonl"), str(tmp_path / "rows.parquet")], out)
    assert (run.manifest.records_in, run.manifest.records_out) == (3, 2)
    assert run.manifest.dropped == {"missing_text": 1}
    assert len(_strict_lines(out)) == 3  # every line of every shard parses as strict JSON
    docs = {d["text"]: d["metadata"] for d in read_documents(str(out))}
    assert docs["not a number"] == {"score": "NaN", "hi": "Infinity", "lo": "-Infinity", "ok": 1.5}
    assert docs["a parquet row"] == {"x": "NaN"}
    (letter,) = read_dead_letters(str(out))
    assert letter["record"] == {"id": "n2", "score": "NaN"}


def test_non_finite_floats_are_written_as_strict_json_by_any_stage(tmp_path):
    """A document stage fed a JSON line holding NaN (not through ingest) keeps the document
    and writes the value as a string."""
    (tmp_path / "in.jsonl").write_text(
        '{"id": "q", "text": "a few words of text here", "source": "web",'
        ' "metadata": {"score": NaN, "range": [-Infinity, Infinity]}}\n'
    )
    out = tmp_path / "out"
    config = json.dumps({"sources": {"web": {"enabled": False}}})
    manifest = quality.main(
        ["--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--config", config]
    ).manifest
    assert (manifest.records_in, manifest.records_out) == (1, 1)
    (doc,) = _strict_lines(out)
    assert doc["metadata"]["score"] == "NaN"
    assert doc["metadata"]["range"] == ["-Infinity", "Infinity"]


def test_an_hf_hub_dataset_is_no_local_path(tmp_path, monkeypatch):
    """``hf:org/name`` names a Hub dataset: an output folder ``./org/name`` does not overlap
    it, and the stage reads the Hub's dataset, not that (just cleared) folder."""
    import datasets

    monkeypatch.chdir(tmp_path)
    loaded: list[tuple[str, str | None, str]] = []

    def load_dataset(path: str, name: str | None = None, split: str = "train", **_: object):
        loaded.append((path, name, split))
        return datasets.Dataset.from_list([{"text": f"hub row {i}"} for i in range(3)])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert not overlaps("org/name", "hf:org/name")
    run = _ingest(["hf:org/name"], "org/name")
    assert (run.manifest.records_in, run.manifest.records_out) == (3, 3)
    assert set(loaded) == {("hf://datasets/org/name", None, "train")}
    assert sorted(d["text"] for d in read_documents("org/name")) == [
        "hub row 0",
        "hub row 1",
        "hub row 2",
    ]


def test_an_hf_name_of_a_local_folder_with_files_still_overlaps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    (local / "train.jsonl").write_text(_line({"text": "a local dataset file"}))
    assert overlaps("org/name", "hf:org/name")  # datasets would read this folder
    assert overlaps("org", "hf:org/name:config@train")
    assert not overlaps("elsewhere", "hf:org/name")
    with pytest.raises(StageError, match="overlaps"):
        _ingest(["hf:org/name"], "org/name")
    assert (local / "train.jsonl").exists()
