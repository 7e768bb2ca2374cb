"""The data plane end to end on the real corpora, with a summary: what `make demo` runs.

Each stage is invoked through its command-line entry point (`pipelines.<stage>.main(argv)`),
the same interface the Airflow operators use, so the demo exercises the real contract.

    python -m pipelines.demo --data-dir data --output out/demo [beam pipeline options]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.manifest import Manifest, read_manifest

log = logging.getLogger("pipelines.demo")

DEFAULT_CONFIG = Path(__file__).with_name("demo_config.json")


@dataclass(frozen=True)
class StageResult:
    name: str
    output: str
    manifest: Manifest
    seconds: float


def _run(
    name: str, main: Callable[[Sequence[str]], Any], argv: list[str], output: Path
) -> StageResult:
    log.info("== %s", name)
    started = time.monotonic()
    main([*argv, "--output", str(output)])
    return StageResult(name, str(output), read_manifest(str(output)), time.monotonic() - started)


def run_data_plane(
    data_dir: Path,
    output: Path,
    config: dict[str, Any],
    beam_args: Sequence[str] = (),
    *,
    raw: dict[str, str] | None = None,
    eval_sets: dict[str, str] | None = None,
) -> list[StageResult]:
    """Run every stage in order; ``raw``/``eval_sets`` default to the fetched corpora."""
    from pipelines import (
        decontaminate,
        exact_dedup,
        fuzzy_dedup,
        ingest,
        quality,
        tokenize,
        train_tokenizer,
    )
    from pipelines.corpora import fetch

    if raw is None:
        raw = fetch.fetch_all(data_dir)
    if eval_sets is None:
        eval_sets = fetch.eval_paths(data_dir)
    beam = list(beam_args)

    def cfg(stage: str) -> list[str]:
        return ["--config", json.dumps(config.get(stage, {}))]

    results = []
    inputs = [arg for path in sorted(raw.values()) for arg in ("--input", str(path))]
    results.append(_run("ingest", ingest.main, [*inputs, *cfg("ingest"), *beam], output / "ingest"))
    previous = output / "ingest"
    for name, module in (
        ("quality", quality),
        ("exact_dedup", exact_dedup),
        ("fuzzy_dedup", fuzzy_dedup),
    ):
        argv = ["--input", str(previous), *cfg(name), *beam]
        results.append(_run(name, module.main, argv, output / name))
        previous = output / name
    evals = [arg for path in sorted(eval_sets.values()) for arg in ("--eval_set", str(path))]
    argv = ["--input", str(previous), *evals, *cfg("decontaminate"), *beam]
    results.append(_run("decontaminate", decontaminate.main, argv, output / "decontaminate"))
    clean = output / "decontaminate"
    argv = ["--input", str(clean), *cfg("train_tokenizer"), *beam]
    results.append(_run("train_tokenizer", train_tokenizer.main, argv, output / "tokenizer"))
    argv = [
        "--input",
        str(clean),
        "--tokenizer",
        str(output / "tokenizer"),
        *cfg("tokenize"),
        *beam,
    ]
    results.append(_run("tokenize", tokenize.main, argv, output / "tokens"))
    return results


def format_summary(results: Sequence[StageResult]) -> str:
    lines = [
        f"{'stage':<16}{'in':>9}{'out':>9}{'dropped':>9}  {'seconds':>8}  drop reasons",
        "-" * 100,
    ]
    for r in results:
        m = r.manifest
        ranked = sorted(m.dropped.items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = ", ".join(f"{k}={v}" for k, v in ranked[:4])
        if len(ranked) > 4:
            reasons += f", +{len(ranked) - 4} more reasons (see manifest.json)"
        lines.append(
            f"{r.name:<16}{m.records_in:>9}{m.records_out:>9}{sum(m.dropped.values()):>9}"
            f"  {r.seconds:>8.1f}  {reasons}"
        )
    for r in results:
        for key in ("num_tokens", "vocab_size", "tokenizer_sha256"):
            if key in r.manifest.extra:
                lines.append(f"{r.name}: {key} = {r.manifest.extra[key]}")
    lines.append("")
    lines.extend(f"{r.name:<16}{r.output}" for r in results)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    from pipelines.stage import setup_logging

    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--output", type=Path, default=Path("out/demo"))
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="per-stage configs")
    args, beam_args = parser.parse_known_args(argv)
    config = json.loads(args.config.read_text())
    results = run_data_plane(args.data_dir, args.output, config, beam_args)
    print()
    print(format_summary(results))


if __name__ == "__main__":
    main()
