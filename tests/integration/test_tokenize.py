"""Stage 7 end to end: documents -> token store, nothing lost, exact round trip, same bytes."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from operators.lineage.describe import describe_documents
from pipelines import spm, tokenize, train_tokenizer
from pipelines.artifact_stage import run_artifact_stage
from pipelines.beam_io import read_dead_letters, stable_shard
from pipelines.manifest import read_manifest
from tests.support.sharded import write_id_sharded_output
from tokenstore import TokenStore

NUM_SHARDS = 3
_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her an be this which or "
    "had not are but were have one all their there been has when who would more if into "
    "time river market city garden letter winter number people system water report evening "
    "naïve café Grüße 東京 😀"
)
WORDS = _WORDS_TEXT.split()


def _document(i: int, rng: random.Random) -> dict:
    if i % 7 == 0:  # code: indentation and blank lines are content
        body = "\n".join(
            f"def f{i}_{k}(x):\n    return x * {k}  # {rng.choice(WORDS)}\n" for k in range(5)
        )
    else:
        paragraphs = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "."
            for _ in range(rng.randint(1, 4))
        ]
        body = "\n\n".join(paragraphs)
    return {"id": f"doc-{i:04d}", "text": body, "source": "synthetic", "metadata": {"i": i}}


def _line(obj: object) -> str:
    return json.dumps(obj) + "\n"


BAD_LINES = {
    "not json\n": "invalid_json",
    _line({"id": 7, "text": "x", "source": "s"}): "non_string_id",
    _line({"id": "no-text", "source": "s"}): "missing_text",
    _line({"id": "empty", "text": "", "source": "s"}): "empty_text",
    '{"id": "surrogate", "text": "bad \\ud800", "source": "s"}\n': "invalid_unicode",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = [_document(i, rng) for i in range(240)]
    (root / "a.jsonl").write_text("".join(_line(d) for d in docs[:120]) + "".join(BAD_LINES))
    (root / "b.jsonl").write_text("".join(_line(d) for d in docs[120:]))
    return root, docs


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    config = train_tokenizer.TrainTokenizerConfig(vocab_size=400, num_threads=2)
    run_artifact_stage(
        train_tokenizer.STAGE,
        train_tokenizer.KIND,
        train_tokenizer.build,
        config,
        [str(corpus[0])],
        str(out),
        num_shards=2,
    )
    return out


def _tokenize(corpus_dir: Path, tokenizer: Path, out: Path, beam_args: list[str] | None = None):
    config = tokenize.TokenizeConfig(tokenizer=str(tokenizer), batch_docs=50)
    return run_artifact_stage(
        tokenize.STAGE,
        tokenize.KIND,
        tokenize.build,
        config,
        [str(corpus_dir)],
        str(out),
        num_shards=NUM_SHARDS,
        beam_args=beam_args or [],
    )


@pytest.fixture(scope="module")
def store_run(corpus, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "tokens"
    return out, _tokenize(corpus[0], tokenizer_dir, out).manifest


def test_nothing_is_lost(corpus, store_run):
    out, manifest = store_run
    _, docs = corpus
    assert manifest.records_in == len(docs) + len(BAD_LINES)
    assert manifest.records_out == len(docs)
    assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
    assert manifest.dropped == dict(Counter(BAD_LINES.values()))
    letters = list(read_dead_letters(str(out)))
    assert Counter(x["reason"] for x in letters) == manifest.dropped
    ledger = TokenStore.open(str(out)).ledger
    assert ledger.num_docs == manifest.records_out
    assert ledger.metadata["records_in"] == manifest.records_in
    assert ledger.metadata["dropped"] == manifest.dropped


def test_ledger_records_the_bytes_of_the_tokenized_texts(corpus, store_run):
    """``metadata.num_bytes``: UTF-8 bytes of the stored documents' texts, from which
    trainer.evaluate gives bits per byte for a store evaluated without its tokenizer."""
    out, _ = store_run
    _, docs = corpus
    ledger = TokenStore.open(str(out)).ledger
    assert ledger.metadata["num_bytes"] == sum(len(d["text"].encode("utf-8")) for d in docs)


def test_round_trip_gives_back_the_text_in_store_order(corpus, tokenizer_dir, store_run):
    out, _ = store_run
    _, docs = corpus
    store = TokenStore.open(str(out))
    sp = spm.processor((tokenizer_dir / spm.MODEL_NAME).read_bytes())
    # Store order: shards by name, documents sorted by id inside each shard.
    expected = [
        d
        for shard in range(NUM_SHARDS)
        for d in sorted(docs, key=lambda d: d["id"])
        if stable_shard(d["id"], NUM_SHARDS) == shard
    ]
    assert store.num_docs == len(expected)
    for index, doc in enumerate(expected):
        tokens = store.document(index)
        assert tokens[-1] == store.eos_id
        assert sp.decode(tokens[:-1].tolist()) == doc["text"], doc["id"]
    flat = store.read(0, store.num_tokens)
    assert int(np.count_nonzero(flat == store.eos_id)) == store.num_docs


def test_ledger_names_the_tokenizer(tokenizer_dir, store_run):
    out, manifest = store_run
    tokenizer = read_manifest(str(tokenizer_dir)).extra
    ledger = TokenStore.open(str(out)).ledger
    assert ledger.tokenizer_sha256 == tokenizer["model_sha256"]
    assert (ledger.vocab_size, ledger.eos_id) == (400, spm.EOS_ID)
    assert [s.name for s in ledger.shards] == [
        tokenize.token_shard_name(i, NUM_SHARDS) for i in range(NUM_SHARDS)
    ]
    assert manifest.extra["num_tokens"] == ledger.num_tokens
    assert manifest.extra["kind"] == "token-store"
    # One manifest shard per token shard, with its documents and a digest of its files.
    assert [(s.path, s.records) for s in manifest.shards] == [
        (f"shards/{s.name}", s.num_docs) for s in ledger.shards
    ]
    assert all(len(s.sha256) == 64 and s.bytes > 0 for s in manifest.shards)


def test_lineage_describes_the_store(store_run):
    out, manifest = store_run
    described = describe_documents(str(out))
    assert described["counts"]["records_out"] == manifest.records_out
    assert described["content_hash"].startswith("sha256:")


def test_multi_processing_gives_identical_bytes(corpus, tokenizer_dir, store_run, tmp_path, digest):
    out, _ = store_run
    other = tmp_path / "tokens"
    _tokenize(
        corpus[0],
        tokenizer_dir,
        other,
        ["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
    )
    assert digest(other) == digest(out)


def _id_sharded_output(root: Path, docs: list[dict], extra_lines: dict[int, list[str]]) -> Path:
    return write_id_sharded_output(root, docs, NUM_SHARDS, extra_lines)


def _tokenize_config(tokenizer: Path, **kw) -> tokenize.TokenizeConfig:
    return tokenize.TokenizeConfig(tokenizer=str(tokenizer), batch_docs=50, **kw)


def _run(inputs: Path, config: tokenize.TokenizeConfig, out: Path):
    return tokenize.run(config, [str(inputs)], str(out), num_shards=NUM_SHARDS).manifest


def test_id_sharded_inputs_skip_the_shuffle_and_write_the_same_store(
    corpus, tokenizer_dir, store_run, tmp_path, digest, caplog
):
    _, docs = corpus
    sharded = _id_sharded_output(tmp_path / "sharded", docs, {1: list(BAD_LINES)})
    caplog.set_level("INFO", logger="pipelines.tokenize")
    direct = _run(sharded, _tokenize_config(tokenizer_dir), tmp_path / "direct")
    assert "one store shard per input shard" in caplog.text
    shuffled = _run(sharded, _tokenize_config(tokenizer_dir, shuffle=True), tmp_path / "shuffled")
    assert "shuffling by id" not in caplog.text  # shuffle=True declines without asking

    # Same accounting, same dead letters, same bytes: how the store was read does not show.
    assert direct.records_in == len(docs) + len(BAD_LINES)
    assert direct.dropped == dict(Counter(BAD_LINES.values()))
    for name in ("records_in", "records_out", "dropped", "shards", "dead_letter_shards", "extra"):
        assert getattr(direct, name) == getattr(shuffled, name), name
    for sub in ("shards", "dead_letter"):
        assert digest(tmp_path / "direct" / sub) == digest(tmp_path / "shuffled" / sub), sub
    ledger = "ledger.json"
    assert (tmp_path / "direct" / ledger).read_bytes() == (
        tmp_path / "shuffled" / ledger
    ).read_bytes()
    # And the token shards are those of the store tokenized from the unsharded files.
    assert digest(tmp_path / "direct" / "shards") == digest(store_run[0] / "shards")


def test_id_sharded_inputs_out_of_order_are_sorted_in_memory(
    corpus, tokenizer_dir, store_run, tmp_path, digest, caplog
):
    """The merge-as-you-read path needs id order; an input without it still gives the store."""
    _, docs = corpus
    reversed_shards = write_id_sharded_output(
        tmp_path / "sharded", docs[::-1], NUM_SHARDS, sort=False
    )
    caplog.set_level("INFO", logger="pipelines.tokenize")
    manifest = _run(reversed_shards, _tokenize_config(tokenizer_dir), tmp_path / "out")
    assert "one store shard per input shard" in caplog.text
    assert "is not in (id, text) order" in caplog.text
    assert manifest.records_out == len(docs)
    assert digest(tmp_path / "out" / "shards") == digest(store_run[0] / "shards")


def test_a_document_in_the_wrong_input_shard_is_an_error(corpus, tokenizer_dir, tmp_path):
    _, docs = corpus
    stray = next(d for d in docs if stable_shard(d["id"], NUM_SHARDS) != 0)
    sharded = _id_sharded_output(tmp_path / "sharded", docs[:20], {0: [_line(stray)]})
    with pytest.raises(Exception, match=r"is shard 0 of 3 but holds document"):
        _run(sharded, _tokenize_config(tokenizer_dir), tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_inputs_that_are_not_id_sharded_are_shuffled(corpus, tokenizer_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="pipelines.tokenize")
    manifest = _run(corpus[0], _tokenize_config(tokenizer_dir), tmp_path / "out")
    assert "shuffling by id" in caplog.text
    assert manifest.records_out == len(corpus[1])
