"""A step's RUNNING lease while its task is deferred.

The step model (:mod:`operators.steps`) keeps a running step's lease alive from a heartbeat
thread in the worker process, renewing a 120 s lease every 40 s. A *deferred* task has no
worker process: the task ends after submitting the JobSet and resumes on some worker when the
trigger fires. Left alone, the lease would expire within two minutes and the next DAG run that
reaches the same step would take it over while the JobSet is still training.

Chosen: **the trigger renews the lease**, and the lease is longer while deferred
(:data:`DEFERRED_LEASE_SECONDS`, renewed every third of it). The trigger is the one process
that is alive exactly while the JobSet is followed, so the lease lives as long as somebody
watches the run and no longer: a lease fixed at "as long as training might take" would block
every rerun for weeks after a crash. The longer lease covers the gaps nobody renews in -- the
submission itself, a triggerer restart or failover, and the queueing between the trigger's
event and ``execute_complete`` on a worker. If the lease is taken over anyway (a triggerer
down for longer than that), the trigger notices (the next generation exists), stops renewing
and ends with ``lease_lost`` without deleting the JobSet: the new owner's submission finds the
same JobSet (same name, same step version) and adopts it, so the training is never run twice.

Built on the step model's public lease API (:meth:`operators.steps.StepRunner.run_held` and
:class:`operators.steps.HeldLease`): lease generations created atomically, status markers, and
the same ``(owner, generation)`` ownership check the heartbeat makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from operators.steps import HeldLease, Step, StepResult, StepRunner, StepSpec, join

__all__ = ["DEFERRED_LEASE_SECONDS", "DeferredLease", "SubmittingStepRunner", "handle_file"]

DEFERRED_LEASE_SECONDS = 600.0

# The step model's held lease, by the name the trigger and the training operator use: JSON-able
# (to_dict/from_dict), renewed by the trigger, ended by execute_complete or on_kill.
DeferredLease = HeldLease


class SubmittingStepRunner(StepRunner):
    """A :class:`StepRunner` whose work function only *submits*: the lease stays held.

    Everything else is the step model's: SUCCESS is a cache hit, a live lease is waited for, a
    stale one taken over. When ``fn`` returns, the step is left RUNNING under
    :attr:`lease` (the trigger renews it); when it raises, the step is FAILED and the lease
    released, as for any step. :attr:`lease` is set before ``fn`` runs, so ``fn`` can record
    it (the JobSet handle file) for whoever resumes the task.
    """

    def __init__(self, root: str, **kwargs: Any) -> None:
        kwargs.setdefault("lease_seconds", DEFERRED_LEASE_SECONDS)
        super().__init__(root, **kwargs)
        self.lease: DeferredLease | None = None

    def run(
        self,
        step: Step,
        fn: Callable[[StepSpec], Any],
        *,
        on_lost: Callable[[], None] | None = None,  # no heartbeat here: the trigger renews
    ) -> StepResult:
        def submit(spec: StepSpec, lease: HeldLease) -> Any:
            self.lease = lease
            return fn(spec)

        return self.run_held(step, submit)


def handle_file(output: str) -> str:
    """Where a deferred step keeps its JobSet handle (read back after a trigger timeout)."""
    return join(output, "jobset_handle.json")
