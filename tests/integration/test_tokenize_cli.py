"""Stages 6 and 7 as their command lines run them: ``python -m pipelines.<stage>``."""

from __future__ import annotations

import json
import subprocess
import sys
import tokenize as stdlib_tokenize
from pathlib import Path

import pytest

from pipelines import tokenize
from tokenstore import TokenStore

TEXTS = [
    "The river ran past the market and the city garden in winter.",
    "    def area(r):\n        return 3.14159 * r * r\n",
    "Grüße aus Zürich — naïve café, 東京 and 😀 in one line.",
    "A letter of the people, by the people, for the people.",
]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"pipelines.{module}", *args], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    docs = [
        {"id": f"c{i:03d}", "text": f"{TEXTS[i % len(TEXTS)]} ({i})", "source": "cli"}
        for i in range(60)
    ]
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs) + "{oops\n")
    return root


def test_train_then_tokenize_from_the_command_line(inputs, tmp_path):
    trained = _run(
        "train_tokenizer",
        "--input",
        str(inputs / "docs.jsonl"),
        "--output",
        str(tmp_path / "tok"),
        "--num_shards",
        "1",
        "--config",
        json.dumps({"vocab_size": 400, "num_threads": 1}),
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    manifest = json.loads(trained.stdout)
    assert (manifest["records_in"], manifest["records_out"]) == (61, 60)
    # --tokenizer takes the tokenizer directory or the model file itself.
    done = _run(
        "tokenize",
        "--input",
        str(inputs),
        "--tokenizer",
        str(tmp_path / "tok" / "tokenizer.model"),
        "--output",
        str(tmp_path / "tokens"),
        "--num_shards",
        "2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout)
    assert (printed["records_in"], printed["records_out"], printed["dropped"]) == (
        61,
        60,
        {"invalid_json": 1},
    )
    store = TokenStore.open(str(tmp_path / "tokens"))
    assert store.num_docs == 60
    assert store.ledger.tokenizer_sha256 == manifest["extra"]["model_sha256"]


def test_tokenize_refuses_to_run_without_a_tokenizer(inputs, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        tokenize.main(["--input", str(inputs), "--output", str(tmp_path / "x")])
    assert refused.value.code == 2
    assert "tokenizer is required" in capsys.readouterr().err


def test_tokenize_finds_its_tokenizer_missing_before_clearing_the_output(inputs, tmp_path, capsys):
    out = tmp_path / "tokens"
    out.mkdir()
    (out / "ledger.json").write_text("the last run's store")
    empty = tmp_path / "empty-tokenizer"
    empty.mkdir()
    absent = str(tmp_path / "absent.model")
    base = ["--input", str(inputs / "docs.jsonl"), "--output", str(out)]
    for extra, named in [
        ([], "tokenizer is required"),
        (["--tokenizer", absent], f"tokenizer {absent!r} matches no files"),
        (["--tokenizer", str(empty)], f"no sentencepiece model at {empty / 'tokenizer.model'}"),
    ]:
        with pytest.raises(SystemExit) as refused:
            tokenize.main([*base, *extra])
        assert refused.value.code == 2
        assert named in capsys.readouterr().err
        assert (out / "ledger.json").read_text() == "the last run's store"


def test_stage_module_does_not_shadow_stdlib_tokenize():
    # `python -m pipelines.tokenize` puts the repository root, not pipelines/, on sys.path,
    # so `import tokenize` (linecache, inspect, ...) still finds the standard library's.
    assert Path(stdlib_tokenize.__file__).parent == Path(json.__file__).parent.parent
    assert Path(tokenize.__file__).parent.name == "pipelines"


def test_tokenize_refuses_an_output_holding_its_tokenizer(inputs, tmp_path, capsys):
    model = tmp_path / "out" / "tokenizer.model"
    model.parent.mkdir()
    model.write_bytes(b"not cleared")
    with pytest.raises(SystemExit) as refused:
        tokenize.main(
            [
                "--input",
                str(inputs / "docs.jsonl"),
                "--tokenizer",
                str(model),
                "--output",
                str(tmp_path / "out"),
            ]
        )
    assert refused.value.code == 2
    assert "overlaps" in capsys.readouterr().err
    assert model.read_bytes() == b"not cleared"
