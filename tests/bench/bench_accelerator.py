"""Accelerator benchmark: the trainer's bf16 step on whatever chip JAX finds (TPU or GPU), for
the 150m and 300m presets, with MFU against the chip's bf16 peak and a same-run matmul peak.

    python -m tests.bench.bench_accelerator [--presets 150m,300m] [--batch 8] [--seq 2048]
        [--steps 10] [--attention auto,splash] [--json OUT] [--profile DIR]

One command, prepared for a machine with an accelerator (``docs/benchmarks.md`` says how it
was run on a TPU v5e). On a CPU-only machine it says so and exits 0, so ``make bench`` can run
it everywhere.

Per preset and attention implementation: the real train step (``trainer.train.setup``:
bf16 compute over float32 master weights, the accelerator's layer loop, AdamW), on one fixed
device batch of random tokens (the loader is measured by ``bench_trainer.py``; here only the
chip's work), compiled, warmed up, then ``--steps`` steps timed together (the state carries
from one step to the next, so they run back to back) and ``jax.block_until_ready`` at the end.
FLOPs per step are ``trainer.shapes.flops_per_token`` (6N plus attention, full not causal-
halved: the PaLM/Marin convention) times the tokens. Two denominators:

* the chip's published dense bf16 peak (``trainer.shapes.CHIP_PEAK_FLOPS``, by device kind);
* an 8192^3 bf16 matmul measured in the same process (what the chip sustains here).

``--profile DIR``: after the timed steps, a ``jax.profiler`` trace of 3 more steps per row,
``DIR/<preset>-<attention>-<batch>x<seq>/.../*.xplane.pb`` (read with xprof, see
``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VOCAB = 32768
# ``jax.devices()[0].device_kind`` (a lower-case substring) -> the TPU catalogue's name, whose
# peak is trainer.shapes.CHIP_PEAK_FLOPS'; GPUs, which the catalogue does not hold, by their
# published dense bf16 peak.
TPU_KINDS = {"v5 lite": "v5e", "v5e": "v5e", "v5p": "v5p", "v6": "v6e", "v4": "v4"}
GPU_PEAKS = {"h100": 989e12, "h200": 989e12, "a100": 312e12}


def chip_peak(kind: str) -> tuple[str, float | None]:
    from trainer.shapes import CHIP_PEAK_FLOPS

    for key, name in TPU_KINDS.items():
        if key in kind.lower():
            return name, CHIP_PEAK_FLOPS[name]
    for key, peak in GPU_PEAKS.items():
        if key in kind.lower():
            return key.upper(), peak
    return kind, None


def matmul_peak(n: int = 8192, reps: int = 10) -> float:
    """Sustained bf16 FLOP/s of an n x n x n product (median of ``reps`` timed calls)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def bench(
    preset: str, attention: str, batch: int, seq: int, steps: int, store: str, profile: str = ""
) -> dict:
    import jax

    from trainer.config import load_config
    from trainer.shapes import flops_per_token, param_count
    from trainer.train import BatchFeeder, setup

    out = tempfile.mkdtemp(prefix=f"bench-{preset}-")
    cfg = load_config(
        None,
        [
            f"output_dir={out}",
            f"data.sources=[{{path: {store}}}]",
            f"model.preset={preset}",
            f"model.attention={attention}",
            "steps=100000",
            f"batch_size={batch}",
            f"seq_len={seq}",
            "compute_dtype=bfloat16",
            "checkpoint.resume=false",
            "checkpoint.save_every=0",
            "optimizer.warmup_steps=10",
        ],
    )
    run = setup(cfg)
    fixed = BatchFeeder(run.loader, run.mesh, seq, batch).get(0)
    state = run.state
    t = time.perf_counter()
    step = run.step_fn.lower(state, fixed).compile()
    compile_s = time.perf_counter() - t
    for _ in range(2):
        state, m = step(state, fixed)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, fixed)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t) / steps
    if profile:
        jax.profiler.start_trace(str(Path(profile) / f"{preset}-{attention}-{batch}x{seq}"))
        for _ in range(3):
            state, m = step(state, fixed)
        jax.block_until_ready(m)
        jax.profiler.stop_trace()
    flops = flops_per_token(run.mcfg, seq) * batch * seq
    return {
        "preset": preset,
        "attention": attention,
        "params": param_count(run.mcfg),
        "layers": run.mcfg.num_layers,
        "hidden": run.mcfg.hidden_dim,
        "batch": batch,
        "seq": seq,
        "compile_s": round(compile_s, 1),
        "step_s": step_s,
        "tokens_per_s": batch * seq / step_s,
        "flops_per_s": flops / step_s,
        "loss": float(m["loss"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="150m,300m")
    parser.add_argument("--attention", default="auto", help="comma-separated kernels to compare")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default="")
    parser.add_argument("--profile", default="", help="folder for jax.profiler traces")
    args = parser.parse_args()

    import jax

    backend = jax.default_backend()
    if backend == "cpu":
        print("bench_accelerator: no accelerator here (JAX's backend is cpu): nothing measured")
        return 0
    device = jax.devices()[0]
    name, peak = chip_peak(device.device_kind)
    measured = matmul_peak()
    print(
        f"{device.device_kind} ({name}), {len(jax.devices())} device(s); published bf16 peak "
        f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s, measured 8192^3 bf16 matmul "
        f"{measured / 1e12:.0f} TFLOP/s"
    )
    from tests.support.trainer_data import write_random_store

    store = tempfile.mkdtemp(prefix="bench-store-")
    tokens_needed = args.batch * (args.seq + 1)
    write_random_store(store, vocab_size=VOCAB, num_docs=max(400, tokens_needed // 40), shards=2)
    rows = []
    for preset in args.presets.split(","):
        for attention in args.attention.split(","):
            try:
                r = bench(preset, attention, args.batch, args.seq, args.steps, store, args.profile)
            except Exception as exc:  # out of memory, a kernel this chip lacks: say so
                print(f"{preset} {attention}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                rows.append({"preset": preset, "attention": attention, "error": str(exc)[:300]})
                continue
            r["mfu_published"] = r["flops_per_s"] / peak if peak else None
            r["mfu_measured"] = r["flops_per_s"] / measured
            rows.append(r)
            print(
                f"{preset:>5} {attention:<7} {r['params'] / 1e6:6.0f}M params  batch {r['batch']} x "
                f"{r['seq']}  step {r['step_s'] * 1000:7.1f} ms  {r['tokens_per_s']:9.0f} tokens/s  "
                f"MFU {100 * (r['mfu_published'] or float('nan')):5.1f}% of the published peak, "
                f"{100 * r['mfu_measured']:5.1f}% of the measured matmul  "
                f"(compile {r['compile_s']} s, loss {r['loss']:.3f})"
            )
    if args.json:
        body = {
            "device": device.device_kind,
            "chip": name,
            "published_peak": peak,
            "measured_peak": measured,
            "jax": jax.__version__,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(body, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
