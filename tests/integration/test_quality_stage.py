"""The quality stage end to end: reasons, per-source rules, stored scores, accounting."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pipelines import quality
from pipelines.beam_io import read_dead_letters, read_documents
from pipelines.quality import QualityConfig, QualityThresholds, apply_thresholds
from pipelines.stage import config_from_mapping
from tests.support.long_documents import ENGLISH

FORTUNE = "The best way to predict the future is to invent it."
CODE = "def main():\n    for i in range(10):\n        print({i: i ** 2})\n"
CONFIG = {"sources": {"python-stdlib": {"enabled": False}, "fortunes": {"min_words": 3}}}


def _doc(doc_id: str, text: str, source: str = "web") -> dict:
    return {"id": doc_id, "text": text, "source": source, "metadata": {"n": 1}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    docs = [
        _doc("good", ENGLISH),
        _doc("lorem", ENGLISH + "\n\nLorem ipsum dolor sit amet, consectetur adipiscing elit."),
        _doc("short", FORTUNE),
        _doc("fortune", FORTUNE, "fortunes"),
        _doc("code", CODE, "python-stdlib"),
        _doc("bullets", "\n".join(f"- item number {i} with some words" for i in range(30))),
        _doc("repeated", " ".join(["Buy the best cheap watches and get free shipping."] * 30)),
        _doc("empty", ""),
        _doc("unicode", "\u00e9t\u00e9 \U0001f600 " * 60),
    ]
    lines = [json.dumps(d, ensure_ascii=False) for d in docs]
    lines += ["not json", json.dumps({"id": "no-text", "source": "web"}), "[1, 2]"]
    (root / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = root / "out"
    argv = ["--input", str(root / "in.jsonl"), "--output", str(out), "--config", json.dumps(CONFIG)]
    manifest = quality.main(argv).manifest
    kept = {d["id"]: d for d in read_documents(str(out))}
    letters = list(read_dead_letters(str(out)))
    return out, manifest, kept, letters


def test_accounting_holds_with_odd_records(run):
    _, manifest, kept, letters = run
    assert manifest.records_in == 12
    assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
    assert len(kept) == manifest.records_out
    assert Counter(letter["reason"] for letter in letters) == manifest.dropped
    assert manifest.dropped["invalid_json"] == 1
    assert manifest.dropped["missing_text"] == 1


def test_good_prose_passes_and_bad_text_gets_its_reason(run):
    _, _, kept, letters = run
    assert "good" in kept
    reasons = {x["record"]["id"]: x["reason"] for x in letters if isinstance(x["record"], dict)}
    assert reasons["lorem"] == "quality:max_lorem_ipsum"
    assert reasons["short"] == "quality:min_words"
    assert reasons["empty"] == "quality:min_words"
    assert reasons["bullets"] == "quality:max_bullet_line_fraction"
    assert reasons["repeated"].startswith("quality:max_")


def test_per_source_rules(run):
    _, _, kept, _ = run
    # The same quote is too short as web text but fine as a fortune; code skips the rules.
    assert "fortune" in kept
    assert "code" in kept


def test_dead_letters_list_every_failed_rule(run):
    _, _, _, letters = run
    bullets = next(x for x in letters if x.get("origin") == "bullets")
    assert bullets["failed_rules"][0] == "max_bullet_line_fraction"
    assert "min_terminal_punctuation_line_fraction" in bullets["failed_rules"]
    assert bullets["stage"] == "quality"


def test_scores_are_stored_and_thresholds_reapply(run):
    _, manifest, kept, letters = run
    config = config_from_mapping(QualityConfig, manifest.config)
    resolved = config.resolved()
    for doc in kept.values():
        assert doc["metadata"]["n"] == 1  # existing metadata survives
        scores = doc["metadata"]["quality"]
        assert apply_thresholds(scores, resolved.get(doc["source"], config.thresholds)) == []
    for letter in letters:
        if not letter["reason"].startswith("quality:"):
            continue
        scores = letter["record"]["metadata"]["quality"]
        assert apply_thresholds(scores, QualityThresholds()) == letter["failed_rules"]
    # Stricter thresholds re-applied to stored scores, without re-scoring any text.
    good = kept["good"]["metadata"]["quality"]
    assert apply_thresholds(good, QualityThresholds(min_words=1000)) == ["min_words"]


def test_manifest_records_the_config(run):
    _, manifest, _, _ = run
    assert manifest.config["sources"] == CONFIG["sources"]
    assert manifest.config["thresholds"]["min_words"] == 50


def test_second_run_is_byte_identical(run, tmp_path, digest):
    out, manifest, _, _ = run
    again = tmp_path / "again"
    argv = [
        "--input",
        manifest.inputs[0],
        "--output",
        str(again),
        "--config",
        json.dumps(CONFIG),
    ]
    quality.main(argv)
    assert digest(Path(out)) == digest(again)


def test_the_command_runs_on_workers_of_another_main_module(run, tmp_path, digest):
    """``python -m pipelines.quality`` on worker processes whose ``__main__`` is not the
    stage's (as on Dataflow): what the pipeline holds must pickle by reference to
    ``pipelines.quality``, not to ``__main__`` (a cache wrapper there broke every worker)."""
    out, manifest, _, _ = run
    again = tmp_path / "workers"
    argv = ["--input", manifest.inputs[0], "--output", str(again), "--config", json.dumps(CONFIG)]
    argv += ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.quality", *argv], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert digest(Path(out)) == digest(again)


def test_unknown_config_field_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        quality.main(
            [
                "--input",
                str(tmp_path),
                "--output",
                str(tmp_path / "o"),
                "--config",
                '{"min_wrds": 1}',
            ]
        )
    assert exit_info.value.code == 2
    assert "min_wrds" in capsys.readouterr().err
