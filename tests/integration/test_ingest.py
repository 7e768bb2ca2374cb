"""Ingest on hostile input: every record is kept or dead-lettered with a counted reason."""

from __future__ import annotations

import base64
import gc
import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions
from apache_beam.runners.direct import direct_runner
from apache_beam.runners.portability.fn_api_runner import fn_runner

from pipelines import ingest
from pipelines.beam_io import read_dead_letters, read_documents
from pipelines.manifest import read_manifest
from pipelines.stage import (
    StageError,
    config_from_mapping,
    pipeline_runner,
    run_as_command,
    run_stage,
)

BIG_DOC_CHARS = 20 * 1024 * 1024


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


@pytest.fixture(scope="module")
def hostile_inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    good = [
        {"id": f"doc-{i}", "text": f"Document number {i} has ordinary text.", "source": "web"}
        for i in range(20)
    ]
    lines = [_line(d) for d in good]
    lines += [
        b'{"id": "trunc", "text": "cut off in the mid\n',  # truncated JSON
        b"not json at all\n",
        b'{"id": "bad-utf8", "text": "caf\xe9"}\n',  # latin-1 byte: invalid UTF-8
        _line({"id": "no-text", "source": "web"}),
        _line({"id": "num-text", "text": 42}),
        _line({"id": "empty", "text": "   \n\t "}),
        _line({"id": "doc-3", "text": "A second record claiming id doc-3.", "source": "web"}),
        _line(["a", "list"]),
        _line({"id": "big", "text": "word " * (BIG_DOC_CHARS // 5), "source": "web"}),
    ]
    (root / "mixed.jsonl").write_bytes(b"".join(lines))
    # A NUL-laden binary file given as an input.
    (root / "blob.jsonl").write_bytes(bytes(range(256)) * 64 + b"\n\x00\x00\x00\n")
    # A gzip file cut in half: the first records survive, the rest is one dead letter.
    gz = gzip.compress(
        b"".join(_line({"id": f"gz-{i}", "text": f"zipped {i}"}) for i in range(400))
    )
    (root / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    return root


@pytest.fixture(scope="module")
def hostile_run(hostile_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "ingest"
    run = run_stage(
        "ingest",
        ingest.build,
        ingest.IngestConfig(source="web"),
        [
            str(hostile_inputs / "mixed.jsonl"),
            str(hostile_inputs / "blob.jsonl"),
            str(hostile_inputs / "cut.jsonl.gz"),
        ],
        str(out),
        raw_records=True,
    )
    return out, run.manifest


def test_nothing_is_lost(hostile_run):
    out, manifest = hostile_run
    kept = list(read_documents(str(out)))
    letters = list(read_dead_letters(str(out)))
    assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
    assert len(kept) == manifest.records_out
    assert Counter(letter["reason"] for letter in letters) == manifest.dropped


def test_each_bad_record_gets_its_reason(hostile_run):
    _, manifest = hostile_run
    assert manifest.dropped == {
        "invalid_json": 2,  # the truncated line, "not json at all"
        "invalid_utf8": 65,  # mixed.jsonl's latin-1 line; 64 of blob.jsonl's 66 lines
        "binary_data": 2,  # blob.jsonl's lines that are UTF-8 but hold NUL bytes
        "missing_text": 1,
        "non_string_text": 1,
        "empty_text": 1,
        "duplicate_id": 1,
        "invalid_record": 1,  # a JSON list
        "too_long": 1,
        "unreadable_file": 1,  # the rest of the cut gzip file
    }


def test_good_records_survive_and_are_normalized(hostile_run):
    out, _ = hostile_run
    kept = {d["id"]: d for d in read_documents(str(out))}
    assert {f"doc-{i}" for i in range(20)} <= set(kept)
    assert all(d["source"] == "web" for d in kept.values() if d["id"].startswith("doc-"))
    # The truncated gzip still yields the records before the cut.
    assert any(i.startswith("gz-") for i in kept)


def test_duplicate_id_keeps_one_and_names_it(hostile_run):
    """Of the two records with id doc-3 (mixed.jsonl's lines 4 and 27), the one with the
    smaller hash of its text is kept: line 4's, the same on every run and runner."""
    out, _ = hostile_run
    kept = {d["id"]: d for d in read_documents(str(out))}
    assert kept["doc-3"]["text"] == "Document number 3 has ordinary text."
    [letter] = [x for x in read_dead_letters(str(out)) if x["reason"] == "duplicate_id"]
    assert letter["record"]["text"] == "A second record claiming id doc-3."
    assert letter["origin"].endswith("mixed.jsonl:27"), letter["origin"]
    assert letter["duplicate_of"].endswith("mixed.jsonl:4"), letter["duplicate_of"]


def test_binary_bytes_are_kept_verbatim_in_dead_letters(hostile_run, hostile_inputs):
    """Every line of the binary file is a letter whose record gives back the line's exact
    bytes: base64 where they are not UTF-8, the text itself where they are (NUL bytes)."""
    out, _ = hostile_run
    binary = [x for x in read_dead_letters(str(out)) if "blob.jsonl" in x["origin"]]
    assert {x["reason"] for x in binary} == {"invalid_utf8", "binary_data"}, binary

    def raw(letter) -> bytes:
        record = letter["record"]
        return base64.b64decode(record["base64"]) if isinstance(record, dict) else record.encode()

    by_line = sorted(binary, key=lambda x: int(x["origin"].rsplit(":", 1)[1]))
    recovered = b"".join(raw(x) + b"\n" for x in by_line)  # a letter's line, its newline cut
    assert recovered == (hostile_inputs / "blob.jsonl").read_bytes()


def test_big_document_is_kept_when_allowed(tmp_path):
    src = tmp_path / "big.jsonl"
    src.write_bytes(_line({"id": "big", "text": "word " * (BIG_DOC_CHARS // 5)}))
    config = ingest.IngestConfig(source="web", max_chars=BIG_DOC_CHARS + 1)
    run = run_stage(
        "ingest", ingest.build, config, [str(src)], str(tmp_path / "o"), raw_records=True
    )
    assert run.manifest.records_out == 1
    (doc,) = read_documents(str(tmp_path / "o"))
    assert len(doc["text"]) == BIG_DOC_CHARS - 1  # trailing space stripped


def test_parquet_and_hf_dataset_inputs(tmp_path):
    rows = [{"text": f"parquet row {i}", "url": f"http://example.com/{i}"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "part.parquet")
    import datasets

    datasets.Dataset.from_list(
        [{"text": f"hf row {i}", "label": i} for i in range(7)]
    ).save_to_disk(str(tmp_path / "hfds"))
    run = run_stage(
        "ingest",
        ingest.build,
        ingest.IngestConfig(source="web"),
        [str(tmp_path / "part.parquet"), f"hf:{tmp_path / 'hfds'}"],
        str(tmp_path / "o"),
        raw_records=True,
    )
    assert (run.manifest.records_in, run.manifest.records_out) == (12, 12)
    docs = {d["text"]: d for d in read_documents(str(tmp_path / "o"))}
    assert docs["parquet row 3"]["metadata"]["url"] == "http://example.com/3"
    assert docs["hf row 6"]["metadata"]["label"] == 6


def test_same_input_same_bytes_in_process_and_multi_processing(hostile_inputs, tmp_path, digest):
    inputs = [str(hostile_inputs / "mixed.jsonl"), str(hostile_inputs / "cut.jsonl.gz")]
    config = ingest.IngestConfig(source="web")
    run_stage("ingest", ingest.build, config, inputs, str(tmp_path / "a"), raw_records=True)
    run_stage(
        "ingest",
        ingest.build,
        config,
        inputs,
        str(tmp_path / "b"),
        raw_records=True,
        beam_args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
    )
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert read_manifest(str(tmp_path / "a")).records_in > 0


def test_direct_runner_is_the_in_process_fn_api_runner(hostile_inputs, tmp_path, monkeypatch):
    """``--runner=DirectRunner`` runs on Beam's FnApiRunner, never through Beam's switching
    DirectRunner (which would first try to fetch and run Prism); other runners pass by name."""

    def refuse(*args, **kwargs):
        raise AssertionError("the stage went through Beam's switching DirectRunner")

    ran = []
    real_run = fn_runner.FnApiRunner.run_pipeline

    def spy(self, pipeline, options):
        ran.append(options.view_as(DirectOptions).direct_num_workers)
        return real_run(self, pipeline, options)

    monkeypatch.setattr(direct_runner.SwitchingDirectRunner, "run_pipeline", refuse)
    monkeypatch.setattr(fn_runner.FnApiRunner, "run_pipeline", spy)
    run = run_stage(
        "ingest",
        ingest.build,
        ingest.IngestConfig(source="web"),
        [str(hostile_inputs / "mixed.jsonl")],
        str(tmp_path / "o"),
        raw_records=True,
        beam_args=["--runner=DirectRunner", "--direct_num_workers=1"],
    )
    assert ran == [1]  # the stage's options reached the runner
    assert run.manifest.records_out > 0
    dataflow = PipelineOptions(["--runner=DataflowRunner"])
    assert pipeline_runner(dataflow) == "DataflowRunner"
    # Every spelling Beam reads as its DirectRunner; nothing else.
    for name in ("directrunner", "Direct", "apache_beam.runners.direct.direct_runner.DirectRunner"):
        assert isinstance(
            pipeline_runner(PipelineOptions([f"--runner={name}"])), fn_runner.FnApiRunner
        )
    for name in ("Dataflow", "PrismRunner", "mypackage.DirectRunner"):
        assert pipeline_runner(PipelineOptions([f"--runner={name}"])) == name


def test_heap_frozen_during_the_run_and_at_exit(hostile_inputs, tmp_path, monkeypatch):
    """Objects that outlive a stage's run are out of the collector's sight while it runs,
    and back after it; a stage command also freezes what it leaves for the exit."""
    frozen_during_run = []
    real_run = fn_runner.FnApiRunner.run_pipeline

    def spy(self, pipeline, options):
        frozen_during_run.append(gc.get_freeze_count())
        return real_run(self, pipeline, options)

    monkeypatch.setattr(fn_runner.FnApiRunner, "run_pipeline", spy)
    config = ingest.IngestConfig(source="web")
    inputs = [str(hostile_inputs / "mixed.jsonl")]
    try:
        run_stage("ingest", ingest.build, config, inputs, str(tmp_path / "o"), raw_records=True)
        assert frozen_during_run[0] > 1000  # the imported modules, Beam's included
        assert gc.get_freeze_count() == 0
        # A heap the caller froze stays frozen (Airflow's LocalExecutor freezes before forking).
        gc.freeze()
        frozen_before = gc.get_freeze_count()
        run_stage("ingest", ingest.build, config, inputs, str(tmp_path / "p"), raw_records=True)
        assert gc.get_freeze_count() >= frozen_before
        gc.unfreeze()
        made_by_main: list[list[int]] = []
        run_as_command(lambda: made_by_main.extend([i] for i in range(10_000)))
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()


def test_unknown_config_field_is_named():
    with pytest.raises(StageError, match="max_char"):
        config_from_mapping(ingest.IngestConfig, {"max_char": 5})


def test_cli_refuses_multi_threading_and_bad_config(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text('{"text": "hi"}\n')
    base = [
        sys.executable,
        "-m",
        "pipelines.ingest",
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o"),
    ]
    bad_mode = subprocess.run(
        [*base, "--direct_running_mode=multi_threading"], capture_output=True, text=True
    )
    assert bad_mode.returncode == 2
    assert "multi_threading is not supported" in bad_mode.stderr
    bad_config = subprocess.run(
        [*base, "--config", '{"min_chars": 0}'], capture_output=True, text=True
    )
    assert bad_config.returncode == 2
    assert "min_chars" in bad_config.stderr
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.ingest",
            "--input",
            str(tmp_path / "nope*.jsonl"),
            "--output",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2
    assert "matches no files" in missing.stderr
    assert not (tmp_path / "o").exists()  # refused before the output folder was touched


def test_parquet_columns_json_lacks_are_converted(tmp_path):
    """Timestamp, date, time, duration, binary and decimal columns (and lists and structs of
    them) reach metadata in one JSON form; a dropped row's dead letter carries them too."""
    import datetime
    import decimal

    at = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456)
    table = pa.table(
        {
            "text": ["a row with typed columns", None],
            "at": pa.array([at, at], pa.timestamp("us")),
            "at_ns": pa.array([at, at], pa.timestamp("ns", tz="UTC")),
            "day": pa.array([at.date()] * 2, pa.date32()),
            "clock": pa.array([at.time()] * 2, pa.time64("us")),
            "took": pa.array([datetime.timedelta(seconds=90)] * 2, pa.duration("ms")),
            "blob": pa.array([b"\x00\xff", b"\x01"], pa.binary()),
            "price": pa.array([decimal.Decimal("19.90")] * 2, pa.decimal128(5, 2)),
            "seen": pa.array([[at], []], pa.list_(pa.timestamp("s"))),
            "info": pa.array(
                [{"day": at.date(), "n": 1}] * 2,
                pa.struct([("day", pa.date32()), ("n", pa.int64())]),
            ),
        }
    )
    pq.write_table(table, tmp_path / "typed.parquet")
    run = run_stage(
        "ingest",
        ingest.build,
        ingest.IngestConfig(source="web"),
        [str(tmp_path / "typed.parquet")],
        str(tmp_path / "o"),
        raw_records=True,
    )
    assert (run.manifest.records_out, run.manifest.dropped) == (1, {"missing_text": 1})
    (doc,) = read_documents(str(tmp_path / "o"))
    expected = {
        "at": "2024-05-06T07:08:09.123456",
        "at_ns": "2024-05-06T07:08:09.123456+00:00",
        "day": "2024-05-06",
        "clock": "07:08:09.123456",
        "took": "P0DT90S",
        "blob": {"base64": "AP8="},
        "price": "19.90",
        "seen": ["2024-05-06T07:08:09"],
        "info": {"day": "2024-05-06", "n": 1},
    }
    assert doc["metadata"] == expected
    (letter,) = read_dead_letters(str(tmp_path / "o"))
    assert letter["record"] == {
        **expected,
        "text": None,
        "blob": {"base64": "AQ=="},
        "seen": [],
    }


def test_a_value_without_json_form_is_dropped_with_its_field_named():
    config = ingest.IngestConfig(source="web")
    [out] = ingest.to_document(("f:1", {"text": "hello there", "odd": [object()]}), config)
    letter = out.value
    assert letter["reason"] == "unrepresentable_metadata"
    assert "['odd'][0]" in letter["detail"]
    assert letter["record"]["odd"] == [{"unrepresentable": "builtins.object"}]


@pytest.mark.parametrize(
    ("input_path", "output_path"),
    [
        ("docs", "docs"),  # --input X --output X
        ("out/ingest", "out"),  # the output holds the input
        ("docs", "docs/o"),  # the output inside a folder input
        ("docs/*.jsonl", "docs/o"),  # a glob: its folder part
        ("docs/../docs/a.jsonl", "./docs"),  # spelled another way
    ],
)
def test_an_output_overlapping_an_input_is_refused_before_it_is_cleared(
    tmp_path, monkeypatch, input_path, output_path
):
    monkeypatch.chdir(tmp_path)
    for folder in ("docs", "out/ingest"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "a.jsonl").write_text('{"text": "kept"}\n')
    with pytest.raises(StageError, match="overlaps") as refused:
        run_stage(
            "ingest",
            ingest.build,
            ingest.IngestConfig(),
            [input_path],
            output_path,
            raw_records=True,
        )
    assert repr(output_path) in str(refused.value) and repr(input_path) in str(refused.value)
    assert (tmp_path / "docs" / "a.jsonl").exists() and (tmp_path / "out/ingest/a.jsonl").exists()


def test_overlap_is_judged_on_normalized_paths_and_urls():
    from pipelines.stage import overlaps

    assert overlaps("gs://bucket/out", "gs://bucket/out/ingest/")
    assert overlaps("gs://bucket/out/ingest", "gs://bucket/out")
    assert overlaps("gs://bucket/a/../out/", "gs://bucket/out/data/*.jsonl.gz")
    assert overlaps("gs://bucket/out/x", "gs://bucket/out*/x")  # a glob: its literal start
    assert overlaps("/tmp/out", "file:///tmp/out/x.jsonl")
    assert overlaps("/data/raw/mine", "hf:/data/raw@train")  # a local Hugging Face folder
    assert not overlaps("gs://bucket/out", "gs://bucket/output")
    assert not overlaps("gs://bucket/out", "gs://other/out")
    assert not overlaps("gs://bucket/out", "/bucket/out")
    assert not overlaps("/tmp/out", "/tmp/in/*.jsonl")
    assert not overlaps("/tmp/out", "/tmp/in-*.jsonl")  # no match can lie in /tmp/out
