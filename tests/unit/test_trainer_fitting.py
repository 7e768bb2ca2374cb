"""Scaling-law fits recover known laws from noisy synthetic sweeps, and say why they cannot.

The sweep is Chinchilla's own law (Hoffmann et al. 2022, approach 3's fitted values)
L(N, D) = 1.69 + 406.4 / N^0.34 + 410.7 / D^0.28, sampled as an IsoFLOP sweep would be: five
budgets from 1e18 to 1e20 FLOPs, seven sizes per budget around the optimum (x/4 .. x4), each
loss with 0.3% multiplicative noise (seeded).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

from trainer.fitting import Cell, FitError, bootstrap, fit_isoflop, fit_parametric

E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
BUDGETS = (1e18, 3e18, 1e19, 3e19, 1e20)


def true_loss(n: float, d: float) -> float:
    return E + A / n**ALPHA + B / d**BETA


def true_optimum(c: float) -> float:
    g = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    return g * (c / 6) ** (BETA / (ALPHA + BETA))


def sweep(noise: float = 0.003, seed: int = 0, budgets=BUDGETS, sizes: int = 7) -> list[Cell]:
    rng = np.random.default_rng(seed)
    cells = []
    for c in budgets:
        for f in np.linspace(-1, 1, sizes):
            n = true_optimum(c) * 4**f
            d = c / (6 * n)
            metric = true_loss(n, d) * (1 + noise * rng.standard_normal())
            cells.append(Cell(c, n, d, float(metric), name=f"C={c:.0e}/{f:+.2f}"))
    return cells


@pytest.fixture(scope="module")
def parametric():
    return fit_parametric(sweep())


def test_approach_3_recovers_the_law_and_forecasts_100x_past_the_fit(parametric):
    fit = parametric
    assert fit.alpha == pytest.approx(ALPHA, abs=0.03)
    assert fit.beta == pytest.approx(BETA, abs=0.03)
    assert pytest.approx(E, rel=0.05) == fit.E
    assert len(fit.cells) == 35 and fit.excluded == () and fit.warnings == ()
    # Delphi's test: a budget two orders of magnitude past the largest fitted one.
    c = 1e22
    forecast = fit.forecast(c)
    n = true_optimum(c)
    assert forecast["metric"] == pytest.approx(true_loss(n, c / (6 * n)), rel=0.01)
    assert forecast["params"] == pytest.approx(n, rel=0.1)
    assert forecast["params"] * forecast["tokens"] * 6 == pytest.approx(c)


def test_approach_2_recovers_the_compute_optimal_exponents():
    fit = fit_isoflop(sweep())
    assert len(fit.optima) == len(BUDGETS) and fit.excluded == ()
    assert fit.params.exponent == pytest.approx(BETA / (ALPHA + BETA), abs=0.02)
    assert fit.tokens.exponent == pytest.approx(ALPHA / (ALPHA + BETA), abs=0.02)
    assert fit.params.exponent + fit.tokens.exponent == pytest.approx(1.0, abs=1e-6)  # C = 6ND
    for optimum in fit.optima:
        assert optimum.params == pytest.approx(true_optimum(optimum.compute), rel=0.15)
    assert fit.metric.exponent < 0  # loss falls with compute
    n = fit.forecast(1e21)["params"]
    assert n == pytest.approx(true_optimum(1e21), rel=0.15)


def test_bootstrap_intervals_cover_the_truth_and_are_reproducible(parametric):
    iso = bootstrap(fit_isoflop, sweep(), forecast_budgets=[1e21], samples=100, seed=1)
    exponent = iso.quantities["params_exponent"]
    assert exponent.low < BETA / (ALPHA + BETA) < exponent.high
    assert exponent.low < exponent.estimate < exponent.high
    assert iso.samples + iso.failed == 100
    forecast = iso.forecasts[1e21]["params"]
    assert forecast.low < true_optimum(1e21) < forecast.high
    # Seeded: the same cells give the same intervals.
    again = bootstrap(fit_isoflop, sweep(), forecast_budgets=[1e21], samples=100, seed=1)
    assert again.quantities == iso.quantities

    warm = functools.partial(fit_parametric, starts=[parametric.start()])
    par = bootstrap(warm, sweep(), forecast_budgets=[1e22], samples=40, seed=1)
    metric = par.forecasts[1e22]["metric"]
    n = true_optimum(1e22)
    assert metric.low < true_loss(n, 1e22 / (6 * n)) < metric.high
    assert par.quantities["alpha"].high - par.quantities["alpha"].low > 1e-4  # it moved


def test_a_diverged_or_failed_cell_is_left_out_with_its_reason(parametric):
    cells = sweep()
    cells[3] = dataclasses.replace(cells[3], metric=float("nan"))
    cells[10] = dataclasses.replace(cells[10], metric=None)
    fit = fit_isoflop(cells)
    reasons = {e.cell: e.reason for e in fit.excluded}
    assert "diverged" in reasons[cells[3].key] and "failed" in reasons[cells[10].key]
    assert len(fit.optima) == len(BUDGETS)  # six sizes are still a curve
    assert cells[3].key not in fit.optima[0].cells
    par = fit_parametric(cells, starts=[parametric.start()])
    assert len(par.cells) == 33 and {e.cell for e in par.excluded} == set(reasons)


def test_a_budget_without_a_minimum_is_excluded_and_named():
    cells = [dataclasses.replace(c, metric=3.0) if c.compute == 1e19 else c for c in sweep(noise=0)]
    fit = fit_isoflop(cells)
    (excluded,) = fit.excluded
    assert excluded.cell == "budget 1e+19" and "no minimum" in excluded.reason
    assert [o.compute for o in fit.optima] == [1e18, 3e18, 3e19, 1e20]


def test_a_grid_that_misses_the_optimum_says_widen_it():
    cells = [c for c in sweep(noise=0) if c.compute != 1e19]
    # At 1e19, only sizes well above the optimum: the parabola's minimum is outside them.
    for f in (1.5, 2.0, 2.5, 3.0):
        n = true_optimum(1e19) * 4**f
        cells.append(Cell(1e19, n, 1e19 / (6 * n), true_loss(n, 1e19 / (6 * n))))
    fit = fit_isoflop(cells)
    (excluded,) = fit.excluded
    assert "no minimum inside the sampled sizes" in excluded.reason
    assert "is the smallest" in excluded.reason and "widen the grid" in excluded.reason


def test_a_resample_that_repeats_cells_fits_by_size_or_says_why_not():
    """Bootstrap resamples repeat cells: a budget whose resample holds its lowest size
    three times is fitted by size (three distinct sizes around the minimum), and one whose
    lowest cell is now its largest distinct size is excluded by name, never handed to a
    parabola through two sizes (numpy's RankWarning, an arbitrary curve)."""
    import warnings

    by_budget = {}
    for c in sweep(noise=0):
        by_budget.setdefault(c.compute, []).append(c)
    cells = [c for b, group in by_budget.items() if b != 1e19 for c in group]
    group = sorted(by_budget[1e19], key=lambda c: c.params)
    middle = group[3]  # the lowest of the seven sizes
    repeated = [group[2], middle, middle, middle, group[4]]
    bent = [group[0], group[1], group[2], group[2], group[2]]  # no size past the lowest one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rank-deficient parabola fails the test
        fit = fit_isoflop(cells + repeated)
        assert not fit.excluded and len(fit.optima) == len(BUDGETS)
        unbracketed = fit_isoflop(cells + bent)
    (excluded,) = unbracketed.excluded
    assert excluded.cell == "budget 1e+19"
    assert "is the largest" in excluded.reason and "widen the grid" in excluded.reason


def test_a_steep_far_side_does_not_bend_the_parabola():
    """A wide grid's largest models, trained on few tokens, sit far above the parabola of the
    curve's minimum: the fit goes through the cells near the minimum only."""
    cells = sweep(noise=0)
    far = [
        Cell(1e19, n, 1e19 / (6 * n), true_loss(n, 1e19 / (6 * n)) + 1.5, name=f"far-{i}")
        for i, n in enumerate(true_optimum(1e19) * np.array([16.0, 48.0]))
    ]
    fit = fit_isoflop(cells + far)
    (optimum,) = [o for o in fit.optima if o.compute == 1e19]
    assert fit.excluded == () and not {"far-0", "far-1"} & set(optimum.cells)
    assert optimum.params == pytest.approx(true_optimum(1e19), rel=0.15)


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        (sweep(budgets=(1e19,)), r"at least 2 budgets .* got 1"),
        (sweep(sizes=2), r"a parabola needs 3 sizes"),
        ([], r"got 0"),
    ],
)
def test_degenerate_sweeps_raise_a_clear_error(cells, message):
    with pytest.raises(FitError, match=message):
        fit_isoflop(cells)


def test_approach_3_refuses_too_few_cells():
    with pytest.raises(FitError, match=r"at least 5 usable cells over 2\+ budgets, got 3 over 1"):
        fit_parametric(sweep(budgets=(1e19,), sizes=3))
    nan_sweep = [dataclasses.replace(c, metric=math.nan) for c in sweep()]
    with pytest.raises(FitError, match="diverged"):
        fit_parametric(nan_sweep)


def test_approach_3_says_when_a_parameter_ends_at_its_bound():
    # A size term steeper than the search allows (N^-4; alpha is searched up to 3).
    cells = [
        Cell(c, n, c / (6 * n), 2.0 + 1e16 / n**4 + 30 / (c / (6 * n)) ** 0.2)
        for c in (1e12, 3e12)
        for n in (1e4, 2e4, 4e4, 8e4)
    ]
    fit = fit_parametric(cells)
    assert fit.alpha == pytest.approx(3.0)
    assert fit.warnings == ("alpha = 3 is at its bound [0.01, 3.0]: the cells do not constrain it",)
