"""Training entrypoint: ``python -m trainer.train --config FILE_OR_GS_URI [--set a.b=c ...]``.

Writes under ``output_dir``: ``config.json`` (resolved), ``checkpoints/``, ``metrics.jsonl``
(one JSON object per logged step; after a resume, steps after the restored checkpoint are logged
again and the last line for a step wins) and ``result.json`` (status, steps, final loss, error,
``start_step``: the checkpoint step the run resumed from, 0 for a fresh start, and
``train_seconds``: the wall time of this run's step loop).

Exit codes: 0 succeeded; 1 failed; 2 invalid config (nothing computed);
``EXIT_RESTART`` = 42 preempted: SIGTERM was received, a checkpoint was saved, run me again
(the JobSet failure policy restarts on it; a restarted run resumes from the checkpoint).

Why just over 500 lines: the train step, the loop and the entrypoint's signal and exit-code
handling are read together when a run misbehaves; the model, kernels, data, optimizer and
checkpoints already live in their own modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import equinox as eqx
import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from tokenstore import TokenStore
from trainer import checkpoint as ckpt
from trainer import distributed as dist
from trainer import hostmem, kernels, rundir, vector_width
from trainer.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    load_config,
    resolve_model,
    to_dict,
)
from trainer.data import MixtureLoader
from trainer.model import Batch, Transformer, jit_document_batch
from trainer.optim import make_optimizer, schedule
from trainer.shapes import CHIP_PEAK_FLOPS, flops_per_token, param_count

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_RESTART = 0, 1, 2, 42

# The chips' peaks by the words of their jax device_kind ("TPU v5 lite", "TPU v6 lite", ...).
TPU_PEAK_FLOPS = {
    "v4": CHIP_PEAK_FLOPS["v4"],
    "v5 lite": CHIP_PEAK_FLOPS["v5e"],
    "v5e": CHIP_PEAK_FLOPS["v5e"],
    "v5p": CHIP_PEAK_FLOPS["v5p"],
    "v6": CHIP_PEAK_FLOPS["v6e"],
}


class TrainState(eqx.Module):
    step: Array  # int32 scalar: number of optimizer steps taken
    params: Transformer
    opt_state: Any
    router_bias: Array  # (layers, experts): quantile-balancing bias, gradient-free


# ---------------------------------------------------------------------------------------------
# pure math


def loss_and_stats(
    params: Transformer,
    router_bias: Array,
    batch: Batch,
    *,
    z_loss_coef: float,
    dtype: Any,
    loss_chunk: int = 0,
) -> tuple[Array, dict[str, Array]]:
    """Mean next-token cross-entropy of a batch of packed windows, plus z-loss and the MoE
    auxiliary loss when configured. Returns (objective, stats). ``loss_chunk``: positions per
    chunk of the fused output projection + loss (0: sized for one device holding the batch)."""
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    x, moe = params.hidden(inputs, batch.segments, batch.positions, router_bias, dtype)
    b, s = inputs.shape
    chunk = loss_chunk or kernels.loss_chunk(s, b, params.cfg.vocab_size)
    objective, loss = kernels.fused_cross_entropy(
        x, params.head(), targets, z_loss_coef=z_loss_coef, chunk=chunk
    )
    stats: dict[str, Array] = {"loss": loss}
    m = params.cfg.moe
    if m is not None:
        if m.balancing == "aux_loss":
            objective = objective + m.aux_loss_coef * jnp.mean(moe["aux_loss"])
        load = moe["load"]  # (L, E)
        cv = jnp.std(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
        stats.update(
            moe_imbalance_cv=jnp.mean(cv),
            moe_drop_frac=jnp.sum(moe["dropped"]) / jnp.sum(moe["assigned"]),
            moe_aux_loss=jnp.mean(moe["aux_loss"]),
            moe_beta=moe["beta"],
        )
    return objective, stats


def make_train_step(cfg: TrainConfig, mcfg: ModelConfig, tx, data_parallel: int = 1):
    """The jit-able step (state, batch) -> (state, metrics); ``batch`` is a
    ``model.document_batch``. ``data_parallel``: how many ways the batch is split, which sizes
    the per-device chunks of the fused loss."""
    dtype = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
    lr_fn = schedule(cfg.optimizer, cfg.steps)
    chunk = kernels.loss_chunk(cfg.seq_len, cfg.batch_size // data_parallel, mcfg.vocab_size)

    def step_fn(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Array]]:
        def objective(p):
            return loss_and_stats(
                p,
                state.router_bias,
                batch,
                z_loss_coef=cfg.optimizer.z_loss_coef,
                dtype=dtype,
                loss_chunk=chunk,
            )

        (obj, stats), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        bias = state.router_bias
        if mcfg.moe is not None and mcfg.moe.balancing == "quantile":
            bias = -stats["moe_beta"]  # the next step selects with b = -beta
        stats.pop("moe_beta", None)
        metrics = {
            **stats,
            "objective": obj,
            "grad_norm": optax.global_norm(grads),
            "lr": lr_fn(state.step),
        }
        return TrainState(state.step + 1, params, opt_state, bias), metrics

    return step_fn


# ---------------------------------------------------------------------------------------------
# setup


@dataclasses.dataclass
class Run:
    cfg: TrainConfig
    mcfg: ModelConfig
    mesh: Any
    loader: MixtureLoader
    state: TrainState
    state_shardings: Any
    step_fn: Any
    checkpointer: ckpt.Checkpointer
    start_step: int


def open_stores(paths: list[str]) -> list[TokenStore]:
    return [TokenStore.open(p) for p in paths]


def init_state(cfg: TrainConfig, mcfg: ModelConfig, tx, mesh):
    n_bias = mcfg.moe.num_experts if mcfg.moe else 0

    def init_fn(key):
        params = Transformer(mcfg, key)
        return TrainState(
            jnp.zeros((), jnp.int32),
            params,
            tx.init(params),
            jnp.zeros((mcfg.num_layers, n_bias), jnp.float32),
        )

    key = jax.random.key(cfg.seed)
    abstract = jax.eval_shape(init_fn, key)
    shardings = dist.param_shardings(abstract, mesh)
    return jax.jit(init_fn, out_shardings=shardings)(key), abstract, shardings


def checkpoint_write_threads(configured: int) -> int | None:
    """The background checkpoint writer's thread budget: as configured, else on a CPU-only run a
    quarter of the cores (the writer competes with the step: on the 2-core benchmark VM an
    uncapped writer made a save every 5 steps of 75m cost 17% of step time, one thread 8.5%),
    else TensorStore's default (on accelerator hosts the step does not run on the cores)."""
    if configured:
        return configured
    if jax.default_backend() == "cpu":
        return max(1, (os.cpu_count() or 1) // 4)
    return None


def setup(cfg: TrainConfig) -> Run:
    mesh = dist.make_mesh(cfg.mesh)
    dp = dist.data_parallel_size(mesh)
    if cfg.batch_size % dp:
        raise ConfigError("batch_size", f"must be divisible by the data-parallel size {dp}")
    stores = open_stores([s.path for s in cfg.data.sources])
    loader = MixtureLoader(
        stores,
        [s.weight for s in cfg.data.sources],
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        block_size=cfg.data.block_size,
    )
    # MoE routing groups default to each device's rows of the batch (see MoEConfig.group_size)
    mcfg = resolve_model(
        cfg.model,
        vocab_size=loader.vocab_size,
        tokens_per_device=cfg.batch_size // dp * cfg.seq_len,
    )
    if mcfg.vocab_size < loader.vocab_size:
        raise ConfigError("model.vocab_size", f"smaller than the token store's {loader.vocab_size}")
    tx = make_optimizer(cfg.optimizer, cfg.steps)
    state, abstract, shardings = init_state(cfg, mcfg, tx, mesh)
    checkpointer = ckpt.Checkpointer(
        rundir.checkpoints_dir(cfg.output_dir),
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
        write_threads=checkpoint_write_threads(cfg.checkpoint.write_threads),
    )
    if jax.process_index() == 0:
        gone = checkpointer.discard_unfinished()
        if gone:
            print(f"deleted unfinished checkpoint saves (no commit.json): steps {gone}", flush=True)
    if jax.process_count() > 1:  # nobody saves or reads before they are gone
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("slipway: unfinished checkpoints deleted")
    start = 0
    if cfg.checkpoint.resume:
        latest = ckpt.latest_step(checkpointer.root)
        if latest is not None:
            target = jax.tree_util.tree_map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
            )
            del state
            state = checkpointer.restore(latest, target)
            start = latest
    step_fn = jax.jit(
        dist.on_mesh(make_train_step(cfg, mcfg, tx, dp), mesh),
        in_shardings=(shardings, dist.batch_sharding(mesh)),
        out_shardings=(shardings, dist.replicated(mesh)),
        donate_argnums=0,
    )
    return Run(cfg, mcfg, mesh, loader, state, shardings, step_fn, checkpointer, start)


class BatchFeeder:
    """Reads this host's rows of the global batch in a background thread, one step ahead, and
    hands the step a ``Batch`` (document ids computed on the devices, see ``jit_document_batch``)."""

    def __init__(self, loader: MixtureLoader, mesh, seq_len: int, batch_size: int) -> None:
        self.loader = loader
        self.sharding = dist.batch_sharding(mesh)
        self.shape = (batch_size, seq_len + 1)
        index_map = self.sharding.addressable_devices_indices_map(self.shape)
        rows = set()
        for idx in index_map.values():
            rows.update(range(*idx[0].indices(batch_size)))
        self.rows = sorted(rows)
        self.row_pos = {r: i for i, r in enumerate(self.rows)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data")
        self._next: tuple[int, Any] | None = None
        self.wait_s = 0.0  # time the training thread waited for data
        self._documents = jit_document_batch(loader.eos_id, self.sharding)

    def _host(self, step: int) -> np.ndarray:
        return self.loader.rows(step, self.rows)

    def get(self, step: int) -> Batch:
        t0 = time.perf_counter()
        if self._next is not None and self._next[0] == step:
            host = self._next[1].result()
        else:
            host = self._host(step)
        self._next = (step + 1, self._pool.submit(self._host, step + 1))
        self.wait_s += time.perf_counter() - t0

        def cb(index):
            rows = range(*index[0].indices(self.shape[0]))
            return host[[self.row_pos[r] for r in rows]][:, index[1]]

        return self._documents(jax.make_array_from_callback(self.shape, self.sharding, cb))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def peak_flops(cfg: TrainConfig) -> float | None:
    if cfg.peak_flops_per_device > 0:
        return cfg.peak_flops_per_device * jax.device_count()
    kind = jax.devices()[0].device_kind.lower()
    for name, flops in TPU_PEAK_FLOPS.items():
        if name in kind:
            return flops * jax.device_count()
    return None


# ---------------------------------------------------------------------------------------------
# the loop


class Preemption:
    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:  # only sets a flag: the loop saves cleanly
        self.requested = True

    def agreed(self) -> bool:
        """All processes stop at the same step (one may see SIGTERM a step later)."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.requested))
        return bool(np.max(flags))


class MetricsLog:
    """JSON lines appended to ``path``. Object stores (gs://) cannot append: there the whole
    file (earlier runs' lines included) is rewritten at most every ``remote_flush_s`` seconds
    and on close, which also respects GCS's one-write-per-second-per-object limit."""

    def __init__(self, path: str, remote_flush_s: float = 30.0) -> None:
        self.fs, self.path = fsspec.core.url_to_fs(path)
        self.local = "file" in self.fs.protocol or "local" in self.fs.protocol
        self.remote_flush_s = remote_flush_s
        self._last = time.monotonic()
        if self.local:
            self._file = self.fs.open(self.path, "a")
        else:
            exists = self.fs.exists(self.path)
            self._lines = self.fs.cat_file(self.path).decode().splitlines() if exists else []

    def write(self, record: dict) -> None:
        line = json.dumps(record)
        if self.local:
            self._file.write(line + "\n")
            self._file.flush()
            return
        self._lines.append(line)
        if time.monotonic() - self._last >= self.remote_flush_s:
            self._rewrite()

    def _rewrite(self) -> None:
        self.fs.pipe_file(self.path, ("\n".join(self._lines) + "\n").encode())
        self._last = time.monotonic()

    def close(self) -> None:
        if self.local:
            self._file.close()
        elif self._lines:
            self._rewrite()


def _write_json(path: str, body: dict) -> None:
    with fsspec.open(path, "w") as f:
        json.dump(body, f, indent=2)
        f.write("\n")


def train(cfg: TrainConfig, *, preemption: Preemption | None = None) -> dict[str, Any]:
    """Run (or resume) training; returns the result record (also written to result.json)."""
    out = cfg.output_dir.rstrip("/")
    lead = jax.process_index() == 0
    fs, base = fsspec.core.url_to_fs(out)
    if lead:
        fs.makedirs(base, exist_ok=True)
    preemption = preemption or Preemption()
    run = setup(cfg)
    mcfg = run.mcfg
    n_params = param_count(mcfg)
    fpt = flops_per_token(mcfg, cfg.seq_len)
    peak = peak_flops(cfg)
    if lead:
        _write_json(
            rundir.join(out, rundir.CONFIG),
            {
                "config": to_dict(cfg),
                "model": to_dict(mcfg),
                "params": n_params,
                # what evaluation and export check their stores and tokenizer against
                "tokenizer_sha256": run.loader.stores[0].ledger.tokenizer_sha256,
                "flops_per_token": fpt,
                "devices": jax.device_count(),
                "processes": jax.process_count(),
                "mesh": dict(run.mesh.shape),
                # process of each mesh position: shows which axis crosses hosts / slices
                "mesh_processes": np.vectorize(lambda d: d.process_index)(
                    run.mesh.devices
                ).tolist(),
            },
        )
    feeder = BatchFeeder(run.loader, run.mesh, cfg.seq_len, cfg.batch_size)
    metrics_file = MetricsLog(rundir.join(out, rundir.METRICS)) if lead else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    state = run.state
    step = run.start_step
    last_loss: float | None = None
    pending: tuple[int, dict] | None = None  # a step's metrics, read once the next one runs
    saved = -1  # the step last checkpointed by the loop
    t_last = loop_start = time.perf_counter()
    status = "succeeded"

    def flush(entry) -> float:
        nonlocal t_last
        s, m = entry
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        now = time.perf_counter()
        dt = now - t_last
        t_last = now
        tps = tokens_per_step / dt if dt > 0 else 0.0
        rec = {"step": s, **m, "tokens_per_s": tps, "step_time_s": dt}
        if peak:
            rec["mfu"] = tps * fpt / peak
        if metrics_file is not None and (s % cfg.log_every == 0 or s == cfg.steps):
            metrics_file.write(rec)
        return m["loss"]

    try:
        while step < cfg.steps:
            batch = feeder.get(step)
            state, metrics = run.step_fn(state, batch)
            step += 1
            if pending is not None:
                last_loss = flush(pending)
            pending = (step, metrics)
            save_now = cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0
            perm = cfg.checkpoint.permanent_every and step % cfg.checkpoint.permanent_every == 0
            if step < cfg.steps and (save_now or perm):
                run.checkpointer.save(step, state, permanent=bool(perm))
                saved = step
            if step < cfg.steps and preemption.agreed():
                status = "preempted"
                break
        if pending is not None:
            last_loss = flush(pending)
        # Pre-empted right after a save: that checkpoint is this step's. Saving it again would
        # uncommit it while it is rewritten (the grace period may end mid-write) and could
        # turn a permanent checkpoint into a temporary one that a later save prunes.
        if step != saved and (
            step > run.start_step or ckpt.latest_step(run.checkpointer.root) != step
        ):
            run.checkpointer.save(step, state, permanent=status == "succeeded")
        run.checkpointer.wait()
    finally:
        feeder.close()
        if metrics_file is not None:
            metrics_file.close()
    result = {
        "status": status,
        "steps": step,
        "final_loss": last_loss,
        "error": None,
        "params": n_params,
        "exit_code": EXIT_OK if status == "succeeded" else EXIT_RESTART,
        # the checkpoint step this run resumed from (0: a fresh start); this run trained and
        # logged steps start_step + 1 .. steps
        "start_step": run.start_step,
        # wall seconds of this run's step loop (compilation and the last checkpoint included,
        # startup not): the "actual" beside a sweep cell's estimate
        "train_seconds": round(time.perf_counter() - loop_start, 3),
    }
    if lead:
        _write_json(rundir.join(out, rundir.RESULT), result)
    run.checkpointer.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", help="YAML/JSON config: local path or gs:// URI")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="A.B=C",
        help="override a config field (repeatable; value parsed as YAML)",
    )
    args = parser.parse_args(argv)
    hostmem.keep_step_memory_warm()  # before any JAX backend starts (CPU runs only)
    vector_width.prefer_host_vector_width()  # likewise (AVX-512 CPUs only)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return EXIT_CONFIG
    preemption = Preemption()
    preemption.install()  # before distributed init: a SIGTERM during startup is not lost
    try:
        dist.initialize(cfg.distributed)
        result = train(cfg, preemption=preemption)
        return int(result["exit_code"])
    except ConfigError as e:  # raised by checks that need the data (batch vs mesh, vocab)
        print(f"invalid config: {e}", file=sys.stderr)
        _fail(cfg, str(e), "invalid_config")
        return EXIT_CONFIG
    except Exception as e:
        traceback.print_exc()
        _fail(cfg, f"{type(e).__name__}: {e}", "failed")
        return EXIT_FAILED


def _fail(cfg: TrainConfig, error: str, status: str) -> None:
    if jax.process_index() != 0:
        return
    try:
        fs, base = fsspec.core.url_to_fs(cfg.output_dir)
        fs.makedirs(base, exist_ok=True)
        _write_json(
            rundir.join(cfg.output_dir, rundir.RESULT),
            {
                "status": status,
                "steps": None,
                "final_loss": None,
                "error": error,
                "exit_code": EXIT_CONFIG if status == "invalid_config" else EXIT_FAILED,
            },
        )
    except Exception:  # the original error matters more than the result file
        traceback.print_exc()


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
