"""A training run's output directory: one owner of its layout, for the trainer and its readers.

    <output_dir>/
        config.json                 the resolved config (model, mesh, devices, FLOPs/token)
        metrics.jsonl               one JSON object per logged step; a resumed run logs the
                                    steps after its checkpoint again: the last line per step wins
        result.json                 status, steps, final loss, start step, error, exit code
        checkpoints/step-NNNNNNNNN/ one checkpoint (trainer/checkpoint.py writes its insides);
            commit.json             written last: a checkpoint exists only once this does
        eval/step-NNNNNNNNN.json    trainer.evaluate's default output

The trainer writes these; the operators (which never import JAX) read them to follow a run,
find where it resumes, and record it. Standard library and fsspec only; paths may be local or
``gs://``.
"""

from __future__ import annotations

import json
import re
from typing import Any

CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULT = "result.json"
CHECKPOINTS = "checkpoints"
COMMIT = "commit.json"
EVAL = "eval"
STEP_DIR_RE = re.compile(r"step-([0-9]{9})")


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def step_dir(checkpoints: str, step: int) -> str:
    """One checkpoint's folder under a run's ``checkpoints/`` folder."""
    return join(checkpoints, step_name(step))


def checkpoints_dir(output_dir: str) -> str:
    return join(output_dir, CHECKPOINTS)


def eval_path(output_dir: str, step: int) -> str:
    return join(output_dir, EVAL, f"{step_name(step)}.json")


def committed_steps(checkpoints: str) -> list[tuple[int, dict[str, Any]]]:
    """The committed checkpoints under ``checkpoints`` with their commit records, oldest
    first (a folder without ``commit.json`` is a save that did not finish: not a checkpoint)."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(checkpoints)
    if not fs.exists(base):
        return []
    found = []
    for entry in fs.ls(base, detail=False):
        match = STEP_DIR_RE.fullmatch(entry.rstrip("/").rsplit("/", 1)[-1])
        commit = f"{entry.rstrip('/')}/{COMMIT}"
        if match and fs.exists(commit):
            with fs.open(commit, "r") as f:
                found.append((int(match.group(1)), json.load(f)))
    return sorted(found, key=lambda item: item[0])


def last_checkpoint(output_dir: str) -> tuple[int, str] | None:
    """(step, folder) of a run's newest committed checkpoint, or None."""
    steps = committed_steps(checkpoints_dir(output_dir))
    if not steps:
        return None
    step = steps[-1][0]
    return step, step_dir(checkpoints_dir(output_dir), step)


def read_json(path: str) -> dict[str, Any] | None:
    """A JSON file of the run (``config.json``, ``result.json``), None while it is missing or
    half-written."""
    import fsspec

    try:
        with fsspec.open(path, "r") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def trained_vocab_size(output_dir: str) -> int | None:
    """The vocabulary the run's model was built with (``config.json``'s resolved model), None
    before the trainer wrote it."""
    body = read_json(join(output_dir, CONFIG)) or {}
    vocab = (body.get("model") or {}).get("vocab_size")
    return int(vocab) if vocab else None


def trained_tokenizer_sha256(output_dir: str) -> str | None:
    """The sha256 of the tokenizer that made the run's training stores (``config.json``), None
    before the trainer wrote it, or for a run trained before it was recorded."""
    return (read_json(join(output_dir, CONFIG)) or {}).get("tokenizer_sha256")


def read_result(output_dir: str) -> dict[str, Any] | None:
    return read_json(join(output_dir, RESULT))


def metrics_size(output_dir: str) -> int:
    """Bytes of ``metrics.jsonl`` so far (0 before the first line): where the lines a new
    attempt logs begin, for :func:`read_metrics` ``since``."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(join(output_dir, METRICS))
    try:
        return int(fs.size(path))
    except FileNotFoundError:
        return 0


def read_metrics(output_dir: str, since: int = 0) -> list[dict[str, Any]]:
    """``metrics.jsonl`` by step, the last line per step winning (a resume logs steps again);
    a line being written is skipped. ``since``: only the lines from that byte offset
    (:func:`metrics_size`), those of the attempts after it."""
    import fsspec

    try:
        with fsspec.open(join(output_dir, METRICS), "rb") as f:
            f.seek(since)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]
