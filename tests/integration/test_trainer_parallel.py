"""Parallel layouts beyond data parallelism, against one 1 process x 1 device reference run:

- tensor parallelism (heads / MLP / vocabulary split over ``tensor``), alone and with FSDP;
- a multislice job simulated on CPU: 2 processes as 2 slices (the JobSet's ``MEGASCALE_*``
  environment, ``distributed.mode: auto``) of 2 devices each, ``replica`` across the slices;
- evaluation of the reference checkpoint by 2 processes (parameters sharded across them);
- splash attention (Pallas' interpreter on CPU devices) under a mesh, per device.

Each layout must reproduce the reference loss curve (and the evaluation its metrics) within
floating-point tolerance. Sequences of 256 tokens give two 128-token query blocks, so the
block-causal attention runs sharded too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.trainer_data import final_params, free_port, loss_curve, write_random_store

STEPS = 8
TIMEOUT = 300


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("data") / "store")
    write_random_store(root, num_docs=300)
    return root


def _sets(store: str, out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.sources=[{{path: {store}}}]",
        "model.preset=nano",
        f"steps={STEPS}",
        "batch_size=4",
        "seq_len=256",
        "optimizer.warmup_steps=2",
        "optimizer.learning_rate=3e-3",
        "checkpoint.save_every=0",
        *extra,
    ]


def _cmd(module: str, sets: list[str], *args: str) -> list[str]:
    return [sys.executable, "-m", module, *[x for s in sets for x in ("--set", s)], *args]


def _env(devices: int, **extra: str) -> dict[str, str]:
    # cheap LLVM compiles (the same flags for every run, so comparisons are unaffected)
    flags = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={devices}"
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGASCALE_", "TPU_"))}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip(), **extra}


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, out[-4000:]
        outs.append(out)
    return outs


def _same_run(out: Path, ref: Path, rtol: float) -> None:
    curve = loss_curve(ref, STEPS)
    assert curve[-1] < curve[0]
    np.testing.assert_allclose(loss_curve(out, STEPS), curve, rtol=rtol, atol=rtol)
    p, r = final_params(out, STEPS), final_params(ref, STEPS)
    assert p.keys() == r.keys()
    # Adam divides each gradient by its running RMS: where a gradient is ~0, the update's
    # size hinges on the last bits of a reduction whose order the layout changes (seen: one
    # element of 8192 off by 1.2e-5). One step moves a weight by up to lr = 3e-3; a layout
    # bug moves whole rows by whole steps, which 1e-4 (3% of one step) still catches.
    for k in r:
        np.testing.assert_allclose(p[k], r[k], rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "1x1"
    _finish([_start(_cmd("trainer.train", _sets(store, out)), _env(1))])
    return out


def test_tensor_parallel_matches_one_device(store, reference, tmp_path):
    tp = tmp_path / "tensor2"
    fsdp_tp = tmp_path / "fsdp2-tensor2"
    _finish(
        [
            _start(
                _cmd("trainer.train", _sets(store, tp, "mesh.data=1", "mesh.tensor=2")), _env(2)
            ),
            _start(
                _cmd(
                    "trainer.train",
                    _sets(store, fsdp_tp, "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"),
                ),
                _env(4),
            ),
        ]
    )
    assert json.loads((tp / "config.json").read_text())["mesh"]["tensor"] == 2
    mesh = json.loads((fsdp_tp / "config.json").read_text())["mesh"]
    assert (mesh["fsdp"], mesh["tensor"]) == (2, 2)
    # tensor parallelism splits matmul reductions (attention output, MLP down projection,
    # vocabulary log-sum-exp) into per-device partial sums: a different summation order
    _same_run(tp, reference, rtol=5e-5)
    _same_run(fsdp_tp, reference, rtol=5e-5)


def test_multislice_replica_axis_spans_slices(store, reference, tmp_path):
    out = tmp_path / "2slices"
    port = free_port()
    procs = [
        _start(
            _cmd("trainer.train", _sets(store, out, "mesh.replica=2", "mesh.data=-1")),
            _env(
                2,  # 2 devices per slice
                TPU_WORKER_HOSTNAMES="127.0.0.1",  # one host per slice
                TPU_WORKER_ID="0",
                MEGASCALE_NUM_SLICES="2",
                MEGASCALE_SLICE_ID=str(i),
                MEGASCALE_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            ),
        )
        for i in range(2)
    ]
    _finish(procs)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["processes"] == 2 and cfg["devices"] == 4
    assert cfg["mesh"] == {"replica": 2, "data": 2, "fsdp": 1, "tensor": 1}
    # replica i is slice (process) i; the data axis stays inside a slice
    assert cfg["mesh_processes"] == [[[[0]], [[0]]], [[[1]], [[1]]]]
    _same_run(out, reference, rtol=2e-5)


def test_two_process_evaluation_matches_one_process(store, reference, tmp_path):
    heldout = str(tmp_path / "heldout")
    write_random_store(heldout, num_docs=200, seed=7)
    sets = _sets(store, reference)
    args = ("--store", heldout, "--max-tokens", "8192", "--batch-size", "4")
    one = tmp_path / "eval-1.json"
    two = tmp_path / "eval-2.json"
    port = free_port()
    dist = [
        "distributed.mode=explicit",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.num_processes=2",
        "mesh.data=1",
        "mesh.fsdp=2",  # parameters sharded across the two processes
    ]
    outs = _finish(
        [
            _start(_cmd("trainer.evaluate", sets, *args, "--output", str(one)), _env(1)),
            *[
                _start(
                    _cmd(
                        "trainer.evaluate",
                        [*sets, *dist, f"distributed.process_id={i}"],
                        *args,
                        "--output",
                        str(two),
                    ),
                    _env(1),
                )
                for i in range(2)
            ],
        ]
    )
    single, double = json.loads(one.read_text()), json.loads(two.read_text())
    assert single["step"] == double["step"] == STEPS
    a, b = single["results"][0], double["results"][0]
    assert a["tokens"] == b["tokens"] == (8192 // 256) * 256
    for key in ("loss", "perplexity", "bits_per_byte"):
        if a[key] is None:
            assert b[key] is None
        else:
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
    # both processes report the same numbers (only process 0 writes the file)
    printed = [json.loads(o[o.index("{") :]) for o in outs[1:]]
    assert printed[0]["results"][0]["loss"] == printed[1]["results"][0]["loss"] == b["loss"]


def test_splash_attention_runs_per_device_under_a_mesh():
    """XLA cannot partition a Pallas call, so on a multi-chip slice splash must run inside a
    ``shard_map``: ``distributed.on_mesh`` gives the traced step its mesh and
    ``kernels.per_device`` splits q, k and v by rows of the batch and, where the tensor axis
    divides the query heads, by heads (kv heads it does not divide repeated first); a mesh
    without a tensor axis splits rows only. Forward and gradients match the blocked attention
    on one device (tests/support/splash_on_mesh.py)."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.splash_on_mesh"],
        env=_env(4),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    local = {(tuple(r["mesh"].items()), r["heads"], r["kv_heads"]): r["local_qkv"] for r in rows}
    b, s, hd = 4, 256, 64
    half, quarter = [b // 2, s], [b // 4, s]
    assert local == {  # q, k, v per device
        ((("data", 2), ("tensor", 2)), 4, 2): [[*half, 2, hd], [*half, 1, hd], [*half, 1, hd]],
        ((("fsdp", 4),), 4, 2): [[*quarter, 4, hd], [*quarter, 2, hd], [*quarter, 2, hd]],
        # one kv head, which tensor=2 does not divide: repeated, then split like the queries
        ((("data", 2), ("tensor", 2)), 4, 1): [[*half, 2, hd], [*half, 2, hd], [*half, 2, hd]],
        ((("data", 2), ("tensor", 2)), 2, 1): [[*half, 1, hd], [*half, 1, hd], [*half, 1, hd]],
        ((("data", 4),), 4, 2): [[*quarter, 4, hd], [*quarter, 2, hd], [*quarter, 2, hd]],
    }
    for r in rows:
        assert r["shard_maps"] == 2, r  # the forward and the backward each run per device
        assert r["masks"] == [[r["local_qkv"][0][2], s, s]] * 2, r
        assert r["worst"] < 1e-4, r
