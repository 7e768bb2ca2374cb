"""The trainer's device mesh for a launch: what runs where follows from the slice shape.

The trainer's mesh has the axes ``(replica, data, fsdp, tensor)`` (``trainer/config.py``
``MeshConfig``, ``trainer/distributed.py``). A launch fixes it as MaxText and Levanter do:

- ``replica`` = the number of slices: the only axis that crosses slices (DCN), pure data
  parallelism, one gradient all-reduce per step over the slow network;
- inside a slice (ICI) every chip is used, by ``fsdp`` (parameters and optimizer state sharded
  over the slice's chips) when a preset's training state would take more than
  :data:`HBM_FRACTION` of one chip's memory, else by ``data`` (replicated parameters, no
  all-gathers): an ``8b`` run never holds 120 GiB of state on every chip;
- ``tensor`` = 1 unless the run form's ``mesh`` override says otherwise.

The mesh reaches the trainer as ``--set mesh.<axis>=N`` arguments in the JobSet manifest, so
the manifest says how a run was laid out and the trainer config file stays the same whatever
it runs on. Imports only the standard library and the trainer's JAX-free config and shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import Any

from operators.jobset.catalogue import SliceShape

AXES = ("replica", "data", "fsdp", "tensor")
OVERRIDE_AXES = ("data", "fsdp", "tensor")  # replica is always the slice count
# f32 parameters, their gradients and Adam's two moments.
STATE_BYTES_PER_PARAM = 16
# Parameters are sharded when their training state would fill more than this share of one
# chip's memory: the rest is for activations, the compiled program and the runtime.
HBM_FRACTION = 0.25
# The vocabulary the preset names count (Llama-3's); a run's own comes from its token store.
PRESET_VOCAB = 128_256


class MeshError(ValueError):
    """A mesh override that cannot lay out on the launch's slices."""


@cache
def preset_params(preset: str) -> int:
    """Parameters of a ``trainer/shapes.py`` preset (0 for a name that is none)."""
    from trainer.config import ModelConfig, resolve_model
    from trainer.shapes import PRESETS, param_count

    if preset not in PRESETS:
        return 0
    return param_count(resolve_model(ModelConfig(preset=preset), vocab_size=PRESET_VOCAB))


def shards_parameters(preset: str, shape: SliceShape) -> bool:
    """Whether ``preset``'s training state is too large to replicate on every chip."""
    state = preset_params(preset) * STATE_BYTES_PER_PARAM
    return state > HBM_FRACTION * shape.hbm_gib_per_chip * 2**30


def launch_mesh(
    shape: SliceShape, preset: str, override: Mapping[str, object] | None = None
) -> dict[str, int]:
    """The mesh for a launch (the module docstring), with the run form's ``override`` of some
    of ``data``, ``fsdp``, ``tensor`` on top: axes it leaves out are 1, except that the rest of
    the slice goes to the preset's fill axis (``fsdp`` or ``data``), or to the other of the
    two when the override names that one. Raises :class:`MeshError` naming the axis."""
    override = dict(override or {})
    unknown = sorted(set(override) - set(OVERRIDE_AXES))
    if unknown:
        raise MeshError(
            f"mesh: unknown axis {', '.join(unknown)} (choose from {', '.join(OVERRIDE_AXES)}; "
            "replica is always the number of slices)"
        )
    for key, value in override.items():
        if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
            raise MeshError(
                f"mesh.{key}: must be -1 (the rest of the slice) or >= 1, got {value!r}"
            )
    fill = "fsdp" if shards_parameters(preset, shape) else "data"
    inner: dict[str, int] = {"data": 1, "fsdp": 1, "tensor": 1, **override}  # type: ignore[dict-item]
    if -1 not in inner.values():
        rest = next((a for a in (fill, "data", "fsdp") if a not in override), None)
        if rest is not None:
            inner[rest] = -1
    chips = shape.chips_per_slice
    fills = [k for k, v in inner.items() if v == -1]
    fixed = math.prod(v for v in inner.values() if v != -1)
    if len(fills) > 1:
        raise MeshError(f"mesh: at most one axis may be -1, not {', '.join(fills)}")
    if (fills and chips % fixed) or (not fills and fixed != chips):
        raise MeshError(
            f"mesh: {override} does not lay out on the {chips} chips of a {shape.topology} slice "
            f"(data x fsdp x tensor must be {chips}; -1 fills the rest)"
        )
    return {"replica": shape.slices, **inner}


def resolved(mesh: Mapping[str, int], chips_per_slice: int) -> dict[str, int]:
    """A :func:`launch_mesh` mesh with its ``-1`` axis as the rest of the slice's chips."""
    fixed = math.prod(v for k, v in mesh.items() if k != "replica" and v != -1)
    return {k: chips_per_slice // fixed if v == -1 else v for k, v in mesh.items()}


def data_parallel_size(mesh: Mapping[str, int]) -> int:
    """How many ways a :func:`resolved` mesh splits the batch: the product of its batch axes
    (``trainer.mesh_axes.BATCH_AXES``). The trainer refuses a batch this does not divide."""
    from trainer.mesh_axes import BATCH_AXES

    return math.prod(mesh[axis] for axis in BATCH_AXES)


def run_data_parallel_size(params: Mapping[str, Any]) -> int:
    """The data-parallel size of a run form's training launch: its slices of its topology,
    laid out by :func:`launch_mesh` for its preset and ``mesh`` override."""
    from operators.jobset.catalogue import resolve

    shape = resolve(params["accelerator"], params["topology"], int(params["slices"]))
    mesh = launch_mesh(shape, params.get("model_preset", "nano"), params.get("mesh") or {})
    return data_parallel_size(resolved(mesh, shape.chips_per_slice))


def mesh_args(mesh: Mapping[str, int]) -> tuple[str, ...]:
    """The trainer arguments that set the mesh (``trainer.config`` ``--set`` overrides)."""
    return tuple(arg for axis in AXES for arg in ("--set", f"mesh.{axis}={mesh[axis]}"))
