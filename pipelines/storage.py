"""Paths that may be local or remote (``gs://``, ``hf://``...), through fsspec.

Every pipeline reads and writes through these helpers so the same code runs on a laptop
(local directories) and on Dataflow (``gs://`` buckets).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import posixpath
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

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


def _gunzip_chunks(raw: BinaryIO, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """Decompress gzip (multi-member too) incrementally.

    Unlike GzipFile, a truncated file still yields everything decoded before the cut, and then
    raises EOFError, so the caller can keep those records and dead-letter the rest.
    """
    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    fed = False  # has the current member decoder seen any input?
    while data := raw.read(chunk_size):
        while data:
            fed = True
            yield decoder.decompress(data)
            if decoder.eof:
                data = decoder.unused_data
                decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
                fed = False
            else:
                data = b""
    if fed and not decoder.eof:
        raise EOFError("compressed file ended before the end-of-stream marker")


def iter_lines(path: str) -> Iterator[bytes]:
    """Raw non-blank lines (without the newline) of a text file, gunzipping ``.gz`` files."""
    with fsspec.open(path, "rb") as raw:
        chunks: Iterable[bytes] = (
            _gunzip_chunks(raw) if path.endswith(".gz") else iter(lambda: raw.read(1 << 20), b"")
        )
        pending = b""
        for chunk in chunks:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.endswith(b"\r"):
                    line = line[:-1]
                if line.strip():
                    yield line
        if pending.strip():
            yield pending.rstrip(b"\r")


def gzip_bytes(data: bytes) -> bytes:
    """Deterministic gzip: no file name, no timestamp, fixed level."""
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return out.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
