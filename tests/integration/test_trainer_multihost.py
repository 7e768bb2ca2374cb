"""One mesh, several layouts: 1 process x 2 devices and 2 processes x 1 device (one global mesh
through ``jax.distributed`` on localhost, FSDP-sharded parameters, checkpoint shards written by
both processes) give the same loss curve and final parameters as 1 process x 1 device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.trainer_data import final_params, free_port, loss_curve, write_random_store

STEPS = 12


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("data") / "store")
    write_random_store(root, num_docs=300)
    return root


def _args(store: str, out: Path, *extra: str) -> list[str]:
    sets = [
        f"output_dir={out}",
        f"data.sources=[{{path: {store}}}]",
        "model.preset=nano",
        f"steps={STEPS}",
        "batch_size=4",
        "seq_len=32",
        "optimizer.warmup_steps=2",
        "optimizer.learning_rate=3e-3",
        "checkpoint.save_every=6",
        *extra,
    ]
    return [sys.executable, "-m", "trainer.train", *[x for s in sets for x in ("--set", s)]]


def _env(devices: int) -> dict[str, str]:
    # cheap LLVM compiles (same flags for every layout, so the comparison is unaffected)
    flags = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={devices}"
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}


def test_layouts_give_the_same_loss_curve(store, tmp_path):
    one = tmp_path / "1x1"
    two_dev = tmp_path / "1x2"
    two_proc = tmp_path / "2x1"
    port = free_port()
    procs = [
        subprocess.Popen(
            _args(
                store,
                two_proc,
                "mesh.data=1",
                "mesh.fsdp=2",
                "distributed.mode=explicit",
                f"distributed.coordinator_address=127.0.0.1:{port}",
                "distributed.num_processes=2",
                f"distributed.process_id={i}",
            ),
            env=_env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    singles = [
        subprocess.run(_args(store, one), env=_env(1), capture_output=True, text=True, timeout=170),
        subprocess.run(
            _args(store, two_dev), env=_env(2), capture_output=True, text=True, timeout=170
        ),
    ]
    for p in procs:
        out, _ = p.communicate(timeout=170)
        assert p.returncode == 0, out[-3000:]
    for r in singles:
        assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((two_proc / "config.json").read_text())
    assert cfg["processes"] == 2 and cfg["mesh"]["fsdp"] == 2
    assert json.loads((two_dev / "config.json").read_text())["mesh"]["data"] == 2
    ref = loss_curve(one, STEPS)
    assert ref[-1] < ref[0]
    np.testing.assert_allclose(loss_curve(two_dev, STEPS), ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(loss_curve(two_proc, STEPS), ref, rtol=2e-5, atol=2e-5)
    p1, p2 = final_params(one, STEPS), final_params(two_proc, STEPS)
    assert p1.keys() == p2.keys()
    for k in p1:  # the checkpoint assembled from both processes' shards
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=1e-5, err_msg=k)
