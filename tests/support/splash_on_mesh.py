"""Splash attention under a device mesh, run by Pallas' interpreter on CPU devices: what
``tests/integration/test_trainer_parallel.py`` checks in a process of its own (the device count
is fixed when JAX starts).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.support.splash_on_mesh

For each mesh layout, the splash path (``kernels.attention(..., "splash")``, jitted through
``distributed.on_mesh`` over batch-sharded inputs, as the train step is) and the blocked
attention on one device, forward and gradients; prints one JSON line per layout with the
largest relative difference, the masks the kernels were built for and the per-device shapes
of q, k and v inside the forward ``shard_map``.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import trainer.distributed as dist
import trainer.kernels as kernels
from tests.support.trainer_data import attention_inputs
from trainer.config import MeshConfig

LAYOUTS = [
    # (mesh axes, query heads, kv heads): meshes as the trainer makes them (all four axes)
    ({"data": 2, "tensor": 2}, 4, 2),  # heads split over tensor
    ({"fsdp": 4}, 4, 2),  # batch only
    ({"data": 2, "tensor": 2}, 4, 1),  # one kv head: repeated to one per query head, split
    ({"data": 2, "tensor": 2}, 2, 1),
    ({"data": 4}, 4, 2, "bare"),  # a mesh of one axis, no tensor axis at all
]


def check(axes: dict[str, int], h: int, kv_heads: int, kind: str = "trainer") -> dict:
    q, k, v, ct, seg = attention_inputs(4, 256, h, kv_heads, 64, seed=3)

    def loss(impl: str):
        def f(q, k, v, seg):
            return jnp.sum(kernels.attention(q, k, v, seg, impl) * ct)

        return jax.value_and_grad(f, argnums=(0, 1, 2))

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(loss("blocked"))(q, k, v, seg)
        if kind == "bare":
            mesh = Mesh(np.array(jax.devices()), tuple(axes))
            rows = heads = NamedSharding(mesh, PartitionSpec(tuple(axes)))
        else:
            mesh = dist.make_mesh(
                MeshConfig(**{"replica": 1, "data": 1, "fsdp": 1, "tensor": 1, **axes})
            )
            rows = dist.batch_sharding(mesh)
            heads = NamedSharding(mesh, PartitionSpec(dist.BATCH_AXES, None, "tensor", None))
        seen: list[tuple[int, ...]] = []
        real_make = sa.make_splash_mha

        def make(mask, **kwargs):
            seen.append(mask.shape)  # (heads, S, S) of the block the kernel is built for
            return real_make(mask, interpret=True, **kwargs)

        sa.make_splash_mha = make
        try:
            step = jax.jit(
                dist.on_mesh(loss("splash"), mesh),
                in_shardings=(heads, rows, rows, rows),  # q split over heads, as projected
            )
            got = step(q, k, v, seg)
            traced = jax.make_jaxpr(dist.on_mesh(loss("splash"), mesh))(q, k, v, seg)
        finally:
            sa.make_splash_mha = real_make
    worst = max(
        float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
        for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True)
    )
    maps = [eqn for eqn in traced.jaxpr.eqns if eqn.primitive.name == "shard_map"]
    # the forward's q, k and v as each device sees them (the kernel's constants come first)
    local = [list(var.aval.shape) for var in maps[0].params["jaxpr"].invars if var.aval.ndim == 4]
    return {
        "mesh": axes,
        "heads": h,
        "kv_heads": kv_heads,
        "worst": worst,
        "masks": [list(shape) for shape in seen],
        "shard_maps": len(maps),
        "local_qkv": local,
    }


def main() -> None:
    real_backend = jax.default_backend
    jax.default_backend = lambda: "tpu"  # splash refuses other backends; the interpreter runs it
    try:
        assert real_backend() == "cpu" and len(jax.devices()) == 4, jax.devices()
        for layout in LAYOUTS:
            print(json.dumps(check(*layout)), flush=True)
    finally:
        jax.default_backend = real_backend


if __name__ == "__main__":
    main()
