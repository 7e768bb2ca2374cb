"""The one harness every data-plane stage runs in: read -> transform -> write, with accounting.

:func:`run_pipeline` owns what every stage shares: the checks and options of a run
(:func:`prepare_run`), one Beam pipeline, the dead letters (every record not kept, with its
reason) written as deterministic shards and counted by reason, a single final step that writes
the manifest proving nothing was lost, and the log line. What differs is the **output
strategy**, which reads the inputs, runs the stage's ``build`` and says what the manifest
records:

* :class:`DocumentShards` (this module) -- the document stages: ``build(records, config)``
  returns kept documents (written as deterministic shards) and dead letters;
* :class:`~pipelines.artifact_stage.FinalizedArtifact` -- the tokenizer and the token store:
  the workers write parts and one final step assembles the artifact (trains the tokenizer,
  writes the token store's ledger) once the counts are checked.

Every stage module exposes ``main(argv)`` (:func:`command_line`) so it runs on its own as
``python -m pipelines.<stage> --input ... --output ... [beam pipeline options]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import logging
import os
import posixpath
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import apache_beam as beam
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions
from apache_beam.runners.runner import PipelineRunner

from pipelines import storage
from pipelines.beam_io import (
    DEAD,
    HF_PREFIX,
    RECORDS,
    InputError,
    ParseDocuments,
    ReadRecords,
    glob_files,
    hf_hub_name,
    no_files_message,
    parse_hf_spec,
    write_dead_letters,
    write_documents,
)
from pipelines.configs import ConfigError, build_config
from pipelines.manifest import Manifest, ShardInfo, read_manifest

log = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")


@dataclasses.dataclass
class StageOutputs:
    """What a stage's ``build`` returns: kept documents, dead letters, optional manifest extras."""

    kept: beam.PCollection
    dropped: beam.PCollection
    extra: beam.PCollection | None = None  # dicts merged into the manifest's ``extra``


Build = Callable[[beam.PCollection, Any], StageOutputs]

DEFAULT_SHARDS = 4


class StageError(RuntimeError):
    """A stage could not run: bad options, bad config, or missing input."""


def config_from_args(config_type: type[ConfigT], text: str | None) -> ConfigT:
    """Build a frozen config dataclass from JSON (inline or ``@file``); unknown keys are errors."""
    if not text:
        return config_type()
    if text.startswith("@"):
        text = storage.read_bytes(text[1:]).decode("utf-8")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise StageError(f"--config is not valid JSON: {err}") from None
    return config_from_mapping(config_type, values)


def config_from_mapping(config_type: type[ConfigT], values: Mapping[str, Any]) -> ConfigT:
    """:func:`pipelines.configs.build_config`, its errors as :class:`StageError`."""
    try:
        return build_config(config_type, values)
    except ConfigError as err:
        raise StageError(str(err)) from None


def pipeline_options(beam_args: Sequence[str]) -> PipelineOptions:
    options = PipelineOptions(list(beam_args))
    standard = options.view_as(StandardOptions)
    if not standard.runner:
        standard.runner = "DirectRunner"
    direct = options.view_as(DirectOptions)
    if direct.direct_running_mode == "multi_threading":
        # Seen to lose records in GroupByKey on Beam 2.77; we refuse rather than risk it.
        raise StageError(
            "direct_running_mode=multi_threading is not supported (it has been seen to lose"
            " records); use in_memory or multi_processing"
        )
    return options


def pipeline_runner(options: PipelineOptions) -> str | PipelineRunner:
    """The runner a stage's pipeline gets: for ``DirectRunner``, Beam's in-process
    ``FnApiRunner``, built as Beam's DirectRunner builds it; any other runner by its name.

    Beam 2.77's DirectRunner first tries Prism, a Go runner it downloads from GitHub: with
    network access a "local" stage would run on a fetched binary in another process, and
    offline each stage spends ~0.5 s converting the pipeline for Prism before falling back to
    the FnApiRunner. Slipway's local runs are the FnApiRunner, whatever the network.
    """
    name = options.view_as(StandardOptions).runner
    if not _is_direct_runner(name):
        return name
    # Imported here: the Dataflow path does not need the local runner's modules.
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    info = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(info))


def _is_direct_runner(name: str) -> bool:
    """Whether Beam would read ``name`` as its DirectRunner: any case, with or without the
    "Runner" suffix, or by its module path (as ``apache_beam.runners.runner.create_runner``)."""
    module, _, short = name.rpartition(".")
    if module and module != "apache_beam.runners.direct.direct_runner":
        return False
    key = short.lower().removesuffix("runner")
    return key in ("direct", "switchingdirect")


def _count_reasons(letters: Sequence[beam.PCollection]) -> beam.PCollection:
    reasons = [
        part | f"Reason{i}" >> beam.Map(lambda letter: letter["reason"])
        for i, part in enumerate(letters)
    ]
    return (
        reasons
        | "AllReasons" >> beam.Flatten()
        | "CountReasons" >> beam.combiners.Count.PerElement()
    )


def write_document_manifest(
    _: Any,
    output: str,
    stage: str,
    config: Mapping[str, Any],
    inputs: list[str],
    records_in: int,
    reasons: Mapping[str, int],
    shards: list[dict[str, Any]],
    dead_shards: list[dict[str, Any]],
    extra: list[Mapping[str, Any]],
) -> None:
    merged_extra: dict[str, Any] = {}
    for item in extra:
        merged_extra.update(item)
    manifest = Manifest(
        stage=stage,
        config=dict(config),
        inputs=list(inputs),
        records_in=records_in,
        records_out=sum(s["records"] for s in shards),
        dropped=dict(sorted(reasons.items())),
        shards=sorted((ShardInfo(**s) for s in shards), key=lambda s: s.path),
        dead_letter_shards=sorted((ShardInfo(**s) for s in dead_shards), key=lambda s: s.path),
        extra=dict(sorted(merged_extra.items())),
    )
    manifest.write(output)


@dataclasses.dataclass(frozen=True)
class StageRun:
    """What one stage run produced; ``manifest`` is the authoritative record."""

    output: str
    manifest: Manifest
    seconds: float


def clear_output(output: str) -> None:
    """Remove what a previous run left, so stale shards never mix with new ones."""
    fs = storage.filesystem(output)
    if fs.exists(output):
        if "://" in output:
            fs.rm(output, recursive=True)
        else:
            shutil.rmtree(output)
    storage.makedirs(output)


def _matches(spec: str) -> bool:
    """Whether a file, folder or glob input names anything (local or on an object store); a
    glob's matches in ``dead_letter/`` folders do not count (``beam_io.glob_files``)."""
    if storage.is_glob(spec):
        return bool(glob_files(spec))
    return storage.exists(spec)


# Config fields that name paths a stage reads besides its inputs: decontamination's eval sets,
# tokenize's tokenizer. Clearing the output must not delete them either.
READ_PATH_FIELDS = ("eval_sets", "tokenizer")


def _normalized(path: str, url: bool) -> str:
    if url:  # an object store has no symlinks and no current folder
        path = posixpath.normpath(path) if path else ""
        return "" if path == "." else path
    return os.path.realpath(path or ".")


def comparable_path(spec: str) -> tuple[str, bool]:
    """``(location, is_glob)``: a path or URL spelled one way, to compare locations. Local
    paths are absolute with symlinks resolved, URLs normalized (``gs://b/x/../y/`` is
    ``gs://b/y``), an ``hf:`` spec is its dataset name or folder. A glob is the literal text
    before its first wildcard (its folders normalized): every match starts with it."""
    if spec.startswith(HF_PREFIX):
        spec = parse_hf_spec(spec)[0]
    scheme, separator, rest = spec.partition("://")
    if not separator or scheme == "file":
        scheme, rest = "", rest if separator else spec
    url = f"{scheme}://" if scheme else ""
    wildcards = [rest.index(c) for c in storage.GLOB_CHARS if c in rest]
    if not wildcards:
        return url + _normalized(rest, bool(url)), False
    head = rest[: min(wildcards)]
    folder, tail = (
        (head[: head.rindex("/")] or "/", head.rsplit("/", 1)[1]) if "/" in head else ("", head)
    )
    folder = _normalized(folder, bool(url))
    return url + (f"{folder.rstrip('/')}/{tail}" if folder else tail), True


def _hf_hub_spec(spec: str) -> bool:
    """Whether ``spec`` is ``hf:NAME[:CONFIG][@SPLIT]`` naming a Hub dataset (no local path)."""
    return spec.startswith(HF_PREFIX) and hf_hub_name(parse_hf_spec(spec)[0])


def overlaps(output: str, spec: str) -> bool:
    """Whether clearing ``output`` could delete what ``spec`` names, or ``output`` lies where
    ``spec`` reads: the same location, one inside the other, or (a glob) a match inside the
    output or the output where a match could be. A Hub dataset (``hf:org/name``) is no local
    path: it overlaps nothing (``beam_io.hf_hub_name``; it is then read from the Hub only)."""
    if _hf_hub_spec(spec):
        return False
    out, _ = comparable_path(output)
    where, is_glob = comparable_path(spec)
    if is_glob:
        return out.startswith(where) or where.startswith(out.rstrip("/") + "/")
    return (
        out == where
        or out.startswith(where.rstrip("/") + "/")
        or where.startswith(out.rstrip("/") + "/")
    )


def check_output_apart(
    stage: str, output: str, inputs: Sequence[str], reads: Sequence[str] = ()
) -> None:
    """Refuse an output that is, holds or lies inside anything the stage reads: clearing it
    would delete the stage's own input (``--input X --output X``, ``--output out --input
    out/ingest``), and an output inside a folder input would be read by the next run."""
    for spec in [*inputs, *reads]:
        if overlaps(output, spec):
            raise StageError(
                f"{stage}: --output {output!r} overlaps {spec!r}, which the stage reads (the same"
                " location, or one inside the other): clearing the output would delete it;"
                " write the output somewhere else"
            )


def config_read_fields(config: Any) -> list[tuple[str, str]]:
    """``(field, path)`` for each path a stage's config names for it to read
    (``READ_PATH_FIELDS``)."""
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    paths: list[tuple[str, str]] = []
    for field in READ_PATH_FIELDS:
        value = values.get(field)
        if isinstance(value, str):
            paths.extend([(field, value)] if value else [])
        elif isinstance(value, list | tuple):
            paths.extend((field, p) for p in value if isinstance(p, str) and p)
    return paths


def config_read_paths(config: Any) -> list[str]:
    """The paths a stage's config names for it to read (``READ_PATH_FIELDS``)."""
    return [path for _, path in config_read_fields(config)]


def check_reads(stage: str, config: Any) -> None:
    """Refuse, before the output is cleared, a run without a path its config requires
    (``REQUIRED_READS``: decontamination's eval sets, tokenize's tokenizer) or with a read
    path that names nothing; the error names the field."""
    given = config_read_fields(config)
    required: Mapping[str, str] = getattr(config, "REQUIRED_READS", {})
    for field, usage in required.items():
        if not any(name == field for name, _ in given):
            raise StageError(f"{stage}: {field} is required ({usage})")
    for field, path in given:
        if not path.startswith(HF_PREFIX) and not _matches(path):
            raise StageError(f"{stage}: {field} {path!r} matches no files")


def prepare_run(
    stage: str,
    inputs: Sequence[str],
    output: str,
    num_shards: int,
    beam_args: Sequence[str],
    reads: Sequence[str] = (),
) -> PipelineOptions:
    """Checks shared by every stage run; returns the Beam options. ``reads``: what the stage
    reads besides its inputs (``config_read_paths``), kept apart from the output. The output
    is not touched: :func:`run_pipeline` clears it once the pipeline is built, so that what a
    stage finds missing while building (its tokenizer's model, say) leaves the last output as
    it was."""
    if not inputs:
        raise StageError(f"{stage}: at least one --input is required")
    if num_shards < 1:
        raise StageError(f"{stage}: --num_shards must be >= 1")
    options = pipeline_options(beam_args)
    check_output_apart(stage, output, inputs, reads)
    for spec in inputs:  # before the output is cleared: a mistyped input keeps the last one
        if not spec.startswith(HF_PREFIX) and not _matches(spec):
            raise StageError(f"{stage}: {no_files_message(spec)}")
    return options


def log_finished(stage: str, manifest: Manifest, seconds: float) -> None:
    log.info(
        "stage %s: %d in, %d out, dropped %s (%.1fs)",
        stage,
        manifest.records_in,
        manifest.records_out,
        dict(manifest.dropped),
        seconds,
    )


@dataclasses.dataclass(frozen=True)
class Planned:
    """What an output strategy added to the pipeline, for the harness to finish.

    ``records_in``: one int, the records read (readable or not); ``dead``: every dead-letter
    collection; ``finish(_, *, output, stage, config, inputs, records_in, reasons,
    dead_shards, **sides)`` writes the manifest, run once after everything else with
    ``sides`` (Beam side inputs) as keyword arguments.
    """

    records_in: beam.PCollection
    dead: Sequence[beam.PCollection]
    finish: Callable[..., None]
    sides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class OutputStrategy(Protocol):
    """How a stage reads its inputs, runs its ``build`` and records its output."""

    def expand(
        self,
        pipeline: beam.Pipeline,
        stage: str,
        config: Any,
        inputs: list[str],
        output: str,
        num_shards: int,
    ) -> Planned: ...


def run_pipeline(
    stage: str,
    strategy: OutputStrategy,
    config: Any,
    inputs: Sequence[str],
    output: str,
    *,
    num_shards: int = DEFAULT_SHARDS,
    beam_args: Sequence[str] = (),
) -> StageRun:
    """Run one stage as one Beam pipeline and return its manifest."""
    options = prepare_run(stage, inputs, output, num_shards, beam_args, config_read_paths(config))
    check_reads(stage, config)
    config_dict = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    started = time.monotonic()
    # A caller may have frozen the heap already (Airflow's LocalExecutor does before it forks
    # its workers): then it stays as the caller left it, as thawing is all or nothing.
    thaw = gc.get_freeze_count() == 0
    try:
        with beam.Pipeline(runner=pipeline_runner(options), options=options) as pipeline:
            _build(pipeline, stage, strategy, config, config_dict, inputs, output, num_shards)
            # Built: every input and read path was found. Only now is the last output removed
            # (the pipeline runs as the block closes).
            clear_output(output)
            log.info("stage %s: reading %s, writing %s", stage, list(inputs), output)
            # Runs as the block closes. What exists now (Beam, the pipeline graph, the
            # caller's objects) outlives the run: the collector's full collections during
            # the run need not re-scan it (~200k objects, ~0.5 s of a 12 s stage).
            gc.freeze()
    finally:
        if thaw:
            gc.unfreeze()
    manifest = read_manifest(output)
    seconds = time.monotonic() - started
    log_finished(stage, manifest, seconds)
    return StageRun(output, manifest, seconds)


def _build(
    pipeline: beam.Pipeline,
    stage: str,
    strategy: OutputStrategy,
    config: Any,
    config_dict: dict[str, Any],
    inputs: Sequence[str],
    output: str,
    num_shards: int,
) -> None:
    """The stage's transforms, its dead-letter shards and its manifest step."""
    planned = strategy.expand(pipeline, stage, config, list(inputs), output, num_shards)
    dead = tuple(planned.dead)  # not flattened: each part is written where it is made
    dead_shards = write_dead_letters(dead, output, num_shards)
    reasons = _count_reasons(dead)
    (
        pipeline
        | "Once" >> beam.Create([None])
        | "Manifest"
        >> beam.Map(
            planned.finish,
            output=output,
            stage=stage,
            config=config_dict,
            inputs=list(inputs),
            records_in=beam.pvalue.AsSingleton(planned.records_in),
            reasons=beam.pvalue.AsDict(reasons),
            dead_shards=beam.pvalue.AsList(dead_shards),
            **planned.sides,
        )
    )


@dataclasses.dataclass(frozen=True)
class DocumentShards:
    """The document stages' output: kept documents as deterministic shards.

    ``raw_records`` hands ``build`` the undecoded ``(origin, object)`` pairs (ingest needs
    them: raw records have no ids yet); other stages get validated documents.
    """

    build: Build
    raw_records: bool = False

    def expand(
        self,
        pipeline: beam.Pipeline,
        stage: str,
        config: Any,
        inputs: list[str],
        output: str,
        num_shards: int,
    ) -> Planned:
        read = pipeline | "ReadInputs" >> ReadRecords(inputs)
        records_in = read[RECORDS] | "CountRecords" >> beam.combiners.Count.Globally()
        unreadable_in = read[DEAD] | "CountUnreadable" >> beam.combiners.Count.Globally()
        total_in = (
            (records_in, unreadable_in)
            | "InCounts" >> beam.Flatten()
            | "RecordsIn" >> beam.CombineGlobally(sum)
        )
        if self.raw_records:
            built = self.build(read[RECORDS], config)
            dead = [read[DEAD], built.dropped]
        else:
            parsed = read[RECORDS] | "Parse" >> ParseDocuments(stage)
            built = self.build(parsed[RECORDS], config)
            dead = [read[DEAD], built.dropped, parsed[DEAD]]
        extra = built.extra
        if extra is None:
            extra = pipeline | "NoExtra" >> beam.Create([], reshuffle=False)
        shards = write_documents(built.kept, output, num_shards)
        return Planned(
            records_in=total_in,
            dead=dead,
            finish=write_document_manifest,
            sides={"shards": beam.pvalue.AsList(shards), "extra": beam.pvalue.AsList(extra)},
        )


def run_stage(
    stage: str,
    build: Build,
    config: Any,
    inputs: list[str],
    output: str,
    *,
    num_shards: int = DEFAULT_SHARDS,
    beam_args: Sequence[str] = (),
    raw_records: bool = False,
) -> StageRun:
    """Run one document stage (:class:`DocumentShards`) and return its manifest."""
    return run_pipeline(
        stage,
        DocumentShards(build, raw_records),
        config,
        inputs,
        output,
        num_shards=num_shards,
        beam_args=beam_args,
    )


def setup_logging() -> None:
    """INFO for our stages, WARNING for Beam's own chatter (type-hint notes per transform)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Importing Beam may already have configured the root logger (at WARNING), which makes
    # basicConfig a no-op; lower the level only, keeping whatever handlers a caller set up.
    if logging.getLogger().level > logging.INFO:
        logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    # Except the line DataflowRunner logs once the job exists ("Created job with id: [...]"):
    # the Beam stage hook reads the job id from it, to follow and cancel the job.
    logging.getLogger("apache_beam.runners.dataflow.internal.apiclient").setLevel(logging.INFO)


def stage_argument_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        help="stage output dir, JSONL/Parquet glob (local or gs://), or hf:NAME[:CONFIG][@SPLIT];"
        " repeatable",
    )
    parser.add_argument("--output", required=True, help="output directory (local or gs://)")
    parser.add_argument(
        "--config", default=None, help="stage config as JSON, or @path to a JSON file"
    )
    parser.add_argument("--num_shards", type=int, default=DEFAULT_SHARDS)
    return parser


def command_line(
    stage: str,
    description: str,
    config_type: type,
    execute: Callable[[Any, argparse.Namespace, list[str]], StageRun],
    argv: Sequence[str] | None = None,
    *,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    apply_arguments: Callable[[Any, argparse.Namespace], Any] | None = None,
) -> StageRun:
    """The command line every stage shares; unknown flags are Beam pipeline options.

    ``add_arguments(parser)`` adds stage flags; ``apply_arguments(config, args)`` folds them
    into the config, so the manifest records them like any other setting. Errors a user can
    fix exit with status 2 and one line, not a traceback.
    """
    setup_logging()
    parser = stage_argument_parser(description)
    if add_arguments is not None:
        add_arguments(parser)
    args, beam_args = parser.parse_known_args(argv)
    try:
        config = config_from_args(config_type, args.config)
        if apply_arguments is not None:
            config = apply_arguments(config, args)
        run = execute(config, args, beam_args)
    except (StageError, FileNotFoundError, InputError) as err:
        parser.exit(2, f"{stage}: error: {err}\n")
    print(run.manifest.to_json(), end="")
    return run


def run_as_command(main: Callable[[], object]) -> None:
    """A stage module's ``__main__``: ``main()`` in a process that ends with the stage.

    What is left when the stage is done is moved out of the garbage collector's sight
    (``gc.freeze``): the interpreter's exit would otherwise scan its ~200k objects in several
    full collections (~0.4 s). Only for a process that exits after the stage: in a long-lived
    one (the Airflow hook calls ``main`` directly), frozen garbage would never be freed.

    Run as ``python -m pipelines.<stage>``, the stage's module is ``__main__``, and Beam
    pickles what the pipeline holds: cloudpickle pickles ``__main__``'s functions and classes
    by value, and refers to what it cannot (a ``functools.cache`` wrapper) as
    ``__main__.<name>``, which a worker process (Dataflow's, a multi-process DirectRunner's)
    cannot find in its own ``__main__``. So ``main`` is taken from the module under its
    importable name (``pipelines.<stage>``), whose objects pickle by reference.
    """
    main = _importable(main)
    main()
    gc.freeze()


def _importable(main: Callable[[], object]) -> Callable[[], object]:
    """``main`` as its module's importable name holds it (itself unless run as a script)."""
    if getattr(main, "__module__", None) != "__main__":
        return main
    spec = getattr(main, "__globals__", {}).get("__spec__")  # runpy sets it, as ``-m`` does
    if spec is None or spec.name in ("__main__", ""):  # a file run by path: nothing to import
        return main
    return getattr(importlib.import_module(spec.name), main.__name__)


def stage_main(
    stage: str,
    description: str,
    config_type: type,
    build: Build | OutputStrategy,
    argv: Sequence[str] | None = None,
    raw_records: bool = False,
    *,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    apply_arguments: Callable[[Any, argparse.Namespace], Any] | None = None,
) -> StageRun:
    """Command-line entry of a stage: a document stage's ``build``, or any output strategy."""
    strategy = build if hasattr(build, "expand") else DocumentShards(build, raw_records)

    def execute(config: Any, args: argparse.Namespace, beam_args: list[str]) -> StageRun:
        return run_pipeline(
            stage,
            strategy,
            config,
            args.input,
            args.output,
            num_shards=args.num_shards,
            beam_args=beam_args,
        )

    return command_line(
        stage,
        description,
        config_type,
        execute,
        argv,
        add_arguments=add_arguments,
        apply_arguments=apply_arguments,
    )
