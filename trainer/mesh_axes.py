"""The device mesh's axis names, in one place for the module that builds meshes
(``trainer.distributed``), the one that runs kernels per device inside them
(``trainer.kernels``), which the former imports through the model, and the launch's check
of a run's batch against its mesh (``operators.jobset.mesh``). Constants only."""

from __future__ import annotations

AXES = ("replica", "data", "fsdp", "tensor")
BATCH_AXES = ("replica", "data", "fsdp")  # the batch is split over these, together
HEAD_AXIS = "tensor"  # attention heads are split over this one
