"""The scaling sweep, Airflow-free: its run form, its grid of cells and their steps, the fit.

* :mod:`operators.sweep.form` -- the ``slipway_scaling_sweep`` form: the pipeline's data and
  launch fields, plus budgets, points, recipe, seeds, metric and forecast budgets, and the
  checks a JSON schema cannot make;
* :mod:`operators.sweep.grid` -- the cells (one recipe run per budget, size and seed) and
  each cell's content-addressed train and evaluate steps, on the pipeline's token stores;
* :mod:`operators.sweep.outcomes` -- what the cells reached, the fits, the pre-registered
  forecasts and their check.

The Airflow operators that run them are :mod:`operators.sweep_tasks`.
"""
