"""Optimizer: schedules (warmup, cosine, linear, WSD, floor) and the weight-decay mask."""

from __future__ import annotations

import itertools

import jax
import pytest

from trainer.config import ModelConfig, OptimizerConfig, resolve_model
from trainer.model import Transformer
from trainer.optim import decay_mask, leaf_name, schedule


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
def test_schedule_warmup_peak_and_floor(decay):
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=10, decay=decay, min_lr_ratio=0.1)
    lr = schedule(cfg, 100)
    assert float(lr(0)) == pytest.approx(0.1)
    assert float(lr(9)) == pytest.approx(1.0)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(100)) == pytest.approx(0.1)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b - 1e-7 for a, b in itertools.pairwise(values))  # monotone


def test_wsd_is_flat_then_decays():
    lr = schedule(
        OptimizerConfig(
            learning_rate=1.0,
            warmup_steps=0,
            decay="wsd",
            decay_steps_fraction=0.2,
            min_lr_ratio=0.0,
        ),
        100,
    )
    assert float(lr(79)) == pytest.approx(1.0)
    assert float(lr(90)) == pytest.approx(0.5)


def test_no_weight_decay_on_norms_and_embeddings():
    cfg = resolve_model(ModelConfig(preset="nano"), vocab_size=16)
    shapes = jax.eval_shape(lambda k: Transformer(cfg, k), jax.random.key(0))
    mask = decay_mask(shapes)
    flat = jax.tree_util.tree_flatten_with_path(mask)[0]
    by_name = {leaf_name(p): v for p, v in flat}
    assert by_name["embed"] is False and by_name["weight"] is False
    assert by_name["wq"] and by_name["w_down"] and by_name["lm_head"]
