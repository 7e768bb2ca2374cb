"""Storage: the three operations the step protocol needs (read, atomic replace, atomic
create), on local files and through fsspec (GCS's ``ifGenerationMatch=0``)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Protocol

log = logging.getLogger(__name__)


class Store(Protocol):
    def read(self, path: str) -> bytes | None: ...
    def write(self, path: str, data: bytes) -> None: ...
    def create(self, path: str, data: bytes) -> bool: ...
    def makedirs(self, path: str) -> None: ...
    def modified(self, path: str) -> float | None: ...  # epoch seconds; None if unknown


class LocalStore:
    """Local files: atomic create with ``O_EXCL``, atomic replace with temp file + rename."""

    def read(self, path: str) -> bytes | None:
        try:
            with open(_local_path(path), "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        path = _local_path(path)
        directory = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)  # readers see the old file or the new one, never half
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def create(self, path: str, data: bytes) -> bool:
        # Write the content to a temp file first and hard-link it into place: link() is as
        # exclusive as O_EXCL, and a reader never sees the lease file empty.
        path = _local_path(path)
        directory = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError:
                # Filesystems without hard links: fall back to O_EXCL (brief empty window).
                try:
                    out = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(out, "wb") as handle:
                    handle.write(data)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def makedirs(self, path: str) -> None:
        os.makedirs(_local_path(path), exist_ok=True)

    def modified(self, path: str) -> float | None:
        try:
            return os.stat(_local_path(path)).st_mtime
        except OSError:
            return None


class FsspecStore:
    """Object stores through fsspec.

    ``create`` uses ``pipe_file(mode="create")``: gcsfs turns it into an upload with
    ``ifGenerationMatch=0``, which GCS applies atomically (a second creator gets HTTP 412,
    raised as FileExistsError), and the memory filesystem into ``open("xb")``. Filesystems
    without a native exclusive create fall back to fsspec's check-then-write, which is *not*
    atomic: two runners can then both win a lease; a warning says so. Single-object writes
    are atomic on GCS and S3, so ``write`` needs no temp file.
    """

    ATOMIC_CREATE = frozenset({"gs", "gcs", "memory"})

    def __init__(self, url: str) -> None:
        import fsspec  # lazily: local runs need no fsspec at import time

        self.fs, _ = fsspec.core.url_to_fs(url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.atomic_create = bool(self.ATOMIC_CREATE.intersection(protocols))
        if not self.atomic_create:
            log.warning(
                "%s: no atomic exclusive create on %s; concurrent runners of one step may "
                "both acquire its lease",
                url,
                protocols,
            )

    def read(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def create(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def modified(self, path: str) -> float | None:
        try:
            return float(self.fs.modified(path).timestamp())
        except (OSError, NotImplementedError, AttributeError, ValueError):
            return None


def store_for(root: str) -> Store:
    if "://" not in root or root.startswith("file://"):
        return LocalStore()
    return FsspecStore(root)


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path
