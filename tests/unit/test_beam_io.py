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
