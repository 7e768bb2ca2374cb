"""Llama-family decoder and its mixture-of-experts variant, in Equinox. The whole model is here;
how its matmuls, attention and loss run (CPU-tuned backward passes, library attention kernels)
is ``trainer/kernels.py``.

Shapes: B batch, S sequence, D hidden, H query heads, K kv heads, hd head size, F MLP width,
E experts, V vocabulary.

Conventions:
- A model is a pytree whose leaves are exactly its parameters (all config is static), so it can
  be passed straight through ``jax.jit`` with per-leaf shardings.
- Weights are raw arrays laid out ``(in, ..., out)`` and applied with ``einsum``; each named
  weight has logical axes in ``PARAM_AXES`` which ``trainer.distributed`` maps to mesh axes.
- Layers are stacked along a leading axis. On accelerators deep stacks run with ``lax.scan``
  (compile time constant in depth, which matters for 8B TPU runs); on the CPU backend, and on
  accelerators up to ``UNROLL_MAX_LAYERS_ACCELERATOR`` layers, one copy per layer is traced
  instead, which runs faster (``ModelConfig.layer_loop``).
- Numerically sensitive pieces (norm statistics, softmax, router, loss) run in float32
  whatever the compute dtype.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import Array

from trainer.config import ModelConfig, MoEConfig
from trainer.kernels import attention, dense, swiglu

# logical axes per named weight (after the leading stacked-layer axis, if any)
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "wq": ("embed", "heads", None),
    "wk": ("embed", "heads", None),
    "wv": ("embed", "heads", None),
    "wo": ("heads", None, "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "router": ("embed", None),
    "e_gate": ("expert", "embed", "mlp"),
    "e_up": ("expert", "embed", "mlp"),
    "e_down": ("expert", "mlp", "embed"),
    "weight": (None,),  # norms
}
NO_DECAY = {"embed", "weight"}  # norms and embeddings (the model has no biases)


# ---------------------------------------------------------------------------------------------
# modules


def _normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


class RMSNorm(eqx.Module):
    weight: Array
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight).astype(x.dtype)


def rotary(x: Array, positions: Array, theta: float) -> Array:
    """Rotate pairs (x[..., i], x[..., i + hd/2]) by position-dependent angles (Llama layout).
    x: (B, S, H, hd); positions: (B, S)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[..., None] * inv  # (B, S, hd/2)
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(eqx.Module):
    wq: Array  # (D, H, hd)
    wk: Array  # (D, K, hd)
    wv: Array  # (D, K, hd)
    wo: Array  # (H, hd, D)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    implementation: str = eqx.field(static=True)  # trainer.kernels.attention's switch

    def __init__(self, cfg: ModelConfig, key: Array):
        d, h, k, hd = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (d, h, hd), cfg.init_std)
        self.wk = _normal(kk, (d, k, hd), cfg.init_std)
        self.wv = _normal(kv, (d, k, hd), cfg.init_std)
        # scaled init for residual outputs (GPT-2 / Levanter): keeps the residual stream O(1)
        self.wo = _normal(ko, (h, hd, d), cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.num_heads, self.num_kv_heads, self.rope_theta = h, k, cfg.rope_theta
        self.implementation = cfg.attention

    def __call__(self, x: Array, segments: Array, positions: Array) -> Array:
        """x (B, S, D), segments and positions (B, S) -> (B, S, D)."""
        with jax.named_scope("attention"):
            return self._attend(x, segments, positions)

    def _attend(self, x: Array, segments: Array, positions: Array) -> Array:
        b, s, d = x.shape
        dt = x.dtype

        # one matmul for the projections of equal shape, stacked on a new axis (the heads axis
        # keeps its sharding): q, k and v together when every head has its own kv head, else
        # q alone and k with v
        if self.num_heads == self.num_kv_heads:
            qkv = dense(x, jnp.stack([self.wq, self.wk, self.wv], axis=1).astype(dt))
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, S, heads, hd)
        else:
            q = dense(x, self.wq.astype(dt))
            kv = dense(x, jnp.stack([self.wk, self.wv], axis=1).astype(dt))
            k, v = kv[:, :, 0], kv[:, :, 1]
        q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        out = attention(q, k, v, segments, self.implementation)  # (B, S, H, hd)
        hd = q.shape[-1]
        out = out.reshape(b, s, self.num_heads * hd)
        return dense(out, self.wo.astype(dt).reshape(self.num_heads * hd, d))


class MLP(eqx.Module):
    w_gate: Array  # (D, F)
    w_up: Array  # (D, F)
    w_down: Array  # (F, D)

    def __init__(self, d: int, f: int, std: float, out_std: float, key: Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_gate = _normal(k1, (d, f), std)
        self.w_up = _normal(k2, (d, f), std)
        self.w_down = _normal(k3, (f, d), out_std)

    def __call__(self, x: Array) -> Array:
        """x (B, S, D) -> (B, S, D): SwiGLU."""
        dt = x.dtype
        with jax.named_scope("mlp"):
            w_gate_up = jnp.stack([self.w_gate, self.w_up], axis=1).astype(dt)  # (D, 2, F)
            return swiglu(x, w_gate_up, self.w_down.astype(dt))


# ---------------------------------------------------------------------------------------------
# mixture of experts


def route(
    logits: Array, bias: Array, top_k: int, capacity: int, valid: Array | None = None
) -> tuple[Array, Array, Array, Array, dict[str, Array]]:
    """Top-k routing of one group of T tokens over E experts (pure; float32).

    Selection uses ``logits + bias`` (bias is gradient-free, set by quantile balancing); combine
    weights come from the unbiased logits. ``valid`` (T,) bool: tokens that may take expert
    capacity; the others (an evaluation's padding) are routed nowhere, so a sequence's scores
    never depend on the padding beside it in a batch. Returns (expert index (T,k), slot (T,k),
    keep (T,k), weight (T,k), stats) where stats carries beta (E,), load (E,), drops and the aux
    loss terms.
    """
    t, e = logits.shape
    biased = logits + jax.lax.stop_gradient(bias)
    n_sel = min(top_k + 1, e)
    top_vals, top_idx = jax.lax.top_k(biased, n_sel)
    idx = top_idx[:, :top_k]
    # quantile balancing: a_t is token t's cutoff (its (k+1)-th biased score); expert e would
    # get exactly q tokens if its bias were -beta_e with beta_e the q-th largest s[t,e] - a_t.
    cutoff = top_vals[:, top_k] if n_sel > top_k else jnp.full((t,), -jnp.inf)
    q = max(1, (t * top_k) // e)
    margin = jax.lax.stop_gradient(logits - cutoff[:, None])  # (T, E)
    beta = jax.lax.top_k(margin.T, q)[0][:, q - 1]  # (E,)
    probs = jax.nn.softmax(logits, axis=-1)
    weight = jnp.take_along_axis(probs, idx, axis=-1)
    if top_k > 1:  # renormalize over the chosen experts; with k=1 keep p so the router learns
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(idx, e, dtype=jnp.int32)  # (T, k, E)
    if valid is not None:
        onehot = onehot * valid[:, None, None].astype(jnp.int32)
    # capacity: first choices claim slots before second choices, then in token order
    flat = onehot.transpose(1, 0, 2).reshape(top_k * t, e)
    slot = jnp.sum((jnp.cumsum(flat, axis=0) - 1) * flat, axis=-1).reshape(top_k, t).T
    keep = slot < capacity
    if valid is not None:
        keep = keep & valid[:, None]
    load = jnp.sum(onehot, axis=(0, 1)).astype(jnp.float32)  # assignments per expert, pre-drop
    stats = {
        "beta": beta,
        "load": load,
        "dropped": jnp.sum(~keep).astype(jnp.float32),
        "frac_routed": load / (t * top_k),
        "mean_prob": jnp.mean(probs, axis=0),
    }
    return idx, slot, keep, weight, stats


class MoE(eqx.Module):
    router: Array  # (D, E), applied in float32
    shared: MLP
    e_gate: Array  # (E, D, F)
    e_up: Array  # (E, D, F)
    e_down: Array  # (E, F, D)
    moe: MoEConfig = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, key: Array):
        m = cfg.moe
        assert m is not None
        d, f, e = cfg.hidden_dim, m.expert_dim, m.num_experts
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        kr, ks, k1, k2, k3 = jax.random.split(key, 5)
        self.router = _normal(kr, (d, e), cfg.init_std)
        self.shared = MLP(d, m.shared_expert_dim, cfg.init_std, out_std, ks)
        self.e_gate = _normal(k1, (e, d, f), cfg.init_std)
        self.e_up = _normal(k2, (e, d, f), cfg.init_std)
        self.e_down = _normal(k3, (e, f, d), out_std)
        self.moe = m

    def capacity(self, group: int) -> int:
        m = self.moe
        if m.capacity_factor <= 0:
            return group * m.top_k  # never drop
        return max(1, math.ceil(m.capacity_factor * group * m.top_k / m.num_experts))

    def __call__(
        self, x: Array, bias: Array, valid: Array | None = None, route_rows: bool = False
    ) -> tuple[Array, dict[str, Array]]:
        """x (B, S, D), the router bias (E,), ``valid`` (B, S) bool or None (every token) ->
        (B, S, D) and the routing stats. ``route_rows``: each row is a routing group of its own
        (benchmark scoring: a request then competes for capacity with nothing else)."""
        b, s, d = x.shape
        m = self.moe
        # routing groups: runs of gs consecutive tokens, row-major. The trainer and evaluator set
        # gs to the tokens one device holds (``resolve_model(tokens_per_device=)``): the batch
        # rows are split into contiguous blocks over the devices, so group g is device g's shard
        # and each quantile is taken over a device's tokens without crossing devices. 0 (a
        # direct call): all the tokens of the call are one group.
        gs = s if route_rows else (m.group_size or b * s)
        xg = x.reshape(b * s // gs, gs, d)
        cap = self.capacity(gs)
        logits = jnp.einsum("gtd,de->gte", xg.astype(jnp.float32), self.router)
        if valid is None:  # training: every token routed, the step's graph as it always was
            routed = jax.vmap(lambda lg: route(lg, bias, m.top_k, cap))(logits)
        else:
            vg = valid.reshape(b * s // gs, gs)
            routed = jax.vmap(lambda lg, v: route(lg, bias, m.top_k, cap, v))(logits, vg)
        idx, slot, keep, weight, stats = routed

        def dispatch(xt, ix, sl, kp):
            buf = jnp.zeros((m.num_experts, cap, d), x.dtype)
            src = jnp.broadcast_to(xt[:, None, :], (*ix.shape, d))
            return buf.at[ix, jnp.where(kp, sl, cap)].set(src, mode="drop")

        buf = jax.vmap(dispatch)(xg, idx, slot, keep)  # (G, E, C, D)
        dt = x.dtype
        h = jax.nn.silu(jnp.einsum("gecd,edf->gecf", buf, self.e_gate.astype(dt)))
        h = h * jnp.einsum("gecd,edf->gecf", buf, self.e_up.astype(dt))
        y = jnp.einsum("gecf,efd->gecd", h, self.e_down.astype(dt))

        def combine(yg, ix, sl, kp, w):
            got = yg[ix, jnp.minimum(sl, cap - 1)]  # (T, k, D)
            return jnp.sum(got * (w * kp)[..., None].astype(dt), axis=1)

        out = jax.vmap(combine)(y, idx, slot, keep, weight).reshape(b, s, d)
        out = out + self.shared(x)
        # beta averaged over groups (by default one per data-parallel device): the one bias
        # every device selects with next step
        load = jnp.sum(stats["load"], axis=0)
        aux = m.num_experts * jnp.sum(
            jnp.mean(stats["frac_routed"], axis=0) * jnp.mean(stats["mean_prob"], axis=0)
        )
        return out, {
            "beta": jnp.mean(stats["beta"], axis=0),
            "load": load,
            "dropped": jnp.sum(stats["dropped"]),
            "assigned": jnp.asarray(b * s * m.top_k, jnp.float32),
            "aux_loss": aux,
        }


# ---------------------------------------------------------------------------------------------
# decoder


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: MLP | MoE

    def __init__(self, cfg: ModelConfig, key: Array):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.hidden_dim, cfg.norm_eps)
        self.attn = Attention(cfg, ka)
        self.mlp_norm = RMSNorm(cfg.hidden_dim, cfg.norm_eps)
        if cfg.moe is None:
            out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
            self.mlp = MLP(cfg.hidden_dim, cfg.intermediate_dim, cfg.init_std, out_std, km)
        else:
            self.mlp = MoE(cfg, km)

    def __call__(
        self,
        x: Array,
        segments: Array,
        positions: Array,
        bias: Array,
        valid: Array | None = None,
        route_rows: bool = False,
    ) -> tuple[Array, dict[str, Array]]:
        """Pre-norm residual block: x (B, S, D), segments and positions (B, S), the MoE router
        bias (E,), the tokens that take expert capacity (B, S; None: all), each row its own
        routing group or not -> (B, S, D) and the MoE stats (empty for a dense block)."""
        with jax.named_scope("block"):
            x = x + self.attn(self.attn_norm(x), segments, positions)
            if isinstance(self.mlp, MoE):
                with jax.named_scope("moe"):
                    y, stats = self.mlp(self.mlp_norm(x), bias, valid, route_rows)
            else:
                y, stats = self.mlp(self.mlp_norm(x)), {}
            return x + y, stats


class Transformer(eqx.Module):
    embed: Array  # (V, D)
    layers: Block  # stacked: every leaf has a leading num_layers axis
    final_norm: RMSNorm
    lm_head: Array | None  # (D, V); None when tied to embed
    cfg: ModelConfig = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, key: Array):
        ke, kl, kh = jax.random.split(key, 3)
        self.embed = _normal(ke, (cfg.vocab_size, cfg.hidden_dim), cfg.init_std)
        self.layers = eqx.filter_vmap(lambda k: Block(cfg, k))(jax.random.split(kl, cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_dim, cfg.norm_eps)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else _normal(kh, (cfg.hidden_dim, cfg.vocab_size), cfg.init_std)
        )
        self.cfg = cfg

    def hidden(
        self,
        tokens: Array,
        segments: Array,
        positions: Array,
        router_bias: Array | None = None,
        dtype: jnp.dtype = jnp.float32,
        valid: Array | None = None,
        route_rows: bool = False,
    ) -> tuple[Array, dict[str, Array]]:
        """tokens, segments, positions: (B, S) -> final-normed hidden states (B, S, D) in
        ``dtype``, per-layer MoE stats. The output projection is ``head()``. ``valid`` (B, S)
        bool: the tokens that take MoE expert capacity (an evaluation's padding does not);
        None: all of them. ``route_rows``: each row its own MoE routing group (scoring)."""
        cfg = self.cfg
        x = jnp.take(self.embed, tokens, axis=0).astype(dtype)
        params, static = eqx.partition(self.layers, eqx.is_array)
        if router_bias is None:
            router_bias = jnp.zeros((cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0))

        def body(h, xs):
            p, bias = xs
            return eqx.combine(p, static)(h, segments, positions, bias, valid, route_rows)

        if cfg.remat:
            body = jax.checkpoint(body)
        if unroll_layers(cfg):
            per_layer = []
            for i in range(cfg.num_layers):
                layer_i = jax.tree_util.tree_map(operator.itemgetter(i), (params, router_bias))
                x, layer_stats = body(x, layer_i)
                per_layer.append(layer_stats)
            stats = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_layer)
        else:
            x, stats = jax.lax.scan(body, x, (params, router_bias))
        return self.final_norm(x), stats

    def head(self) -> Array:
        """The output projection (D, V): ``lm_head``, or the embedding when tied."""
        return self.embed.T if self.lm_head is None else self.lm_head

    def __call__(
        self,
        tokens: Array,
        segments: Array,
        positions: Array,
        router_bias: Array | None = None,
        dtype: jnp.dtype = jnp.float32,
    ) -> tuple[Array, dict[str, Array]]:
        """tokens, segments, positions: (B, S) -> float32 logits (B, S, V), per-layer MoE stats.
        Training and evaluation do not materialize the logits: see ``fused_cross_entropy``."""
        x, stats = self.hidden(tokens, segments, positions, router_bias, dtype)
        logits = jnp.einsum(
            "bsd,dv->bsv", x, self.head().astype(dtype), preferred_element_type=jnp.float32
        )
        return logits, stats


class Batch(NamedTuple):
    """A step's packed windows: ``tokens`` (B, S+1), whose inputs are ``tokens[:, :-1]`` and
    targets ``tokens[:, 1:]``, with the inputs' document ids and within-document positions
    (B, S) from ``segments_and_positions``."""

    tokens: Array
    segments: Array
    positions: Array


def document_batch(tokens: Array, eos_id: int) -> Batch:
    """``Batch`` of packed windows (B, S+1). Steps get it from ``jit_document_batch``."""
    segments, positions = segments_and_positions(tokens[:, :-1], eos_id)
    return Batch(tokens, segments, positions)


def jit_document_batch(eos_id: int, sharding=None):
    """``document_batch`` as a jitted computation of its own, outputs laid out as ``sharding``.

    Not part of the training or evaluation step: inside it, XLA:CPU fuses the last pass of the
    segment ids' cumulative sum into every attention-mask fusion of the unrolled layers, which
    makes the 30m step 1.4x slower. Computed outside, the ids reach the step as a ready array
    (as MaxText's input pipeline hands over segment ids)."""
    return jax.jit(functools.partial(document_batch, eos_id=eos_id), out_shardings=sharding)


def segments_and_positions(tokens: Array, eos_id: int) -> tuple[Array, Array]:
    """Document ids and within-document positions of a packed window (B, S).

    Every document ends with EOS, so a new document starts right after each EOS. The EOS itself
    belongs to the document it ends.
    """
    is_eos = (tokens == eos_id).astype(jnp.int32)
    segments = jnp.cumsum(is_eos, axis=1) - is_eos  # exclusive cumsum
    s = tokens.shape[1]
    idx = jnp.broadcast_to(jnp.arange(s), tokens.shape)
    starts = jnp.concatenate([jnp.ones_like(is_eos[:, :1]), is_eos[:, :-1]], axis=1)
    doc_start = jax.lax.cummax(jnp.where(starts > 0, idx, 0), axis=1)
    return segments, idx - doc_start


UNROLL_MAX_LAYERS_ACCELERATOR = 16  # deeper stacks scan on accelerators (compile time)


def unroll_layers(cfg: ModelConfig) -> bool:
    """Whether ``Transformer.hidden`` traces one copy of the layer per layer instead of a scan.

    On XLA:CPU the scan's stacked per-layer residuals are zero-filled and copied in and out
    every step, and no layer's work overlaps another's: unrolled, the 30m step is 1.08x faster
    and the 75m 1.04x, with bit-identical results (docs/benchmarks.md, session 6). On a TPU the
    stacking costs copies too: unrolled, the 150m step on a v5e took 69 instead of 80 ms and
    the 300m 200 instead of 230 (docs/benchmarks.md, accelerator section), for about twice the
    compile time (17 vs 8 s). Deeper models keep the scan on accelerators, as in MaxText and
    Levanter: unrolled compile time grows with depth. Decided at trace time, when the backend
    is known."""
    if cfg.layer_loop == "auto":
        if jax.default_backend() == "cpu":
            return True
        return cfg.num_layers <= UNROLL_MAX_LAYERS_ACCELERATOR
    return cfg.layer_loop == "unroll"


@eqx.filter_jit
def init_model(cfg: ModelConfig, key: Array) -> Transformer:
    """Jitted construction: eager init dispatches thousands of tiny ops (seconds on CPU)."""
    return Transformer(cfg, key)
