"""TPU preflight: does the Cloud TPU API offer this accelerator in this zone?

Asked once, before a JobSet is submitted to GKE, so that a run on a TPU generation the zone
does not have fails in seconds with a message naming what the zone does offer, instead of
pods pending forever on a node pool that can never exist.

The answer is advisory, and only a definite "no" is an error:

* the API answers and the generation is not among the zone's accelerator types:
  :class:`AcceleratorNotOffered` (a :class:`~operators.jobset.catalogue.ShapeError`);
* the API answers, the generation is offered but this exact slice shape is not listed: a
  warning (GKE node pools, reservations and new shapes can run what the list omits);
* the API cannot be asked (no network, no credentials, permission denied, API disabled,
  timeout): a warning, and the launch goes on - a preflight that cannot ask must never be
  what stops a run;
* ``cpu`` runs, and regional locations (TPUs are per zone), are skipped.

Airflow-free like the rest of :mod:`operators.jobset`; ``google-cloud-tpu`` is imported
only when no client is passed in. The caller brings project and credentials (the training
operator has them from its GCP connection), as values or as callables looked up inside the
check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from operators import naming
from operators.jobset.catalogue import ShapeError, SliceShape

__all__ = [
    "TPU_API_GENERATION",
    "AcceleratorNotOffered",
    "PreflightResult",
    "accelerator_type_name",
    "check_accelerator_offered",
]

log = logging.getLogger(__name__)

# Catalogue name -> the Cloud TPU API's accelerator-type prefix ("v5litepod-16", "v5p-8").
TPU_API_GENERATION = {
    "v4": "v4",
    "v5e": "v5litepod",
    "v5p": "v5p",
    "v6e": "v6e",
    "tpu7x": "tpu7x",
}
# The size in a type's name counts TensorCores on v4/v5p (2 per chip), chips on v5e/v6e.
# tpu7x is left out: its naming is not verified (the catalogue marks it unverified too), so
# only its topology is matched.
_SIZE_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
DEFAULT_TIMEOUT_S = 20.0


Status = Literal["offered", "shape_unlisted", "unverified", "skipped"]


class AcceleratorNotOffered(ShapeError):
    """The TPU API answered: this zone has no accelerator of this generation."""


class TpuClientLike(Protocol):
    """What the preflight needs of ``google.cloud.tpu_v2.TpuClient``."""

    def list_accelerator_types(self, *, parent: str, **kwargs: Any) -> Iterable[Any]: ...


@dataclass(frozen=True)
class PreflightResult:
    """What the preflight found; ``status`` says how sure it is."""

    status: Status
    accelerator: str
    zone: str
    message: str
    offered: tuple[str, ...] = ()  # the zone's accelerator types of this generation

    @property
    def verified(self) -> bool:
        return self.status == "offered"


def accelerator_type_name(shape: SliceShape) -> str | None:
    """The Cloud TPU API's name for one slice of ``shape`` (``v5p-32``), where known."""
    per_chip = _SIZE_PER_CHIP.get(shape.accelerator)
    if per_chip is None:
        return None
    return f"{TPU_API_GENERATION[shape.accelerator]}-{shape.chips_per_slice * per_chip}"


def _topologies(item: Any) -> set[str]:
    return {str(c.topology) for c in getattr(item, "accelerator_configs", ()) if c.topology}


def _default_client(credentials: Any) -> TpuClientLike:
    from google.cloud import tpu_v2

    return tpu_v2.TpuClient(credentials=credentials)


def _list_types(client: TpuClientLike, parent: str, timeout: float) -> list[Any]:
    # One attempt with a deadline (no retry loop): an unreachable API must cost seconds,
    # not the default minute of retries, before the warning.
    return list(client.list_accelerator_types(parent=parent, timeout=timeout, retry=None))


def _match(shape: SliceShape, zone: str, listed: list[Any]) -> PreflightResult:
    generation = TPU_API_GENERATION[shape.accelerator]
    ours = [t for t in listed if str(t.type_).startswith(f"{generation}-")]
    offered = tuple(sorted(str(t.type_) for t in ours))
    if not ours:
        generations = sorted({str(t.type_).rsplit("-", 1)[0] for t in listed})
        raise AcceleratorNotOffered(
            f"{shape.accelerator} ({generation}) is not offered in zone {zone}: the TPU API "
            f"lists {', '.join(generations) or 'no TPU types'} there; choose another zone or "
            "accelerator"
        )
    name = accelerator_type_name(shape)
    if any(shape.topology in _topologies(t) for t in ours) or (name and name in offered):
        return PreflightResult(
            "offered",
            shape.accelerator,
            zone,
            f"{name or shape.accelerator} ({shape.topology}) is offered in {zone}",
            offered,
        )
    return PreflightResult(
        "shape_unlisted",
        shape.accelerator,
        zone,
        f"{generation} is offered in {zone} but topology {shape.topology} "
        f"({name or 'this size'}) is not among {', '.join(offered)}; the GKE node pool "
        "decides - check it exists",
        offered,
    )


def _resolve(value: Any) -> Any:
    """A value, or what a zero-argument callable returns (looked up only when needed)."""
    return value() if callable(value) else value


def check_accelerator_offered(
    shape: SliceShape,
    *,
    project: str | Callable[[], str | None] | None,
    zone: str,
    client: TpuClientLike | None = None,
    credentials: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> PreflightResult:
    """Ask the Cloud TPU API whether ``zone`` offers ``shape``'s accelerator.

    Raises :class:`AcceleratorNotOffered` only when the API answered and the generation is not
    there, and :class:`ValueError` for a malformed project or zone given as text; every other
    outcome is a :class:`PreflightResult`, logged as a warning unless verified.

    ``client`` replaces the real ``tpu_v2.TpuClient`` (built with ``credentials``, else
    Application Default Credentials). ``project`` and ``credentials`` may be zero-argument
    callables (``hook.get_credentials``): they are called inside the check, so a connection
    without credentials or project is a warning too, not a failed launch.
    """
    if not shape.is_tpu:
        return PreflightResult("skipped", shape.accelerator, zone, "not a TPU: nothing to check")
    if isinstance(project, str) and not naming.full(naming.PROJECT, project):
        raise ValueError(f"TPU preflight: {project!r} is not a GCP project id")
    if naming.full(naming.REGION, zone):
        message = f"{zone} is a region; TPU types are offered per zone: preflight skipped"
        log.info("TPU preflight: %s", message)
        return PreflightResult("skipped", shape.accelerator, zone, message)
    if not naming.full(naming.ZONE, zone):
        raise ValueError(f"TPU preflight: {zone!r} is not a zone (e.g. us-central2-b)")

    try:
        project_id = _resolve(project)
        if not naming.full(naming.PROJECT, project_id):
            raise LookupError(f"no usable GCP project ({project_id!r})")
        parent = f"projects/{project_id}/locations/{zone}"
        listed = _list_types(client or _default_client(_resolve(credentials)), parent, timeout)
    except Exception as exc:  # unreachable, no credentials/project, denied, disabled, timeout
        message = (
            f"could not ask the TPU API whether {zone} offers {shape.accelerator} "
            f"({type(exc).__name__}: {exc}); launching without that check"
        )
        log.warning("TPU preflight: %s", message)
        return PreflightResult("unverified", shape.accelerator, zone, message)

    result = _match(shape, zone, listed)
    if result.verified:
        log.info("TPU preflight: %s", result.message)
    else:
        log.warning("TPU preflight: %s", result.message)
    return result
