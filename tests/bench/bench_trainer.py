"""Trainer benchmark: tokens/s and MFU of the 30m- and 75m-class presets on this machine,
against the matmul peak measured in the same process with ``jnp.dot``; data-loader and
asynchronous-checkpoint step-time overheads; save/restore time; peak host memory.

Run: ``python tests/bench/bench_trainer.py [--steps N] [--json OUT]`` or
``pytest -m bench tests/bench/bench_trainer.py``. Results: ``docs/benchmarks.md`` (trainer).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import checkpoint as ckpt
from trainer.config import load_config
from trainer.model import flops_per_token, param_count
from trainer.testing import write_random_store
from trainer.train import BatchFeeder, setup

VOCAB = 8192
SEQ = 512
BATCH = 8


def matmul_peak(n: int = 1024, reps: int = 20) -> float:
    """Sustained float32 FLOP/s of a square jnp.dot on this machine, best of 3."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(a, b)
        out.block_until_ready()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    return best


def _timed_steps(step, state, batches, n, before=None):
    """Per-step wall times (each step waited for: on this shared machine the median of
    per-step times is far less noisy than one total)."""
    times = []
    for i in range(n):
        t = time.perf_counter()
        if before is not None:
            before(i, state)
        state, m = step(state, batches(i))
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return state, np.asarray(times)


def bench_preset(preset: str, store: str, out: str, steps: int, peak: float) -> dict:
    cfg = load_config(
        None,
        [
            f"output_dir={out}",
            f"data.sources=[{{path: {store}}}]",
            f"model.preset={preset}",
            f"steps={10 * steps}",
            f"batch_size={BATCH}",
            f"seq_len={SEQ}",
            "checkpoint.resume=false",
            "optimizer.warmup_steps=10",
        ],
    )
    run = setup(cfg)
    feeder = BatchFeeder(run.loader, run.mesh, SEQ, BATCH)
    fixed = feeder.get(0)
    state = run.state
    t = time.perf_counter()
    step = run.step_fn.lower(state, fixed).compile()
    compile_s = time.perf_counter() - t
    state, _ = _timed_steps(step, state, lambda i: fixed, 3)  # warm up
    # 1. compute only: the same device batch every step
    state, t_fixed = _timed_steps(step, state, lambda i: fixed, steps)
    # 2. with the real loader (reads from the token store, one step ahead in a thread)
    state, t_loader = _timed_steps(step, state, lambda i: feeder.get(100 + i), steps)
    # 3. with the loader and an asynchronous checkpoint every 5 steps (bounded: one in flight)
    c = ckpt.Checkpointer(f"{out}/ckpt-async", keep=1)

    def save(i, st):
        if i and i % 5 == 0:
            c.save(i, st)

    state, t_ckpt = _timed_steps(step, state, lambda i: feeder.get(200 + i), steps, save)
    c.wait()
    # 4. save and restore, synchronously
    c2 = ckpt.Checkpointer(f"{out}/ckpt-sync", async_save=False)
    t = time.perf_counter()
    c2.save(1, state)
    save_s = time.perf_counter() - t
    target = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    t = time.perf_counter()
    restored = c2.restore(1, target)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t
    c.close()
    c2.close()
    feeder.close()
    fpt = flops_per_token(run.mcfg, SEQ)
    tps = BATCH * SEQ / np.median(t_fixed)
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    return {
        "preset": preset,
        "params": param_count(run.mcfg),
        "flops_per_token": fpt,
        "compile_s": compile_s,
        "step_s_median": float(np.median(t_fixed)),
        "step_s_min": float(np.min(t_fixed)),
        "mfu_best_step": BATCH * SEQ / float(np.min(t_fixed)) * fpt / peak,
        "tokens_per_s": tps,
        "mfu_vs_matmul_peak": tps * fpt / peak,
        # medians: robust to other jobs' bursts; means: include every save's host copy
        "loader_overhead": float(np.median(t_loader) / np.median(t_fixed) - 1),
        "loader_overhead_mean": float(t_loader.mean() / t_fixed.mean() - 1),
        "async_ckpt_overhead": float(np.median(t_ckpt) / np.median(t_loader) - 1),
        "async_ckpt_overhead_mean": float(t_ckpt.mean() / t_loader.mean() - 1),
        "host_copy_s": c.last_host_copy_s,
        "state_mib": state_bytes / 2**20,
        "save_s": save_s,
        "restore_s": restore_s,
    }


def run(steps: int = 10) -> dict:
    peak = matmul_peak()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"{tmp}/store"
        write_random_store(store, vocab_size=VOCAB, num_docs=3000)
        rows = [bench_preset(p, store, f"{tmp}/{p}", steps, peak) for p in ("30m", "75m")]
    return {
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "matmul_peak_gflops": peak / 1e9,
        "vocab": VOCAB,
        "seq_len": SEQ,
        "batch": BATCH,
        "presets": rows,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def table(r: dict) -> str:
    lines = [
        f"matmul peak (jnp.dot 1024^2 f32): {r['matmul_peak_gflops']:.1f} GFLOP/s; "
        f"peak RSS {r['peak_rss_mib']:.0f} MiB; vocab {r['vocab']}, seq {r['seq_len']}, "
        f"batch {r['batch']}",
        "",
        "| preset | params | tokens/s | MFU (median step) | MFU (best step) | loader overhead "
        "median / mean | async ckpt overhead median / mean | state MiB | save s | restore s "
        "| compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["presets"]:
        lines.append(
            f"| {p['preset']} | {p['params'] / 1e6:.2f}M | {p['tokens_per_s']:.0f} | "
            f"{100 * p['mfu_vs_matmul_peak']:.1f}% | {100 * p['mfu_best_step']:.1f}% | "
            f"{100 * p['loader_overhead']:.1f}% / {100 * p['loader_overhead_mean']:.1f}% | "
            f"{100 * p['async_ckpt_overhead']:.1f}% / {100 * p['async_ckpt_overhead_mean']:.1f}% | "
            f"{p['state_mib']:.1f} | {p['save_s']:.2f} | "
            f"{p['restore_s']:.2f} | {p['compile_s']:.1f} |"
        )
    return "\n".join(lines)


@pytest.mark.bench
def test_bench_trainer():
    result = run()
    print(table(result))
    assert all(p["tokens_per_s"] > 0 for p in result["presets"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    res = run(args.steps)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    sys.exit(0)
