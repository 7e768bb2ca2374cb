"""The run's step graph: a pure function of the run form (Marin's executor, on Airflow).

Every task rebuilds the same graph from the run's params and picks its own steps, so versions
agree across tasks, processes and machines without passing them through XCom. A step's
version covers what it computes (stage config, raw input content, upstream versions); how it
runs (runner, workers, accelerator, backend, fault injection) is unversioned.

Raw inputs enter the versions by *content* (sha256), not only by path: refetched corpora
with new bytes give new versions, unchanged ones keep every downstream cache hit.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from operators.settings import data_dir
from operators.steps import Step, join, output_of

# What each stage's output is, for lineage.
DATASET, TOKENIZER, TOKEN_STORE = "dataset", "tokenizer", "token_store"
EVAL_STORES = ("lambada",)  # eval sets tokenized as held-out prose (data/eval/<name>.jsonl.gz)
EVAL_STORE_PREFIX = "eval-"  # eval sets tokenized as held-out stores: eval-<name>
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
    train_stores: Mapping[str, Step] = field(default_factory=dict)
    eval_stores: Mapping[str, Step] = field(default_factory=dict)
    raw_inputs: Mapping[str, str] = field(default_factory=dict)
    eval_sets: Mapping[str, str] = field(default_factory=dict)

    def all_steps(self) -> list[Step]:
        steps = [s.step for group in self.stages.values() for s in group]
        return [*steps, self.split, self.train, self.evaluate]


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


def build_graph(params: Mapping[str, Any]) -> Graph:
    """The run's steps. Needs the raw and eval files present (the fetch task makes them)."""
    data = data_dir(params.get("data_dir"))
    sources = sources_of(params)
    names = [s.name for s in sources]
    stage_cfg = {k: dict(v) for k, v in params["stage_configs"].items()}
    shards = int(params["num_shards"])
    # How, not what: Beam runner and its settings never enter a version.
    how = {"runner": params["runner"], "dataflow": dict(params.get("dataflow") or {})}

    raw = {name: raw_path(data, name) for name in names}
    evals = eval_set_paths(data)

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
        step = Step(step_name or name, config, unversioned=how)
        return StageStep(step, name, {**options, "num_shards": shards}, output_type, inputs)

    ingest = stage(
        "ingest",
        {"input": [raw[n] for n in names]},
        inputs=tuple((raw[n], DATASET, None) for n in names),
        versioned={"input_content": {n: content_id(raw[n]) for n in names}},
    )
    chain = [ingest]
    for name in ("quality", "exact_dedup", "fuzzy_dedup"):
        prev = chain[-1].step
        chain.append(
            stage(
                name, {"input": [stage_output(prev)]}, inputs=((stage_output(prev), DATASET, None),)
            )
        )
    prev = chain[-1].step
    decon = stage(
        "decontaminate",
        {"input": [stage_output(prev)], "eval_set": list(evals.values())},
        inputs=(
            (stage_output(prev), DATASET, None),
            *((p, DATASET, "eval_set") for p in evals.values()),
        ),
        versioned={
            "input": [stage_output(prev)],
            "eval_content": {n: content_id(p) for n, p in evals.items()},
        },
    )
    split = Step(
        "split",
        {
            "input": stage_output(decon.step),
            "sources": names,
            "heldout_fraction": float(params["heldout_fraction"]),
            "min_heldout_chars": 20_000,
        },
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
            versioned={"input_content": content_id(evals[e]), "tokenizer": tokenizer},
        )
        tokenize.append(s)
        eval_stores[f"{EVAL_STORE_PREFIX}{e}"] = s.step

    train = Step(
        "train",
        train_step_config(params, {n: stage_output(train_stores[n]) for n in names}),
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
    evaluate = Step(
        "evaluate",
        {
            "train": output_of(train),
            "stores": {k: stage_output(v) for k, v in eval_stores.items()},
            "tokenizer": stage_output(tok.step, "tokenizer.model"),
            "max_tokens": int(params["eval_max_tokens"]),
        },
        unversioned={"backend": params["backend"], "image": params["image"]},
    )
    return Graph(
        stages={
            "ingest": (ingest,),
            "quality": (chain[1],),
            "exact_dedup": (chain[2],),
            "fuzzy_dedup": (chain[3],),
            "decontaminate": (decon,),
            "train_tokenizer": (tok,),
            "tokenize": tuple(tokenize),
        },
        split=split,
        train=train,
        evaluate=evaluate,
        train_stores=train_stores,
        eval_stores=eval_stores,
        raw_inputs=raw,
        eval_sets=evals,
    )
