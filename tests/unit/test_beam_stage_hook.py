"""BeamStageHook on the DirectRunner: the stage's ``main`` runs in the task's process, with the
arguments its command line would get, and its failures read as a failed process's would."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from operators.hooks.beam import BeamStageFailed, BeamStageHook
from pipelines.manifest import read_manifest


def _corpus(path, texts):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"id": f"d{i}", "text": text, "source": "tiny"}) + "\n")


def test_direct_runner_stage_runs_in_this_process(tmp_path, monkeypatch):
    _corpus(tmp_path / "raw.jsonl.gz", ["one document here", "", "another one"])
    # A subprocess would show as a Popen: there must be none.
    monkeypatch.setattr(
        "subprocess.Popen", lambda *a, **k: pytest.fail(f"a subprocess was started: {a}")
    )
    hook = BeamStageHook()
    assert hook.in_process
    out = tmp_path / "ingest"
    result = hook.run_module(
        "pipelines.ingest",
        {"input": [str(tmp_path / "raw.jsonl.gz")], "output": str(out), "num_shards": 2},
    )
    assert result == {}
    manifest = read_manifest(str(out))
    assert (manifest.records_in, manifest.records_out) == (3, 2)
    assert manifest.dropped == {"empty_text": 1}


def test_a_refused_option_fails_with_the_stage_message_and_status(tmp_path):
    hook = BeamStageHook()
    with pytest.raises(BeamStageFailed, match="exited with 2") as err:
        hook.run_module(
            "pipelines.quality",
            {
                "input": [str(tmp_path / "missing")],
                "output": str(tmp_path / "out"),
                "config": '{"thresholds": {"min_wordz": 3}}',
            },
        )
    assert err.value.returncode == 2
    assert "min_wordz" in str(err.value)  # the stage's own one-line error names the field


def test_an_exception_in_the_stage_fails_with_its_traceback(tmp_path, monkeypatch):
    import pipelines.ingest

    def broken(argv):
        raise ValueError("disk on fire")

    monkeypatch.setattr(pipelines.ingest, "main", broken)
    with pytest.raises(BeamStageFailed, match="ValueError: disk on fire") as err:
        BeamStageHook().run_module("pipelines.ingest", {"input": ["x"], "output": "y"})
    assert err.value.returncode == 1 and "in broken" in str(err.value)


def test_other_runners_and_interpreters_run_a_subprocess():
    assert not BeamStageHook(py_interpreter=sys.executable + "-other").in_process
    assert not BeamStageHook(in_process=False).in_process
    hook = BeamStageHook(in_process=False)
    assert hook.command("pipelines.ingest", {"output": "o"})[:4] == [
        sys.executable,
        "-m",
        "pipelines.ingest",
        "--runner=DirectRunner",
    ]
