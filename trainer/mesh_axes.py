"""The device mesh's axis names, in one place for the module that builds meshes
(``trainer.distributed``) and the one that runs kernels per device inside them
(``trainer.kernels``), which the former imports through the model."""

from __future__ import annotations

AXES = ("replica", "data", "fsdp", "tensor")
BATCH_AXES = ("replica", "data", "fsdp")  # the batch is split over these, together
HEAD_AXIS = "tensor"  # attention heads are split over this one
