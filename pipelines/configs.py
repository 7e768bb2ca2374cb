"""Stage configs: each data-plane stage's config dataclass, and one check for all of them.

The dataclasses live here, not in their Beam modules, so the DAG's ``validate`` task (and
``slipway plan``) check a run's ``stage_configs`` without importing Beam, TensorStore or
SentencePiece; each stage module imports its config from here (``pipelines.quality.
QualityConfig`` and the like still work). A JSON object becomes a config through
:func:`build_config`, which refuses unknown keys and values of the wrong type (by the
dataclass's annotations: ``int``, ``float``, ``bool``, ``str``, ``X | None``, tuples,
mappings, nested config dataclasses), then lets the dataclass's ``__post_init__`` check
ranges. Every error names the field. The stage harness (``--config``) and the ``validate``
task both call it, so a typo in a stage config fails before any data is read.

Standard library only (MinHash helpers are imported where a fuzzy-dedup config needs them).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from pipelines.minhash import MinHashParams

# Reserved token ids, the first four of every vocabulary (pipelines/spm.py). pad is 0 so
# zero-filled buffers are padding; eos is what tokenization appends to every document (and what
# the trainer's data loader splits documents on).
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
SPECIAL_IDS = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}

PARAGRAPH_UNITS = ("paragraph", "line")
NORMALIZATIONS = ("identity", "nfkc")

# Slipway's upper bounds on the values that size a stage's work or memory before any data is
# read (a run's form sets them, and one typo should not take a shared worker down): each far
# above what any corpus needs.
MAX_NUM_PERM = 4096  # MinHash permutations (Marin and DataTrove use 112-256)
MAX_ROUNDS = 64  # connected-components rounds, each two shuffles unrolled in the pipeline
MAX_BATCH = 65_536  # documents per vectorized MinHash call or per encode call
MAX_THREADS = 256  # tokenizer training and encoding threads
MAX_VOCAB_SIZE = 1 << 20  # the largest vocabularies in use are 256k


def _at_most(config: object, limit: int, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value > limit:
            raise ValueError(f"{name} must be <= {limit}, not {value!r}")


# -- ingest ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IngestConfig:
    source: str = ""  # source name for records that carry none
    text_field: str = "text"
    id_field: str = "id"
    min_chars: int = 1
    max_chars: int = 5_000_000  # longer documents are dropped as "too_long"

    def __post_init__(self) -> None:
        if self.min_chars < 1 or self.max_chars < self.min_chars:
            raise ValueError("need 1 <= min_chars <= max_chars")


# -- quality -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityThresholds:
    """One set of rule thresholds; ``None`` switches a rule off, ``enabled=False`` all of them."""

    enabled: bool = True
    # Gopher quality filters.
    min_words: int | None = 50
    max_words: int | None = 100_000
    min_mean_word_length: float | None = 3.0
    max_mean_word_length: float | None = 10.0
    max_hash_word_ratio: float | None = 0.1
    max_ellipsis_word_ratio: float | None = 0.1
    max_bullet_line_fraction: float | None = 0.9
    max_ellipsis_line_fraction: float | None = 0.3
    min_alpha_word_fraction: float | None = 0.8
    min_stop_words: int | None = 2
    # C4 filters. C4 removes lines without terminal punctuation; at document level we follow
    # FineWeb's 0.12 floor on the fraction of lines that end in it.
    min_terminal_punctuation_line_fraction: float | None = 0.12
    max_lorem_ipsum: int | None = 0
    max_boilerplate_line_fraction: float | None = 0.2
    max_curly_brackets: int | None = None  # C4 drops any "{"; off: code sources are wanted
    # Gopher repetition filters.
    max_duplicate_line_fraction: float | None = 0.30
    max_duplicate_paragraph_fraction: float | None = 0.30
    max_duplicate_line_char_fraction: float | None = 0.20
    max_duplicate_paragraph_char_fraction: float | None = 0.20
    max_top_2gram_char_fraction: float | None = 0.20
    max_top_3gram_char_fraction: float | None = 0.18
    max_top_4gram_char_fraction: float | None = 0.16
    max_duplicate_5gram_char_fraction: float | None = 0.15
    max_duplicate_6gram_char_fraction: float | None = 0.14
    max_duplicate_7gram_char_fraction: float | None = 0.13
    max_duplicate_8gram_char_fraction: float | None = 0.12
    max_duplicate_9gram_char_fraction: float | None = 0.11
    max_duplicate_10gram_char_fraction: float | None = 0.10

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "enabled":
                if not isinstance(value, bool):
                    raise ValueError(f"enabled must be true or false, not {value!r}")
            elif value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)  # NaN compares false: the rule would never fire
                or value < 0
            ):
                raise ValueError(f"{f.name} must be a finite number >= 0 or null, not {value!r}")
            elif isinstance(value, float) and "int" in str(f.type) and not value.is_integer():
                raise ValueError(f"{f.name} must be a whole number or null, not {value!r}")


def _replace_thresholds(base: QualityThresholds, values: Any, where: str) -> QualityThresholds:
    if isinstance(values, QualityThresholds):
        return values
    if not isinstance(values, Mapping):
        raise ValueError(f"{where} must be an object of thresholds, not {values!r}")
    known = {f.name for f in dataclasses.fields(QualityThresholds)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown threshold(s) in {where}: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    return dataclasses.replace(base, **values)


@dataclass(frozen=True)
class QualityConfig:
    """Default thresholds plus per-source overrides (only the fields an override names change).

    ``sources`` maps a document ``source`` to a partial mapping of ``QualityThresholds`` fields,
    kept as given so the manifest records exactly what was asked for.
    """

    thresholds: QualityThresholds = field(default_factory=QualityThresholds)
    sources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = _replace_thresholds(QualityThresholds(), self.thresholds, "thresholds")
        object.__setattr__(self, "thresholds", base)
        if not isinstance(self.sources, Mapping):
            raise ValueError("sources must map source names to threshold objects")
        sources = {}
        for name in sorted(self.sources):
            overrides = self.sources[name]
            if isinstance(overrides, QualityThresholds):
                overrides = dataclasses.asdict(overrides)
            _replace_thresholds(base, overrides, f"sources[{name!r}]")  # validates
            sources[str(name)] = dict(overrides)
        object.__setattr__(self, "sources", sources)

    def resolved(self) -> dict[str, QualityThresholds]:
        """Each overridden source's full thresholds."""
        return {
            name: _replace_thresholds(self.thresholds, overrides, name)
            for name, overrides in self.sources.items()
        }


# -- exact and fuzzy dedup ---------------------------------------------------------------------


@dataclass(frozen=True)
class ExactDedupConfig:
    dedup_documents: bool = True
    dedup_paragraphs: bool = True
    remove_duplicate_paragraphs: bool = False  # False: only mark spans in metadata
    paragraph_unit: str = "paragraph"  # "paragraph" (blank-line separated) or "line"
    # Paragraphs with fewer normalized words are never compared: "Thanks," or "}" recur
    # everywhere and say nothing about copied content.
    min_paragraph_words: int = 3

    def __post_init__(self) -> None:
        if self.paragraph_unit not in PARAGRAPH_UNITS:
            raise ValueError(
                f"paragraph_unit must be one of {', '.join(PARAGRAPH_UNITS)},"
                f" not {self.paragraph_unit!r}"
            )
        if self.min_paragraph_words < 1:
            raise ValueError("min_paragraph_words must be >= 1")
        for name in ("dedup_documents", "dedup_paragraphs", "remove_duplicate_paragraphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false")


@dataclass(frozen=True)
class FuzzyDedupConfig:
    threshold: float = 0.8  # estimated Jaccard of shingle sets that makes a pair an edge
    num_perm: int = 256
    ngram: int = 5  # words per shingle
    seed: int = 1
    bands: int = 0  # 0 with rows=0: derived from num_perm and threshold by optimal_bands
    rows: int = 0
    # LSH misses are lost for good while LSH false positives only cost a verification (every
    # candidate is checked against the full signature), so misses weigh 9x more.
    false_positive_weight: float = 0.1
    false_negative_weight: float = 0.9
    max_rounds: int = 12  # large-star/small-star rounds unrolled in the pipeline
    fail_on_nonconvergence: bool = False
    batch_size: int = 256  # documents per vectorized MinHash call

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError("threshold must be in (0, 1)")
        if self.num_perm < 1 or self.ngram < 1 or self.batch_size < 1 or self.max_rounds < 1:
            raise ValueError("num_perm, ngram, batch_size and max_rounds must be >= 1")
        if (self.bands == 0) != (self.rows == 0):
            raise ValueError("set both bands and rows, or neither (derived)")
        if self.bands < 0 or self.rows < 0 or self.bands * self.rows > self.num_perm:
            raise ValueError("need bands * rows <= num_perm")
        if self.bands > 0xFFFF:
            raise ValueError("at most 65535 bands")
        _at_most(self, MAX_NUM_PERM, "num_perm")
        _at_most(self, MAX_ROUNDS, "max_rounds")
        _at_most(self, MAX_BATCH, "batch_size")
        if min(self.false_positive_weight, self.false_negative_weight) < 0:
            raise ValueError("LSH error weights must be >= 0")

    @property
    def minhash(self) -> MinHashParams:
        from pipelines.minhash import MinHashParams

        return MinHashParams(num_perm=self.num_perm, ngram=self.ngram, seed=self.seed)

    def lsh(self) -> tuple[int, int]:
        """(bands, rows): the configured ones, or the optimum for threshold and num_perm."""
        from pipelines.minhash import optimal_bands

        if self.bands:
            return self.bands, self.rows
        return optimal_bands(
            self.threshold, self.num_perm, self.false_positive_weight, self.false_negative_weight
        )


# -- decontaminate -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecontaminateConfig:
    # Path fields a run cannot do without, with the flag that gives them: checked before the
    # output is cleared (``pipelines.stage.check_reads``).
    REQUIRED_READS: ClassVar[dict[str, str]] = {"eval_sets": "--eval_set PATH"}

    eval_sets: tuple[str, ...] = ()  # paths/globs; --eval_set flags are appended
    ngram: int = 13
    min_overlap: int = 1  # distinct shared n-grams with one eval set that make a match
    min_short_words: int = 8  # shorter eval texts are skipped; up to ngram-1 used whole

    def __post_init__(self) -> None:
        if isinstance(self.eval_sets, str) or not all(isinstance(p, str) for p in self.eval_sets):
            raise ValueError("eval_sets must be a list of paths or globs")
        object.__setattr__(self, "eval_sets", tuple(self.eval_sets))
        for name in ("ngram", "min_overlap", "min_short_words"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")


# -- tokenizer and token stores ----------------------------------------------------------------


@dataclass(frozen=True)
class TrainTokenizerConfig:
    vocab_size: int = 32_000
    sample_rate: float = 1.0  # fraction of documents that are candidates (stable hash of id)
    max_sample_chars: int = 100_000_000  # budget, in document characters
    seed: int = 0  # hash seed: another seed chooses another sample
    max_line_chars: int = 4096  # longer lines are cut into pieces for training
    character_coverage: float = 0.9995  # rarer characters are left to byte fallback
    normalization: str = "identity"  # "identity" (exact round trip) or "nfkc"
    split_digits: bool = True
    max_piece_length: int = 16
    num_threads: int = 4  # recorded in the model file, so fixed rather than os.cpu_count()

    def __post_init__(self) -> None:
        minimum = len(SPECIAL_IDS) + 256 + 1
        if self.vocab_size < minimum:
            raise ValueError(f"vocab_size must be >= {minimum} (specials + 256 byte pieces + 1)")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError("sample_rate must be in (0, 1]")
        if self.max_sample_chars < 1 or self.max_line_chars < 1:
            raise ValueError("max_sample_chars and max_line_chars must be >= 1")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError("character_coverage must be in (0, 1]")
        if self.num_threads < 1 or self.max_piece_length < 1:
            raise ValueError("num_threads and max_piece_length must be >= 1")
        _at_most(self, MAX_VOCAB_SIZE, "vocab_size")
        _at_most(self, MAX_THREADS, "num_threads")


@dataclass(frozen=True)
class TokenizeConfig:
    REQUIRED_READS: ClassVar[dict[str, str]] = {"tokenizer": "--tokenizer DIR_OR_MODEL"}

    tokenizer: str = ""  # tokenizer directory (stage 6 output) or .model file; --tokenizer
    encode_threads: int = 0  # SentencePiece threads per batch; 0 = one per CPU (max 8)
    batch_docs: int = 1024  # documents per encode call
    # Re-shard by id through a shuffle even when the inputs are already id-sharded stage
    # outputs (the store is the same either way; this is for comparison and tests).
    shuffle: bool = False

    def __post_init__(self) -> None:
        if self.encode_threads < 0:
            raise ValueError("encode_threads must be >= 0")
        if self.batch_docs < 1:
            raise ValueError("batch_docs must be >= 1")
        _at_most(self, MAX_THREADS, "encode_threads")
        _at_most(self, MAX_BATCH, "batch_docs")


# -- building one from JSON ----------------------------------------------------------------------

ConfigT = TypeVar("ConfigT")

STAGE_CONFIGS: dict[str, type] = {
    "ingest": IngestConfig,
    "quality": QualityConfig,
    "exact_dedup": ExactDedupConfig,
    "fuzzy_dedup": FuzzyDedupConfig,
    "decontaminate": DecontaminateConfig,
    "train_tokenizer": TrainTokenizerConfig,
    "tokenize": TokenizeConfig,
}


class ConfigError(ValueError):
    """A stage config that cannot be built; ``field`` names the offending key ('' for all)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def config_type(stage: str) -> type:
    """The config dataclass of ``stage``."""
    if stage not in STAGE_CONFIGS:
        raise ConfigError(f"unknown stage {stage!r} (known: {', '.join(STAGE_CONFIGS)})")
    return STAGE_CONFIGS[stage]


def _describe(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        nullable = type(None) in typing.get_args(tp)
        return " or ".join(parts) + (" or null" if nullable else "")
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        return "a list"
    if origin in (dict, Mapping) or tp in (dict, Mapping) or dataclasses.is_dataclass(tp):
        return "an object"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return str(tp)


def _fits(tp: Any, value: Any) -> bool:
    """Whether a JSON value fits an annotation (unknown annotations: left to the dataclass)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if tp is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (tuple, list, Sequence):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            return False
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return not args or all(_fits(args[0], v) for v in value)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping | tp)
    return True


def build_config(config_type: type[ConfigT], values: Any) -> ConfigT:
    """``config_type(**values)``, after refusing unknown keys and mistyped values by name."""
    name = config_type.__name__
    if not isinstance(values, Mapping):
        raise ConfigError(f"{name}: the config must be a JSON object, not {values!r}")
    fields = {f.name: f for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config field(s) for {name}: {', '.join(unknown)}"
            f" (known: {', '.join(sorted(fields))})",
            unknown[0],
        )
    hints = typing.get_type_hints(config_type)
    for key, value in values.items():
        if not _fits(hints[key], value):
            raise ConfigError(
                f"{key}: expected {_describe(hints[key])}, got {value!r} ({name})", key
            )
    try:
        return config_type(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid {name}: {err}") from None


def check_stage_configs(configs: Mapping[str, Any]) -> list[str]:
    """Every problem of a DAG run's ``stage_configs``, as ``stage_configs.<stage>: why``."""
    problems = []
    for stage, values in configs.items():
        try:
            build_config(config_type(stage), values)
        except ConfigError as exc:
            problems.append(f"stage_configs.{stage}: {exc}")
    return problems
