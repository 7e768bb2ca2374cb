"""Input resolution: what a spec expands to, and clear refusals."""

from __future__ import annotations

import pytest

from pipelines.beam_io import InputError, resolve_inputs
from pipelines.manifest import Manifest, ShardInfo


def _manifest(fmt: str) -> Manifest:
    return Manifest(
        stage="train_tokenizer",
        config={},
        inputs=[],
        records_in=1,
        records_out=1,
        dropped={},
        shards=[ShardInfo("tokenizer.model", 1, 1, "x")],
        dead_letter_shards=[],
        format=fmt,
    )


def test_artifact_output_is_not_read_as_documents(tmp_path):
    _manifest("slipway-artifact/v1").write(str(tmp_path))
    with pytest.raises(InputError, match="not documents"):
        resolve_inputs([str(tmp_path)])


def test_directory_expands_to_supported_files_in_order(tmp_path):
    (tmp_path / "b.jsonl.gz").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.parquet").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("ignored: not a document file")
    sources = resolve_inputs([str(tmp_path)])
    assert [(s.kind, s.path.rsplit("/", 1)[1]) for s in sources] == [
        ("jsonl", "b.jsonl.gz"),
        ("parquet", "a.parquet"),
    ]


def test_hf_spec_is_split_into_shards():
    sources = resolve_inputs(["hf:org/name:cfg@validation"], hf_shards=3)
    assert [(s.path, s.hf_config, s.hf_split, s.shard) for s in sources] == [
        ("org/name", "cfg", "validation", i) for i in range(3)
    ]


def test_glob_without_matches_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no files"):
        resolve_inputs([str(tmp_path / "*.jsonl")])


def test_gzip_stream_writes_gzip_files_bytes_whatever_the_pieces():
    """Shards are compressed as their lines come; the file must be what GzipFile writes for the
    whole payload at once (mtime 0, level 6), however the payload was cut."""
    import gzip
    import io
    import random

    from pipelines import storage

    rng = random.Random(0)
    payload = "".join(
        f'{{"id":"d{i}","text":"{"word " * rng.randint(0, 400)}é😀"}}\n' for i in range(3000)
    ).encode()
    reference = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=reference, mtime=0, compresslevel=6) as gz:
        gz.write(payload)
    for threaded, chunk_bytes in [(False, 1), (False, 1 << 18), (True, 1000), (True, 1 << 18)]:
        pieces: list[bytes] = []
        stream = storage.GzipStream(pieces.append, threaded=threaded, chunk_bytes=chunk_bytes)
        at = 0
        while at < len(payload):
            step = rng.choice([1, 7, 100, 4096, 70_000])
            stream.write(payload[at : at + step])
            at += step
        stream.finish()
        written = b"".join(pieces)
        assert written == reference.getvalue()
        assert stream.compressed_bytes == len(written)
        assert stream.sha256.hexdigest() == storage.sha256_hex(written)
    assert storage.gzip_bytes(payload) == reference.getvalue()
    assert gzip.decompress(storage.gzip_bytes(b"")) == b""


def _records(n: int) -> bytes:
    return b"".join(b'{"id": "%d", "text": "document %d"}\n' % (i, i) for i in range(n))


@pytest.mark.parametrize(
    ("damage", "kept", "dead"),
    [
        ("none", 40, 0),
        ("zero padding after the member", 40, 0),  # as GzipFile reads it
        ("a flipped byte mid-stream", None, 1),
        ("a bad checksum", None, 1),  # decoded in one piece: nothing before it
        ("garbage after the member", 40, 1),
    ],
)
def test_a_corrupt_gzip_keeps_what_came_before_and_dead_letters_the_rest(
    tmp_path, damage, kept, dead
):
    """Reading never crashes on a damaged file: records before the damage are kept and the
    rest is one ``unreadable_file`` letter, never an exception that fails the stage."""
    import gzip

    from apache_beam import pvalue

    from pipelines.beam_io import read_source

    body = gzip.compress(_records(40), mtime=0)
    if damage == "zero padding after the member":
        body += bytes(512)
    elif damage == "a flipped byte mid-stream":
        body = body[:150] + bytes([body[150] ^ 0xFF]) + body[151:]
    elif damage == "a bad checksum":
        body = body[:-8] + bytes([body[-8] ^ 0xFF]) + body[-7:]
    elif damage == "garbage after the member":
        body += b"not gzip at all"
    path = tmp_path / "corpus.jsonl.gz"
    path.write_bytes(body)
    (source,) = resolve_inputs([str(path)])
    out = list(read_source(source))
    letters = [o.value for o in out if isinstance(o, pvalue.TaggedOutput)]
    records = [o for o in out if not isinstance(o, pvalue.TaggedOutput)]
    assert len(letters) == dead, letters
    assert all(letter["reason"] == "unreadable_file" for letter in letters)
    if kept is None:  # what decoded before the damaged piece is kept, in order
        kept = len(records)
    assert [r[1]["id"] for r in records] == [str(i) for i in range(kept)]
    if letters:  # the letter says where the unread rest begins
        assert letters[0]["origin"].endswith(f":{kept + 1}"), letters


def _read(path) -> tuple[list, list]:
    """(records, letters) of one input file, as the stages read it."""
    from apache_beam import pvalue

    from pipelines.beam_io import read_source

    (source,) = resolve_inputs([str(path)])
    out = list(read_source(source))
    letters = [o.value for o in out if isinstance(o, pvalue.TaggedOutput)]
    return [o for o in out if not isinstance(o, pvalue.TaggedOutput)], letters


def test_a_line_json_cannot_parse_is_one_letter_and_reading_goes_on(tmp_path):
    """A 5,000-digit integer (a plain ValueError from json.loads) and a line nested 100,000
    deep (RecursionError) are each one ``invalid_json`` letter; the records after them are
    read, and nothing is counted as an unreadable file."""
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(
        b'{"id": "0", "text": "before"}\n'
        + b'{"id": "big", "n": '
        + b"9" * 5000
        + b"}\n"
        + b"[" * 100_000
        + b"]" * 100_000
        + b"\n"
        + b'{"id": "3", "text": "after"}\n'
    )
    records, letters = _read(path)
    assert [r[1]["id"] for r in records] == ["0", "3"]
    assert [(x["reason"], x["origin"].rsplit(":", 1)[1]) for x in letters] == [
        ("invalid_json", "2"),
        ("invalid_json", "3"),
    ]
    assert "ValueError" in letters[0]["detail"] and "RecursionError" in letters[1]["detail"]


def test_origins_are_the_lines_of_the_file_blank_lines_counted(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b'{"id": "a", "text": "x"}\n\n  \n{bad\r\n\n{"id": "b", "text": "y"}')
    records, letters = _read(path)
    assert [r[0].rsplit(":", 1)[1] for r in records] == ["1", "6"]
    assert [x["origin"].rsplit(":", 1)[1] for x in letters] == ["4"]


def _stage_output(root, finished: bool) -> None:
    """A documents stage output's files: its shards, its dead letters, its manifest if done."""
    (root / "data").mkdir(parents=True)
    (root / "dead_letter").mkdir()
    for i in range(2):
        (root / "data" / f"part-0000{i}-of-00002.jsonl.gz").write_bytes(b"")
        (root / "dead_letter" / f"part-0000{i}-of-00002.jsonl.gz").write_bytes(b"")
    if finished:
        (root / "manifest.json").write_text("{}")


def test_folder_input_reads_no_dead_letters(tmp_path):
    """A folder holding stage outputs: their document shards are read, never the dead
    letters beside them (JSONL too, but not documents)."""
    (tmp_path / "raw.jsonl").write_bytes(b"")
    _stage_output(tmp_path / "quality", finished=True)
    (tmp_path / "notes" / "dead_letter").mkdir(parents=True)
    (tmp_path / "notes" / "dead_letter" / "x.jsonl").write_bytes(b"")
    (tmp_path / "notes" / "manifest.json").write_text("{}")
    names = [s.path[len(str(tmp_path)) + 1 :] for s in resolve_inputs([str(tmp_path)])]
    assert names == [
        "quality/data/part-00000-of-00002.jsonl.gz",
        "quality/data/part-00001-of-00002.jsonl.gz",
        "raw.jsonl",
    ]


@pytest.mark.parametrize("where", ["", "out/quality"])
def test_an_unfinished_stage_output_is_refused(tmp_path, where):
    """Shards without a manifest are a crashed (or running) stage's: maybe partial."""
    output = tmp_path / where if where else tmp_path
    _stage_output(output, finished=False)
    (tmp_path / "raw.jsonl").write_bytes(b"")
    with pytest.raises(InputError, match="unfinished stage output") as refused:
        resolve_inputs([str(tmp_path)])
    assert repr(str(output)) in str(refused.value)
    (output / "data" / "part-00000-of-00002.jsonl.gz").unlink()
    (output / "data" / "part-00001-of-00002.jsonl.gz").unlink()
    with pytest.raises(InputError, match="unfinished stage output"):  # dead_letter/ alone
        resolve_inputs([str(tmp_path)])


def test_folder_inputs_on_an_object_store():
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("memory://bucket/corpus/a.jsonl", b"")
    fs.pipe("memory://bucket/corpus/done/data/part-00000-of-00001.jsonl.gz", b"")
    fs.pipe("memory://bucket/corpus/done/dead_letter/part-00000-of-00001.jsonl.gz", b"")
    fs.pipe("memory://bucket/corpus/done/manifest.json", b"{}")
    assert [s.path for s in resolve_inputs(["memory://bucket/corpus"])] == [
        "memory:///bucket/corpus/a.jsonl",
        "memory:///bucket/corpus/done/data/part-00000-of-00001.jsonl.gz",
    ]
    fs.rm("memory://bucket/corpus/done/manifest.json")
    with pytest.raises(InputError, match="'memory:///bucket/corpus/done' is an unfinished"):
        resolve_inputs(["memory://bucket/corpus/"])


def _stage_output_with_dead_letters(root):
    """A finished stage output's files: shards under data/, letters under dead_letter/."""
    for folder in ("data", "dead_letter"):
        (root / folder).mkdir(parents=True)
        (root / folder / "part-00000-of-00001.jsonl.gz").write_bytes(b"")
    (root / "manifest.json").write_text("{}")


def test_a_glob_leaves_out_dead_letter_folders_as_a_folder_input_does(tmp_path):
    _stage_output_with_dead_letters(tmp_path / "out")
    for pattern in ("out/**/*.jsonl.gz", "*/*/part-*.jsonl.gz", "out/*/*"):
        sources = resolve_inputs([str(tmp_path / pattern)])
        assert [s.path for s in sources] == [
            str(tmp_path / "out/data/part-00000-of-00001.jsonl.gz")
        ], pattern
    with pytest.raises(FileNotFoundError, match="only files in dead_letter/ folders"):
        resolve_inputs([str(tmp_path / "out/dead_lette?/*.jsonl.gz")])
    # nor is a stage's manifest (its lines are no documents)
    with pytest.raises(FileNotFoundError, match=r"or named manifest\.json"):
        resolve_inputs([str(tmp_path / "out/*.json")])
    # A dead_letter/ the glob names before its wildcards, or a file named without one, is
    # read as named (dead letters re-processed on purpose; a user's own folder of that name).
    named = str(tmp_path / "out/dead_letter/part-00000-of-00001.jsonl.gz")
    assert [s.path for s in resolve_inputs([named])] == [named]
    assert [s.path for s in resolve_inputs([str(tmp_path / "out/dead_letter/*.gz")])] == [named]
    _stage_output_with_dead_letters(tmp_path / "dead_letter" / "corpus")
    under = resolve_inputs([str(tmp_path / "dead_letter/corpus/*/*.jsonl.gz")])
    assert [s.path for s in under] == [
        str(tmp_path / "dead_letter/corpus/data/part-00000-of-00001.jsonl.gz")
    ]


def test_an_hf_hub_name_is_read_from_the_hub_unless_a_local_folder_holds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)  # empty: no dataset datasets could read
    assert {s.hub for s in resolve_inputs(["hf:org/name@train"], hf_shards=2)} == {True}
    (tmp_path / "org" / "name" / "train.jsonl").write_text('{"text": "local"}\n')
    assert {s.hub for s in resolve_inputs(["hf:org/name@train"], hf_shards=2)} == {False}
    # a finished stage output there (a run of hf:org/name into ./org/name) is no dataset
    (tmp_path / "org" / "name" / "manifest.json").write_text("{}")
    assert {s.hub for s in resolve_inputs(["hf:org/name@train"], hf_shards=2)} == {True}
    for local in (f"hf:{tmp_path}/x", "hf:./org/name", "hf:a/b/c", "hf:gs://b/d"):
        assert {s.hub for s in resolve_inputs([local], hf_shards=1)} == {False}, local
