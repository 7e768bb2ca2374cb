"""The manifest refuses to record a stage that lost records."""

from __future__ import annotations

import pytest

from pipelines.manifest import AccountingError, Manifest, ShardInfo, read_manifest


def _manifest(records_in: int, out: int, dropped: dict[str, int], dead: int) -> Manifest:
    return Manifest(
        stage="s",
        config={"k": 1},
        inputs=["in"],
        records_in=records_in,
        records_out=out,
        dropped=dropped,
        shards=[ShardInfo("data/part-0", out, 10, "x")],
        dead_letter_shards=[ShardInfo("dead_letter/part-0", dead, 10, "y")],
    )


def test_round_trip(tmp_path):
    manifest = _manifest(5, 3, {"b": 1, "a": 1}, 2)
    manifest.write(str(tmp_path))
    assert read_manifest(str(tmp_path)) == manifest


@pytest.mark.parametrize(
    ("records_in", "out", "dropped", "dead", "message"),
    [
        (6, 3, {"a": 2}, 2, "6 records in, but 3 out"),
        (5, 3, {"a": 2}, 1, "dead letters do not add up"),
    ],
)
def test_lost_records_are_refused(tmp_path, records_in, out, dropped, dead, message):
    with pytest.raises(AccountingError, match=message):
        _manifest(records_in, out, dropped, dead).write(str(tmp_path))
    assert not (tmp_path / "manifest.json").exists()


def test_missing_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a finished stage output"):
        read_manifest(str(tmp_path))
