"""Trainer benchmark: tokens/s and MFU of the 30m- and 75m-class presets on this machine,
against the matmul peak measured in the same process with ``jnp.dot``; data-loader and
asynchronous-checkpoint step-time overheads; save/restore time; peak host memory.

Run: ``python -m tests.bench.bench_trainer [--compute-steps N] [--json OUT]`` or
``pytest -m bench tests/bench/bench_trainer.py``. Results: ``docs/benchmarks.md`` (trainer).

Every figure is paired with a reference measured right next to it, because the machine this
runs on is shared (other jobs take cores for seconds at a time): each timed step is preceded by
its own ``jnp.dot`` peak sample, and MFU is the median over steps of (achieved FLOP/s / that
step's peak); loader and checkpoint overheads compare alternating steps / blocks of steps rather
than two phases minutes apart. Checkpoint overhead is also reported as its cause, the writer's
CPU seconds per save, which the machine's noise does not blur the way it blurs block times.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.trainer_data import write_random_store
from trainer import checkpoint as ckpt
from trainer import hostmem, vector_width
from trainer.config import load_config
from trainer.model import unroll_layers
from trainer.shapes import flops_per_token, param_count
from trainer.train import BatchFeeder, checkpoint_write_threads, setup

# What a user of these presets runs: Marin's context for them (1,024 tokens, packed documents)
# and an 8k vocabulary. Marin's batches (hundreds of sequences) would make one step last a
# minute on a 2-core CPU; per-token cost is flat in the batch from ~4k tokens per step on
# (matmuls with 4,096 rows; 30m at 512 x 8, 512 x 16, 1024 x 4 and 1024 x 8 tokens measured the
# same MFU within noise), so 4 sequences of 1,024.
VOCAB = 8192
SEQ = 1024
BATCH = 4
# The benchmarked shapes: name -> (config overrides, sequence length, batch). The presets run
# at SEQ x BATCH; "h512" is issue 18's GPT-2-small-like shape (hidden 512, 8 layers, 8 heads of
# 64, MLP 1408, tied embeddings, ~30M parameters at this vocabulary) at 512 x 8 tokens, "h768" a
# wider one (12 heads of 64, MLP 2048, 6 layers to keep a step of PyTorch under ~10 s here).
SHAPES: dict[str, tuple[tuple[str, ...], int, int]] = {
    "30m": (("model.preset=30m",), SEQ, BATCH),
    "75m": (("model.preset=75m",), SEQ, BATCH),
    "150m": (("model.preset=150m",), SEQ, BATCH),
    "h512": (
        (
            "model.hidden_dim=512",
            "model.num_layers=8",
            "model.num_heads=8",
            "model.num_kv_heads=8",
            "model.head_dim=64",
            "model.intermediate_dim=1408",
            "model.tie_embeddings=true",
        ),
        512,
        8,
    ),
    "h768": (
        (
            "model.hidden_dim=768",
            "model.num_layers=6",
            "model.num_heads=12",
            "model.num_kv_heads=12",
            "model.head_dim=64",
            "model.intermediate_dim=2048",
            "model.tie_embeddings=true",
        ),
        512,
        8,
    ),
}
SAVE_EVERY = 10  # steps per block in the checkpoint-overhead phase: a save every ~4-15 s here
# (a stress setting: Levanter's CheckpointerConfig saves a temporary checkpoint every 15 minutes)


class MatmulPeak:
    """Sustained float32 FLOP/s of an n x n matmul, called back to back for (at least) a given
    time; subclasses say how one batch of products is run. Sampled for as long as the step it
    is compared with: a short sample is more often entirely inside, or entirely outside,
    another job's burst than a long step is, which makes per-step ratios swing both ways."""

    def __init__(self, n: int = 1024, batch: int = 5) -> None:
        self.n, self.batch = n, batch
        self.samples: list[float] = []

    def _products(self) -> None:
        """Run ``batch`` products and wait for them."""
        raise NotImplementedError

    def sample(self, seconds: float = 0.2) -> float:
        calls, t = 0, time.perf_counter()
        while True:
            self._products()
            calls += self.batch
            elapsed = time.perf_counter() - t
            if elapsed >= seconds:
                break
        flops = 2 * self.n**3 * calls / elapsed
        self.samples.append(flops)
        return flops


class Peak(MatmulPeak):
    """The ``jnp.dot`` peak: a jitted 1024 x 1024 float32 product."""

    def __init__(self, n: int = 1024, batch: int = 5) -> None:
        super().__init__(n, batch)
        self.a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        self.b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        self.f = jax.jit(lambda a, b: a @ b)
        self.f(self.a, self.b).block_until_ready()

    def _products(self) -> None:
        # dispatched `batch` at a time, then waited for: asynchronous dispatch keeps the cores
        # busy between products
        for _ in range(self.batch):
            out = self.f(self.a, self.b)
        out.block_until_ready()


def _writer_cpu_s() -> float:
    """CPU seconds used so far by the checkpoint writer: our ``checkpoint`` thread and
    TensorStore's pool workers (Linux /proc; the loader's reads share those workers, but the
    checkpoint phase compares blocks that both read). On a CPU-only run every writer CPU second
    is taken from the step's cores, so this is the overhead's cause, measured without the
    step-time noise of a shared machine."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:  # the thread ended
            continue
        if name.split("(", 1)[1].startswith(("checkpoint", "ts_pool_worker")):
            fields = rest.split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def _step(step, state, batch):
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    return state, time.perf_counter() - t


def preset_config(shape: str, store: str, out: str):
    """The benchmark's training config for one of ``SHAPES`` (shared with
    reference_pytorch.py); its ``seq_len`` and ``batch_size`` are the shape's."""
    overrides, seq, batch = SHAPES[shape]
    return load_config(
        None,
        [
            f"output_dir={out}",
            f"data.sources=[{{path: {store}}}]",
            *overrides,
            "steps=100000",
            f"batch_size={batch}",
            f"seq_len={seq}",
            "checkpoint.resume=false",
            "optimizer.warmup_steps=10",
        ],
    )


def bench_preset(
    preset: str, store: str, out: str, steps: int, rounds: int, peak: Peak, compute_steps: int
) -> dict:
    run = setup(preset_config(preset, store, out))
    seq, batch = run.cfg.seq_len, run.cfg.batch_size  # the shape's
    feeder = BatchFeeder(run.loader, run.mesh, seq, batch)
    fixed = feeder.get(0)
    state = run.state
    t = time.perf_counter()
    step = run.step_fn.lower(state, fixed).compile()
    compile_s = time.perf_counter() - t
    for _ in range(3):  # warm up as the timed loop runs: the peak's buffers shape the heap too
        peak.sample(seconds=0.1)
        state, dt = _step(step, state, fixed)
    fpt = flops_per_token(run.mcfg, seq)
    flops_per_step = batch * seq * fpt

    # 1. compute: one fixed device batch; each step right after its own peak sample, taken
    # over as long as the previous step lasted
    t_fixed, mfu, peaks, faults = [], [], [], 0
    for _ in range(compute_steps):
        p = peak.sample(seconds=dt)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        state, dt = _step(step, state, fixed)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        t_fixed.append(dt)
        peaks.append(p)
        mfu.append(flops_per_step / dt / p)

    # 2. loader: alternate a fixed-batch step and a step fed by the real loader (token store
    # reads, one step ahead in a thread); the loader's cost is whatever the training thread
    # waits for data plus any slowdown from the reads running beside the step
    feeder.wait_s = 0.0
    a_fixed, a_loader = [], []
    for i in range(steps):
        state, dt = _step(step, state, fixed)
        a_fixed.append(dt)
        state, dt = _step(step, state, feeder.get(100 + i))
        a_loader.append(dt)
    loader_wait = feeder.wait_s / steps

    # 3. asynchronous checkpoints: alternate a block of SAVE_EVERY loader-fed steps without a
    # save and one that starts with a save (copy to host in this thread, write in the
    # background while the block's steps run); overhead = median over pairs of the ratio
    # the writer's thread budget the trainer uses (a quarter of the cores on a CPU-only run)
    c = ckpt.Checkpointer(f"{out}/ckpt-async", keep=1, write_threads=checkpoint_write_threads(0))
    plain, saving, copy_s, wait_s, writer_cpu = [], [], [], [], []
    n = 1000
    for _ in range(rounds):
        for with_save in (False, True):
            cpu0 = _writer_cpu_s()
            t0 = time.perf_counter()
            if with_save:
                c.save(n, state)
                copy_s.append(c.last_host_copy_s)
                wait_s.append(c.last_wait_s)
            for _ in range(SAVE_EVERY):
                state, _ = _step(step, state, feeder.get(n))
                n += 1
            # a write still running at the block's end is waited for inside the block: it
            # counts as overhead, and the next plain block never overlaps a write
            c.wait()
            (saving if with_save else plain).append(time.perf_counter() - t0)
            writer_cpu.append((_writer_cpu_s() - cpu0, with_save))
    background_write_s = c.last_save_s
    c.close()
    plain_a, saving_a = np.asarray(plain), np.asarray(saving)
    # the writer's CPU per save, net of the pool's CPU in plain blocks (the loader's reads)
    cpu_save = np.median([c_ for c_, w in writer_cpu if w])
    cpu_plain = np.median([c_ for c_, w in writer_cpu if not w])

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
    c2.close()
    feeder.close()
    t_fixed_a = np.asarray(t_fixed)
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    return {
        "preset": preset,
        "seq_len": seq,
        "batch": batch,
        "params": param_count(run.mcfg),
        "flops_per_token": fpt,
        "compile_s": compile_s,
        "layers_unrolled": unroll_layers(run.mcfg),  # model.layer_loop "auto": unrolled on CPU
        "step_s_median": float(np.median(t_fixed_a)),
        "step_s_min": float(np.min(t_fixed_a)),
        "tokens_per_s": batch * seq / float(np.median(t_fixed_a)),
        # per step: achieved FLOP/s over the jnp.dot peak sampled just before that step
        "mfu_vs_matmul_peak": float(np.median(mfu)),
        # least-disturbed estimates of both: fastest step over the highest peak sample
        "mfu_best_step": flops_per_step / float(np.min(t_fixed_a)) / max(peaks),
        "mfu_steps": [float(x) for x in mfu],
        "matmul_peak_gflops_median": float(np.median(peaks)) / 1e9,
        # spread of the per-step ratios: this machine is shared, and the median of a few
        # dozen steps moves by a few points from run to run
        "mfu_p25_p75": [float(np.percentile(mfu, 25)), float(np.percentile(mfu, 75))],
        "page_faults_per_step": faults / compute_steps,
        "loader_overhead": float(np.median(a_loader) / np.median(a_fixed) - 1),
        "loader_wait_s_per_step": loader_wait,
        "async_ckpt_overhead": float(np.median(saving_a / plain_a) - 1),
        "async_ckpt_extra_s_per_save": float(np.median(saving_a - plain_a)),
        "ckpt_host_copy_s": float(np.median(copy_s)),
        "ckpt_wait_s": float(np.median(wait_s)),
        "ckpt_background_write_s": background_write_s,
        "ckpt_writer_cpu_s_per_save": float(cpu_save - cpu_plain),
        "ckpt_writer_cpu_share": float((cpu_save - cpu_plain) / np.median(saving_a)),
        "state_mib": state_bytes / 2**20,
        "save_s": save_s,
        "restore_s": restore_s,
    }


def run(steps: int = 10, rounds: int = 6, compute_steps: int = 30, shapes: str = "30m,75m") -> dict:
    # what `python -m trainer.train` does first on a CPU-only machine (trainer/hostmem.py,
    # trainer/vector_width.py)
    warm = hostmem.keep_step_memory_warm()
    wide = vector_width.prefer_host_vector_width()
    peak = Peak()
    peak.sample(1.0)
    with tempfile.TemporaryDirectory() as tmp:
        store = f"{tmp}/store"
        write_random_store(store, vocab_size=VOCAB, num_docs=3000)
        rows = [
            bench_preset(p, store, f"{tmp}/{p}", steps, rounds, peak, compute_steps)
            for p in shapes.split(",")
        ]
    return {
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "matmul_peak_gflops_median": float(np.median(peak.samples)) / 1e9,
        "matmul_peak_gflops_max": max(peak.samples) / 1e9,
        "vocab": VOCAB,
        "save_every": SAVE_EVERY,
        "malloc_kept_warm": warm,
        "vector_width_512": wide,
        "presets": rows,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def table(r: dict) -> str:
    lines = [
        f"jnp.dot peak (1024^2 f32, sampled before every timed step): median "
        f"{r['matmul_peak_gflops_median']:.0f}, max {r['matmul_peak_gflops_max']:.0f} GFLOP/s; "
        f"peak RSS {r['peak_rss_mib']:.0f} MiB; vocab {r['vocab']}; "
        f"malloc kept warm (trainer/hostmem.py): {r['malloc_kept_warm']}; "
        f"512-bit vectors (trainer/vector_width.py): {r['vector_width_512']}",
        "",
        "| shape (seq x batch) | params | FLOPs/token | tokens/s | MFU (median step, p25-p75) "
        "| MFU (best step / best peak) | page faults / step "
        f"| loader overhead (paired steps) / wait per step | async ckpt overhead (save every {r['save_every']}) "
        "| per save: extra s / host copy s / writer CPU s | state MiB | save s | restore s "
        "| compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["presets"]:
        lines.append(
            f"| {p['preset']} ({p['seq_len']} x {p['batch']}, "
            f"{'unrolled' if p['layers_unrolled'] else 'scan'}) "
            f"| {p['params'] / 1e6:.2f}M | {p['flops_per_token'] / 1e6:.1f}M | "
            f"{p['tokens_per_s']:.0f} | {100 * p['mfu_vs_matmul_peak']:.1f}% "
            f"({100 * p['mfu_p25_p75'][0]:.0f}-{100 * p['mfu_p25_p75'][1]:.0f}%) | "
            f"{100 * p['mfu_best_step']:.1f}% | {p['page_faults_per_step']:.0f} | "
            f"{100 * p['loader_overhead']:.1f}% / {1e3 * p['loader_wait_s_per_step']:.1f} ms | "
            f"{100 * p['async_ckpt_overhead']:.1f}% | "
            f"{p['async_ckpt_extra_s_per_save']:.3f} / {p['ckpt_host_copy_s']:.3f} / "
            f"{p['ckpt_writer_cpu_s_per_save']:.2f} | "
            f"{p['state_mib']:.1f} | {p['save_s']:.2f} | {p['restore_s']:.2f} | "
            f"{p['compile_s']:.1f} |"
        )
    return "\n".join(lines)


@pytest.mark.bench
def test_bench_trainer():
    result = run()
    print(table(result))
    assert all(p["tokens_per_s"] > 0 for p in result["presets"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="paired steps, loader phase")
    parser.add_argument(
        "--compute-steps", type=int, default=30, help="timed steps for tokens/s and MFU"
    )
    parser.add_argument("--rounds", type=int, default=6, help="checkpoint block pairs")
    parser.add_argument(
        "--shapes", default="30m,75m", help=f"comma-separated, of {','.join(SHAPES)}"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    res = run(args.steps, args.rounds, args.compute_steps, args.shapes)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    sys.exit(0)
