"""A mixture-of-experts nano trains through the real loop and logs expert-load imbalance,
capacity drops and the auxiliary-loss value every step; with data parallelism each device's
rows of the batch are one routing group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import tensorstore as ts

from tests.support.trainer_data import loss_curve, write_random_store
from trainer.config import load_config


def test_moe_trains_and_logs_expert_stats(tmp_path):
    store = str(tmp_path / "store")
    write_random_store(store, num_docs=400)
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"data.sources=[{{path: {store}}}]",
            "model.preset=nano",
            "model.moe={num_experts: 4, top_k: 1, capacity_factor: 1.0}",
            "steps=30",
            "batch_size=8",
            "seq_len=64",
            "optimizer.learning_rate=3e-3",
            "optimizer.warmup_steps=5",
            "checkpoint.save_every=0",
        ],
    )
    from trainer.train import train

    result = train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert result["status"] == "succeeded"
    assert {"moe_imbalance_cv", "moe_drop_frac", "moe_aux_loss"} <= set(lines[-1])
    assert 0 <= lines[-1]["moe_drop_frac"] < 1
    assert lines[-1]["loss"] < lines[0]["loss"]


DP_STEPS, DP_BATCH, DP_SEQ = 6, 4, 64  # 2 devices: 2 rows = 128 tokens each


def _train_cli(store: str, out: Path, devices: int, *extra: str) -> subprocess.Popen:
    sets = [
        f"output_dir={out}",
        f"data.sources=[{{path: {store}}}]",
        "model.preset=nano",
        "model.num_layers=1",  # routing is per layer: one layer shows it, and compiles faster
        "model.moe={num_experts: 4, top_k: 1, capacity_factor: 1.0}",
        *extra,
        f"steps={DP_STEPS}",
        f"batch_size={DP_BATCH}",
        f"seq_len={DP_SEQ}",
        "optimizer.learning_rate=3e-3",
        "optimizer.warmup_steps=2",
        "checkpoint.save_every=0",
    ]
    # forced host devices; cheap LLVM compiles (the same flags for every run compared)
    flags = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={devices}"
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGASCALE_", "TPU_"))}
    env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
    cmd = [sys.executable, "-m", "trainer.train", *[x for s in sets for x in ("--set", s)]]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _router_bias(out: Path) -> np.ndarray:
    path = out / "checkpoints" / f"step-{DP_STEPS:09d}" / "arrays" / "router_bias"
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    return ts.open(spec).result().read().result()  # (layers, experts)


def _moe_curves(out: Path) -> dict[str, np.ndarray]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "moe_imbalance_cv", "moe_drop_frac")
    return {k: np.array([r[k] for r in rows]) for k in keys}


def test_data_parallel_moe_routes_each_devices_rows_as_one_group(tmp_path):
    store = str(tmp_path / "store")
    write_random_store(store, num_docs=300)
    dp2, per_device, whole = tmp_path / "dp2", tmp_path / "per-device", tmp_path / "whole"
    procs = [
        _train_cli(store, dp2, 2),  # default group: each device's 2 rows
        _train_cli(store, per_device, 1, "model.moe.group_size=128"),  # the same, explicitly
        _train_cli(store, whole, 1),  # default group on one device: all 4 rows
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-4000:]
    groups = {
        d.name: json.loads((d / "config.json").read_text())["model"]["moe"]["group_size"]
        for d in (dp2, per_device, whole)
    }
    assert groups == {"dp2": 128, "per-device": 128, "whole": 256}
    assert json.loads((dp2 / "config.json").read_text())["mesh"]["data"] == 2
    # two devices, each routing its own 128 tokens, is one device routing the same two groups:
    # the same quantiles, biases, loads, drops and losses
    loss_curve(dp2, DP_STEPS)  # every step logged
    a, b = _moe_curves(dp2), _moe_curves(per_device)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(_router_bias(dp2), _router_bias(per_device), atol=1e-5)
    # ... and not one group over the global batch (which is what the model would do unless
    # the trainer set the group from the mesh)
    assert not np.allclose(_router_bias(dp2), _router_bias(whole), atol=1e-3)
