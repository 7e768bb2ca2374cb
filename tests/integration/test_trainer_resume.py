"""Preemption safety, end to end through ``python -m trainer.train`` in subprocesses:

- SIGKILL mid-run (right after a checkpoint commits, with training already past it), restart:
  final parameters and loss are bit-identical to an uninterrupted run;
- SIGTERM: the run saves, writes result status "preempted", exits 42; a rerun completes
  bit-identically too.

Bit-identity alone would also hold for a restart from step 0 (training is deterministic), so
each restart must also show that it resumed: ``result.json``'s ``start_step`` is the latest
checkpoint's step and the restarted run's first line in ``metrics.jsonl`` is that step + 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from tests.support.trainer_data import write_random_store
from trainer.checkpoint import latest_step
from trainer.train import EXIT_RESTART

STEPS = 40
_CACHE: dict[str, str] = {}

# Runs the real entrypoint; optionally signals itself once checkpoint `at` has committed (from
# the checkpoint thread, so the training thread is typically a few steps further on).
RUNNER = """
import os, signal, sys
from trainer import checkpoint, train
sig, at = sys.argv[1], int(sys.argv[2])
if sig != "none":
    orig = checkpoint.Checkpointer._commit
    def commit(self, fs, base, step, permanent, meta):
        orig(self, fs, base, step, permanent, meta)
        if step == at:
            os.kill(os.getpid(), getattr(signal, sig))
    checkpoint.Checkpointer._commit = commit
sys.exit(train.main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("data") / "store")
    write_random_store(root, num_docs=300)
    # a persistent compilation cache (as a restarted pod would use): later runs skip XLA
    _CACHE["dir"] = str(tmp_path_factory.mktemp("jax-cache"))
    return root


def _run(store: str, out: Path, sig: str = "none", at: int = 0) -> int:
    args = [
        "--set",
        f"output_dir={out}",
        "--set",
        f"data.sources=[{{path: {store}}}]",
        "--set",
        "model.preset=nano",
        "--set",
        f"steps={STEPS}",
        "--set",
        "batch_size=4",
        "--set",
        "seq_len=32",
        "--set",
        "optimizer.warmup_steps=4",
        "--set",
        "checkpoint.save_every=5",
        "--set",
        "checkpoint.permanent_every=20",
    ]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        # cheap LLVM compiles; every run here uses the same flags, so bit-identity still holds
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
        "JAX_COMPILATION_CACHE_DIR": _CACHE["dir"],
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, sig, str(at), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode not in (0, EXIT_RESTART, -signal.SIGKILL):
        raise AssertionError(proc.stderr[-3000:])
    return proc.returncode


def _final_arrays(out: Path) -> dict[str, np.ndarray]:
    base = out / "checkpoints" / f"step-{STEPS:09d}" / "arrays"
    return {
        name: ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(base / name)}})
        .result()
        .read()
        .result()
        for name in sorted(os.listdir(base))
    }


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _assert_identical(a: Path, b: Path) -> None:
    ra, rb = (json.loads((p / "result.json").read_text()) for p in (a, b))
    assert ra["status"] == rb["status"] == "succeeded"
    assert ra["final_loss"] == rb["final_loss"]  # bit-identical float
    xa, xb = _final_arrays(a), _final_arrays(b)
    assert xa.keys() == xb.keys() and len(xa) > 10
    for k in xa:
        np.testing.assert_array_equal(xa[k], xb[k], err_msg=k)
    # the last line per step wins: the resumed log reads as the uninterrupted one
    last_a, last_b = ({m["step"]: m["loss"] for m in _metrics(p)} for p in (a, b))
    assert last_a == last_b and sorted(last_a) == list(range(1, STEPS + 1))


def _assert_resumed(out: Path, first_run_lines: int, checkpoint: int) -> None:
    """The restart (whose log lines follow the first run's ``first_run_lines``) started from
    ``checkpoint``, not from step 0."""
    assert 0 < checkpoint < STEPS
    result = json.loads((out / "result.json").read_text())
    assert result["start_step"] == checkpoint
    restarted = _metrics(out)[first_run_lines:]
    assert restarted[0]["step"] == checkpoint + 1
    assert [m["step"] for m in restarted] == list(range(checkpoint + 1, STEPS + 1))


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    assert _run(store, out) == 0
    return out


def test_sigkill_then_restart_is_bit_identical(store, reference, tmp_path):
    out = tmp_path / "killed"
    assert _run(store, out, "SIGKILL", 10) == -signal.SIGKILL
    assert not (out / "result.json").exists()
    checkpoint, logged = latest_step(str(out / "checkpoints")), len(_metrics(out))
    assert checkpoint == 10  # killed right after that commit: no later checkpoint
    assert _run(store, out) == 0  # resumes from the latest complete checkpoint
    _assert_resumed(out, logged, checkpoint)
    _assert_identical(reference, out)
    # permanent checkpoint kept, temporaries rolled (keep=1)
    steps = sorted(os.listdir(out / "checkpoints"))
    assert "step-000000020" in steps and f"step-{STEPS:09d}" in steps and len(steps) <= 4


def test_sigterm_saves_and_exits_with_restart_code(store, reference, tmp_path):
    out = tmp_path / "preempted"
    assert _run(store, out, "SIGTERM", 10) == EXIT_RESTART
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "preempted" and result["exit_code"] == EXIT_RESTART
    assert 10 <= result["steps"] < STEPS
    saved = sorted(os.listdir(out / "checkpoints"))[-1]
    assert saved == f"step-{result['steps']:09d}"  # saved exactly where it stopped
    assert result["start_step"] == 0
    logged = len(_metrics(out))
    assert _metrics(out)[-1]["step"] == result["steps"]  # every step it trained was logged
    assert _run(store, out) == 0
    _assert_resumed(out, logged, result["steps"])
    _assert_identical(reference, out)


def test_preempted_after_a_permanent_save_keeps_it_and_a_resume_clears_unfinished_saves(
    store, tmp_path, monkeypatch
):
    # SIGTERM agreed at step 20, which the loop has just saved as permanent: that checkpoint is
    # the pre-empted run's last one. Saving step 20 again (as temporary) would uncommit it while
    # rewriting it, and a later save would prune it.
    from trainer import checkpoint, train
    from trainer.config import load_config

    writes: list[tuple[int, bool]] = []
    write = checkpoint.Checkpointer._write

    def spy(self, step, leaves, permanent, meta):
        writes.append((step, permanent))
        return write(self, step, leaves, permanent, meta)

    monkeypatch.setattr(checkpoint.Checkpointer, "_write", spy)

    class AtStep20(train.Preemption):
        def __init__(self) -> None:
            super().__init__()
            self.asked = 0

        def agreed(self) -> bool:
            self.asked += 1  # once per step that is not the last
            return self.asked == 20

    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path / 'run'}",
            f"data.sources=[{{path: {store}}}]",
            "model.preset=nano",
            f"steps={STEPS}",
            "batch_size=4",
            "seq_len=32",
            "optimizer.warmup_steps=4",
            "checkpoint.save_every=5",
            "checkpoint.permanent_every=20",
        ],
    )
    result = train.train(cfg, preemption=AtStep20())
    assert result["status"] == "preempted" and result["steps"] == 20
    assert [w for w in writes if w[0] == 20] == [(20, True)]  # saved once, permanent
    # A save of step 25 that a kill left unfinished (no commit.json), by a run whose arrays
    # were chunked differently (another mesh): the resumed run must not reopen it.
    checkpoints = tmp_path / "run" / "checkpoints"
    stale = checkpoints / "step-000000025"
    shutil.copytree(checkpoints / "step-000000020", stale)
    (stale / "commit.json").unlink()
    meta_file = next(stale.glob("arrays/*/zarr.json"))
    meta = json.loads(meta_file.read_text())
    grid = meta["chunk_grid"]["configuration"]
    grid["chunk_shape"] = [1] * len(grid["chunk_shape"])
    meta_file.write_text(json.dumps(meta))
    writes.clear()
    result = train.train(cfg, preemption=train.Preemption())
    assert result["status"] == "succeeded" and result["start_step"] == 20
    assert (25, False) in writes  # saved (and pruned by later saves), not refused
    committed = dict(checkpoint.committed_steps(str(tmp_path / "run" / "checkpoints")))
    assert committed[20]["permanent"] is True and committed[STEPS]["permanent"] is True
