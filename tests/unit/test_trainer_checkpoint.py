"""Checkpoints: exact round trip, atomic visibility, rolling + permanent, flat host memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import checkpoint as ckpt


def _tree(seed=0, n=256):
    k = jax.random.key(seed)
    return {
        "step": jnp.asarray(7, jnp.int32),
        "w": jax.random.normal(k, (n, n)),
        "layers": [jax.random.normal(k, (3, n)), jnp.arange(5, dtype=jnp.int32)],
        "scalar": jnp.asarray(1.5),
    }


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("write_threads", [None, 1])  # TensorStore's default, or capped
def test_round_trip_is_exact(tmp_path, write_threads):
    c = ckpt.Checkpointer(str(tmp_path), write_threads=write_threads)
    tree = _tree()
    c.save(3, tree)
    c.wait()
    assert ckpt.latest_step(str(tmp_path)) == 3
    _same(c.restore(3, tree), tree)
    c.close()


def test_incomplete_checkpoint_is_invisible(tmp_path, monkeypatch):
    c = ckpt.Checkpointer(str(tmp_path), async_save=False, keep=5)
    c.save(1, _tree())

    def crash(*a, **k):
        raise RuntimeError("killed before commit")

    monkeypatch.setattr(c, "_commit", crash)
    with pytest.raises(RuntimeError):
        c.save(2, _tree(1))
    assert (tmp_path / "step-000000002" / "arrays").exists()  # data written ...
    assert ckpt.latest_step(str(tmp_path)) == 1  # ... but not visible
    monkeypatch.undo()
    c.save(2, _tree(1))  # a retry of the same step replaces the partial one
    assert ckpt.latest_step(str(tmp_path)) == 2
    _same(c.restore(2, _tree()), _tree(1))


def test_rolling_and_permanent(tmp_path):
    c = ckpt.Checkpointer(str(tmp_path), keep=2)
    for step in range(1, 8):
        c.save(step, _tree(step, n=8), permanent=step % 3 == 0)
    c.close()
    assert [s for s, _ in ckpt.committed_steps(str(tmp_path))] == [3, 5, 6, 7]
    assert sorted(os.listdir(tmp_path)) == [f"step-{s:09d}" for s in (3, 5, 6, 7)]


# Run in a child process: the suite's own process holds whatever earlier tests left (JAX's
# and Beam's threads, caches), whose allocations would count against the checkpointer.
_SAVES = r"""
import gc, json, sys
import jax, jax.numpy as jnp, psutil
from trainer import checkpoint as ckpt

n = 1024  # ~4 MiB of float32 per save, 8 MiB with the copy in flight
tree = {"w": jax.random.normal(jax.random.key(0), (n, n)), "step": jnp.asarray(7, jnp.int32)}
c = ckpt.Checkpointer(sys.argv[1], keep=1)
proc = psutil.Process()
for step in range(15):  # warm up allocators and TensorStore
    c.save(step, tree)
c.wait()
gc.collect()
before = proc.memory_info().rss
for step in range(15, 55):
    c.save(step, tree)
c.wait()
gc.collect()
growth = proc.memory_info().rss - before
c.close()
print(json.dumps({"growth": growth, "steps": [s for s, _ in ckpt.committed_steps(sys.argv[1])]}))
"""


def test_host_memory_does_not_grow_over_many_saves(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": "."}
    out = subprocess.run(
        [sys.executable, "-c", _SAVES, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["growth"] < 24 << 20, f"RSS grew {found['growth'] / 2**20:.1f} MiB over 40 saves"
    assert found["steps"] == [54]


def test_metrics_log_appends_locally_and_rewrites_on_object_stores(tmp_path):
    import fsspec

    from trainer.train import MetricsLog

    local = MetricsLog(str(tmp_path / "m.jsonl"))
    local.write({"step": 1})
    local.close()
    again = MetricsLog(str(tmp_path / "m.jsonl"))  # a resumed run appends
    again.write({"step": 2})
    again.close()
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    remote = MetricsLog("memory://bucket/run/m.jsonl")  # no append on object stores
    remote.write({"step": 1})
    remote.close()
    resumed = MetricsLog("memory://bucket/run/m.jsonl", remote_flush_s=0)
    resumed.write({"step": 2})
    assert (
        fsspec.filesystem("memory").cat_file("/bucket/run/m.jsonl") == b'{"step": 1}\n{"step": 2}\n'
    )
    resumed.close()
