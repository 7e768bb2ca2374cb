"""Mixture of experts: quantile balancing, capacity drops, the auxiliary-loss baseline."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from trainer.config import ModelConfig, MoEConfig, resolve_model
from trainer.model import init_model, route, segments_and_positions


def _cv(load) -> float:
    load = np.asarray(load)
    return float(load.std() / load.mean())


def _skewed_logits(t=512, e=8):
    return jax.random.normal(jax.random.key(0), (t, e)) + jnp.linspace(3.0, 0.0, e)


def test_quantile_balancing_drives_imbalance_down_on_a_skewed_router():
    s, k = _skewed_logits(), 2
    cap = int(1.25 * s.shape[0] * k / s.shape[1])
    bias = jnp.zeros(s.shape[1])
    cvs, drops = [], []
    for _ in range(8):
        _, _, _, _, stats = route(s, bias, k, cap)
        cvs.append(_cv(stats["load"]))
        drops.append(float(stats["dropped"]))
        bias = -stats["beta"]  # the update rule: next step uses b = -beta
    assert cvs[0] > 0.8  # badly skewed at first
    assert cvs[-1] < 0.05 and cvs[-1] < cvs[0] / 20
    assert drops[0] > 0 and drops[-1] == 0  # capacity overflow disappears with balance


def test_combine_weights_come_from_unbiased_logits():
    s = _skewed_logits(16, 4)
    bias = jnp.array([-5.0, 0.0, 5.0, 0.0])
    idx, _, _, w, _ = route(s, bias, 2, 32)
    probs = jax.nn.softmax(s, axis=-1)
    expect = jnp.take_along_axis(probs, idx, axis=-1)
    np.testing.assert_allclose(w, expect / expect.sum(-1, keepdims=True), rtol=1e-6)
    assert np.all(np.asarray(idx) != 0)  # the bias, not the logits, decided selection


def test_capacity_drops_are_counted_first_choices_first():
    s = jnp.tile(jnp.array([[5.0, 1.0, 0.0, -1.0]]), (10, 1))  # everyone wants expert 0 then 1
    _, _, keep, _, stats = route(s, jnp.zeros(4), 2, capacity=4)
    assert float(stats["dropped"]) == 12  # 6 overflow on expert 0, 6 on expert 1
    assert np.asarray(keep)[:4].all() and not np.asarray(keep)[4:].any()
    np.testing.assert_array_equal(np.asarray(stats["load"]), [10, 10, 0, 0])


def _moe_model(balancing: str):
    cfg = resolve_model(
        ModelConfig(
            hidden_dim=16,
            intermediate_dim=32,
            num_layers=2,
            num_heads=2,
            moe=MoEConfig(num_experts=4, top_k=1, balancing=balancing),
        ),
        vocab_size=32,
    )
    m = init_model(cfg, jax.random.key(1))
    skew = jnp.zeros_like(m.layers.mlp.router).at[:, :, 0].set(0.5)  # router prefers expert 0
    return eqx.tree_at(lambda mm: mm.layers.mlp.router, m, m.layers.mlp.router + skew)


def test_model_level_bias_loop_balances_every_layer():
    m = _moe_model("quantile")
    toks = jax.random.randint(jax.random.key(2), (4, 64), 1, 32)
    seg, pos = segments_and_positions(toks, 0)
    bias = jnp.zeros((2, 4))
    first = None
    fwd = jax.jit(lambda b: m(toks, seg, pos, b)[1])
    for _ in range(6):
        stats = fwd(bias)
        cv = [_cv(x) for x in np.asarray(stats["load"])]
        first = first or cv
        bias = -stats["beta"]
    assert max(cv) < min(first) / 2


def test_aux_loss_gradient_reduces_imbalance():
    s0 = _skewed_logits(256, 4)
    offs = jnp.zeros(4)

    def aux(o):
        probs = jax.nn.softmax(s0 + o, axis=-1)
        _, _, _, _, st = route(s0 + o, jnp.zeros(4), 1, 256)
        return 4 * jnp.sum(st["frac_routed"] * jnp.mean(probs, 0))

    start = _cv(route(s0, jnp.zeros(4), 1, 256)[4]["load"])
    grad = jax.jit(jax.grad(aux))
    for _ in range(200):
        offs = offs - 2.0 * grad(offs)
    end = _cv(route(s0 + offs, jnp.zeros(4), 1, 256)[4]["load"])
    assert end < start
