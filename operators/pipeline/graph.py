"""The run's step graph: a pure function of the run form and the corpora's content.

:mod:`operators.pipeline` says which tasks there are and what each reads; this module gives
each task its content-addressed steps (Marin's executor, on Airflow). A step's version covers
what it computes (stage config, raw input content, upstream versions); how it runs (runner,
workers, accelerator, backend, fault injection) is unversioned.

Raw inputs enter the versions by *content* (sha256), not only by path: refetched corpora with
new bytes give new versions, unchanged ones keep every downstream cache hit.

Resolved once per DAG run: the ``fetch`` task hashes the corpora and writes the resolved graph
(content ids and every step's key) to the run's folder (:func:`write_resolved`) and lineage;
every later task rebuilds the graph from the form with those ids (:func:`graph_for_run`), so
versions agree across tasks, processes and machines and no task hashes a corpus file again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from operators.pipeline import DOCUMENT_STAGES, definition
from operators.settings import data_dir
from operators.steps import Step, join, output_of
from trainer.tasks import TASK_NAMES, TASKS

log = logging.getLogger(__name__)

# What each stage's output is, for lineage.
DATASET, TOKENIZER, TOKEN_STORE = "dataset", "tokenizer", "token_store"
EVAL_SAMPLES = 5  # greedy completions of trainer.evaluate's fixed prompts, in every run
EVAL_STORES = ("lambada",)  # eval sets tokenized as held-out prose (data/eval/<name>.jsonl.gz)
EVAL_STORE_PREFIX = "eval-"  # eval sets tokenized as held-out stores: eval-<name>
# What a step computes beyond the config its version hashes: its code, and the defaults of
# the config it does not spell out (the stage config dataclasses in pipelines/configs.py, the
# trainer's TrainConfig and presets). Bump a step's number when a change to either changes
# what it writes, so that runs stop reusing outputs computed the old way: its version, and
# every downstream version, changes. 0 enters no version (the versions from before these
# numbers stand). tests/unit/test_step_versions.py fails when a default changes without a bump.
OUTPUT_VERSIONS: dict[str, int] = {
    # Not bumped for strict JSON (cd6a2f1: a NaN or infinite metadata float is written as the
    # string "NaN", not the bare NaN): only corpora holding such floats change, and stages
    # read either spelling (json.loads), so an output cached the old way stays readable
    "ingest": 0,
    # 1: alpha_word_fraction counts letters as str.isalpha (½, ², Ⅻ are none)
    "quality": 1,
    # 1: a text with no word character is compared as it is; removal keeps the text's layout
    "exact_dedup": 1,
    "fuzzy_dedup": 0,
    # 1: eval texts normalized as ingest normalizes the corpus
    "decontaminate": 1,
    # 1: the sample's lines as the trainer reads them (no blank piece, no carriage return)
    "train_tokenizer": 1,
    # 1: the ledger records num_bytes (UTF-8 bytes of the tokenized texts: bits per byte)
    "tokenize": 1,
    "split": 0,
    "train": 0,
    # 1: an MoE model's padding takes no expert capacity; non-finite metrics kept as null
    # 2: bfloat16 runs score with float32 logits (no ties from rounding); bits per byte
    # counts a piece by its token type (a code piece "<>" is two bytes); tasks count the
    # examples whose context was cut to fit seq_len ("truncated")
    "evaluate": 2,
    # 1: bos is the EOS id (the token documents were trained after)
    # 2: the provenance records the weights' dtype and hashes README.md; a model past 5 GB
    # of weights is written as shards with an index
    "export": 2,
}


def with_output_version(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``kind``'s :data:`OUTPUT_VERSIONS` number, when it is not 0."""
    if OUTPUT_VERSIONS[kind]:
        config["output_version"] = OUTPUT_VERSIONS[kind]
    return config


# Stage-config fields that name files: in a run the graph supplies them (the eval sets from
# ``data_dir``'s checked root, the tokenizer from the run's own step), so a run's
# ``stage_configs`` may not set them; the stage CLIs keep them for runs by hand.
GRAPH_SUPPLIED = {
    ("decontaminate", "eval_sets"): "the eval sets are data_dir's eval/ files",
    ("tokenize", "tokenizer"): "the tokenizer is the run's train_tokenizer step",
}


class StageConfigNotAllowed(ValueError):
    """A run's ``stage_configs`` sets a field the graph supplies (:data:`GRAPH_SUPPLIED`)."""


def graph_supplied_problems(stage_configs: Mapping[str, Any]) -> list[str]:
    """Each field of a run's ``stage_configs`` that only the graph may set, with why."""
    return [
        f"stage_configs.{stage}.{name}: not a run setting ({why})"
        for (stage, name), why in GRAPH_SUPPLIED.items()
        if isinstance(stage_configs.get(stage), Mapping) and name in stage_configs[stage]
    ]


# A stage clears its --output directory before writing, so it writes below the step's output
# directory, never into it: the step's status marker and lease files must survive.
STAGE_OUT = "output"


def stage_output(step: Step, subpath: str = "") -> Any:
    """Reference a Beam stage step's output directory (or a file in it)."""
    return output_of(step, f"{STAGE_OUT}/{subpath}" if subpath else STAGE_OUT)


@dataclass(frozen=True)
class StageStep:
    """One Beam stage run: a step plus how to call ``python -m pipelines.<stage>``.

    ``options`` values may hold :class:`~operators.steps.OutputRef` (resolved per root);
    they are the stage's command-line options (``input``, ``eval_set``, ``tokenizer``...).
    """

    step: Step
    stage: str
    options: Mapping[str, Any]
    output_type: str
    inputs: tuple[tuple[Any, str, str | None], ...] = ()  # (uri or OutputRef, type, role)


@dataclass(frozen=True)
class Graph:
    stages: Mapping[str, tuple[StageStep, ...]]  # Airflow task id -> its Beam steps
    split: Step
    train: Step
    evaluate: Step
    export: Step
    train_stores: Mapping[str, Step] = field(default_factory=dict)
    eval_stores: Mapping[str, Step] = field(default_factory=dict)
    raw_inputs: Mapping[str, str] = field(default_factory=dict)
    eval_sets: Mapping[str, str] = field(default_factory=dict)
    content_ids: Mapping[str, str] = field(default_factory=dict)  # raw/eval path -> content id

    def task_steps(self) -> dict[str, tuple[Step, ...]]:
        """Each task's steps, in pipeline order (tasks without steps are left out)."""
        by_task = {
            **{task: tuple(s.step for s in group) for task, group in self.stages.items()},
            "split": (self.split,),
            "train": (self.train,),
            "evaluate": (self.evaluate,),
            "export": (self.export,),
        }
        return {t.task_id: by_task[t.task_id] for t in definition.PIPELINE if t.task_id in by_task}

    def all_steps(self) -> list[Step]:
        return [step for steps in self.task_steps().values() for step in steps]

    def input_fields(self, uri: Any) -> dict[str, Any]:
        """The content id of a raw or eval file this graph read (lineage input fields)."""
        cid = self.content_ids.get(uri) if isinstance(uri, str) else None
        return {"content_hash": cid} if cid else {}


@lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def content_id(path: str) -> str:
    """A content hash of a corpus file: local sha256 (memoised on size + mtime); for an object
    store, the MD5 it keeps for the object (``md5Hash`` on GCS), else a streamed sha256. Never
    a name, size or mtime: re-uploading the same bytes must not re-version the pipeline."""
    if not _remote(path):
        st = os.stat(path)
        return _sha256(path, st.st_size, st.st_mtime_ns)
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    info = fs.info(p)
    if info.get("md5Hash"):
        return f"md5:{info['md5Hash']}"
    digest = hashlib.sha256()
    with fs.open(p, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def raw_path(root: str, name: str) -> str:
    return join(root, "raw", f"{name}.jsonl.gz")


def eval_path(root: str, name: str) -> str:
    return join(root, "eval", f"{name}.jsonl.gz")


def _exists(path: str) -> bool:
    if not _remote(path):
        return os.path.exists(path.removeprefix("file://"))
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def missing_corpora(params: Mapping[str, Any]) -> list[str]:
    """The run's sources (and ``eval``, for the eval sets) not yet under its data folder.
    ``eval`` is missing when any set the run reads is: LAMBADA, and the set of each of its
    ``eval_tasks`` (a folder from an older fetch, or a partial copy, may have only some)."""
    data = data_dir(params.get("data_dir"))
    missing = [s.name for s in sources_of(params) if not _exists(raw_path(data, s.name))]
    sets = set(EVAL_STORES) | {TASKS[t].eval_set for t in params.get("eval_tasks") or ()}
    if any(not _exists(eval_path(data, e)) for e in sorted(sets)):
        missing.append("eval")
    return missing


def eval_set_paths(root: str) -> dict[str, str]:
    """Every eval set present under ``{data}/eval`` (decontamination checks them all)."""
    folder = join(root, "eval")
    if _remote(root):
        import fsspec

        fs, base = fsspec.core.url_to_fs(folder)
        names = [posixpath.basename(p) for p in fs.ls(base, detail=False)] if fs.isdir(base) else []
    elif os.path.isdir(folder):
        names = os.listdir(folder)
    else:
        names = []
    return {
        f[: -len(".jsonl.gz")]: join(folder, f) for f in sorted(names) if f.endswith(".jsonl.gz")
    }


@dataclass(frozen=True)
class Source:
    """A training corpus of the run and its mixture weight (the form's ``sources``)."""

    name: str
    weight: float


def sources_of(params: Mapping[str, Any]) -> tuple[Source, ...]:
    return tuple(Source(str(s["name"]), float(s["weight"])) for s in params["sources"])


def train_step_config(params: Mapping[str, Any], stores: Mapping[str, Any]) -> dict[str, Any]:
    """The ``train`` step's versioned config: the form's training fields and, per source, its
    token store (``stores``: source name -> path or upstream output) and mixture weight."""
    weights = {s.name: s.weight for s in sources_of(params)}
    return {
        "model": {"preset": params["model_preset"]},
        "steps": int(params["steps"]),
        "batch_size": int(params["batch_size"]),
        "seq_len": int(params["seq_len"]),
        "seed": int(params["seed"]),
        "optimizer": {
            "learning_rate": float(params["learning_rate"]),
            "warmup_steps": int(params["warmup_steps"]),
        },
        "sources": [{"name": n, "path": path, "weight": weights[n]} for n, path in stores.items()],
    }


def trainer_run_config(config: Mapping[str, Any], output_dir: str) -> dict[str, Any]:
    """A ``train`` step's config as the trainer's own ``TrainConfig`` (``trainer/config.py``),
    built and validated by the trainer's code: a :class:`trainer.config.ConfigError` names the
    trainer field. Every field is written out, defaults included, so the file says exactly
    what ran."""
    from trainer.config import TrainConfig, from_dict, to_dict, validate

    steps = int(config["steps"])
    body = {
        "output_dir": output_dir,
        "steps": steps,
        "batch_size": config["batch_size"],
        "seq_len": config["seq_len"],
        "seed": config["seed"],
        "log_every": 1,
        "model": dict(config["model"]),
        "data": {
            "sources": [
                {"path": s["path"], "weight": s["weight"], "name": s["name"]}
                for s in config["sources"]
            ]
        },
        "optimizer": dict(config["optimizer"]),
        # A few rolling checkpoints per run: a preempted or failed run loses little.
        "checkpoint": {"save_every": max(1, steps // 4), "keep": 1},
    }
    cfg = from_dict(TrainConfig, body)
    validate(cfg)
    return to_dict(cfg)


def build_graph(params: Mapping[str, Any], content_ids: Mapping[str, str] | None = None) -> Graph:
    """The run's steps. Needs the raw and eval files present (the fetch task makes them).

    ``content_ids`` (path -> id, from the run's resolved graph: :func:`read_resolved`) stand
    in for hashing those files again; a path not in it is hashed.
    """
    if problems := graph_supplied_problems(params["stage_configs"]):  # again, at use
        raise StageConfigNotAllowed("; ".join(problems))
    data = data_dir(params.get("data_dir"))
    sources = sources_of(params)
    names = [s.name for s in sources]
    stage_cfg = {k: dict(v) for k, v in params["stage_configs"].items()}
    shards = int(params["num_shards"])
    # How, not what: Beam runner and its settings never enter a version.
    how = {"runner": params["runner"], "dataflow": dict(params.get("dataflow") or {})}

    raw = {name: raw_path(data, name) for name in names}
    evals = eval_set_paths(data)
    content: dict[str, str] = {}

    def cid(path: str) -> str:
        if path not in content:
            content[path] = (content_ids or {}).get(path) or content_id(path)
        return content[path]

    def stage(
        name: str,
        options: dict[str, Any],
        output_type: str = DATASET,
        inputs: tuple[tuple[Any, str, str | None], ...] = (),
        step_name: str | None = None,
        versioned: Mapping[str, Any] | None = None,
    ) -> StageStep:
        # Local paths of raw files stay out of versions (content ids stand for them), so a
        # checkout elsewhere, or the same bytes in a bucket, hits the same cache.
        config = {
            "stage": name,
            "config": stage_cfg.get(name, {}),
            "num_shards": shards,
            **(options if versioned is None else versioned),
        }
        step = Step(step_name or name, with_output_version(name, config), unversioned=how)
        return StageStep(step, name, {**options, "num_shards": shards}, output_type, inputs)

    # The document stages, wired as the task table says: each reads the output of its
    # document-stage upstream; ingest reads the raw files, decontaminate the eval sets too.
    documents: dict[str, StageStep] = {}
    for task_id in [t.task_id for t in definition.PIPELINE if t.task_id in DOCUMENT_STAGES]:
        source = definition.document_input(task_id)
        if source is None:
            documents[task_id] = stage(
                task_id,
                {"input": [raw[n] for n in names]},
                inputs=tuple((raw[n], DATASET, None) for n in names),
                versioned={"input_content": {n: cid(raw[n]) for n in names}},
            )
            continue
        prev = stage_output(documents[source].step)
        if task_id == "decontaminate":
            documents[task_id] = stage(
                task_id,
                {"input": [prev], "eval_set": list(evals.values())},
                inputs=((prev, DATASET, None), *((p, DATASET, "eval_set") for p in evals.values())),
                versioned={"input": [prev], "eval_content": {n: cid(p) for n, p in evals.items()}},
            )
        else:
            documents[task_id] = stage(task_id, {"input": [prev]}, inputs=((prev, DATASET, None),))
    decon = documents["decontaminate"]
    split = Step(
        "split",
        with_output_version(
            "split",
            {
                "input": stage_output(decon.step),
                "sources": names,
                "heldout_fraction": float(params["heldout_fraction"]),
                "min_heldout_chars": 20_000,
            },
        ),
    )

    def split_file(kind: str, name: str) -> Any:
        return output_of(split, f"{kind}/{name}.jsonl.gz")

    tok = stage(
        "train_tokenizer",
        {"input": [split_file("train", n) for n in names]},
        output_type=TOKENIZER,
        inputs=tuple((split_file("train", n), DATASET, None) for n in names),
    )
    tokenizer = stage_output(tok.step)
    tokenize: list[StageStep] = []
    train_stores: dict[str, Step] = {}
    eval_stores: dict[str, Step] = {}
    for kind in ("train", "heldout"):
        for n in names:
            s = stage(
                "tokenize",
                {"input": [split_file(kind, n)], "tokenizer": tokenizer},
                output_type=TOKEN_STORE,
                inputs=((split_file(kind, n), DATASET, None), (tokenizer, TOKENIZER, "tokenizer")),
                step_name=f"tokens/{kind}/{n}",
            )
            tokenize.append(s)
            (train_stores if kind == "train" else eval_stores)[
                n if kind == "train" else f"heldout-{n}"
            ] = s.step
    for e in EVAL_STORES:
        if e not in evals:
            continue
        s = stage(
            "tokenize",
            {"input": [evals[e]], "tokenizer": tokenizer},
            output_type=TOKEN_STORE,
            inputs=((evals[e], DATASET, None), (tokenizer, TOKENIZER, "tokenizer")),
            step_name=f"tokens/eval/{e}",
            versioned={"input_content": cid(evals[e]), "tokenizer": tokenizer},
        )
        tokenize.append(s)
        eval_stores[f"{EVAL_STORE_PREFIX}{e}"] = s.step

    train = Step(
        "train",
        with_output_version(
            "train", train_step_config(params, {n: stage_output(train_stores[n]) for n in names})
        ),
        unversioned={
            "accelerator": params["accelerator"],
            "topology": params["topology"],
            "slices": int(params["slices"]),
            "backend": params["backend"],
            "image": params["image"],
            "fail_at_step": int(params["fail_at_step"]),
            "mesh": dict(params.get("mesh") or {}),
        },
    )
    evaluate_config: dict[str, Any] = {
        "train": output_of(train),
        "stores": {k: stage_output(v) for k, v in eval_stores.items()},
        "tokenizer": stage_output(tok.step, "tokenizer.model"),
        "max_tokens": int(params["eval_max_tokens"]),
        "samples": EVAL_SAMPLES,
    }
    evaluate_how: dict[str, Any] = {"backend": params["backend"], "image": params["image"]}
    # In the catalogue's order, not the form's: the same tasks listed in another order are
    # the same evaluation (a cache hit), and the defaults are already in that order.
    chosen = set(params.get("eval_tasks") or [])
    tasks = [t for t in TASK_NAMES if t in chosen]
    if tasks:
        # benchmarks (trainer/tasks.py): the sets they read enter the version by content, the
        # folder they are read from does not
        # (a set that is missing is the evaluation's error to report, naming the file)
        sets = sorted({TASKS[t].eval_set for t in tasks})
        evaluate_config |= {
            "tasks": tasks,
            "task_limit": int(params.get("eval_task_limit") or 0),
            "task_sets": {s: cid(evals[s]) if s in evals else None for s in sets},
        }
        evaluate_how["task_data"] = join(data, "eval")
    evaluate = Step(
        "evaluate", with_output_version("evaluate", evaluate_config), unversioned=evaluate_how
    )
    export = Step(
        "export",
        with_output_version(
            "export",
            {
                "train": output_of(train),
                "tokenizer": stage_output(tok.step, "tokenizer.model"),
                "dtype": params.get("export_dtype") or "float32",
            },
        ),
        unversioned={"backend": params["backend"], "image": params["image"]},
    )
    return Graph(
        stages={
            **{task_id: (s,) for task_id, s in documents.items()},
            "train_tokenizer": (tok,),
            "tokenize": tuple(tokenize),
        },
        split=split,
        train=train,
        evaluate=evaluate,
        export=export,
        train_stores=train_stores,
        eval_stores=eval_stores,
        raw_inputs=raw,
        eval_sets=evals,
        content_ids=content,
    )


# -- one stage run's command line (the Beam operator and the data-plane walker) ---------------


def stage_options(stage_step: StageStep, spec: Any, root: str) -> dict[str, Any]:
    """``python -m pipelines.<stage>`` options of one stage step bound to ``root`` (``spec``:
    its :class:`~operators.steps.StepSpec`): references resolved, the output below the step's
    output directory, the stage config exactly as the step holds it (what its version hashed)."""
    import json

    from operators.steps import OutputRef, output_path

    def path(value: Any) -> str:
        if isinstance(value, OutputRef):
            return join(output_path(root, value.step), value.subpath)
        return str(value)

    options: dict[str, Any] = {}
    for key, value in stage_step.options.items():
        if isinstance(value, list | tuple):
            options[key] = [path(v) for v in value]
        elif isinstance(value, Mapping):
            options[key] = json.dumps(value)
        else:
            options[key] = path(value)
    options["output"] = join(spec.output_path, STAGE_OUT)
    options["config"] = json.dumps(dict(spec.config["config"]), sort_keys=True)
    return options


def run_split(spec: Any) -> dict[str, Any]:
    """Run the ``split`` step (``spec``: its StepSpec) into its output directory."""
    from pipelines.split import split_documents

    c = spec.config
    return split_documents(
        c["input"], spec.output_path, c["sources"], c["heldout_fraction"], c["min_heldout_chars"]
    )


def stage_argv(options: Mapping[str, Any]) -> list[str]:
    """Options as a stage's ``main(argv)`` takes them: a list repeats its flag."""
    argv: list[str] = []
    for key, value in options.items():
        for item in value if isinstance(value, list | tuple) else [value]:
            argv += [f"--{key}", str(item)]
    return argv


# -- the graph resolved once per DAG run --------------------------------------------------------

RESOLVED_GRAPH = "graph.json"  # in the run's folder (operators.settings.run_folder)


class CorpusChanged(RuntimeError):
    """A corpus file changed after the run's ``fetch`` resolved its content id."""


# What names one write of an object, most specific first (GCS, GCS/S3 etags, timestamps).
_OBJECT_STAMP_KEYS = ("generation", "md5Hash", "etag", "ETag", "updated", "LastModified", "mtime")


def _file_stamp(path: str) -> list[Any] | None:
    """How a later task of the run sees that a corpus file changed since ``fetch`` hashed it:
    a local file's [size, mtime_ns]; an object's [size, its generation or etag or update
    time] (one metadata request). None for a file that is not there, or an object store that
    names no write."""
    if _remote(path):
        import fsspec

        try:
            fs, p = fsspec.core.url_to_fs(path)
            info = fs.info(p)
        except (OSError, ValueError):
            return None
        mark = next((info[k] for k in _OBJECT_STAMP_KEYS if info.get(k) is not None), None)
        return None if mark is None else [int(info.get("size") or 0), str(mark)]
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def resolved_record(graph: Graph) -> dict[str, Any]:
    """What the ``fetch`` task writes: the corpora's content ids with their files' stamps
    (:func:`_file_stamp`), and every step's key."""
    stamps = {p: _file_stamp(p) for p in sorted(graph.content_ids)}
    return {
        "content_ids": dict(sorted(graph.content_ids.items())),
        "stamps": {p: stamp for p, stamp in stamps.items() if stamp is not None},
        "steps": {step.name: step.key for step in graph.all_steps()},
    }


def write_resolved(graph: Graph, run_id: str) -> str:
    """Write the run's resolved graph (``{run folder}/graph.json``); returns its path."""
    from operators.settings import write_run_file

    return write_run_file(run_id, RESOLVED_GRAPH, resolved_record(graph))


def read_resolved(run_id: str) -> dict[str, Any] | None:
    """The run's resolved graph, or None when ``fetch`` has not written one (yet)."""
    from operators.settings import run_folder
    from trainer.rundir import read_json  # the one "JSON file, or None while missing" reader

    return read_json(join(run_folder(run_id), RESOLVED_GRAPH))


def graph_for_run(params: Mapping[str, Any], run_id: str | None) -> Graph:
    """The run's graph: built with the content ids its ``fetch`` task resolved (no corpus file
    is hashed again), checked against the step keys it recorded; :class:`CorpusChanged` when a
    corpus file changed since (its stamp: :func:`_file_stamp`). Without a resolved graph (a
    task run on its own, ``fetch`` not run yet) the files are hashed here."""
    resolved = read_resolved(run_id) if run_id else None
    if resolved is None:
        return build_graph(params)
    changed_files = sorted(
        path for path, stamp in (resolved.get("stamps") or {}).items() if _file_stamp(path) != stamp
    )
    if changed_files:
        # Replaced since fetch (a repaired raw file, then only the failed tasks cleared): the
        # run's ids no longer name the bytes, and new ones would move every step downstream.
        raise CorpusChanged(
            f"{', '.join(changed_files)} changed since this run's fetch resolved the corpora "
            "(its size and modification time, or the object's generation): clear fetch with its downstream tasks to run on the "
            "new bytes (steps whose inputs did not change stay cache hits)"
        )
    graph = build_graph(params, content_ids=resolved["content_ids"])
    now = {step.name: step.key for step in graph.all_steps()}
    changed = sorted(n for n, k in now.items() if resolved["steps"].get(n) != k)
    if changed:
        # The form and the corpora are the run's; a difference means the code changed under
        # a running DAG run (a deploy mid-run). The new code's versions are the ones to use.
        log.warning("steps %s differ from the run's resolved graph: the code changed", changed)
    return graph
