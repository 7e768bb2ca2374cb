"""Paths that may be local or remote (``gs://``, ``hf://``...), through fsspec.

Every pipeline reads and writes through these helpers so the same code runs on a laptop
(local directories) and on Dataflow (``gs://`` buckets).
"""

from __future__ import annotations

import contextlib
import hashlib
import posixpath
import queue
import struct
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
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
    matches = fs.glob(pattern) if is_glob(pattern) else [pattern]
    found = []
    for match in matches:
        full = match if match.startswith(protocol) else protocol + match
        if fs.isfile(full):
            found.append(full)
    return sorted(found)


GLOB_CHARS = "*?["


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` holds a wildcard (``*``, ``?``, ``[``)."""
    return any(c in pattern for c in GLOB_CHARS)


def strip_protocol(path: str) -> str:
    """``path`` as its filesystem names it (``expand_glob``'s matches, less the protocol): a
    local path made absolute, an object's ``bucket/key``."""
    return fsspec.core.url_to_fs(path)[1]


def exists(path: str) -> bool:
    return filesystem(path).exists(path)


def makedirs(path: str) -> None:
    filesystem(path).makedirs(path, exist_ok=True)


def read_bytes(path: str) -> bytes:
    with fsspec.open(path, "rb") as handle:
        return handle.read()


@contextlib.contextmanager
def atomic_writer(path: str) -> Iterator[BinaryIO]:
    """A file written in pieces that readers see whole or not at all, never half of it.

    Local files are written under a temporary name and renamed; object stores (GCS) make a
    single-object upload atomic already. A failure leaves no file (locally, no temporary).
    """
    fs = filesystem(path)
    if "://" in path and not path.startswith("file://"):
        with fs.open(path, "wb") as handle:
            yield handle
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(tmp, "wb") as handle:
            yield handle
        fs.mv(tmp, path)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write a whole file so that readers see the old file or the new one, never half of one."""
    with atomic_writer(path) as handle:
        handle.write(data)


def _gunzip_chunks(raw: BinaryIO, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """Decompress gzip (multi-member too) incrementally.

    Unlike GzipFile, a truncated file still yields everything decoded before the cut, and then
    raises EOFError, so the caller can keep those records and dead-letter the rest; corrupt
    data (a bad block or checksum) likewise yields what came before it, then raises
    ValueError. Zero bytes after a complete member are padding, skipped as GzipFile skips them.
    """
    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    fed = False  # has the current member decoder seen any input?
    members = 0  # members decoded to their end
    while data := raw.read(chunk_size):
        while data:
            if members and not fed:
                data = data.lstrip(b"\x00")
                if not data:
                    break
            fed = True
            try:
                yield decoder.decompress(data)
            except zlib.error as err:
                raise ValueError(f"corrupt compressed data: {err}") from err
            if decoder.eof:
                data = decoder.unused_data
                decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
                fed = False
                members += 1
            else:
                data = b""
    if fed and not decoder.eof:
        raise EOFError("compressed file ended before the end-of-stream marker")


def iter_lines(path: str) -> Iterator[bytes]:
    """Raw non-blank lines (without the newline) of a text file, gunzipping ``.gz`` files."""
    for _, line in iter_numbered_lines(path):
        yield line


def iter_numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of the non-blank lines of ``iter_lines``, numbered as an
    editor numbers them (from 1, blank lines counted), so a dead letter's origin points at
    its line in the file."""
    with fsspec.open(path, "rb") as raw:
        chunks: Iterable[bytes] = (
            _gunzip_chunks(raw) if path.endswith(".gz") else iter(lambda: raw.read(1 << 20), b"")
        )
        pending = b""
        number = 0
        for chunk in chunks:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                number += 1
                if line.endswith(b"\r"):
                    line = line[:-1]
                if line.strip():
                    yield number, line
        if pending.strip():
            yield number + 1, pending.rstrip(b"\r")


# GzipFile(filename="", mtime=0, compresslevel=6)'s header: no flags, no time, no extra flags, OS
# "unknown". Written by hand so a file can be compressed as it streams (``GzipStream``).
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
GZIP_LEVEL = 6


class GzipStream:
    """Deterministic gzip, fed piece by piece: ``gzip_bytes`` of everything written, byte for
    byte, without holding it. Deflate without flushes depends only on the input bytes, not on
    how they were cut into pieces, so a streamed shard equals the one compressed at once.

    ``sink`` receives the compressed bytes as they come (a file's ``write``, a list's
    ``append``); the SHA-256 and size of what it received are kept for the shard's manifest.
    Writes are gathered into chunks of ``chunk_bytes``; with ``threaded`` a second thread
    compresses and sinks them (zlib and file writes release the GIL, so compression overlaps
    the caller's work; a bounded queue keeps at most a few chunks in flight).
    """

    def __init__(
        self,
        sink: Callable[[bytes], object],
        *,
        threaded: bool = False,
        chunk_bytes: int = 1 << 18,
    ) -> None:
        self._sink = sink
        self._deflate = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS, 8, 0)
        self._crc = 0
        self._size = 0
        self.sha256 = hashlib.sha256()
        self.compressed_bytes = 0
        self._chunk_bytes = chunk_bytes
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue[bytes | None] | None = None
        self._thread: threading.Thread | None = None
        self._emit(_GZIP_HEADER)
        if threaded:
            self._queue = queue.Queue(maxsize=4)
            self._thread = threading.Thread(target=self._drain, name="gzip-stream", daemon=True)
            self._thread.start()

    def _emit(self, data: bytes) -> None:
        if data:
            self.sha256.update(data)
            self.compressed_bytes += len(data)
            self._sink(data)

    def _compress(self, chunk: bytes) -> None:
        self._crc = zlib.crc32(chunk, self._crc)
        self._size += len(chunk)
        self._emit(self._deflate.compress(chunk))

    def _drain(self) -> None:
        assert self._queue is not None
        while (chunk := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._compress(chunk)
                except BaseException as err:  # handed to the writer's thread at finish
                    self._error = err

    def _submit(self) -> None:
        if not self._pending:
            return
        chunk = b"".join(self._pending)
        self._pending, self._pending_bytes = [], 0
        if self._queue is None:
            self._compress(chunk)
        else:
            self._queue.put(chunk)

    def write(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= self._chunk_bytes:
            self._submit()

    def _stop(self) -> None:
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def finish(self) -> None:
        self._submit()
        self._stop()
        if self._error is not None:
            raise self._error
        self._emit(self._deflate.flush())
        self._emit(struct.pack("<II", self._crc, self._size & 0xFFFFFFFF))

    def abandon(self) -> None:
        """Stop without finishing (after a failure): the compressing thread ends."""
        self._pending = []
        self._stop()


def gzip_bytes(data: bytes) -> bytes:
    """Deterministic gzip: no file name, no timestamp, fixed level."""
    parts: list[bytes] = []
    stream = GzipStream(parts.append)
    stream.write(data)
    stream.finish()
    return b"".join(parts)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
