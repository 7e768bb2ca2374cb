"""Stage 6 end to end: a deterministic sample, a byte-identical model, and full accounting."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from pathlib import Path

import pytest

from pipelines import spm, train_tokenizer
from pipelines.artifact_stage import run_artifact_stage
from pipelines.beam_io import read_dead_letters, stable_shard
from pipelines.train_tokenizer import TrainTokenizerConfig
from tests.support.sharded import write_id_sharded_output

NUM_SHARDS = 2
_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her an be this which or "
    "had not are but were have one all their there been has when who would more if into "
    "time river market city garden letter winter number people system water report evening"
)
WORDS = _WORDS_TEXT.split()
BASE = TrainTokenizerConfig(vocab_size=400, num_threads=2)


def _line(obj: object) -> str:
    return json.dumps(obj) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(5)
    docs = []
    for i in range(200):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) for _ in range(4)]
        lines.insert(2, "")  # blank lines are not training sentences
        docs.append({"id": f"d{i:03d}", "text": "\n".join(lines), "source": "s"})
    bad = "not json\n" + _line({"id": "x", "source": "s"})
    (root / "docs.jsonl").write_text("".join(_line(d) for d in docs) + bad)
    return root, docs


def _train(corpus_dir: Path, out: Path, config=BASE, beam_args=()):
    return run_artifact_stage(
        train_tokenizer.STAGE,
        train_tokenizer.KIND,
        train_tokenizer.build,
        config,
        [str(corpus_dir)],
        str(out),
        num_shards=NUM_SHARDS,
        beam_args=list(beam_args),
    ).manifest


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    return out, _train(corpus[0], out)


def test_accounting_and_manifest(corpus, trained):
    out, manifest = trained
    _, docs = corpus
    assert (manifest.records_in, manifest.records_out) == (len(docs) + 2, len(docs))
    assert manifest.dropped == {"invalid_json": 1, "missing_text": 1}
    assert len(list(read_dead_letters(str(out)))) == 2
    sample = manifest.extra["sample"]
    # Everything fits the default budget at rate 1.0: all sampled, nothing "dropped" for it.
    assert (sample["docs_sampled"], sample["docs_not_sampled"], sample["docs_over_budget"]) == (
        len(docs),
        0,
        0,
    )
    assert sample["lines"] == 4 * len(docs)
    model = (out / spm.MODEL_NAME).read_bytes()
    assert manifest.extra["model_sha256"] == spm.describe(str(out)).sha256
    (shard,) = manifest.shards  # the model accounts for every document the sampler decided on
    assert (shard.path, shard.records, shard.sha256) == (
        spm.MODEL_NAME,
        manifest.records_out,
        manifest.extra["model_sha256"],
    )
    assert manifest.extra["vocab_size"] == 400 == spm.processor(model).vocab_size()
    assert len((out / spm.VOCAB_NAME).read_text().splitlines()) == 400


def test_multi_processing_gives_identical_bytes(corpus, trained, tmp_path, digest):
    out, _ = trained
    other = tmp_path / "tokenizer"
    _train(
        corpus[0],
        other,
        beam_args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
    )
    assert digest(other) == digest(out)  # model, vocab, sample, dead letters and manifest


def test_rate_and_budget_choose_the_expected_sample(corpus, tmp_path):
    corpus_dir, docs = corpus
    config = TrainTokenizerConfig(
        vocab_size=300, num_threads=2, sample_rate=0.5, max_sample_chars=6000, seed=7
    )
    manifest = _train(corpus_dir, tmp_path / "t", config)
    # The same rule, computed directly: hash below the rate, then smallest (hash, id) to budget.
    limit = train_tokenizer.rate_limit(0.5)
    candidates = sorted(
        (train_tokenizer.sample_hash(d["id"], 7), d["id"], len(d["text"]))
        for d in docs
        if train_tokenizer.sample_hash(d["id"], 7) < limit
    )
    chosen = train_tokenizer.trim_to_budget(list(candidates), 6000)
    sample = manifest.extra["sample"]
    assert sample["docs_sampled"] == len(chosen)
    assert sample["docs_over_budget"] == len(candidates) - len(chosen) > 0
    assert sample["docs_not_sampled"] == len(docs) - len(candidates) > 0
    by_id = {d["id"]: d for d in docs}
    for shard in range(NUM_SHARDS):
        ids = sorted(c[1] for c in chosen if stable_shard(c[1], NUM_SHARDS) == shard)
        expected = "".join(
            line + "\n" for i in ids for line in by_id[i]["text"].split("\n") if line
        )
        path = tmp_path / "t" / train_tokenizer.sample_shard_name(shard, NUM_SHARDS)
        assert gzip.decompress(path.read_bytes()).decode() == expected


def test_cli_refuses_a_vocabulary_too_small(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        train_tokenizer.main(
            [
                "--input",
                str(corpus[0]),
                "--output",
                str(tmp_path / "o"),
                "--config",
                '{"vocab_size": 10}',
            ]
        )
    assert refused.value.code == 2
    assert "vocab_size must be >=" in capsys.readouterr().err


def test_the_shard_path_trains_what_the_harness_path_trains(corpus, tmp_path, digest, caplog):
    """An id-sharded stage output is read twice shard by shard instead of held between the
    passes; the same files as a glob go through the harness: same sample, same model, same
    manifest."""
    _, docs = corpus
    sharded = write_id_sharded_output(
        tmp_path / "in", docs, NUM_SHARDS, {1: ["not json\n", _line({"id": "x", "source": "s"})]}
    )
    config = dataclasses.replace(BASE, max_sample_chars=20_000)  # the budget cut takes part
    caplog.set_level("INFO", logger="pipelines.map_stage")
    by_shard = run_artifact_stage(
        train_tokenizer.STAGE,
        train_tokenizer.KIND,
        train_tokenizer.build,
        config,
        [str(sharded)],
        str(tmp_path / "by_shard"),
        num_shards=NUM_SHARDS,
        read_build=train_tokenizer.build_from_shards,
    ).manifest
    assert "read twice, not held" in caplog.text
    harness = _train(sharded / "data", tmp_path / "harness", config)
    for name in ("records_in", "records_out", "dropped", "shards", "extra"):
        assert getattr(by_shard, name) == getattr(harness, name), name
    assert by_shard.extra["sample"]["docs_over_budget"] > 0
    assert by_shard.dropped == {"invalid_json": 1, "missing_text": 1}
    for sub in ("sample", "dead_letter"):
        assert digest(tmp_path / "by_shard" / sub) == digest(tmp_path / "harness" / sub), sub
    model = "tokenizer.model"
    assert (tmp_path / "by_shard" / model).read_bytes() == (
        tmp_path / "harness" / model
    ).read_bytes()
