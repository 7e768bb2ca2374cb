"""The model's kernels: matmuls, attention and the loss, each with a plain-JAX reference path.

``trainer/model.py`` says *what* the model computes; this module says *how* the expensive parts
run. Everything here is numerically the textbook operation (the tests compare each against
plain ``jnp`` with autodiff, packed documents included):

- ``dense`` and ``swiglu``: matmuls with hand-written backward passes that keep every XLA:CPU
  matmul on row-major operands (same FLOPs as autodiff, up to 2x faster MLP backward on CPU);
- ``attention``: causal softmax attention within packed documents, grouped-query, behind one
  switch (:data:`ATTENTION_IMPLEMENTATIONS`):

  ``blocked``  block-causal flash-style attention with a custom VJP, tuned for XLA:CPU;
  ``xla``      ``jax.nn.dot_product_attention`` (XLA's fused attention, any backend);
  ``cudnn``    the same with cuDNN's flash attention (GPU, bf16/fp16);
  ``splash``   the Pallas splash-attention kernel (TPU; needs the installed JAX's
               ``jax.experimental.pallas.ops.tpu.splash_attention``), per device under a
               mesh (:func:`per_device`);
  ``auto``     ``blocked`` on CPU, ``cudnn`` on GPU for 16-bit inputs (else ``xla``),
               ``splash`` on TPU for sequences of a multiple of 128 (else ``xla``);

- ``fused_cross_entropy`` / ``token_nll``: the output projection and softmax cross-entropy,
  chunked along the sequence so no (B, S, V) logits tensor exists.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec

from trainer.mesh_axes import BATCH_AXES, HEAD_AXIS

AttentionImpl = Literal["auto", "blocked", "xla", "cudnn", "splash"]
ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "blocked", "xla", "cudnn", "splash")


# ---------------------------------------------------------------------------------------------
# matmuls


def _materialized_transpose(a: Array) -> Array:
    """a.T as a real row-major array. The barrier stops XLA from folding the transpose back into
    the consuming dot's dimension numbers, which on CPU ends in a dot with a transposed operand
    that XLA handles by writing a big operand transposed inside an elementwise fusion (slow,
    strided) or by a slower dot kernel."""
    return jax.lax.optimization_barrier(a.T)


def _contract_out(a: Array, w: Array) -> Array:
    """a (N, *out) with w (K, *out) over ``out`` -> (N, K): an input gradient."""
    axes = tuple(range(1, w.ndim))
    return jax.lax.dot_general(a, w, ((axes, axes), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def _dense_vjp(x: Array, w: Array) -> Array:
    """x (..., K) @ w (K, *out) -> (..., *out), with a CPU-friendly backward pass.

    The weight gradient contracts over all tokens, the major axis of both x and dy. Autodiff
    leaves XLA:CPU to pick which of the two to transpose, and it picks badly (e.g. a (tokens,
    4 x hidden) activation gradient written transposed inside the SwiGLU fusion: 2x slower MLP
    backward at the 30m/75m shapes). Here the smaller of x and dy is transposed explicitly, so
    every matmul runs on row-major operands. Same math and FLOPs as autodiff. ``out`` may have
    several axes (e.g. (3, heads, head_dim) for fused q/k/v), so a weight sharded over one of
    them is never reshaped across its sharded axis."""
    return jnp.tensordot(x, w, axes=1)


def _dense_fwd(x, w):
    return dense(x, w), (x, w)


def _weight_grad(a: Array, b: Array) -> Array:
    """a^T b for token-major a (N, K) and b (N, *out) -> (K, *out), in float32: the
    contraction over tokens of every weight gradient. The narrower of a and b is transposed
    explicitly."""
    f32 = jnp.float32
    width = math.prod(b.shape[1:])
    if a.shape[1] <= width:
        return jnp.tensordot(_materialized_transpose(a), b, axes=1, preferred_element_type=f32)
    b_t = jax.lax.optimization_barrier(jnp.moveaxis(b, 0, -1))  # (*out, N), materialized
    return jnp.moveaxis(jnp.tensordot(b_t, a, axes=1, preferred_element_type=f32), -1, 0)


def _dense_bwd(res, dy):
    x, w = res
    x2, dy2 = x.reshape(-1, w.shape[0]), dy.reshape(-1, *w.shape[1:])
    dx = _contract_out(dy2, w)
    return dx.astype(x.dtype).reshape(x.shape), _weight_grad(x2, dy2).astype(w.dtype)


_dense_vjp.defvjp(_dense_fwd, _dense_bwd)


@jax.custom_vjp
def _swiglu_vjp(x: Array, w_gate_up: Array, w_down: Array) -> Array:
    """SwiGLU MLP (silu(x Wg) * (x Wu)) Wd, x (..., D), with ``w_gate_up`` = Wg and Wu stacked
    (D, 2, F): one (D x 2F) matmul forward, one for the input gradient and one for both weight
    gradients instead of two each (bigger matmuls, one transpose of x), and a weight sharded over
    F stays sharded. The backward keeps only x and x [Wg, Wu] (autodiff stores six (tokens x F)
    arrays per layer, which the layer scan writes and zero-fills every step) and runs every
    matmul on row-major operands as ``dense`` does."""
    gu = dense(x, w_gate_up)
    return dense(jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], w_down)


def _swiglu_fwd(x, w_gate_up, w_down):
    x2 = x.reshape(-1, x.shape[-1])
    gu = jnp.tensordot(x2, w_gate_up, axes=1)  # (N, 2, F)
    y = (jax.nn.silu(gu[:, 0]) * gu[:, 1]) @ w_down
    return y.reshape(x.shape), (x2, gu, w_gate_up, w_down)


def _swiglu_bwd(res, dy):
    x2, gu, w_gate_up, w_down = res
    f32 = jnp.float32
    dy2 = dy.reshape(-1, dy.shape[-1])
    gf, uf = gu[:, 0].astype(f32), gu[:, 1].astype(f32)
    sig = jax.nn.sigmoid(gf)
    silu = gf * sig
    h = (silu * uf).astype(gu.dtype)
    # against a row-major copy of Wd^T: XLA:CPU runs this (K = D) matmul ~1.7x faster than
    # contracting Wd's minor axis in place
    dh = jnp.dot(dy2, _materialized_transpose(w_down), preferred_element_type=f32)
    dg = dh * uf * sig * (1.0 + gf * (1.0 - sig))  # silu'
    dgu = jnp.stack([dg, dh * silu], axis=1).astype(gu.dtype)  # (N, 2, F)
    dx = _contract_out(dgu, w_gate_up)
    return (
        dx.astype(x2.dtype).reshape(dy.shape),
        _weight_grad(x2, dgu).astype(w_gate_up.dtype),
        _weight_grad(h, dy2).astype(w_down.dtype),
    )


_swiglu_vjp.defvjp(_swiglu_fwd, _swiglu_bwd)


# On accelerators the hand-written backward passes above do harm: XLA:TPU folds transposes into
# its matmuls by itself, and their barriers and materialized transposes cost copies (on a TPU
# v5e, 150m: 63 ms a step with autodiff, 67 ms with them; 300m: 201 vs 217 ms). There ``dense``
# and ``swiglu`` are plain functions differentiated by autodiff; the CPU backend keeps the
# custom VJPs. Decided at trace time from JAX's default backend, as ``resolve_attention`` and
# the layer loop are.


def dense(x: Array, w: Array) -> Array:
    """x (..., K) @ w (K, *out) -> (..., *out): ``_dense_vjp`` on the CPU, else autodiff."""
    if jax.default_backend() == "cpu":
        return _dense_vjp(x, w)
    return jnp.tensordot(x, w, axes=1)


def swiglu(x: Array, w_gate_up: Array, w_down: Array) -> Array:
    """SwiGLU (silu(x Wg) * (x Wu)) Wd: ``_swiglu_vjp`` on the CPU, else autodiff (the same
    forward, in the compute dtype; a float32 activation cost 5 ms of 63 on the 150m TPU step)."""
    if jax.default_backend() == "cpu":
        return _swiglu_vjp(x, w_gate_up, w_down)
    gu = jnp.tensordot(x, w_gate_up, axes=1)
    return jnp.tensordot(jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], w_down, axes=1)


# ---------------------------------------------------------------------------------------------
# block-causal attention (XLA:CPU)

ATTN_CHUNK = 128  # smallest query block of the block-causal attention loop
ATTN_MAX_BLOCKS = 8  # unrolled blocks at most (compile time; accelerators use a library kernel)
_MASKED = -1e30  # finite: a fully masked row can never occur (each query sees itself)


def _query_blocks(s: int) -> list[tuple[int, int]]:
    """Query blocks [lo, hi); block i attends to keys [0, hi). One block when s is small."""
    chunk = max(ATTN_CHUNK, s // ATTN_MAX_BLOCKS)
    if s <= chunk or s % chunk:
        return [(0, s)]
    return [(i * chunk, (i + 1) * chunk) for i in range(s // chunk)]


def _block_bias(segments: Array, lo: int, hi: int) -> Array:
    """Additive mask (B, c, hi) of query block [lo, hi) against keys [0, hi): 0 where the key
    is not in the future and in the same document, else -1e30. Built from the (B, S) segment
    ids, never per head: adding it broadcasts inside the fused softmax."""
    causal = (lo + jnp.arange(hi - lo))[:, None] >= jnp.arange(hi)[None, :]
    same = segments[:, lo:hi, None] == segments[:, None, :hi]
    return jnp.where(causal[None] & same, 0.0, _MASKED)


def _block_bias_t(segments: Array, lo: int, hi: int) -> Array:
    """``_block_bias`` transposed, (B, hi, c), built in that layout: transposing the forward's
    mask instead makes XLA:CPU read it strided inside the backward's exp fusion (5x slower)."""
    causal = jnp.arange(hi)[:, None] <= (lo + jnp.arange(hi - lo))[None, :]
    same = segments[:, :hi, None] == segments[:, None, lo:hi]
    return jnp.where(causal[None] & same, 0.0, _MASKED)


def _attention_fwd_blocks(q: Array, k: Array, v: Array, segments: Array) -> tuple[Array, Array]:
    """q already scaled by 1/sqrt(hd). Returns the output and the row log-sum-exp (float32).
    The matmuls see a kv head's g query heads and c positions as one (g c) row axis: with a
    size-1 g axis of its own, XLA:CPU copies every score block to move that axis."""
    f32 = jnp.float32
    b, kh, g, _, hd = q.shape
    outs, lses = [], []
    for lo, hi in _query_blocks(q.shape[3]):
        c = hi - lo
        qb = q[:, :, :, lo:hi].reshape(b, kh, g * c, hd)
        s = jnp.einsum("bkmh,bkth->bkmt", qb, k[:, :, :hi], preferred_element_type=f32)
        s = s.reshape(b, kh, g, c, hi) + _block_bias(segments, lo, hi)[:, None, None]
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        # normalize the (c, hd) output rather than the (c, T) probabilities: one pass fewer
        o = jnp.einsum(
            "bkmt,bkth->bkmh",
            e.reshape(b, kh, g * c, hi).astype(v.dtype),
            v[:, :, :hi],
            preferred_element_type=f32,
        )
        outs.append((o.reshape(b, kh, g, c, hd) / total).astype(v.dtype))
        lses.append((m + jnp.log(total))[..., 0])
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


def _scale(q: Array) -> Array:
    return q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)


@jax.custom_vjp
def block_causal_attention(q: Array, k: Array, v: Array, segments: Array) -> Array:
    """Softmax attention, causal and within documents, heads-major:
    q (B, K, G, S, hd), k/v (B, K, S, hd), segments (B, S) -> (B, K, G, S, hd).

    Query blocks attend only to keys up to their own end, so the all-masked upper triangle of
    blocks is never computed. Scores and softmax are float32. The backward pass is the
    flash-attention one: only the output and the row log-sum-exp are kept, and each block's
    probabilities are recomputed from q and k. Keeping (B, H, S, S) probabilities per layer
    instead costs more on CPU (writing, zero-filling and re-reading them through the layer
    scan) than the extra q.k matmul; on an accelerator it is what saves the memory."""
    return _attention_fwd_blocks(_scale(q), k, v, segments)[0]


def _attention_fwd(q, k, v, segments):
    qs = _scale(q)
    out, lse = _attention_fwd_blocks(qs, k, v, segments)
    return out, (qs, k, v, segments, out, lse)


def _attention_bwd(res, d_out):
    """Flash-attention backward, computed key-major: scores^T (keys x queries) come straight out
    of k @ q^T, so P^T and dS^T are produced in the layout that dV = P^T dO and dK = dS^T Q
    consume, and dQ^T = K^T dS^T. Only (B, K, S, hd)-sized operands are ever transposed, never
    the (keys x queries) blocks (which XLA:CPU would otherwise write transposed, slowly).
    ``qs`` is q / sqrt(hd), so dK = dS^T qs and dQ = dS K / sqrt(hd)."""
    qs, k, v, segments, out, lse = res
    f32 = jnp.float32
    # D_i = sum_h dO_ih O_ih = sum_j P_ij dP_ij (the softmax Jacobian's row term), as a
    # matrix-vector product: XLA:CPU's reduce over a short minor axis is ~10x slower
    prod = d_out.astype(f32) * out.astype(f32)
    delta = jnp.matmul(prod, jnp.ones((prod.shape[-1],), f32))  # (B, K, G, S)
    k_t = _materialized_transpose_last2(k)  # (B, K, hd, S)
    dq_parts = []
    dk = jnp.zeros(k.shape, f32)
    dv = jnp.zeros(v.shape, f32)
    b, kh, g, _, hd = qs.shape
    for lo, hi in _query_blocks(qs.shape[3]):
        c = hi - lo
        qb, dob = qs[:, :, :, lo:hi], d_out[:, :, :, lo:hi]  # (B, K, G, c, hd)
        # (g, c) merged into one row axis m, as in the forward
        qb_t = _materialized_transpose_heads(qb).reshape(b, kh, hd, g * c)
        dob_t = _materialized_transpose_heads(dob).reshape(b, kh, hd, g * c)
        qb, dob = qb.reshape(b, kh, g * c, hd), dob.reshape(b, kh, g * c, hd)
        s_t = jnp.einsum("bkth,bkhm->bktm", k[:, :, :hi], qb_t, preferred_element_type=f32)
        bias_t = _block_bias_t(segments, lo, hi)  # (B, T, c)
        s_t = s_t.reshape(b, kh, hi, g, c) + bias_t[:, None, :, None, :]
        p_t = jnp.exp(s_t - lse[:, :, None, :, lo:hi])  # (B, K, T, G, c)
        dv = dv.at[:, :, :hi].add(
            jnp.einsum(
                "bktm,bkmh->bkth",
                p_t.reshape(b, kh, hi, g * c).astype(dob.dtype),
                dob,
                preferred_element_type=f32,
            )
        )
        dp_t = jnp.einsum("bkth,bkhm->bktm", v[:, :, :hi], dob_t, preferred_element_type=f32)
        dp_t = dp_t.reshape(b, kh, hi, g, c)
        ds_t = (p_t * (dp_t - delta[:, :, None, :, lo:hi])).astype(qs.dtype)
        ds_t = ds_t.reshape(b, kh, hi, g * c)
        dk = dk.at[:, :, :hi].add(
            jnp.einsum("bktm,bkmh->bkth", ds_t, qb, preferred_element_type=f32)
        )
        dq_t = jnp.einsum("bkht,bktm->bkhm", k_t[..., :hi], ds_t, preferred_element_type=f32)
        dq_parts.append(dq_t.reshape(b, kh, hd, g, c).transpose(0, 1, 3, 4, 2))  # (B, K, G, c, hd)
    dq = _scale(jnp.concatenate(dq_parts, axis=3))
    return dq.astype(qs.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def _materialized_transpose_last2(a: Array) -> Array:
    return jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2))


def _materialized_transpose_heads(a: Array) -> Array:
    """(B, K, G, c, hd) -> (B, K, hd, G, c), materialized (see ``_materialized_transpose``)."""
    return jax.lax.optimization_barrier(a.transpose(0, 1, 4, 2, 3))


block_causal_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------------
# attention: one entry point, several implementations


def resolve_attention(
    implementation: str, dtype: jnp.dtype, backend: str | None = None, seq_len: int | None = None
) -> str:
    """The implementation ``auto`` stands for on ``backend`` (default: JAX's) for ``dtype`` and
    sequences of ``seq_len`` (splash's tiles need a multiple of ``SPLASH_MIN_BLOCK``)."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r}: one of {ATTENTION_IMPLEMENTATIONS}"
        )
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return "blocked"
    if backend in ("gpu", "cuda", "rocm"):
        return "cudnn" if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"
    if backend == "tpu" and seq_len is not None and seq_len % SPLASH_MIN_BLOCK == 0:
        return "splash"
    return "xla"


def attention(q: Array, k: Array, v: Array, segments: Array, implementation: str = "auto") -> Array:
    """Causal softmax attention within documents, grouped-query.

    q (B, S, H, hd), k and v (B, S, K, hd) with H a multiple of K, segments (B, S) document
    ids of packed sequences (a query sees keys at or before it in the same document)
    -> (B, S, H, hd). Scores and softmax in float32 on every path.
    """
    impl = resolve_attention(implementation, q.dtype, seq_len=q.shape[1])
    if impl == "blocked":
        b, s, h, hd = q.shape
        kh = k.shape[2]
        # heads-major: the core's matmuls batch over (B, K) with the g query heads of a kv head
        # and the positions as one M dimension (no broadcast of k or v)
        qh = q.reshape(b, s, kh, h // kh, hd).transpose(0, 2, 3, 1, 4)
        out = block_causal_attention(qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segments)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, hd)
    if impl == "splash":
        return splash_attention(q, k, v, segments)
    same_document = (segments[:, :, None] == segments[:, None, :])[:, None]  # (B, 1, S, S)
    return jax.nn.dot_product_attention(
        q, k, v, mask=same_document, is_causal=True, implementation=impl
    )


# Splash-attention tiles: query and key blocks of the forward and backward kernels (None: the
# kernel's own default, 128 everywhere, which left the v5e's matrix units mostly idle). On a
# v5e, 1024 beat 512 by 2.3 ms of 51 on the 150m step and 5 of 153 on the 300m (head_dim 64;
# head_dim 128, 1.4b's attention, compiles and runs with it too); split sizes (1024 forward,
# 512 backward or the reverse) were slower on the 150m step than 1024 for both.
SPLASH_BLOCK: int | None = 1024
SPLASH_MIN_BLOCK = 128  # the smallest tile: ``auto`` picks splash for multiples of it
SPLASH_FUSED_BWD = True  # one backward kernel for dq, dk and dv instead of two
# q, k and v handed to the kernel sequence-minor, (heads, hd, S). Head-dim-minor, a head_dim of
# 64 is padded to the TPU tile's 128 lanes, and the arrays around the kernel (rotary's halves,
# the per-example transposes) were written in that padded layout; sequence-minor, XLA folds
# the transposes into the projections' matmul fusions. 150m on a v5e: 58.4 instead of 71.2 ms
# a step in the run that compared them (docs/benchmarks.md, accelerator section).
SPLASH_SEQ_MINOR = True


def _splash_block_sizes(sa, s: int, itemsize: int = 2):
    """``BlockSizes`` of ``SPLASH_BLOCK`` (halved for 4-byte inputs, then until it divides
    ``s``; 128 at least) and ``SPLASH_SEQ_MINOR``'s layouts."""
    if SPLASH_BLOCK is None:
        return None
    # float32 tiles of 1024 overflow the v5e's 16 MiB of scoped VMEM in the fused backward
    # kernel (17.2 MiB at head_dim 64); 512 fits.
    blk = min(SPLASH_BLOCK if itemsize <= 2 else SPLASH_BLOCK // 2, s)
    while s % blk and blk > SPLASH_MIN_BLOCK:
        blk //= 2
    fused = SPLASH_FUSED_BWD
    layout = sa.QKVLayout.SEQ_MINOR if SPLASH_SEQ_MINOR else sa.QKVLayout.HEAD_DIM_MINOR
    return sa.BlockSizes(
        block_q=blk,
        block_kv=blk,
        block_kv_compute=blk,
        block_q_dkv=blk,
        block_kv_dkv=blk,
        block_kv_dkv_compute=blk,
        block_q_dq=None if fused else blk,
        block_kv_dq=None if fused else blk,
        use_fused_bwd_kernel=fused,
        q_layout=layout,
        k_layout=layout,
        v_layout=layout,
    )


def per_device(
    local: Callable[[Array, Array, Array, Array], Array],
    q: Array,
    k: Array,
    v: Array,
    segments: Array,
) -> Array:
    """``local(q, k, v, segments)`` on each device's block of the arrays, as one ``shard_map``
    over the mesh being traced (``distributed.on_mesh``); called directly without one.

    Shapes as :func:`attention`. Each device gets its rows of the batch (split over
    ``BATCH_AXES``, as the batch is) and, where ``HEAD_AXIS`` divides the query heads, its
    heads: query head ``i`` of a block still maps to kv head ``i // (H // K)`` of the block,
    and kv heads that ``HEAD_AXIS`` does not divide are repeated to one per query head first
    (what an MHA kernel does anyway), so no device computes another's heads. XLA cannot
    partition a Pallas (Mosaic) call, so under a multi-device jit one must run on per-device
    blocks; ``local`` sees (B / data-parallel size, S, heads per device, hd).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(q, k, v, segments)
    batch = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    tensor = mesh.shape[HEAD_AXIS] if HEAD_AXIS in mesh.axis_names else 1
    h, kv_heads = q.shape[2], k.shape[2]
    heads = HEAD_AXIS if tensor > 1 and h % tensor == 0 else None
    if heads and kv_heads % tensor:
        k, v = (jnp.repeat(x, h // kv_heads, axis=2) for x in (k, v))
    rows = PartitionSpec(batch, None, heads, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, PartitionSpec(batch, None)),
        out_specs=rows,
        # The kernel's output does not vary along axes its inputs are not split over (a
        # tensor axis that does not divide the heads); Pallas calls carry no such typing.
        check_vma=False,
    )(q, k, v, segments)


def splash_attention(q: Array, k: Array, v: Array, segments: Array) -> Array:
    """The Pallas splash-attention kernel (TPU), per example: causal mask, segment ids for the
    packed documents, grouped-query heads. Shapes as :func:`attention`.

    Under a mesh (``distributed.on_mesh``: the train, evaluation and scoring steps) it runs
    per device (:func:`per_device`), so multi-chip slices can use it. CI has no TPU: there the
    tests run it with Pallas' interpreter (docs/benchmarks.md has the v5e's figures).
    """
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention as sa
    except ImportError as exc:  # pragma: no cover - depends on the installed JAX
        raise RuntimeError(f"attention=splash needs JAX's Pallas TPU kernels: {exc}") from exc
    if jax.default_backend() != "tpu":
        raise RuntimeError(
            f"attention=splash runs on TPU only (backend {jax.default_backend()!r}): use auto"
        )

    def local(q: Array, k: Array, v: Array, segments: Array) -> Array:
        _, s, h, hd = q.shape
        mask = sa.MultiHeadMask([sa.CausalMask((s, s)) for _ in range(h)])
        kernel = sa.make_splash_mha(
            mask,
            head_shards=1,
            q_seq_shards=1,
            block_sizes=_splash_block_sizes(sa, s, q.dtype.itemsize),
        )
        g = h // k.shape[2]
        kx = jnp.repeat(k, g, axis=2) if g > 1 else k  # the MHA kernel: one kv head per query head
        vx = jnp.repeat(v, g, axis=2) if g > 1 else v
        scaled = q * jnp.asarray(1.0 / math.sqrt(hd), q.dtype)  # the kernel does not scale

        def one(qe: Array, ke: Array, ve: Array, seg: Array) -> Array:  # (S, H, hd) each
            out = kernel(
                qe.swapaxes(0, 1),
                ke.swapaxes(0, 1),
                ve.swapaxes(0, 1),
                sa.SegmentIds(q=seg, kv=seg),
            )
            return out.swapaxes(0, 1)

        return jax.vmap(one)(scaled, kx, vx, segments.astype(jnp.int32))

    return per_device(local, q, k, v, segments)


# ---------------------------------------------------------------------------------------------
# loss: output projection + softmax cross-entropy, fused and chunked

LOSS_CHUNK_TOKENS = 256  # tokens per device per loss chunk: (256 x V) float32 logits at a time
# Accelerators: bytes of stacked dlogits (compute dtype) per head-gradient matmul (see
# ``_xent_chunks``); 1 GiB is the whole 8 x 2048 batch at a 32k vocabulary. 0: the carry.
LOSS_DHEAD_GROUP_BYTES = 1 << 30


def loss_chunk(seq_len: int, rows_per_device: int, vocab_size: int) -> int:
    """Positions per row in one loss chunk: a power-of-two divisor of ``seq_len`` such that a
    device's chunk holds about ``LOSS_CHUNK_TOKENS`` tokens (at least one position). Chunks run
    along the sequence, never the batch, so the batch sharding is untouched."""
    del vocab_size  # the budget is in tokens: matmul efficiency, not bytes, bounds it below
    want = max(1, LOSS_CHUNK_TOKENS // max(rows_per_device, 1))
    c = 1
    while c * 2 <= want and seq_len % (c * 2) == 0:
        c *= 2
    return c


def _xent_chunks(x: Array, head: Array, targets: Array, chunk: int, z_loss_coef: float | None):
    """Scan over sequence chunks. Per chunk: logits (B, c, V) in float32, log-sum-exp, the
    target's logit, and (when ``z_loss_coef`` is not None) d(objective)/d(logits) pushed through
    the projection right away, so no (B, S, V) float32 tensor ever exists (on accelerators the
    head gradient contracts groups of chunks' dlogits, in the compute dtype, at most
    ``LOSS_DHEAD_GROUP_BYTES`` of them at a time). Returns per-token nll and lse (B, S), and the
    gradients (dx (B, S, D), dhead (D, V)) of ``mean(nll) + z_loss_coef * mean(lse^2)`` when
    asked."""
    b, s, d = x.shape
    n = b * s
    xs = x.reshape(b, s // chunk, chunk, d).swapaxes(0, 1)  # (S/c, B, c, D)
    ts = targets.reshape(b, s // chunk, chunk).swapaxes(0, 1)
    with_grads = z_loss_coef is not None
    f32 = jnp.float32
    w = head.astype(x.dtype)  # compute dtype for the matmuls; dhead accumulates in float32
    # dx = dlogits @ head^T contracts over the vocabulary, head's minor axis: a row-major copy
    # of head^T (V x D, once per step) makes it a plain matmul (XLA:CPU: ~1.2x faster)
    w_t = _materialized_transpose(w)

    def body(dhead, xt):
        xc, tc = xt
        logits = jnp.einsum("bcd,dv->bcv", xc, w, preferred_element_type=f32)
        m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        e = jnp.exp(logits - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        lse = (m + jnp.log(total))[..., 0]
        # the target's logit from its row of head^T: (B, c, D) work instead of one more pass
        # over the (B, c, V) logits, and the vocabulary-parallel embedding lookup when the
        # vocabulary is sharded. Its gradient never goes through this gather (no scatter):
        # d/dlogits below uses the one-hot compare, fused into that elementwise pass.
        target_logit = jnp.einsum(
            "bcd,bcd->bc", xc, jnp.take(w_t, tc, axis=0), preferred_element_type=f32
        )
        nll = lse - target_logit
        if not with_grads:
            return dhead, (nll, lse, None)
        hit = jnp.arange(logits.shape[-1]) == tc[..., None]
        p = e / total
        # d/dlogits of mean(nll) + z * mean(lse^2): (p - onehot) / n + 2 z lse p / n
        dlogits = (p * (1.0 + 2.0 * z_loss_coef * lse[..., None]) - hit.astype(f32)) / n
        dlogits = dlogits.astype(xc.dtype)
        dx = jnp.einsum("bcv,vd->bcd", dlogits, w_t, preferred_element_type=f32)
        if dhead is None:  # accelerators: the caller contracts the stacked dlogits at once
            return None, (nll, lse, dx.astype(xc.dtype), dlogits)
        dhead = dhead + _weight_grad(xc.reshape(-1, d), dlogits.reshape(-1, dlogits.shape[-1]))
        return dhead, (nll, lse, dx.astype(xc.dtype))

    if with_grads and jax.default_backend() != "cpu" and LOSS_DHEAD_GROUP_BYTES > 0:
        # Accelerators: a float32 (D, V) head-gradient carry is read, added to and copied once
        # per chunk (64 times a step at 8 x 2048), 15 ms of the 300m step on a v5e. Instead
        # the chunks' dlogits (compute dtype) are stacked, g chunks at a time, and contracted
        # with their inputs in one matmul per group: the logits stay chunk-sized (small enough
        # for the chip's on-core memory, which is why bigger chunks were slower), the carry is
        # touched once per group. 300m 177 -> 156 ms a step on a v5e, 150m 56 -> 53 ms.
        n_chunks = s // chunk
        per_chunk = b * chunk * head.shape[1] * jnp.dtype(x.dtype).itemsize
        g = 1
        while g * 2 <= LOSS_DHEAD_GROUP_BYTES // per_chunk and n_chunks % (g * 2) == 0:
            g *= 2

        def group(dhead, xt):
            xg, tg = xt  # (g, B, c, D), (g, B, c)
            _, (nll, lse, dx, dl) = jax.lax.scan(body, None, (xg, tg))
            dhead = dhead + jnp.einsum("gbcd,gbcv->dv", xg, dl, preferred_element_type=f32)
            return dhead, (nll, lse, dx)

        grouped = (
            xs.reshape(n_chunks // g, g, *xs.shape[1:]),
            ts.reshape(n_chunks // g, g, b, chunk),
        )
        dhead, (nll, lse, dx) = jax.lax.scan(group, jnp.zeros(head.shape, f32), grouped)
        nll, lse = nll.reshape(n_chunks, b, chunk), lse.reshape(n_chunks, b, chunk)
        dx = dx.reshape(n_chunks, b, chunk, d)
    else:
        dhead0 = jnp.zeros(head.shape, f32) if with_grads else None
        dhead, (nll, lse, dx) = jax.lax.scan(body, dhead0, (xs, ts))
    nll, lse = nll.swapaxes(0, 1).reshape(b, s), lse.swapaxes(0, 1).reshape(b, s)
    if with_grads:
        dx = dx.swapaxes(0, 1).reshape(b, s, d)
    return nll, lse, dx, dhead


def token_nll(x: Array, head: Array, targets: Array, chunk: int) -> Array:
    """Per-token cross-entropy (B, S) in float32 of hidden states x (B, S, D) under the output
    projection ``head`` (D, V), computed chunk by chunk (forward only: evaluation)."""
    return _xent_chunks(x, head, targets, chunk, None)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_xent(x, head, targets, z_loss_coef, chunk):
    nll, lse, _, _ = _xent_chunks(x, head, targets, chunk, None)
    return jnp.mean(nll) + z_loss_coef * jnp.mean(lse**2), jnp.mean(nll)


def _fused_xent_fwd(x, head, targets, z_loss_coef, chunk):
    nll, lse, dx, dhead = _xent_chunks(x, head, targets, chunk, z_loss_coef)
    out = (jnp.mean(nll) + z_loss_coef * jnp.mean(lse**2), jnp.mean(nll))
    return out, (dx, dhead.astype(head.dtype))


def _fused_xent_bwd(z_loss_coef, chunk, res, g):
    dx, dhead = res
    g_objective, _ = g  # the plain loss is returned under stop_gradient: its cotangent is 0
    return (g_objective * dx).astype(dx.dtype), (g_objective * dhead).astype(dhead.dtype), None


_fused_xent.defvjp(_fused_xent_fwd, _fused_xent_bwd)


def fused_cross_entropy(
    x: Array, head: Array, targets: Array, *, z_loss_coef: float, chunk: int
) -> tuple[Array, Array]:
    """(objective, loss) of hidden states x (B, S, D), output projection ``head`` (D, V) and
    integer targets (B, S): loss = mean cross-entropy (nats), objective = loss + z_loss_coef x
    mean(logsumexp^2). Only the objective is differentiable.

    Equal to the softmax cross-entropy of ``x @ head`` but never materializes the (B, S, V)
    logits: the sequence is processed ``chunk`` positions at a time and, when differentiated,
    each chunk's gradient is computed in the forward pass (the objective is a fixed mean, so its
    cotangent is a scalar that only scales them). Same matmul FLOPs as autodiff, none of its
    (B, S, V) float32 temporaries, and no scatter for the target gather: 3-4x faster on CPU for
    an 8k vocabulary, and it bounds the memory of large-vocabulary heads anywhere (on
    accelerators by ``LOSS_DHEAD_GROUP_BYTES`` of compute-dtype dlogits, see ``_xent_chunks``)."""
    objective, loss = _fused_xent(x, head, targets, float(z_loss_coef), chunk)
    return objective, jax.lax.stop_gradient(loss)
