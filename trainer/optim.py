"""AdamW with a masked weight decay, learning-rate schedules and global-norm clipping (Optax)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from trainer.config import OptimizerConfig
from trainer.model import NO_DECAY


def leaf_name(path) -> str:
    """The field name of a pytree leaf (last attribute/key on its path)."""
    for entry in reversed(path):
        name = getattr(entry, "name", None) or getattr(entry, "key", None)
        if isinstance(name, str):
            return name
    return ""


def decay_mask(params):
    """True where weight decay applies: matrices, never norms or embeddings (no biases here)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: leaf_name(p) not in NO_DECAY and x.ndim >= 2, params
    )


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to the peak, then cosine, linear or WSD decay to min_lr_ratio * peak."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warm = cfg.warmup_steps
    rest = max(total_steps - warm, 1)

    def fn(step):
        step = jnp.asarray(step, jnp.float32)
        warmup = peak * jnp.minimum(1.0, (step + 1) / max(warm, 1))
        t = jnp.clip((step - warm) / rest, 0.0, 1.0)
        if cfg.decay == "cosine":
            after = floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * t))
        elif cfg.decay == "linear":
            after = peak + (floor - peak) * t
        elif cfg.decay == "wsd":  # warmup-stable-decay: flat, then linear decay at the end
            d = cfg.decay_steps_fraction
            u = jnp.clip((t - (1 - d)) / d, 0.0, 1.0)
            after = peak + (floor - peak) * u
        else:
            after = jnp.asarray(peak, jnp.float32)
        return jnp.where(step < warm, warmup, after)

    return fn


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(
        optax.adamw(
            schedule(cfg, total_steps),
            b1=cfg.beta1,
            b2=cfg.beta2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
