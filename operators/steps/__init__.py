"""The step model: content-addressed steps with status markers and heartbeat leases.

One concept per module: ``version`` (steps, versions, paths), ``store`` (the storage
operations), ``lease`` (markers, lease generations, the one lease holder :class:`HeldLease`),
``plan`` (the dry run), ``runner`` (:class:`StepRunner`); this package re-exports them.

Marin's executor semantics, independent of Airflow (operators wrap it; tests run it bare):

* A :class:`Step` is a name, a *versioned* config, upstream steps and an *unversioned* config.
  Its version is the sha256 of canonical JSON over its name, versioned config and upstream
  identities (name + version). Unversioned fields (workers, runner...) and the storage root do
  not enter the hash, and upstream outputs are referenced symbolically (:func:`output_of`), so
  the same pipeline has the same versions on a laptop and on ``gs://``.
* Its output lives at ``{root}/{name}-{version[:HASH_LEN]}``, holding ``.status.json``
  (SUCCESS, FAILED with error, RUNNING with the lease) and the lease files ``.lease-NNNNNN``.
* :meth:`StepRunner.run` skips a SUCCESS step (CACHED), reruns a FAILED one, waits for a live
  lease (WAITED) and takes over a stale one (TOOK_OVER). Exclusion rests on one primitive,
  *atomic create* of lease generation ``n``: locally ``O_CREAT|O_EXCL``, on GCS an upload with
  ``ifGenerationMatch=0`` (gcsfs ``mode="create"``). Taking over generation ``n`` means
  creating ``n + 1``, so of several runners that see the same stale lease exactly one wins,
  without compare-and-swap on a mutable file.
* :func:`plan` is the dry run: what each step would do, and why, using the same probe.
"""

from operators.steps.errors import LeaseLost, StepError, StepFailedElsewhere, StepWaitTimeout
from operators.steps.lease import (
    LEASE_PREFIX,
    STATUS_FILE,
    TRACEBACK_TAIL_CHARS,
    HeldLease,
    Lease,
    Status,
    StatusRecord,
    StepState,
    current_lease,
    probe,
    read_status,
    this_process,
    without_non_finite,
)
from operators.steps.plan import Action, PlanEntry, decide, format_plan, plan
from operators.steps.runner import Outcome, StepResult, StepRunner, default_owner
from operators.steps.store import FsspecStore, LocalStore, Store, store_for
from operators.steps.version import (
    HASH_LEN,
    OutputRef,
    Step,
    StepSpec,
    canonical_json,
    join,
    output_of,
    output_path,
    resolve,
    step_version,
    topological,
)

__all__ = [
    "HASH_LEN",
    "LEASE_PREFIX",
    "STATUS_FILE",
    "TRACEBACK_TAIL_CHARS",
    "Action",
    "FsspecStore",
    "HeldLease",
    "Lease",
    "LeaseLost",
    "LocalStore",
    "Outcome",
    "OutputRef",
    "PlanEntry",
    "Status",
    "StatusRecord",
    "Step",
    "StepError",
    "StepFailedElsewhere",
    "StepResult",
    "StepRunner",
    "StepSpec",
    "StepState",
    "StepWaitTimeout",
    "Store",
    "canonical_json",
    "current_lease",
    "decide",
    "default_owner",
    "format_plan",
    "join",
    "output_of",
    "output_path",
    "plan",
    "probe",
    "read_status",
    "resolve",
    "step_version",
    "store_for",
    "this_process",
    "topological",
    "without_non_finite",
]
