"""bfloat16 compute: a full training run (the CLI path, with checkpoints) trains, keeps float32
master weights and optimizer state, and stays close to the float32 run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorstore as ts

from tests.support.trainer_data import write_random_store
from trainer.train import main

STEPS = 30


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("data") / "store")
    write_random_store(root, num_docs=300)
    return root


def _run(store: str, out, dtype: str) -> list[float]:
    sets = [
        f"output_dir={out}",
        f"data.sources=[{{path: {store}}}]",
        "model.preset=nano",
        f"steps={STEPS}",
        "batch_size=8",
        "seq_len=256",  # two query blocks: the block-causal attention in bfloat16
        "optimizer.learning_rate=3e-3",
        "optimizer.warmup_steps=3",
        "optimizer.z_loss_coef=1e-4",
        "checkpoint.save_every=15",
        f"compute_dtype={dtype}",
    ]
    assert main([x for s in sets for x in ("--set", s)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows]


def test_bfloat16_compute_trains_with_float32_master_weights(store, tmp_path):
    bf16 = _run(store, tmp_path / "bf16", "bfloat16")
    assert np.all(np.isfinite(bf16))
    assert np.mean(bf16[-5:]) < 0.8 * np.mean(bf16[:5])  # clearly learning
    f32 = _run(store, tmp_path / "f32", "float32")
    # same data, same init: bfloat16 matmuls follow the float32 curve closely
    np.testing.assert_allclose(bf16, f32, rtol=0.05)
    arrays = tmp_path / "bf16" / "checkpoints" / f"step-{STEPS:09d}" / "arrays"
    names = sorted(os.listdir(arrays))
    assert any(n.startswith("params") for n in names) and any("opt_state" in n for n in names)
    for n in names:
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(arrays / n)}})
        dtype = arr.result().dtype.numpy_dtype
        if n == "step":
            assert dtype == np.int32
        elif n.startswith(("params", "router_bias")) or arr.result().rank > 0:
            assert dtype == np.float32, n  # master weights and Adam moments stay float32
