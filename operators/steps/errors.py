"""The step model's errors."""

from __future__ import annotations


class StepError(RuntimeError):
    """Base class of step-model errors."""


class StepFailedElsewhere(StepError):
    """The run this runner waited for ended FAILED.

    A waiter does not rerun another owner's failure in the same call: with N concurrent
    waiters a deterministic failure would otherwise run N times. The next invocation (an
    Airflow retry, a backfill) reruns it, as for any FAILED step.
    """


class StepWaitTimeout(StepError):
    """A live lease held by another owner did not end within the wait timeout."""


class LeaseLost(StepError):
    """Another runner took over this runner's lease (ours looked stale): results discarded."""
