"""Scaling-law fits of a sweep's outcomes, with bootstrap intervals and forecasts.

Input: the cells of a sweep, each a :class:`Cell` -- its budget C (training FLOPs), its
non-embedding parameters N, its tokens D and the metric L it reached (held-out loss or
bits/byte; NaN or None for a diverged or failed cell). Two fits, as Hoffmann et al. (2022)
made them, and as the Epoch AI replication (Besiroglu et al., 2024) checked them:

* **Approach 2** (:func:`fit_isoflop`): per budget, a robust (Huber) parabola of L against
  log N, and one against log D, through the cells around the curve's lowest one (within
  :data:`PARABOLA_SPAN` in N); their minima give N*(C), D*(C), L*(C), which are then fitted
  as power laws across budgets (``N* = k C^a``, a line in log-log).
* **Approach 3** (:func:`fit_parametric`): ``L(N, D) = E + A / N^alpha + B / D^beta`` by the
  Huber loss (delta 1e-3) on log L, ``LSE(a - alpha log N, b - beta log D, e)`` against
  ``log L``, L-BFGS from a grid of starts, keeping the best.

:func:`bootstrap` refits on resampled cells (seeded: the same cells give the same intervals)
and gives a percentile interval for every fitted quantity and forecast. Nothing is fitted
silently: every cell left out is listed with its reason (:class:`Exclusion`), and a fit that
cannot be made raises :class:`FitError` saying why (one budget, no curve with a minimum...).

JAX-free (numpy and scipy): the sweep DAG's fit task imports it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize

__all__ = [
    "Cell",
    "Exclusion",
    "FitError",
    "IsoFlopFit",
    "ParametricFit",
    "PowerLaw",
    "bootstrap",
    "fit_isoflop",
    "fit_parametric",
    "usable_cells",
]

HUBER_DELTA = 1e-3  # Hoffmann et al.'s delta for the Huber loss on log L
MIN_POINTS_PER_BUDGET = 3  # a parabola needs three
# A budget's parabola is fitted to the cells within this factor in N of its lowest cell (and
# at least the sizes on either side of it): an IsoFLOP curve is a parabola in log N near its minimum
# only, and a wide grid's far side (large models on a few hundred steps) rises much faster.
PARABOLA_SPAN = 4.0
MIN_BUDGETS = 2  # a power law across budgets needs two (three to say anything)


class FitError(ValueError):
    """A fit that cannot be made from these cells, and why."""


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: budget, size, tokens and the metric it reached."""

    compute: float
    params: float  # non-embedding parameters N
    tokens: float  # D
    metric: float | None  # None / NaN: the cell failed or diverged
    name: str = ""  # the cell's step (lineage) or label

    @property
    def key(self) -> str:
        return self.name or f"C={self.compute:.3g} N={self.params:.3g}"


@dataclass(frozen=True)
class Exclusion:
    """A cell (or a whole budget) left out of a fit, and why."""

    cell: str
    reason: str


def usable_cells(cells: Iterable[Cell]) -> tuple[list[Cell], list[Exclusion]]:
    """The cells a fit can use; the others with their reason (failed, diverged, nonsense)."""
    kept: list[Cell] = []
    left: list[Exclusion] = []
    for c in cells:
        if c.metric is None:
            left.append(Exclusion(c.key, "no metric: the cell failed or was not evaluated"))
        elif not math.isfinite(c.metric):
            left.append(Exclusion(c.key, f"metric is {c.metric}: the run diverged"))
        elif c.metric <= 0:
            left.append(Exclusion(c.key, f"metric {c.metric} is not positive"))
        elif not (c.params > 0 and c.tokens > 0 and c.compute > 0):
            left.append(Exclusion(c.key, "budget, parameters and tokens must be positive"))
        else:
            kept.append(c)
    return kept, left


# -- approach 2 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowerLaw:
    """``y = coefficient * C^exponent`` (fitted as a line in log-log)."""

    coefficient: float
    exponent: float

    def __call__(self, compute: float) -> float:
        return self.coefficient * compute**self.exponent

    @classmethod
    def fit(cls, compute: Sequence[float], y: Sequence[float]) -> PowerLaw:
        slope, intercept = np.polyfit(np.log(compute), np.log(y), 1)
        return cls(float(math.exp(intercept)), float(slope))


@dataclass(frozen=True)
class BudgetOptimum:
    """The minimum of one budget's IsoFLOP parabolas."""

    compute: float
    params: float  # N*
    tokens: float  # D*
    metric: float  # L* (the N-parabola's minimum)
    cells: tuple[str, ...]  # the cells its parabolas used
    # (a, b, c) of the metric ~ a (log N)^2 + b log N + c through them: what a report draws
    parabola: tuple[float, float, float]


@dataclass(frozen=True)
class IsoFlopFit:
    """Chinchilla approach 2: per-budget minima and the power laws through them."""

    optima: tuple[BudgetOptimum, ...]
    params: PowerLaw  # N*(C)
    tokens: PowerLaw  # D*(C)
    metric: PowerLaw  # L*(C)
    excluded: tuple[Exclusion, ...] = ()

    def forecast(
        self, compute: float, params: float | None = None, tokens: float | None = None
    ) -> dict[str, float]:
        """The compute-optimal run at ``compute`` and its metric (L*(C): approach 2 has no
        metric of a given N and D, so ``params``/``tokens`` are only reported back)."""
        return {
            "compute": compute,
            "params": self.params(compute) if params is None else params,
            "tokens": self.tokens(compute) if tokens is None else tokens,
            "metric": self.metric(compute),
        }

    def quantities(self) -> dict[str, float]:
        """The fitted numbers a bootstrap gives intervals for."""
        return {
            "params_exponent": self.params.exponent,
            "tokens_exponent": self.tokens.exponent,
            "metric_exponent": self.metric.exponent,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "approach": 2,
            "optima": [dataclasses.asdict(o) for o in self.optima],
            "params": dataclasses.asdict(self.params),
            "tokens": dataclasses.asdict(self.tokens),
            "metric": dataclasses.asdict(self.metric),
            "excluded": [dataclasses.asdict(e) for e in self.excluded],
        }


def _huber_parabola(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (a, b, c) of ``a x^2 + b x + c``, robust to an outlying cell."""
    start = np.polyfit(x, y, 2)
    scale = max(float(np.std(y)), 1e-12)
    result = optimize.least_squares(
        lambda p: np.polyval(p, x) - y, start, loss="huber", f_scale=0.1 * scale
    )
    return result.x


def _parabola_minimum(
    x: np.ndarray, y: np.ndarray, what: str
) -> tuple[float, float, tuple[float, float, float]] | str:
    """(x at the minimum, y there, the parabola's coefficients), or why there is none inside
    the sampled range."""
    a, b, c = _huber_parabola(x, y)
    if a <= 0:
        return f"the metric has no minimum in {what} (flat or concave curve: a = {a:.3g})"
    x_min = -b / (2 * a)
    if not x.min() <= x_min <= x.max():
        return (
            f"the minimum over {what} lies outside the sampled sizes "
            f"(exp {x_min:.3g} not in [{x.min():.3g}, {x.max():.3g}]): widen the grid"
        )
    return float(x_min), float(np.polyval([a, b, c], x_min)), (float(a), float(b), float(c))


def _around_minimum(group: Sequence[Cell]) -> list[Cell] | str:
    """The cells a budget's parabolas are fitted to: those within :data:`PARABOLA_SPAN` in N
    of the lowest cell, and at least the sizes on either side of it; or why there is no
    minimum to fit (the lowest cell is the smallest or the largest size: the grid does not
    bracket it).

    By size, not by cell: a bootstrap resample repeats cells, and a window of three cells of
    two sizes would hand the parabola an undetermined fit.
    """
    ordered = sorted(group, key=lambda c: c.params)
    sizes = sorted({c.params for c in ordered})
    lowest = min(ordered, key=lambda c: c.metric)
    at = sizes.index(lowest.params)
    if at in (0, len(sizes) - 1):
        side = "smallest" if at == 0 else "largest"
        return (
            f"the metric has no minimum inside the sampled sizes (its lowest cell, "
            f"{lowest.key}, is the {side}): widen the grid"
        )
    span = math.log(PARABOLA_SPAN)
    centre = math.log(lowest.params)
    beside = set(sizes[at - 1 : at + 2])
    return [c for c in ordered if c.params in beside or abs(math.log(c.params) - centre) <= span]


def fit_isoflop(cells: Iterable[Cell]) -> IsoFlopFit:
    """Chinchilla approach 2 on ``cells``; see the module docstring."""
    kept, excluded = usable_cells(cells)
    by_budget: dict[float, list[Cell]] = {}
    for c in kept:
        by_budget.setdefault(c.compute, []).append(c)
    optima: list[BudgetOptimum] = []
    for compute, group in sorted(by_budget.items()):
        names = ", ".join(c.key for c in group)
        if len({c.params for c in group}) < MIN_POINTS_PER_BUDGET:
            excluded.append(
                Exclusion(
                    f"budget {compute:.3g}",
                    f"{len(group)} usable cell(s) ({names}); a parabola needs "
                    f"{MIN_POINTS_PER_BUDGET} sizes",
                )
            )
            continue
        window = _around_minimum(group)
        if isinstance(window, str):
            excluded.append(Exclusion(f"budget {compute:.3g}", window))
            continue
        log_n = np.log([c.params for c in window])
        log_d = np.log([c.tokens for c in window])
        metric = np.array([c.metric for c in window], dtype=float)
        over_n = _parabola_minimum(log_n, metric, "log N")
        over_d = _parabola_minimum(log_d, metric, "log D")
        problem = next((m for m in (over_n, over_d) if isinstance(m, str)), None)
        if problem is not None:
            excluded.append(Exclusion(f"budget {compute:.3g}", problem))
            continue
        assert not isinstance(over_n, str) and not isinstance(over_d, str)
        optima.append(
            BudgetOptimum(
                compute=compute,
                params=math.exp(over_n[0]),
                tokens=math.exp(over_d[0]),
                metric=over_n[1],
                cells=tuple(c.key for c in window),
                parabola=over_n[2],
            )
        )
    if len(optima) < MIN_BUDGETS:
        reasons = "; ".join(f"{e.cell}: {e.reason}" for e in excluded) or "none given"
        raise FitError(
            f"approach 2 needs at least {MIN_BUDGETS} budgets with a usable IsoFLOP curve, "
            f"got {len(optima)} (left out: {reasons})"
        )
    budgets = [o.compute for o in optima]
    return IsoFlopFit(
        optima=tuple(optima),
        params=PowerLaw.fit(budgets, [o.params for o in optima]),
        tokens=PowerLaw.fit(budgets, [o.tokens for o in optima]),
        metric=PowerLaw.fit(budgets, [o.metric for o in optima]),
        excluded=tuple(excluded),
    )


# -- approach 3 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParametricFit:
    """Chinchilla approach 3: ``L(N, D) = E + A / N^alpha + B / D^beta``."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    loss: float  # the objective at the optimum: the sum of Huber losses, in units of delta
    cells: tuple[str, ...] = ()
    excluded: tuple[Exclusion, ...] = ()
    flops_per_param_token: float = 6.0  # C = k N D, for the compute-optimal split
    # Parameters the optimum left at a bound of the search: these cells do not pin them down.
    warnings: tuple[str, ...] = ()

    def __call__(self, params: float, tokens: float) -> float:
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    def optimal_params(self, compute: float) -> float:
        """The N minimising L at fixed ``C = k N D`` (closed form)."""
        a, b = self.alpha, self.beta
        g = (a * self.A / (b * self.B)) ** (1 / (a + b))
        return g * (compute / self.flops_per_param_token) ** (b / (a + b))

    def forecast(
        self, compute: float, params: float | None = None, tokens: float | None = None
    ) -> dict[str, float]:
        """The metric of the run with ``params`` and ``tokens`` (the run that will train);
        without them, of the law's own compute-optimal split of ``C = k N D``."""
        n = self.optimal_params(compute) if params is None else params
        d = compute / (self.flops_per_param_token * n) if tokens is None else tokens
        return {"compute": compute, "params": n, "tokens": d, "metric": self(n, d)}

    def quantities(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta}

    def start(self) -> tuple[float, ...]:
        """This fit as a start for :func:`fit_parametric` (a bootstrap's warm start)."""
        return (math.log(self.A), math.log(self.B), math.log(self.E), self.alpha, self.beta)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["approach"] = 3
        return out


def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals ``r`` and its derivative."""
    small = np.abs(r) <= delta
    loss = np.where(small, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))
    grad = np.where(small, r, delta * np.sign(r))
    return loss, grad


def _objective(
    theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float
) -> tuple[float, np.ndarray]:
    """Sum of Huber(LSE(a - alpha log N, b - beta log D, e) - log L) and its gradient."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    predicted = top + np.log(total)
    loss, dloss = _huber(predicted - log_l, delta)
    # In units of delta: the loss and its gradient are O(1) whatever delta is, so L-BFGS's
    # tolerances mean the same thing for any sweep (the minimiser is unchanged).
    loss, dloss = loss / delta, dloss / delta
    soft = weights / total  # d predicted / d term
    grad = np.array(
        [
            np.sum(dloss * soft[0]),
            np.sum(dloss * soft[1]),
            np.sum(dloss * soft[2]),
            np.sum(dloss * soft[0] * -log_n),
            np.sum(dloss * soft[1] * -log_d),
        ]
    )
    return float(loss.sum()), grad


# Hoffmann et al.'s grid of starts, thinned (their 4,500 starts give the same optimum on
# sweeps of this size; the test checks recovery of known parameters).
START_GRID: tuple[tuple[float, ...], ...] = tuple(
    itertools.product(
        (0.0, 10.0, 20.0),  # a = log A
        (0.0, 10.0, 20.0),  # b = log B
        (-1.0, 0.5),  # e = log E
        (0.2, 0.6),  # alpha
        (0.2, 0.6),  # beta
    )
)
BOUNDS = ((-10.0, 60.0), (-10.0, 60.0), (-5.0, 5.0), (0.01, 3.0), (0.01, 3.0))


def fit_parametric(
    cells: Iterable[Cell],
    *,
    starts: Sequence[Sequence[float]] = START_GRID,
    delta: float = HUBER_DELTA,
    flops_per_param_token: float = 6.0,
) -> ParametricFit:
    """Chinchilla approach 3 on ``cells``; see the module docstring."""
    kept, excluded = usable_cells(cells)
    if len(kept) < 5 or len({c.compute for c in kept}) < MIN_BUDGETS:
        raise FitError(
            f"approach 3 fits 5 parameters: it needs at least 5 usable cells over "
            f"{MIN_BUDGETS}+ budgets, got {len(kept)} over "
            f"{len({c.compute for c in kept})} (left out: "
            + ("; ".join(f"{e.cell}: {e.reason}" for e in excluded) or "none")
            + ")"
        )
    log_n = np.log([c.params for c in kept])
    log_d = np.log([c.tokens for c in kept])
    log_l = np.log([c.metric for c in kept])
    best: Any = None
    for start in starts:
        result = optimize.minimize(
            _objective,
            np.asarray(start, dtype=float),
            args=(log_n, log_d, log_l, delta),
            jac=True,
            method="L-BFGS-B",
            bounds=BOUNDS,
            options={"maxiter": 5000, "ftol": 1e-14, "gtol": 1e-9},
        )
        if np.isfinite(result.fun) and (best is None or result.fun < best.fun):
            best = result
    if best is None:
        raise FitError("approach 3: no start converged to a finite loss")
    a, b, e, alpha, beta = (float(v) for v in best.x)
    names = ("log A", "log B", "log E", "alpha", "beta")
    warnings = tuple(
        f"{name} = {value:.3g} is at its bound [{low}, {high}]: the cells do not constrain it"
        for name, value, (low, high) in zip(names, best.x, BOUNDS, strict=True)
        if min(abs(value - low), abs(value - high)) < 1e-6 * max(1.0, abs(value))
    )
    return ParametricFit(
        E=math.exp(e),
        A=math.exp(a),
        B=math.exp(b),
        alpha=alpha,
        beta=beta,
        loss=float(best.fun),
        cells=tuple(c.key for c in kept),
        excluded=tuple(excluded),
        flops_per_param_token=flops_per_param_token,
        warnings=warnings,
    )


# -- bootstrap -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class Bootstrap:
    """Percentile intervals of a fit's quantities and forecasts over resampled cells."""

    quantities: dict[str, Interval]
    forecasts: dict[float, dict[str, Interval]]
    samples: int  # resamples that could be fitted
    failed: int  # resamples that could not (e.g. a budget lost its curve)
    level: float = 0.95
    seed: int = 0


def bootstrap(
    fit: Callable[[list[Cell]], Any],
    cells: Sequence[Cell],
    *,
    forecast_budgets: Sequence[float] = (),
    forecast_runs: Mapping[float, tuple[float, float]] | None = None,
    samples: int = 200,
    level: float = 0.95,
    seed: int = 0,
) -> Bootstrap:
    """Refit ``fit`` on ``samples`` resamples of the usable ``cells`` (within each budget,
    with replacement: every resample draws from each of the sweep's budgets) and give
    percentile intervals of the refits that succeed (``failed`` counts the others; too few
    successes and there are no intervals). A resample draws sizes with replacement, so it can
    lose a budget's lowest cell or its neighbour: approach 2 then leaves that budget out, or
    fails when fewer than 2 remain. Its intervals are therefore of refits through fewer
    budgets than the point fit, conditioned on success: on a grid whose minima sit near its
    edge (the demo's), most refits use 2 of 3 budgets and the point estimate can sit at the
    edge of its own interval. They are confidence intervals of the fitted law, without the
    forecast run's own seed noise, not prediction intervals.

    ``fit`` is :func:`fit_isoflop`, or :func:`fit_parametric` (pass a warm-started one, e.g.
    ``functools.partial(fit_parametric, starts=[point_estimate_start])``, for speed).
    ``forecast_runs``: budget -> (N, D) of the run that will train there, forecast as that
    run rather than the law's own optimum.
    """
    point = fit(list(cells))
    runs = dict(forecast_runs or {})
    rng = np.random.default_rng(seed)
    by_budget: dict[float, list[Cell]] = {}
    for c in usable_cells(cells)[0]:  # resampling a failed cell in would only fail the refit
        by_budget.setdefault(c.compute, []).append(c)
    values: dict[str, list[float]] = {k: [] for k in point.quantities()}
    predicted: dict[float, dict[str, list[float]]] = {
        b: {k: [] for k in point.forecast(b, *runs.get(b, (None, None)))} for b in forecast_budgets
    }
    failed = 0
    for _ in range(samples):
        resample = [
            group[i]
            for _, group in sorted(by_budget.items())
            for i in rng.integers(0, len(group), len(group))
        ]
        try:
            refit = fit(resample)
        except FitError:
            failed += 1
            continue
        for k, v in refit.quantities().items():
            values[k].append(v)
        for b in forecast_budgets:
            for k, v in refit.forecast(b, *runs.get(b, (None, None))).items():
                predicted[b][k].append(v)
    if len(next(iter(values.values()), [])) < max(10, samples // 2):
        raise FitError(f"bootstrap: only {samples - failed} of {samples} resamples could be fitted")
    tail = 100 * (1 - level) / 2

    def interval(estimate: float, xs: list[float]) -> Interval:
        low, high = np.percentile(xs, [tail, 100 - tail])
        return Interval(float(estimate), float(low), float(high))

    return Bootstrap(
        quantities={k: interval(point.quantities()[k], xs) for k, xs in values.items()},
        forecasts={
            b: {
                k: interval(point.forecast(b, *runs.get(b, (None, None)))[k], xs)
                for k, xs in per.items()
            }
            for b, per in predicted.items()
        },
        samples=samples - failed,
        failed=failed,
        level=level,
        seed=seed,
    )
