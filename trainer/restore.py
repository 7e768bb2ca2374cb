"""Restoring a run's trained parameters for inference (evaluation, sampling, export).

Reads only ``params.*`` and the MoE router bias from a checkpoint, laid out on the caller's mesh;
the optimizer state stays on disk. Its own module so that ``evaluate``, ``generate`` and
``export`` share it without importing one another.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from trainer import checkpoint as ckpt
from trainer import distributed as dist
from trainer import rundir
from trainer.config import ConfigError, TrainConfig, resolve_model
from trainer.model import Transformer

ROUTER_BIAS = "router_bias"  # TrainState.router_bias's leaf in a checkpoint


def load_params(
    cfg: TrainConfig,
    vocab_size: int,
    mesh,
    step: int | None = None,
    *,
    batch_size: int | None = None,
) -> tuple[Transformer, Array, Any, int]:
    """(parameters, router bias, parameter shardings, step) of checkpoint ``step`` (default the
    latest). Only ``params.*`` and ``router_bias`` are read, not the optimizer state.
    ``batch_size`` (default the training batch) sizes the MoE routing groups: each device's
    rows of an evaluation batch are one group, as in training. The router bias is the
    checkpointed quantile-balancing bias; zeros for a dense model or a checkpoint without one."""
    dp = dist.data_parallel_size(mesh)
    tokens_per_device = (batch_size or cfg.batch_size) // dp * cfg.seq_len
    mcfg = resolve_model(cfg.model, vocab_size=vocab_size, tokens_per_device=tokens_per_device)
    root = rundir.checkpoints_dir(cfg.output_dir)
    step = ckpt.latest_step(root) if step is None else step
    if step is None:
        raise ConfigError("output_dir", f"no complete checkpoint under {root}")
    abstract = jax.eval_shape(lambda k: Transformer(mcfg, k), jax.random.key(0))
    shardings = dist.param_shardings(abstract, mesh)
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    checkpointer = ckpt.Checkpointer(root, process_index=0, process_count=1)
    params = checkpointer.restore(step, target, prefix="params.")
    n_experts = mcfg.moe.num_experts if mcfg.moe else 0
    bias_target = jax.ShapeDtypeStruct(
        (mcfg.num_layers, n_experts), jnp.float32, sharding=dist.replicated(mesh)
    )
    if n_experts and ckpt.has_array(root, step, ROUTER_BIAS):
        router_bias = checkpointer.restore(step, bias_target, prefix=ROUTER_BIAS)
    else:  # dense model (nothing to bias), or a checkpoint written without the bias
        router_bias = replicated(np.zeros(bias_target.shape, np.float32), bias_target.sharding)
    checkpointer.close()
    return params, router_bias, shardings, step


def replicated(x: np.ndarray, sharding) -> Array:
    """A host array (the same on every process) laid out as ``sharding``, each process handing
    over the pieces its devices hold, as the evaluation batches are built."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
