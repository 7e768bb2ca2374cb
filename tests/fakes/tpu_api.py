"""FakeTpuClient: stands in for ``google.cloud.tpu_v2.TpuClient`` (a FAKE, no API behind it).

It answers ``list_accelerator_types`` from a fixed list of AcceleratorType-shaped objects
(``name``, ``type_``, ``accelerator_configs[].topology``, as the API returns them), or raises
the error it was given, and records every call (:attr:`FakeTpuClient.calls`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def accelerator_type(
    name: str, topology: str | None = None, *, project: str = "p", zone: str = "z"
) -> Any:
    """An AcceleratorType as the API returns it (``v5litepod-16`` with topology ``4x4``)."""
    configs = [SimpleNamespace(type_=0, topology=topology)] if topology else []
    return SimpleNamespace(
        name=f"projects/{project}/locations/{zone}/acceleratorTypes/{name}",
        type_=name,
        accelerator_configs=configs,
    )


class FakeTpuClient:
    """Answers from a fixed list, or raises ``error``; ``on_call`` runs at each call (a test
    can record what else had happened by then)."""

    def __init__(
        self,
        types: list[Any] | None = None,
        error: Exception | None = None,
        on_call: Callable[[], Any] | None = None,
    ):
        self.types, self.error, self.on_call = types or [], error, on_call
        self.calls: list[dict[str, Any]] = []

    def list_accelerator_types(self, *, parent: str, **kwargs: Any) -> list[Any]:
        self.calls.append({"parent": parent, **kwargs})
        if self.on_call is not None:
            self.on_call()
        if self.error is not None:
            raise self.error
        return list(self.types)
