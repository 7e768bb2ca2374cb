"""TPU catalogue: what GKE calls each TPU type, and which slice shapes exist.

A slice shape is (accelerator, topology, slices). :func:`resolve` turns one into a
:class:`SliceShape` (hosts per slice, chips per host, machine type, node-selector values) or
raises :class:`ShapeError` with a message that names the allowed values, so a bad choice in
the Airflow form fails there, not halfway into a run on a cluster.

Facts are from the GKE TPU documentation ("Plan TPUs in GKE"): a multi-host slice has 4 chips
per host; v5e/v6e single-host slices have 1, 4 or 8 chips on one VM. The ``cpu``
pseudo-accelerator is for local runs and CPU clusters: its topology is the number of processes
(one JAX process per "host"), and it has no TPU node selectors or resources.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CATALOGUE",
    "AcceleratorType",
    "ShapeError",
    "SliceShape",
    "accelerator_names",
    "lookup",
    "resolve",
]

# Slipway's own bound (not a GKE limit): a sweep that asks for more slices than this is a typo.
MAX_SLICES = 64
# Local processes share one machine; more than this is a mistake, not a test.
MAX_CPU_PROCESSES = 64

_TOPOLOGY_RE = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*)*")  # fullmatch: no trailing newline


class ShapeError(ValueError):
    """An accelerator/topology/slices combination that does not exist."""


@dataclass(frozen=True)
class HostLayout:
    """How a topology is laid out on VMs: machine type and chips per host."""

    machine_type: str
    chips_per_host: int


@dataclass(frozen=True)
class AcceleratorType:
    """One TPU generation as GKE exposes it (or the ``cpu`` pseudo-accelerator).

    ``layout(topology)`` returns the VM layout for an allowed topology, or an error string;
    keeping the rule a function (rather than a fixed list) lets the 3D pods accept every
    4-multiple cube GKE accepts without enumerating hundreds of shapes.
    """

    name: str  # Slipway's short name: v4, v5e, v5p, v6e, tpu7x, cpu
    gke_accelerator: str  # cloud.google.com/gke-tpu-accelerator ("" for cpu)
    dims: int  # 2 (AxB) or 3 (AxBxC); 1 for cpu (process count)
    max_chips: int  # chips in a full pod: the largest single slice
    layout: Callable[[str, tuple[int, ...]], HostLayout | str]
    examples: tuple[str, ...]  # shown in errors and docs
    # High-bandwidth memory per chip, GiB (public specs; for cpu a nominal share of host
    # memory per process): decides whether a preset's parameters are sharded by default.
    hbm_gib: float = 16.0
    aliases: tuple[str, ...] = ()
    verified: bool = True  # False: taken from launch docs, not yet run by us

    @property
    def is_tpu(self) -> bool:
        return bool(self.gke_accelerator)


@dataclass(frozen=True)
class SliceShape:
    """A resolved, valid slice shape: everything the manifest and the scheduler need."""

    accelerator: str  # catalogue name (v5p, cpu, ...)
    gke_accelerator: str  # node-selector value ("" for cpu)
    machine_type: str  # GKE machine type ("" for cpu)
    topology: str
    slices: int
    chips_per_slice: int
    hosts_per_slice: int
    chips_per_host: int
    hbm_gib_per_chip: float = 16.0

    @property
    def is_tpu(self) -> bool:
        return bool(self.gke_accelerator)

    @property
    def multislice(self) -> bool:
        return self.slices > 1

    @property
    def total_chips(self) -> int:
        return self.chips_per_slice * self.slices

    @property
    def total_hosts(self) -> int:
        """Pods in the JobSet: one per host per slice."""
        return self.hosts_per_slice * self.slices


def _parse(topology: str, dims: int) -> tuple[int, ...] | str:
    if not isinstance(topology, str) or not _TOPOLOGY_RE.fullmatch(topology):
        return "topology must look like A, AxB or AxBxC with positive integers"
    parts = tuple(int(p) for p in topology.split("x"))
    if len(parts) != dims:
        want = {1: "a process count (e.g. 2)", 2: "AxB (e.g. 4x4)", 3: "AxBxC (e.g. 2x2x4)"}
        return f"topology must be {want[dims]}"
    return parts


def _twod(prefix: str) -> Callable[[str, tuple[int, ...]], HostLayout | str]:
    """v5e / v6e: fixed 2D shapes; single-host VMs hold 1, 4 or 8 chips, multi-host ones 4."""
    single = {"1x1": 1, "2x2": 4, "2x4": 8}
    multi = ("4x4", "4x8", "8x8", "8x16", "16x16")

    def layout(topology: str, parts: tuple[int, ...]) -> HostLayout | str:
        if topology in single:
            chips = single[topology]
            return HostLayout(f"{prefix}-{chips}t", chips)
        if topology in multi:
            return HostLayout(f"{prefix}-4t", 4)
        return f"allowed topologies: {', '.join((*single, *multi))}"

    return layout


def _threed(machine_type: str) -> Callable[[str, tuple[int, ...]], HostLayout | str]:
    """v4 / v5p / tpu7x: 3D tori. Small slices have fixed shapes; larger ones are built from
    4x4x4 cubes, so every dimension is a multiple of 4 (GKE lists them sorted ascending)."""
    small = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")

    def layout(topology: str, parts: tuple[int, ...]) -> HostLayout | str:
        if topology in small:
            return HostLayout(machine_type, 4)
        if all(p % 4 == 0 for p in parts) and list(parts) == sorted(parts):
            return HostLayout(machine_type, 4)
        return (
            f"allowed topologies: {', '.join(small)}, or AxBxC with A<=B<=C all multiples "
            "of 4 (e.g. 4x4x4, 4x4x8, 8x8x16)"
        )

    return layout


def _cpu(topology: str, parts: tuple[int, ...]) -> HostLayout | str:
    if parts[0] > MAX_CPU_PROCESSES:
        return f"at most {MAX_CPU_PROCESSES} processes"
    return HostLayout("", 1)


_TYPES = (
    AcceleratorType(
        name="v4",
        gke_accelerator="tpu-v4-podslice",
        dims=3,
        max_chips=4096,
        layout=_threed("ct4p-hightpu-4t"),
        examples=("2x2x1", "2x2x4", "4x4x4"),
        hbm_gib=32.0,
    ),
    AcceleratorType(
        name="v5e",
        gke_accelerator="tpu-v5-lite-podslice",
        dims=2,
        max_chips=256,
        layout=_twod("ct5lp-hightpu"),
        examples=("2x2", "2x4", "4x4", "16x16"),
        hbm_gib=16.0,
        aliases=("v5litepod", "v5lite"),
    ),
    AcceleratorType(
        name="v5p",
        gke_accelerator="tpu-v5p-slice",
        dims=3,
        max_chips=8960,
        layout=_threed("ct5p-hightpu-4t"),
        examples=("2x2x1", "2x2x4", "4x4x8"),
        hbm_gib=95.0,
    ),
    AcceleratorType(
        name="v6e",
        gke_accelerator="tpu-v6e-slice",
        dims=2,
        max_chips=256,
        layout=_twod("ct6e-standard"),
        examples=("2x2", "2x4", "4x4", "16x16"),
        hbm_gib=32.0,
        aliases=("trillium",),
    ),
    # Ironwood: 4-chip VMs in 3D tori like v5p. Multi-host node pools are placed with a
    # workload policy instead of --tpu-topology; the node labels are the same kind.
    AcceleratorType(
        name="tpu7x",
        gke_accelerator="tpu7x",
        dims=3,
        max_chips=9216,
        layout=_threed("tpu7x-standard-4t"),
        examples=("2x2x1", "2x2x4", "4x4x4"),
        hbm_gib=192.0,
        aliases=("ironwood",),
        verified=False,
    ),
    AcceleratorType(
        name="cpu",
        gke_accelerator="",
        dims=1,
        max_chips=2**31,  # bounded by the process count below, with a clearer message
        layout=_cpu,
        examples=("1", "2", "4"),
        hbm_gib=16.0,
    ),
)

CATALOGUE: dict[str, AcceleratorType] = {t.name: t for t in _TYPES}
_BY_ALIAS: dict[str, AcceleratorType] = {
    key: t for t in _TYPES for key in (t.name, t.gke_accelerator, *t.aliases) if key
}


def accelerator_names() -> tuple[str, ...]:
    return tuple(CATALOGUE)


def lookup(accelerator: str) -> AcceleratorType:
    """A catalogue entry by short name (``v5p``), GKE label (``tpu-v5p-slice``) or alias."""
    key = accelerator.strip().lower() if isinstance(accelerator, str) else accelerator
    try:
        return _BY_ALIAS[key]
    except (KeyError, TypeError):
        raise ShapeError(
            f"unknown accelerator {accelerator!r}: choose one of {', '.join(CATALOGUE)} "
            "(or a GKE accelerator label such as tpu-v5p-slice)"
        ) from None


def resolve(accelerator: str, topology: str, slices: int = 1) -> SliceShape:
    """Validate (accelerator, topology, slices) and derive the slice layout."""
    kind = lookup(accelerator)
    parts = _parse(topology, kind.dims)
    if isinstance(parts, str):
        raise ShapeError(f"{kind.name}: bad topology {topology!r}: {parts}")
    chips = math.prod(parts)
    if chips > kind.max_chips:
        raise ShapeError(
            f"{kind.name}: topology {topology} has {chips} chips, more than a full pod "
            f"({kind.max_chips})"
        )
    layout = kind.layout(topology, parts)
    if isinstance(layout, str):
        raise ShapeError(f"{kind.name}: topology {topology!r} is not offered: {layout}")
    # bool is an int subclass: True would silently mean one slice.
    if isinstance(slices, bool) or not isinstance(slices, int):
        raise ShapeError(f"slices must be an integer, got {slices!r}")
    if slices < 1:
        raise ShapeError(f"slices must be at least 1, got {slices}")
    if slices > MAX_SLICES:
        raise ShapeError(f"slices={slices} is more than Slipway allows ({MAX_SLICES})")
    hosts = chips // layout.chips_per_host
    if kind.name == "cpu" and hosts * slices > MAX_CPU_PROCESSES:
        raise ShapeError(
            f"cpu: {hosts} processes x {slices} slices = {hosts * slices} local processes, "
            f"more than {MAX_CPU_PROCESSES}"
        )
    return SliceShape(
        accelerator=kind.name,
        gke_accelerator=kind.gke_accelerator,
        machine_type=layout.machine_type,
        topology=topology,
        slices=slices,
        chips_per_slice=chips,
        hosts_per_slice=hosts,
        chips_per_host=layout.chips_per_host,
        hbm_gib_per_chip=kind.hbm_gib,
    )
