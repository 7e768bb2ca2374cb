"""`slipway plan`: the dry run of a DAG run's conf, with the form's validation.

Run as the real command in a subprocess: it is a command line, and Airflow's import-time
logging set-up must not leak into (or be disturbed by) the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.tiny_pipeline import make_corpora, tiny_conf


def _plan(conf: str, home) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLIPWAY_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "operators.cli", "plan", "--conf", conf],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_plan_lists_every_step_to_run(tmp_path):
    data = make_corpora(tmp_path / "data")
    result = _plan(json.dumps(tiny_conf(data)), tmp_path / "home")
    assert result.returncode == 0, result.stderr
    for step in ("ingest-", "fuzzy_dedup-", "train_tokenizer-", "train-", "evaluate-"):
        assert step in result.stdout
    assert "never run" in result.stdout


def test_invalid_value_is_refused_naming_the_field(tmp_path):
    result = _plan('{"steps": -1}', tmp_path)
    assert result.returncode == 2
    assert "steps: -1 is less than the minimum of 1" in result.stderr


def test_bad_json_is_refused(tmp_path):
    result = _plan("{steps", tmp_path)
    assert result.returncode == 2
    assert "not valid JSON" in result.stderr


def test_a_conf_file_that_cannot_be_read_is_refused_naming_it(tmp_path):
    missing = tmp_path / "nightly.json"
    result = _plan(f"@{missing}", tmp_path)
    assert result.returncode == 2
    assert f"--conf @{missing}: cannot read it: No such file or directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`slipway lineage trace URI | head`: the pipe closes under the command's output."""
    code = (
        "import sys\n"
        "from operators import cli\n"
        "def stopped(args):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "cli._lineage = stopped\n"
        "sys.exit(cli.main(['lineage', 'runs']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert (result.returncode, result.stderr) == (1, "")


def test_a_misspelled_field_is_refused_with_the_one_meant(tmp_path):
    result = _plan('{"step": 20, "xyzzy": 1}', tmp_path)
    assert result.returncode == 2
    assert "step: not a field of slipway_pipeline's form (did you mean 'steps'?)" in result.stderr
    assert "xyzzy: not a field of slipway_pipeline's form\n" in result.stderr + "\n"
