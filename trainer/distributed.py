"""Multi-host identity, the device mesh, and parameter/batch shardings.

One code path from one CPU to a multislice TPU job: the mesh always has the axes
``(replica, data, fsdp, tensor)``; unused axes have size 1.

- ``replica``: across slices (DCN); pure data parallelism.
- ``data``: data parallelism inside a slice.
- ``fsdp``: data parallelism whose parameters and optimizer state are also sharded.
- ``tensor``: heads / MLP / vocabulary split (Megatron style).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.config import DistributedConfig, MeshConfig
from trainer.mesh_axes import AXES, BATCH_AXES, HEAD_AXIS
from trainer.model import PARAM_AXES
from trainer.optim import leaf_name

LOGICAL_TO_MESH = {
    "embed": "fsdp",
    "heads": HEAD_AXIS,
    "mlp": "tensor",
    "vocab": "tensor",
    "expert": None,
}


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] = ()


def resolve_process(cfg: DistributedConfig, env: Mapping[str, str]) -> ProcessSpec | None:
    """Who am I in the job? None = a single process (no ``jax.distributed``).

    Explicit settings win. Otherwise the JobSet/GKE environment: ``TPU_WORKER_HOSTNAMES``
    (hosts of this slice, comma-separated), ``TPU_WORKER_ID`` or ``JOB_COMPLETION_INDEX``
    (this host's index in the slice), and for multislice ``MEGASCALE_NUM_SLICES``,
    ``MEGASCALE_SLICE_ID``, ``MEGASCALE_COORDINATOR_ADDRESS``. Process ids are
    ``slice_id * hosts_per_slice + worker_id``; the coordinator is the megascale coordinator
    (multislice) or the slice's first host, on ``cfg.port``.
    """
    if cfg.mode == "none":
        return None
    if cfg.mode == "explicit":
        return ProcessSpec(
            cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.local_device_ids
        )
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    worker = env.get("TPU_WORKER_ID", env.get("JOB_COMPLETION_INDEX"))
    slices = int(env.get("MEGASCALE_NUM_SLICES", "1") or 1)
    if not hosts or worker is None:
        return None
    if len(hosts) * slices == 1:
        return None
    slice_id = int(env.get("MEGASCALE_SLICE_ID", "0") or 0)
    coord = env.get("MEGASCALE_COORDINATOR_ADDRESS") if slices > 1 else None
    coord = coord or hosts[0]
    if ":" not in coord:
        coord = f"{coord}:{cfg.port}"
    return ProcessSpec(coord, len(hosts) * slices, slice_id * len(hosts) + int(worker))


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> ProcessSpec | None:
    spec = resolve_process(cfg, os.environ if env is None else env)
    if spec is not None:
        kwargs = {}
        if spec.local_device_ids:
            kwargs["local_device_ids"] = list(spec.local_device_ids)
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            **kwargs,
        )
    return spec


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
    sizes = [cfg.replica, cfg.data, cfg.fsdp, cfg.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise ValueError(f"mesh: {num_devices} devices not divisible by fixed axes {fixed}")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh: axes {dict(zip(AXES, sizes, strict=True))} != {num_devices} devices"
        )
    return tuple(sizes)


def device_slices(devices: list, num_slices: int = 0) -> list[int]:
    """The slice of each device. TPU devices carry ``slice_index``. Platforms that do not (CPU,
    GPU) report one slice (or none) for every device: there a multislice job (``num_slices`` > 1,
    by default ``MEGASCALE_NUM_SLICES``) groups its processes into that many equal, contiguous
    slices, as the JobSet numbers them (process id = slice x hosts_per_slice + worker)."""
    ids = [getattr(d, "slice_index", 0) or 0 for d in devices]
    if len(set(ids)) > 1:
        return ids
    if num_slices <= 0:
        num_slices = int(os.environ.get("MEGASCALE_NUM_SLICES", "1") or 1)
    if num_slices <= 1:
        return ids
    procs = sorted({d.process_index for d in devices})
    if len(procs) % num_slices:
        raise ValueError(f"mesh: {len(procs)} processes do not split into {num_slices} slices")
    per_slice = len(procs) // num_slices
    rank = {p: i for i, p in enumerate(procs)}
    return [rank[d.process_index] // per_slice for d in devices]


def make_mesh(cfg: MeshConfig, devices: list | None = None, num_slices: int = 0) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    slices = device_slices(devices, num_slices)
    n_slices = len(set(slices))
    if n_slices > 1:
        # Multislice: replica across slices (DCN), the rest inside a slice (ICI). Single-slice
        # devices that carry slice_index (all 0) take the plain path below.
        if shape[0] % n_slices:
            raise ValueError(f"mesh: replica={shape[0]} must be a multiple of {n_slices} slices")
        from jax.experimental import mesh_utils

        by_slice: dict[int, list] = {}
        for d, s in zip(devices, slices, strict=True):
            by_slice.setdefault(s, []).append(d)
        inner = (shape[0] // n_slices, *shape[1:])
        # per slice: the topology-aware ICI mesh (on TPU), then slices stacked along replica
        arr = np.concatenate(
            [
                mesh_utils.create_device_mesh(
                    inner, sorted(by_slice[s], key=lambda d: (d.process_index, d.id))
                )
                for s in sorted(by_slice)
            ],
            axis=0,
        )
    else:
        # process-major order: each host's devices are contiguous along the batch axes
        devices.sort(key=lambda d: (d.process_index, d.id))
        arr = np.array(devices).reshape(shape)
    return Mesh(arr, AXES)


def _spec_for(path, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    name = leaf_name(path)
    axes = PARAM_AXES.get(name)
    if axes is None or len(shape) < len(axes):
        return PartitionSpec()
    lead = len(shape) - len(axes)  # stacked-layer axis (never sharded: scan walks it)
    out: list[str | None] = [None] * lead
    for dim, logical in zip(shape[lead:], axes, strict=True):
        axis = LOGICAL_TO_MESH.get(logical) if logical else None
        # an axis that does not divide the dim stays replicated (tiny vocab, few kv heads)
        out.append(axis if axis and dim % mesh.shape[axis] == 0 and axis not in out else None)
    return PartitionSpec(*out)


def param_shardings(tree, mesh: Mesh):
    """NamedSharding per array leaf of ``tree`` (params, or optimizer state mirroring them)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, _spec_for(p, tuple(x.shape), mesh)), tree
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def on_mesh(fn: Callable[_P, _R], mesh: Mesh) -> Callable[_P, _R]:
    """``fn``, traced with ``mesh`` as JAX's abstract mesh: what ``jax.jit`` of a step over
    ``mesh`` wraps. Kernels that XLA cannot partition (Pallas on TPU) find the mesh there and
    run per device inside a ``shard_map`` (``kernels.per_device``); everything else is
    partitioned from the arrays' shardings as before."""

    @functools.wraps(fn)
    def traced(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced
