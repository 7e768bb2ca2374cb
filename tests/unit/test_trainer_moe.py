"""Mixture of experts: quantile balancing, capacity drops, the auxiliary-loss baseline, the
routing group; the balancing methods also through the real train step (``make_train_step``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.config import (
    ConfigError,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    TrainConfig,
    load_config,
    resolve_model,
)
from trainer.model import (
    Batch,
    MoE,
    Transformer,
    route,
    segments_and_positions,
)
from trainer.optim import leaf_name, make_optimizer
from trainer.train import TrainState, make_train_step

# cheap XLA:CPU compiles (deterministic, like the subprocess tests' XLA_FLAGS): these tests
# are about routing, and the default optimization level triples compile time
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


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
    key = jax.random.key(1)
    # compiled cheaply: the model's init at the default optimization level takes ~20 s on CPU
    m = jax.jit(lambda k: Transformer(cfg, k)).lower(key).compile(FAST_COMPILE)(key)
    skew = jnp.zeros_like(m.layers.mlp.router).at[:, :, 0].set(0.5)  # router prefers expert 0
    return eqx.tree_at(lambda mm: mm.layers.mlp.router, m, m.layers.mlp.router + skew)


def test_model_level_bias_loop_balances_every_layer():
    m = _moe_model("quantile")
    toks = jax.random.randint(jax.random.key(2), (4, 64), 1, 32)
    seg, pos = segments_and_positions(toks, 0)
    bias = jnp.zeros((2, 4))
    first = None
    fwd = jax.jit(lambda b: m(toks, seg, pos, b)[1]).lower(bias).compile(FAST_COMPILE)
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


# ---------------------------------------------------------------------------------------------
# the model's own auxiliary loss (what ``loss_and_stats`` adds with ``aux_loss_coef``)


def _random_moe(cfg: ModelConfig, router_scale: float = 1.0) -> MoE:
    """An MoE layer of ``cfg`` with N(0, 0.02^2) weights drawn by NumPy: only its routing
    matters here, and MoE's own (eager) init costs seconds of op compiles on CPU."""
    shape = jax.eval_shape(lambda k: MoE(cfg, k), jax.random.key(0))
    rng = np.random.default_rng(0)
    layer = jax.tree_util.tree_map(
        lambda a: jnp.asarray(0.02 * rng.standard_normal(a.shape), a.dtype), shape
    )
    return eqx.tree_at(lambda m: m.router, layer, router_scale * layer.router)


def _moe_cfg(e: int = 4, capacity_factor: float = 0.0) -> ModelConfig:
    return resolve_model(
        ModelConfig(
            hidden_dim=16,
            intermediate_dim=32,
            num_layers=1,
            num_heads=2,
            moe=MoEConfig(num_experts=e, top_k=1, capacity_factor=capacity_factor),
        ),
        vocab_size=8,
    )


def test_model_aux_loss_on_known_routings():
    e, d, scale = 4, 16, 2.0
    layer = _random_moe(_moe_cfg(e))
    no_bias = jnp.zeros((e,))
    aux = jax.jit(lambda router, x: eqx.tree_at(lambda m: m.router, layer, router)(x, no_bias)[1])
    router = jnp.zeros((d, e)).at[jnp.arange(e), jnp.arange(e)].set(scale)  # expert i reads dim i

    def aux_of(x, router=router):
        return float(aux(router, x)["aux_loss"])

    # balanced: token t points at expert t mod E; by symmetry f_e = P_e = 1/E, so E sum f P = 1
    balanced = jnp.tile(jnp.eye(d)[:e], (8, 1))[None]  # (1, 32, D)
    assert aux_of(balanced) == pytest.approx(1.0, rel=1e-6)
    # collapsed: every token on expert 0, f = (1, 0, 0, 0): E x P_0, close to E
    collapsed = jnp.tile(jnp.eye(d)[:1], (32, 1))[None]
    p0 = math.exp(scale) / (math.exp(scale) + e - 1)
    assert aux_of(collapsed) == pytest.approx(e * p0, rel=1e-6)
    # uniform probabilities (zero router) yet collapsed routing (ties pick expert 0): still 1,
    # the loss is f . P, not the load alone
    assert aux_of(balanced, jnp.zeros((d, e))) == pytest.approx(1.0, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# the balancing methods through the real train step, on a router skewed towards one expert

B, S, V, E, L = 8, 64, 512, 4, 2  # one device: its 512 tokens are one routing group
STEPS = 12


def _train_cfg(balancing: str, aux_loss_coef: float) -> TrainConfig:
    moe = MoEConfig(num_experts=E, top_k=1, balancing=balancing, aux_loss_coef=aux_loss_coef)
    return TrainConfig(
        steps=STEPS,
        batch_size=B,
        seq_len=S,
        model=ModelConfig(hidden_dim=16, intermediate_dim=32, num_layers=L, num_heads=2, moe=moe),
        # a learning rate at which the router's own drift from step to step stays small next to
        # its token-to-token spread (at 3e-3 the one-step-old bias lags and the CV stalls ~0.3)
        optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0, decay="constant"),
    )


@functools.cache
def _skewed_leaves() -> tuple[jax.Array, ...]:
    """Initial parameters (shared by every balancing method) whose routers send nearly every
    token to expert 0 (load CV 1.36 at step 1; 1.73 is all on one): all embeddings share a
    direction u and expert 0's router column points along it; the routers are scaled up 10x so
    that tokens still differ in their logits (a router with preferences, which a quantile can
    split). Drawn by NumPy (norm weights 1, the rest N(0, 0.02^2)): compiling the model's own
    init costs seconds on CPU, and only the routing matters here."""
    mcfg = resolve_model(_train_cfg("none", 0.0).model, vocab_size=V, tokens_per_device=B * S)
    shapes = jax.eval_shape(lambda k: Transformer(mcfg, k), jax.random.key(0))
    rng = np.random.default_rng(1)

    def draw(path, a) -> jax.Array:
        if leaf_name(path) == "weight":  # RMSNorm
            return jnp.ones(a.shape, a.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(a.shape), a.dtype)

    params = jax.tree_util.tree_map_with_path(draw, shapes)
    u = jnp.sign(jnp.asarray(rng.standard_normal(16), jnp.float32))
    params = eqx.tree_at(lambda m: m.embed, params, params.embed + 0.02 * u)
    router = (10.0 * params.layers.mlp.router).at[:, :, 0].add(0.5 * u / 4)
    params = eqx.tree_at(lambda m: m.layers.mlp.router, params, router)
    return tuple(jax.tree_util.tree_leaves(params))


class SkewedRun(NamedTuple):
    metrics: list[dict[str, float]]  # per step
    router_bias: np.ndarray  # after the last step


@functools.cache
def _train_skewed(balancing: str, aux_loss_coef: float = 0.01) -> SkewedRun:
    """STEPS steps of ``make_train_step`` (jitted as ``train.setup`` does, compiled cheaply) from
    the skewed initial parameters, a fresh batch of random tokens each step (the same batches
    for every method)."""
    cfg = _train_cfg(balancing, aux_loss_coef)
    mcfg = resolve_model(cfg.model, vocab_size=V, tokens_per_device=B * S)
    key = jax.random.key(1)
    treedef = jax.tree_util.tree_structure(jax.eval_shape(lambda k: Transformer(mcfg, k), key))
    params = jax.tree_util.tree_unflatten(treedef, _skewed_leaves())  # this method's static cfg
    tx = make_optimizer(cfg.optimizer, cfg.steps)
    opt_state = jax.jit(tx.init)(params)
    state = TrainState(jnp.zeros((), jnp.int32), params, opt_state, jnp.zeros((L, E)))
    # tokens 1..V-1 (EOS is 0, never drawn): one document per row, so the Batch's document ids
    # are 0 and its positions 0..S-1, what ``document_batch`` would compute
    rng = np.random.default_rng(0)
    segments = jnp.zeros((B, S), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    batches = [
        Batch(jnp.asarray(rng.integers(1, V, (B, S + 1)), jnp.int32), segments, positions)
        for _ in range(STEPS)
    ]
    step = (
        jax.jit(make_train_step(cfg, mcfg, tx))  # no donation: the initial leaves are shared
        .lower(state, batches[0])
        .compile(FAST_COMPILE)
    )
    metrics = []
    for batch in batches:
        state, m = step(state, batch)
        metrics.append({k: float(v) for k, v in m.items()})
    return SkewedRun(metrics, np.asarray(state.router_bias))


def _cvs(run: SkewedRun) -> np.ndarray:
    return np.array([m["moe_imbalance_cv"] for m in run.metrics])


def test_train_step_quantile_balancing_balances_a_skewed_router():
    quantile, none = _train_skewed("quantile"), _train_skewed("none")
    cq, cn = _cvs(quantile), _cvs(none)
    # step 1 selects with the initial zero bias in both: the same, nearly collapsed routing
    # (CV sqrt(E - 1) = 1.73 when every token is on one expert)
    assert cq[0] == pytest.approx(cn[0], rel=1e-5) and cq[0] > 1.2
    # the step's bias update (b = -beta of the previous step) spreads the load within steps;
    # without balancing the router stays skewed (the language-model gradient does not fix it)
    assert cq[-5:].mean() < 0.25 * cq[0]
    assert cn[-5:].mean() > 0.8 * cn[0]
    assert np.all(np.argmin(quantile.router_bias, axis=1) == 0)  # overloaded: biased down most
    np.testing.assert_array_equal(none.router_bias, 0.0)  # "none" never touches the bias


def test_train_step_aux_loss_baseline_reduces_imbalance():
    coef = 1.0
    aux, none = _train_skewed("aux_loss", coef), _train_skewed("none")
    first = aux.metrics[0]
    # the objective adds the model's own aux loss with aux_loss_coef ("none" adds nothing);
    # on the skewed routing it is well above its balanced value 1 (at most E)
    assert first["moe_aux_loss"] > 1.5
    assert first["objective"] == pytest.approx(first["loss"] + coef * first["moe_aux_loss"])
    assert none.metrics[0]["objective"] == pytest.approx(none.metrics[0]["loss"], rel=1e-6)
    # its gradient is what balances: the load spreads, the aux loss falls towards 1
    assert _cvs(aux)[-5:].mean() < 0.4 * _cvs(none)[-5:].mean()
    assert aux.metrics[-1]["moe_aux_loss"] < 1.2 < none.metrics[-1]["moe_aux_loss"]
    np.testing.assert_array_equal(aux.router_bias, 0.0)  # no quantile bias in this baseline


# ---------------------------------------------------------------------------------------------
# the routing group: by default all the tokens one device holds in a step


def test_default_routing_group_is_the_tokens_of_one_device():
    cfg = _moe_cfg(capacity_factor=1.0)
    moe = cfg.moe
    # 2 devices x 2 rows x 16 positions: each device's 32 tokens are one group
    assert resolve_model(cfg, 64, tokens_per_device=2 * 16).moe.group_size == 32
    explicit = dataclasses.replace(cfg, moe=dataclasses.replace(moe, group_size=16))
    assert resolve_model(explicit, 64, tokens_per_device=32).moe.group_size == 16  # override
    with pytest.raises(ConfigError, match=r"^model\.moe\.group_size: must divide the tokens"):
        resolve_model(
            dataclasses.replace(cfg, moe=dataclasses.replace(moe, group_size=24)),
            64,
            tokens_per_device=32,
        )
    # a group may be several whole sequences, or a part of one; nothing else
    sets = ["output_dir=/x", "data.sources=[{path: /s}]", "seq_len=16", "model.preset=nano"]
    for ok in (8, 16, 32):
        load_config(None, [*sets, f"model.moe={{num_experts: 4, top_k: 1, group_size: {ok}}}"])
    with pytest.raises(ConfigError, match=r"^model\.moe\.group_size"):
        load_config(None, [*sets, "model.moe={num_experts: 4, top_k: 1, group_size: 24}"])

    # the layer routes rows [0, 2) and [2, 4) (device 0's and device 1's shards of a batch
    # split over 2 devices) each as one group: stats equal routing each shard's tokens alone
    # routers scaled up: tokens with distinct preferences, so that groupings differ visibly
    layer = _random_moe(resolve_model(cfg, 64, tokens_per_device=32), router_scale=10.0)
    x = jax.random.normal(jax.random.key(1), (4, 16, 16))
    bias = jnp.array([0.3, 0.0, -0.1, 0.0])
    _, stats = jax.jit(lambda x: layer(x, bias))(x)
    logits = jnp.einsum("bsd,de->bse", x, layer.router)
    route_stats = jax.jit(lambda lg, cap: route(lg, bias, 1, cap)[4], static_argnums=1)
    shards = [route_stats(logits[r : r + 2].reshape(32, 4), layer.capacity(32)) for r in (0, 2)]
    np.testing.assert_allclose(
        stats["beta"], (shards[0]["beta"] + shards[1]["beta"]) / 2, rtol=1e-6
    )
    np.testing.assert_array_equal(stats["load"], shards[0]["load"] + shards[1]["load"])
    assert float(stats["dropped"]) == sum(float(sh["dropped"]) for sh in shards) > 0
    # ... which is not what one group per sequence (the old default) would give
    per_row = [route_stats(logits[r], layer.capacity(16))["beta"] for r in range(4)]
    assert not np.allclose(stats["beta"], np.mean(per_row, axis=0), atol=1e-3)


def test_padding_takes_no_expert_capacity():
    # Ten tokens all want expert 0 first; the first six are padding. With a capacity of 4,
    # the padding once took the four slots and pushed every real token out.
    s = jnp.tile(jnp.array([[5.0, 1.0, 0.0, -1.0]]), (10, 1))
    valid = jnp.arange(10) >= 6
    _, slot, keep, _, stats = route(s, jnp.zeros(4), 1, capacity=4, valid=valid)
    keep, slot = np.asarray(keep)[:, 0], np.asarray(slot)[:, 0]
    assert keep.tolist() == [False] * 6 + [True] * 4
    assert slot[6:].tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.asarray(stats["load"]), [4, 0, 0, 0])


def test_a_moe_models_scores_do_not_depend_on_what_shares_the_batch():
    # Benchmarks pad every MoE batch to the training window: a request must score the same
    # alone as beside other requests (and their padding). Four choices of one question share
    # a long context, so their tokens crowd the same experts: with one routing group for the
    # batch, capacity drops them differently than alone.
    from trainer import distributed as dist
    from trainer.config import MeshConfig
    from trainer.restore import replicated
    from trainer.scoring import Scorer

    b, length = 4, 64
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0)
    cfg = resolve_model(
        ModelConfig(preset="nano", vocab_size=64, moe=moe), tokens_per_device=b * length
    )
    params = Transformer(cfg, jax.random.key(0))
    mesh = dist.make_mesh(MeshConfig())
    bias = replicated(np.zeros((cfg.num_layers, 4), np.float32), dist.replicated(mesh))
    scorer = Scorer(
        params,
        bias,
        dist.param_shardings(params, mesh),
        mesh,
        batch_size=b,
        max_len=length,
        fixed_length=True,
    )
    rng = np.random.default_rng(1)
    context = rng.integers(1, 64, 58).tolist()
    requests = [(context, rng.integers(1, 64, 5).tolist()) for _ in range(4)]
    requests += [(rng.integers(1, 64, n).tolist(), [7, 8]) for n in (50, 8)]
    together = [s.loglikelihood for s in scorer.score(requests)]
    alone = [scorer.score([r])[0].loglikelihood for r in requests]
    assert together == alone
