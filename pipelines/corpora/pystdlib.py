"""The Python standard library's own source: a code corpus that ships with every interpreter.

Every ``*.py`` module under this interpreter's stdlib directory becomes one document, except
test suites (``test``/``tests``/``idle_test`` directories: mostly fixtures, and they would
dominate the corpus), installed third-party packages (``site-packages``), and the generated
``_sysconfigdata_*`` module, which records this machine's build paths and would make the
corpus differ between machines running the same Python version.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator
from pathlib import Path

from pipelines.documents import Document, make_document

SOURCE = "python-stdlib"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith(("config-", "lib-dynload"))


def module_paths(root: Path) -> list[str]:
    """Relative POSIX paths of the modules to keep, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        for filename in filenames:
            if filename.endswith(".py") and not filename.startswith("_sysconfigdata_"):
                found.append(Path(dirpath, filename).relative_to(root).as_posix())
    return sorted(found)


def read_source(path: Path) -> str:
    """Decode a module as Python itself would (PEP 263 coding cookie, else UTF-8)."""
    with path.open("rb") as handle:
        encoding, _ = tokenize.detect_encoding(handle.readline)
    return path.read_bytes().decode(encoding, errors="replace")


def module_name(relpath: str) -> str:
    parts = relpath[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def fingerprint(root: Path | None = None) -> str:
    """Changes when the interpreter or any kept module changes: the input's 'checksum'."""
    root = root or stdlib_dir()
    digest = hashlib.sha256(sys.version.encode())
    for relpath in module_paths(root):
        stat = (root / relpath).stat()
        digest.update(f"{relpath}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def iter_documents(root: Path | None = None) -> Iterator[Document]:
    root = root or stdlib_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    for relpath in module_paths(root):
        metadata = {
            "path": relpath,
            "module": module_name(relpath),
            "language": "python",
            "python_version": version,
        }
        text = read_source(root / relpath)
        yield make_document(f"{SOURCE}/{relpath}", text, SOURCE, metadata)


def convert(root: Path | None = None) -> list[Document]:
    return list(iter_documents(root))
