"""Map stages (quality, decontamination) read id-sharded inputs shard by shard.

The shard path (one worker per input shard, output shard streamed) and the harness's shuffle
path must be indistinguishable in their outputs: same shards, dead letters and manifest, byte
for byte. A shard that breaks the id-sharding contract is an error, never a misplaced document.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from pipelines import decontaminate, quality
from pipelines.beam_io import stable_shard
from pipelines.manifest import read_manifest
from tests.support.sharded import write_id_sharded_output

NUM_SHARDS = 3
PROSE = (
    "The history of the river valley is closely tied to the farmers who settled there in the"
    " early years of the century. They cleared the land, built small houses with timber from"
    " the nearby hills, and planted wheat and barley along the banks. Over time the villages"
    " grew into market towns, and the roads that connected them carried goods to the coast."
)
EVAL = "Many of the old stone bridges still stand today and visitors come to see them in summer"
BAD_LINES = {
    "not json\n": "invalid_json",
    json.dumps({"id": "no-text", "source": "s"}) + "\n": "missing_text",
}
MANIFEST_FIELDS = ("records_in", "records_out", "dropped", "shards", "dead_letter_shards", "extra")


def _docs(prefix: str, n: int) -> list[dict]:
    docs = []
    for i in range(n):
        text = f"{PROSE} Entry {i} of the {prefix} records."
        if i % 4 == 1:
            text = "too short"  # dropped by quality
        elif i % 4 == 2:
            text = f"{PROSE} {EVAL}."  # dropped by decontamination
        docs.append({"id": f"{prefix}-{i:03d}", "text": text, "source": "web", "metadata": {}})
    return docs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Two id-sharded stage outputs that share ids (``same-*``: one id, two texts), bad lines
    in one shard, and an eval set."""
    root = tmp_path_factory.mktemp("map_inputs")
    shared = [{**d, "id": d["id"].replace("a-", "same-")} for d in _docs("a", 6)]
    first = write_id_sharded_output(
        root / "first", _docs("a", 40) + shared, NUM_SHARDS, {1: list(BAD_LINES)}
    )
    changed = [{**d, "text": d["text"] + " Revised."} for d in shared]
    second = write_id_sharded_output(root / "second", _docs("b", 30) + changed, NUM_SHARDS)
    evalset = root / "eval.jsonl"
    evalset.write_text(json.dumps({"id": "q1", "text": EVAL, "source": "eval"}) + "\n")
    return first, second, evalset


def _globs(*outputs: Path) -> list[str]:
    """The same shard files as plain globs: not stage outputs, so the shuffle path reads them."""
    return [str(out / "data" / "*.jsonl.gz") for out in outputs]


def _run(module, inputs: list[str], out: Path, *extra: str):
    argv = [a for spec in inputs for a in ("--input", spec)]
    return module.main([*argv, "--output", str(out), "--num_shards", str(NUM_SHARDS), *extra])


def _same_outputs(a, b, digest) -> None:
    for name in MANIFEST_FIELDS:
        assert getattr(a.manifest, name) == getattr(b.manifest, name), name
    for sub in ("data", "dead_letter"):
        assert digest(Path(a.output) / sub) == digest(Path(b.output) / sub), sub


@pytest.mark.parametrize("stage", ["quality", "decontaminate"])
def test_the_shard_path_writes_what_the_shuffle_path_writes(
    stage, inputs, tmp_path, digest, caplog
):
    first, second, evalset = inputs
    module = {"quality": quality, "decontaminate": decontaminate}[stage]
    extra = ["--eval_set", str(evalset)] if stage == "decontaminate" else []
    caplog.set_level(logging.INFO, logger="pipelines.map_stage")
    by_shard = _run(module, [str(first), str(second)], tmp_path / "by_shard", *extra)
    assert "one output shard per input shard" in caplog.text
    caplog.clear()
    shuffled = _run(module, _globs(first, second), tmp_path / "shuffled", *extra)
    assert "shuffling by id" in caplog.text

    _same_outputs(by_shard, shuffled, digest)
    manifest = by_shard.manifest
    assert manifest.records_in == 40 + 6 + 30 + 6 + len(BAD_LINES)
    assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
    assert {r: manifest.dropped[r] for r in BAD_LINES.values()} == Counter(BAD_LINES.values())
    reason = "quality:min_words" if stage == "quality" else "contamination"
    assert manifest.dropped[reason] > 0
    if stage == "decontaminate":
        assert manifest.extra["contamination_by_eval_set"] == {"eval": manifest.dropped[reason]}


def test_another_shard_count_takes_the_shuffle_path(inputs, tmp_path, caplog):
    first, _, _ = inputs
    caplog.set_level(logging.INFO, logger="pipelines.map_stage")
    run = quality.main(
        ["--input", str(first), "--output", str(tmp_path / "o"), "--num_shards", "2"]
    )
    assert "shuffling by id" in caplog.text
    assert len(read_manifest(run.output).shards) == 2


def test_a_document_in_the_wrong_shard_is_an_error(tmp_path, capsys):
    docs = _docs("a", 12)
    stray = next(d for d in docs if stable_shard(d["id"], NUM_SHARDS) != 0)
    line = json.dumps(stray) + "\n"
    sharded = write_id_sharded_output(tmp_path / "in", docs, NUM_SHARDS, {0: [line]})
    with pytest.raises(SystemExit):  # exit status 2 and one line, as for any input a user can fix
        _run(quality, [str(sharded)], tmp_path / "out")
    error = capsys.readouterr().err
    assert (
        f"part-00000-of-00003.jsonl.gz is shard 0 of 3 but holds document {stray['id']!r}" in error
    )
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_unsorted_shard_is_an_error(tmp_path, capsys):
    docs = _docs("a", 30)
    sharded = write_id_sharded_output(tmp_path / "in", docs[::-1], NUM_SHARDS, sort=False)
    with pytest.raises(SystemExit):
        _run(quality, [str(sharded)], tmp_path / "out")
    assert "is not sorted by id" in capsys.readouterr().err
    assert not list((tmp_path / "out").rglob("*.tmp-*"))  # the abandoned shard left nothing
