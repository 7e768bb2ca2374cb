"""Paths that may be local or remote (``gs://``, ``hf://``...), through fsspec.

Every pipeline reads and writes through these helpers so the same code runs on a laptop
(local directories) and on Dataflow (``gs://`` buckets).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import posixpath
from collections.abc import Iterator

import fsspec


def join(base: str, *parts: str) -> str:
    if "://" in base:
        return posixpath.join(base, *parts)
    import os

    return os.path.join(base, *parts)


def filesystem(path: str) -> fsspec.AbstractFileSystem:
    fs, _ = fsspec.core.url_to_fs(path)
    return fs


def expand_glob(pattern: str) -> list[str]:
    """Sorted matches of a glob (a plain path matches itself), with the protocol kept."""
    fs, _ = fsspec.core.url_to_fs(pattern)
    protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
    matches = fs.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]
    found = []
    for match in matches:
        full = match if match.startswith(protocol) else protocol + match
        if fs.isfile(full):
            found.append(full)
    return sorted(found)


def exists(path: str) -> bool:
    return filesystem(path).exists(path)


def makedirs(path: str) -> None:
    filesystem(path).makedirs(path, exist_ok=True)


def read_bytes(path: str) -> bytes:
    with fsspec.open(path, "rb") as handle:
        return handle.read()


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write a whole file so that readers see the old file or the new one, never half of one."""
    fs = filesystem(path)
    if "://" in path and not path.startswith("file://"):
        # Object stores (GCS) make single-object uploads atomic already.
        with fs.open(path, "wb") as handle:
            handle.write(data)
        return
    tmp = f"{path}.tmp-{hashlib.sha1(data).hexdigest()[:8]}"
    with fs.open(tmp, "wb") as handle:
        handle.write(data)
    fs.mv(tmp, path)


def iter_lines(path: str) -> Iterator[bytes]:
    """Raw lines (without the newline) of a text file, gunzipping ``.gz`` files."""
    with fsspec.open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        buffered = io.BufferedReader(stream) if path.endswith(".gz") else stream
        for line in buffered:
            line = line.rstrip(b"\n")
            if line.endswith(b"\r"):
                line = line[:-1]
            if line.strip():
                yield line


def gzip_bytes(data: bytes) -> bytes:
    """Deterministic gzip: no file name, no timestamp, fixed level."""
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return out.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
