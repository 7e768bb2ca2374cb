"""`slipway plan`: the dry run of a DAG run's conf, with the form's validation."""

from __future__ import annotations

from operators.cli import main
from operators.testing import make_corpora, tiny_conf


def test_plan_lists_every_step_to_run(tmp_path, monkeypatch, capsys):
    import json

    data = make_corpora(tmp_path / "data")
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "home"))
    assert main(["plan", "--conf", json.dumps(tiny_conf(data))]) == 0
    out = capsys.readouterr().out
    for step in ("ingest-", "fuzzy_dedup-", "train_tokenizer-", "train-", "evaluate-"):
        assert step in out
    assert "never run" in out


def test_invalid_value_is_refused_naming_the_field(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    assert main(["plan", "--conf", '{"steps": -1}']) == 2
    assert "steps: -1 is less than the minimum of 1" in capsys.readouterr().err


def test_bad_json_is_refused(capsys):
    assert main(["plan", "--conf", "{steps"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
