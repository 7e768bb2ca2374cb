"""Named scaling recipes: a compute budget C (training FLOPs) -> a complete training run.

Marin's shape of API: ``recipe.compute_config(C)`` is the compute-optimal run at budget C (model
shape, tokens, batch, learning rate, warmup, schedule, beta2) and ``recipe.isoflop_grid(C,
points)`` the runs of an IsoFLOP curve at C, model sizes log-spaced around that optimum, each
spending the same budget. Pure functions of their arguments, JAX-free (the sweep DAG's form
and its grid task import them):

* ``chinchilla-deepseek`` -- the compute-optimal size of Hoffmann et al. (2022), N ~ sqrt(C/120)
  (D ~ 20 N at C ~ 6 N D), preset-like shapes (:func:`trainer.scaling.shape_for_params`), batch
  and learning rate from DeepSeek LLM's fitted laws (B = 0.292 C^0.3271 tokens, lr = 0.3118
  C^-0.125), 10% warmup (at most 2000 steps), cosine decay, beta2 0.95;
* ``marin-2025`` -- Marin's 2025 heuristics (``marin.scaling_laws.recipe``): depth from width
  (``layers = round(h / (64 + 4 log2 h - 9))``, at least 1), MLP 4h, 128-wide heads
  (one head below 128), widths from 16 in fine steps so that small sweeps have sizes, a fixed number of
  steps per run with the batch solved from the budget (a power of two), ``lr = 0.33 sqrt(B)/h``
  capped at 0.01 by halving the batch, ``beta2 = 0.98^(B/128)``, 10% warmup, linear decay to 0.

Every run spends its budget to within :data:`FLOP_TOLERANCE` (the rounding of steps and batch);
:meth:`RunPlan.estimate` gives its FLOPs and accelerator time before launch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from trainer.config import ModelConfig, OptimizerConfig, TrainConfig
from trainer.scaling import (
    batch_tokens,
    learning_rate,
    non_embedding_params,
    optimal_params,
    shape_for_params,
)
from trainer.shapes import flops_per_token, param_count

__all__ = [
    "FLOP_TOLERANCE",
    "RECIPES",
    "ChinchillaDeepSeek",
    "Marin2025",
    "Recipe",
    "RecipeError",
    "RunPlan",
    "get_recipe",
]

# A run's FLOPs may differ from its budget by this fraction (steps and batch are integers).
FLOP_TOLERANCE = 0.05
# Fewer optimizer steps than this is not a training run worth fitting a curve to.
MIN_STEPS = 20
DEFAULT_MFU = 0.4  # what an estimate assumes of a run's model FLOPs utilisation


class RecipeError(ValueError):
    """A budget the recipe cannot turn into a valid run (too small, too large)."""


@dataclass(frozen=True)
class RunPlan:
    """One training run of a recipe at a compute budget: everything ``trainer.train`` needs
    besides the data."""

    recipe: str
    compute: float  # the budget, FLOPs
    model: ModelConfig
    seq_len: int
    batch_size: int  # sequences per step (global)
    steps: int
    learning_rate: float
    warmup_steps: int
    decay: Literal["cosine", "linear"]
    min_lr_ratio: float
    beta2: float

    @property
    def params(self) -> int:
        return param_count(self.model)

    @property
    def non_embedding_params(self) -> int:
        return non_embedding_params(self.model)

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model, self.seq_len)

    @property
    def flops(self) -> float:
        """Training FLOPs of the run as planned (attention included)."""
        return self.tokens * self.flops_per_token

    @property
    def label(self) -> str:
        """``C=1.5e+15 N=3.4M``: how a grid cell is shown (Airflow's map index)."""
        return f"C={self.compute:.3g} N={_si(self.non_embedding_params)}"

    def estimate(self, peak_flops: float, mfu: float = DEFAULT_MFU) -> dict[str, float]:
        """FLOPs and accelerator seconds before launch: ``peak_flops`` is the whole slice's
        (chips x the chip's peak), ``mfu`` the utilisation assumed."""
        if peak_flops <= 0 or not 0 < mfu <= 1:
            raise RecipeError(f"estimate needs peak_flops > 0 and 0 < mfu <= 1, got {mfu}")
        return {
            "flops": self.flops,
            "seconds": self.flops / (peak_flops * mfu),
            "peak_flops": peak_flops,
            "mfu": mfu,
        }

    def train_config(self, base: TrainConfig | None = None) -> TrainConfig:
        """The trainer's config: ``base`` (data, output, mesh, checkpoints...) with this run's
        shape, length, batch, steps and optimizer."""
        base = base or TrainConfig()
        model = dataclasses.replace(
            base.model,
            preset="",
            vocab_size=self.model.vocab_size,
            hidden_dim=self.model.hidden_dim,
            intermediate_dim=self.model.intermediate_dim,
            num_layers=self.model.num_layers,
            num_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            tie_embeddings=self.model.tie_embeddings,
        )
        optimizer: OptimizerConfig = dataclasses.replace(
            base.optimizer,
            learning_rate=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay=self.decay,
            min_lr_ratio=self.min_lr_ratio,
            beta2=self.beta2,
        )
        return dataclasses.replace(
            base,
            model=model,
            optimizer=optimizer,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            steps=self.steps,
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "recipe": self.recipe,
            "compute": self.compute,
            "model": dataclasses.asdict(self.model),
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "learning_rate": self.learning_rate,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
            "min_lr_ratio": self.min_lr_ratio,
            "beta2": self.beta2,
            "params": self.params,
            "non_embedding_params": self.non_embedding_params,
            "tokens": self.tokens,
            "flops": self.flops,
        }


def _si(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _power_of_two(x: float) -> int:
    return 2 ** max(0, round(math.log2(max(x, 1.0))))


def _multiple(batch: int, of: int) -> int:
    """``batch`` rounded up to a multiple of ``of``: the mesh splits the batch ``of`` ways."""
    return -(-batch // of) * of


class Recipe:
    """What every recipe shares: the optimum's size and the IsoFLOP grid around it."""

    name: str

    def model_for(self, target_params: float, vocab_size: int, seq_len: int) -> ModelConfig:
        raise NotImplementedError

    def plan(self, compute: float, model: ModelConfig, *, vocab_size: int, seq_len: int) -> RunPlan:
        raise NotImplementedError

    def optimal_params(self, compute: float) -> float:
        """N*(C), the non-embedding parameters of the compute-optimal model."""
        return optimal_params(compute)

    def compute_config(self, compute: float, *, vocab_size: int, seq_len: int = 1024) -> RunPlan:
        """The compute-optimal run at budget ``compute``."""
        _check_budget(compute)
        model = self.model_for(self.optimal_params(compute), vocab_size, seq_len)
        return self.plan(compute, model, vocab_size=vocab_size, seq_len=seq_len)

    def isoflop_grid(
        self,
        compute: float,
        points: int = 5,
        *,
        vocab_size: int,
        seq_len: int = 1024,
        spread: float = 4.0,
    ) -> list[RunPlan]:
        """``points`` model sizes log-spaced over [N*/spread, N* x spread], all at budget
        ``compute``, smallest first; sizes that round to the same shape are kept once."""
        _check_budget(compute)
        if points < 1 or spread < 1:
            raise RecipeError(f"isoflop_grid needs points >= 1 and spread >= 1, got {points}")
        n_opt = self.optimal_params(compute)
        grid: list[RunPlan] = []
        for i in range(points):
            frac = i / max(points - 1, 1) if points > 1 else 0.5
            model = self.model_for(n_opt * spread ** (2 * frac - 1), vocab_size, seq_len)
            if grid and model == grid[-1].model:
                continue
            grid.append(self.plan(compute, model, vocab_size=vocab_size, seq_len=seq_len))
        return grid


def _check_budget(compute: float) -> None:
    if not (isinstance(compute, int | float) and math.isfinite(compute) and compute > 0):
        raise RecipeError(f"compute budget must be a positive number of FLOPs, got {compute!r}")


def _checked(plan: RunPlan) -> RunPlan:
    if plan.steps < MIN_STEPS:
        raise RecipeError(
            f"{plan.recipe}: budget {plan.compute:.3g} gives {plan.steps} steps of "
            f"{plan.batch_size} x {plan.seq_len} tokens for a {plan.label} model (at least "
            f"{MIN_STEPS}): raise the budget or shorten seq_len"
        )
    error = abs(plan.flops / plan.compute - 1)
    if error > FLOP_TOLERANCE:
        raise RecipeError(
            f"{plan.recipe}: {plan.label} spends {plan.flops:.3g} FLOPs of a {plan.compute:.3g} "
            f"budget ({error:.1%} off, tolerance {FLOP_TOLERANCE:.0%})"
        )
    return plan


@dataclass(frozen=True)
class ChinchillaDeepSeek(Recipe):
    """Chinchilla's optimum with DeepSeek LLM's batch and learning-rate laws."""

    name: str = "chinchilla-deepseek"
    max_warmup_steps: int = 2000
    beta2: float = 0.95
    min_lr_ratio: float = 0.1
    # The launch's data-parallel size: every batch a multiple of it (the trainer's rule).
    batch_multiple: int = 1

    def model_for(self, target_params: float, vocab_size: int, seq_len: int) -> ModelConfig:
        return shape_for_params(target_params, vocab_size, seq_len)

    def plan(self, compute: float, model: ModelConfig, *, vocab_size: int, seq_len: int) -> RunPlan:
        tokens = compute / flops_per_token(model, seq_len)
        # The fitted law's batch, a power of two in sequences, at most 1/(8 MIN_STEPS) of
        # the run's tokens so that small budgets still take enough steps.
        seqs = min(batch_tokens(compute) / seq_len, tokens / (8 * MIN_STEPS * seq_len))
        batch = _multiple(_power_of_two(seqs), self.batch_multiple)
        steps = max(1, round(tokens / (batch * seq_len)))
        return _checked(
            RunPlan(
                recipe=self.name,
                compute=compute,
                model=model,
                seq_len=seq_len,
                batch_size=batch,
                steps=steps,
                learning_rate=learning_rate(compute),
                warmup_steps=min(steps // 10, self.max_warmup_steps),
                decay="cosine",
                min_lr_ratio=self.min_lr_ratio,
                beta2=self.beta2,
            )
        )


@dataclass(frozen=True)
class Marin2025(Recipe):
    """Marin's 2025 heuristics, at the scales of this project's sweeps too (hidden from 16)."""

    name: str = "marin-2025"
    lr_constant: float = 0.33
    max_learning_rate: float = 0.01
    beta2_base: float = 0.98
    beta2_batch_divisor: float = 128.0
    warmup_fraction: float = 0.1
    mlp_ratio: int = 4
    head_dim: int = 128
    min_hidden: int = 16
    max_hidden: int = 8192
    steps_per_run: int = 2000
    min_batch_size: int = 1
    # The launch's data-parallel size: every batch a multiple of it (the trainer's rule).
    batch_multiple: int = 1

    def num_layers(self, hidden: int) -> int:
        return max(1, round(hidden / (64 + 4 * math.log2(hidden) - 9)))

    def shape(self, hidden: int, vocab_size: int) -> ModelConfig:
        head_dim = min(self.head_dim, hidden)
        heads = max(1, hidden // head_dim)
        return ModelConfig(
            vocab_size=vocab_size,
            hidden_dim=hidden,
            intermediate_dim=hidden * self.mlp_ratio,
            num_layers=self.num_layers(hidden),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=head_dim,
        )

    def hiddens(self) -> list[int]:
        """The widths a run may have: steps of 8 below 64, 32 to 512, 64 to 2048, 128 above
        (Marin steps by 128 or 256 from 512; the finer rungs give a laptop-sized sweep sizes
        to fit a curve through)."""
        ladder = [
            *range(16, 64, 8),
            *range(64, 512, 32),
            *range(512, 2048, 64),
            *range(2048, 65536 + 1, 128),
        ]
        return [h for h in ladder if self.min_hidden <= h <= self.max_hidden]

    def model_for(self, target_params: float, vocab_size: int, seq_len: int) -> ModelConfig:
        return min(
            (self.shape(h, vocab_size) for h in self.hiddens()),
            key=lambda m: abs(math.log(non_embedding_params(m) / target_params)),
        )

    def learning_rate(self, batch: int, hidden: int) -> float:
        return self.lr_constant * math.sqrt(batch) / hidden

    def plan(self, compute: float, model: ModelConfig, *, vocab_size: int, seq_len: int) -> RunPlan:
        tokens = compute / flops_per_token(model, seq_len)
        batch = max(self.min_batch_size, _power_of_two(tokens / (self.steps_per_run * seq_len)))
        while (
            batch > self.min_batch_size
            and self.learning_rate(batch, model.hidden_dim) > self.max_learning_rate
        ):
            batch //= 2
        batch = _multiple(batch, self.batch_multiple)
        steps = max(1, round(tokens / (batch * seq_len)))
        return _checked(
            RunPlan(
                recipe=self.name,
                compute=compute,
                model=model,
                seq_len=seq_len,
                batch_size=batch,
                steps=steps,
                learning_rate=min(
                    self.max_learning_rate, self.learning_rate(batch, model.hidden_dim)
                ),
                warmup_steps=int(self.warmup_fraction * steps),
                decay="linear",
                min_lr_ratio=0.0,
                beta2=self.beta2_base ** (batch / self.beta2_batch_divisor),
            )
        )


RECIPES: dict[str, Recipe] = {r.name: r for r in (ChinchillaDeepSeek(), Marin2025())}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise RecipeError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}") from None
