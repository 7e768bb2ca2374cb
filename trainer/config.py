"""Trainer configuration: frozen dataclasses, loaded from JSON/YAML (local or ``gs://``).

Everything is validated by :func:`validate` before any JAX computation starts, and every error
names the offending field by its dotted path (``optimizer.warmup_steps``), so a bad Airflow form
value fails in seconds rather than halfway into a TPU reservation.

Overrides: ``--set a.b=c`` (repeatable). The value is parsed as a YAML scalar/flow value, so
``--set train.steps=200``, ``--set optimizer.decay=wsd``, ``--set model.tie_embeddings=true``,
``--set 'data.sources=[{path: /s, weight: 1}]'`` all work. Unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from trainer.shapes import PRESETS


class ConfigError(ValueError):
    """An invalid configuration; the message starts with the dotted field name."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 8  # routed experts E (one shared expert is always added)
    top_k: int = 2
    expert_dim: int = 0  # MLP width of each expert; 0 = model.intermediate_dim // top_k
    shared_expert_dim: int = 0  # 0 = expert_dim
    capacity_factor: float = 1.25  # per-group capacity = ceil(cf * T * k / E); <= 0: no drops
    balancing: Literal["quantile", "aux_loss", "none"] = "quantile"
    aux_loss_coef: float = 0.01
    # tokens per routing group (the set each expert's quantile and capacity are taken over);
    # 0 = all the tokens one device holds in a step: its rows of the batch (batch_size / the
    # data-parallel size x seq_len). Per sequence the quantile is too coarse to balance well.
    group_size: int = 0


@dataclass(frozen=True)
class ModelConfig:
    preset: str = ""  # if set, shape fields left at 0 are filled from the preset
    vocab_size: int = 0  # 0 = take it from the (first) token store
    hidden_dim: int = 0
    intermediate_dim: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0  # 0 = hidden_dim // num_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: MoEConfig | None = None
    remat: bool = False  # rematerialize each layer in the backward pass (memory for compute)
    # how the layer stack runs: "scan" (lax.scan: compile time constant in depth), "unroll" (one
    # copy of the layer per layer: faster steps), "auto" = unroll on the CPU backend and on
    # accelerators up to 16 layers (model.UNROLL_MAX_LAYERS_ACCELERATOR), scan deeper ones there
    layer_loop: Literal["auto", "scan", "unroll"] = "auto"
    # attention kernel (trainer/kernels.py): "auto" = the CPU-tuned blocked path on CPU,
    # cuDNN flash attention on GPU (16-bit), splash attention on TPU when the sequence is a
    # multiple of 128 (else XLA's); or one of
    # "blocked", "xla", "cudnn", "splash" (Pallas, TPU)
    attention: Literal["auto", "blocked", "xla", "cudnn", "splash"] = "auto"


@dataclass(frozen=True)
class SourceConfig:
    path: str
    weight: float = 1.0
    name: str = ""


@dataclass(frozen=True)
class DataConfig:
    sources: tuple[SourceConfig, ...] = ()
    block_size: int = 2048  # sequences per mixture block (Levanter-style)
    eval_sources: tuple[SourceConfig, ...] = ()


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    decay_steps_fraction: float = 0.2  # WSD only: fraction of training spent decaying
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # <= 0 disables clipping
    z_loss_coef: float = 0.0


@dataclass(frozen=True)
class MeshConfig:
    # -1 on exactly one axis = "all remaining devices". Batch is split over replica*data*fsdp.
    replica: int = 1
    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclass(frozen=True)
class DistributedConfig:
    # "auto": JobSet/GKE environment if present, else single process. "explicit": use below.
    mode: Literal["auto", "explicit", "none"] = "auto"
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    local_device_ids: tuple[int, ...] = ()
    port: int = 8476


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 500  # temporary (rolling) checkpoints
    keep: int = 1  # how many temporary checkpoints to keep
    permanent_every: int = 0  # 0 = none; these are never deleted
    async_save: bool = True
    resume: bool = True
    # threads the background writer may use; 0 = auto: a quarter of the cores when training
    # runs on the CPU (the writer competes with the step), TensorStore's default otherwise
    write_threads: int = 0


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str = ""
    steps: int = 1000
    batch_size: int = 32  # global, in sequences
    seq_len: int = 1024
    seed: int = 0
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights are always f32
    log_every: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peak_flops_per_device: float = 0.0  # for MFU; 0 = known TPU table or unreported


# ---------------------------------------------------------------------------------------------
# dict -> dataclass, with field paths in every error


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(tp: Any, value: Any, path: str) -> Any:
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(path, "must not be null")
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, path)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(path, f"must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is tuple:
        (inner, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        return tuple(_convert(inner, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(path, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    raise ConfigError(path, f"unsupported type {tp}")  # pragma: no cover


def from_dict(cls: type, body: dict[str, Any], path: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in body:
        if key not in names:
            raise ConfigError(f"{path}.{key}" if path else key, "unknown field")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            sub = f"{path}.{f.name}" if path else f.name
            kwargs[f.name] = _convert(hints[f.name], body[f.name], sub)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        name = missing[0] if missing else "?"
        raise ConfigError(f"{path}.{name}" if path else name, "is required") from e


def to_dict(cfg: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


# ---------------------------------------------------------------------------------------------
# loading and overrides


def read_text(uri: str) -> str:
    import fsspec  # gs:// needs gcsfs (the `gcp` extra); local paths need nothing more

    with fsspec.open(uri, "r") as f:
        return f.read()


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "a.c=x"]`` -> ``{"a": {"b": 1, "c": "x"}}`` (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(item, "override must look like a.b.c=value")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(key, "conflicting overrides")
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_config(
    uri: str | None, overrides: list[str] | None = None, *, require_data: bool = True
) -> TrainConfig:
    body: dict[str, Any] = {}
    if uri:
        text = read_text(uri)
        try:
            body = yaml.safe_load(text) or {}  # YAML is a superset of JSON
        except yaml.YAMLError as e:
            raise ConfigError("<file>", f"cannot parse {uri}: {e}") from e
        if not isinstance(body, dict):
            raise ConfigError("<file>", f"{uri} must hold a mapping")
    body = _merge(body, parse_overrides(list(overrides or [])))
    cfg = from_dict(TrainConfig, body)
    validate(cfg, require_data=require_data)
    return cfg


# ---------------------------------------------------------------------------------------------
# validation


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise ConfigError(path, message)


def validate_model(m: ModelConfig, path: str = "model") -> None:
    _check(
        not m.preset or m.preset in PRESETS,
        f"{path}.preset",
        f"unknown preset {m.preset!r}; known: {sorted(PRESETS)}",
    )
    for name in (
        "vocab_size",
        "hidden_dim",
        "intermediate_dim",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
        _check(getattr(m, name) >= 0, f"{path}.{name}", "must be >= 0")
    r = resolve_model(m, vocab_size=max(m.vocab_size, 1))
    for name in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads"):
        _check(getattr(r, name) > 0, f"{path}.{name}", "must be > 0 (or set model.preset)")
    _check(
        r.num_heads % r.num_kv_heads == 0,
        f"{path}.num_kv_heads",
        f"must divide num_heads ({r.num_heads})",
    )
    _check(
        r.head_dim > 0 and r.head_dim % 2 == 0,
        f"{path}.head_dim",
        "must be even and > 0 (rotary embeddings rotate pairs)",
    )
    _check(r.rope_theta > 0, f"{path}.rope_theta", "must be > 0")
    _check(r.norm_eps > 0, f"{path}.norm_eps", "must be > 0")
    _check(r.init_std > 0, f"{path}.init_std", "must be > 0")
    if m.moe is not None:
        e = m.moe
        _check(e.num_experts >= 1, f"{path}.moe.num_experts", "must be >= 1")
        _check(
            1 <= e.top_k < e.num_experts or (e.num_experts == 1 and e.top_k == 1),
            f"{path}.moe.top_k",
            f"must be in [1, num_experts) (num_experts={e.num_experts})",
        )
        _check(e.expert_dim >= 0, f"{path}.moe.expert_dim", "must be >= 0")
        _check(e.shared_expert_dim >= 0, f"{path}.moe.shared_expert_dim", "must be >= 0")
        _check(e.aux_loss_coef >= 0, f"{path}.moe.aux_loss_coef", "must be >= 0")
        _check(e.group_size >= 0, f"{path}.moe.group_size", "must be >= 0")


def validate(cfg: TrainConfig, *, require_data: bool = True) -> None:
    _check(cfg.steps > 0, "steps", "must be > 0")
    _check(cfg.batch_size > 0, "batch_size", "must be > 0")
    _check(cfg.seq_len > 1, "seq_len", "must be > 1")
    _check(cfg.log_every > 0, "log_every", "must be > 0")
    _check(cfg.peak_flops_per_device >= 0, "peak_flops_per_device", "must be >= 0")
    if require_data:
        _check(bool(cfg.output_dir), "output_dir", "is required")
        _check(len(cfg.data.sources) > 0, "data.sources", "needs at least one token store")
    validate_model(cfg.model)
    mg = cfg.model.moe.group_size if cfg.model.moe else 0
    # a group is a run of whole sequences or a part of one; that it fits the tokens of one
    # device is checked once the mesh is known (``resolve_model(..., tokens_per_device=)``)
    _check(
        mg == 0 or cfg.seq_len % mg == 0 or mg % cfg.seq_len == 0,
        "model.moe.group_size",
        f"must divide seq_len ({cfg.seq_len}) or be a multiple of it",
    )
    for key in ("sources", "eval_sources"):
        for i, s in enumerate(getattr(cfg.data, key)):
            _check(bool(s.path), f"data.{key}[{i}].path", "is required")
            _check(
                math.isfinite(s.weight) and s.weight >= 0,
                f"data.{key}[{i}].weight",
                "must be a finite number >= 0",
            )
    if cfg.data.sources:
        _check(
            sum(s.weight for s in cfg.data.sources) > 0, "data.sources", "weights must not all be 0"
        )
    _check(cfg.data.block_size > 0, "data.block_size", "must be > 0")
    o = cfg.optimizer
    _check(o.learning_rate > 0, "optimizer.learning_rate", "must be > 0")
    _check(
        0 <= o.warmup_steps <= cfg.steps,
        "optimizer.warmup_steps",
        f"must be in [0, steps={cfg.steps}]",
    )
    _check(0 < o.decay_steps_fraction <= 1, "optimizer.decay_steps_fraction", "must be in (0, 1]")
    _check(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", "must be in [0, 1]")
    _check(0 <= o.beta1 < 1, "optimizer.beta1", "must be in [0, 1)")
    _check(0 <= o.beta2 < 1, "optimizer.beta2", "must be in [0, 1)")
    _check(o.eps > 0, "optimizer.eps", "must be > 0")
    _check(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    _check(o.z_loss_coef >= 0, "optimizer.z_loss_coef", "must be >= 0")
    mesh = cfg.mesh
    sizes = {"replica": mesh.replica, "data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    for k, v in sizes.items():
        _check(v == -1 or v >= 1, f"mesh.{k}", "must be >= 1 or -1 (fill)")
    _check(sum(v == -1 for v in sizes.values()) <= 1, "mesh", "at most one axis may be -1")
    d = cfg.distributed
    if d.mode == "explicit":
        _check(
            bool(d.coordinator_address),
            "distributed.coordinator_address",
            "is required when mode is explicit",
        )
        _check(
            d.num_processes >= 1, "distributed.num_processes", "must be >= 1 when mode is explicit"
        )
        _check(
            0 <= d.process_id < max(d.num_processes, 1),
            "distributed.process_id",
            "must be in [0, num_processes)",
        )
    c = cfg.checkpoint
    _check(c.save_every >= 0, "checkpoint.save_every", "must be >= 0 (0 = only at the end)")
    _check(c.keep >= 1, "checkpoint.keep", "must be >= 1")
    _check(c.permanent_every >= 0, "checkpoint.permanent_every", "must be >= 0")
    _check(c.write_threads >= 0, "checkpoint.write_threads", "must be >= 0 (0 = auto)")


def resolve_model(
    m: ModelConfig, vocab_size: int | None = None, *, tokens_per_device: int | None = None
) -> ModelConfig:
    """Fill preset shape fields, derived head_dim and MoE widths, and the vocabulary size.

    ``tokens_per_device`` (the tokens one device holds in a step: its batch rows x seq_len)
    fills the MoE default ``group_size`` 0, so that each device's tokens are one routing group:
    the model sees the global batch and cannot know the mesh. An explicit ``group_size`` must
    divide it (a group never spans devices). Left unset, the model routes all the tokens of a
    call as one group."""
    base = PRESETS.get(m.preset) if m.preset else None
    updates: dict[str, Any] = {}
    for name in (
        "hidden_dim",
        "intermediate_dim",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
        if getattr(m, name) == 0 and base is not None:
            updates[name] = getattr(base, name)
    if vocab_size is not None and m.vocab_size == 0:
        updates["vocab_size"] = vocab_size
    r = dataclasses.replace(m, **updates, preset="")
    if r.num_kv_heads == 0:
        r = dataclasses.replace(r, num_kv_heads=r.num_heads)
    if r.head_dim == 0 and r.num_heads > 0:
        r = dataclasses.replace(r, head_dim=r.hidden_dim // r.num_heads)
    if r.moe is not None:
        ed = r.moe.expert_dim or max(1, r.intermediate_dim // r.moe.top_k)
        r = dataclasses.replace(
            r,
            moe=dataclasses.replace(
                r.moe, expert_dim=ed, shared_expert_dim=r.moe.shared_expert_dim or ed
            ),
        )
    if r.moe is not None and tokens_per_device is not None:
        group = r.moe.group_size or tokens_per_device
        if tokens_per_device % group:
            raise ConfigError(
                "model.moe.group_size",
                f"must divide the tokens per device ({tokens_per_device}: batch_size / "
                "data-parallel size x seq_len)",
            )
        r = dataclasses.replace(r, moe=dataclasses.replace(r.moe, group_size=group))
    return r
