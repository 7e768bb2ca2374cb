"""The manifest that every pipeline output directory carries.

It lists the output shards (with record counts and sha256) and accounts for every input
record: ``records_in == records_out + sum(dropped.values())``. A manifest that breaks this
invariant is never written: the stage fails instead, because a silent loss is a bug.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pipelines import storage

MANIFEST_NAME = "manifest.json"
FORMAT = "slipway-documents/v1"


class AccountingError(RuntimeError):
    """Records went missing: in != out + dropped."""


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the output directory
    records: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    stage: str
    config: Mapping[str, Any]
    inputs: list[str]
    records_in: int
    records_out: int
    dropped: Mapping[str, int]
    shards: list[ShardInfo]
    dead_letter_shards: list[ShardInfo]
    extra: Mapping[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def check(self) -> None:
        dropped = sum(self.dropped.values())
        if self.records_in != self.records_out + dropped:
            raise AccountingError(
                f"stage {self.stage!r}: {self.records_in} records in, but {self.records_out} out"
                f" + {dropped} dropped {dict(self.dropped)}"
            )
        if sum(s.records for s in self.shards) != self.records_out:
            raise AccountingError(
                f"stage {self.stage!r}: shard counts do not add up to records_out"
            )
        if sum(s.records for s in self.dead_letter_shards) != dropped:
            raise AccountingError(f"stage {self.stage!r}: dead letters do not add up to dropped")

    def to_json(self) -> str:
        body = asdict(self)
        body["dropped"] = dict(sorted(self.dropped.items()))
        return json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        body = json.loads(text)
        body["shards"] = [ShardInfo(**s) for s in body["shards"]]
        body["dead_letter_shards"] = [ShardInfo(**s) for s in body["dead_letter_shards"]]
        return cls(**body)

    def write(self, output_dir: str) -> None:
        self.check()
        storage.write_bytes_atomic(
            storage.join(output_dir, MANIFEST_NAME), self.to_json().encode("utf-8")
        )

    def shard_paths(self, output_dir: str) -> list[str]:
        return [storage.join(output_dir, s.path) for s in self.shards]

    def dead_letter_paths(self, output_dir: str) -> list[str]:
        return [storage.join(output_dir, s.path) for s in self.dead_letter_shards]


def read_manifest(output_dir: str) -> Manifest:
    path = storage.join(output_dir, MANIFEST_NAME)
    if not storage.exists(path):
        raise FileNotFoundError(f"{output_dir} has no {MANIFEST_NAME}: not a finished stage output")
    return Manifest.from_json(storage.read_bytes(path).decode("utf-8"))


def has_manifest(path: str) -> bool:
    return storage.exists(storage.join(path, MANIFEST_NAME))
