"""Multi-host identity from JobSet/GKE env vars or explicit settings; mesh and shardings."""

from __future__ import annotations

from typing import ClassVar

import jax
import pytest
from jax.sharding import PartitionSpec as P

from trainer.config import DistributedConfig, MeshConfig, ModelConfig, resolve_model
from trainer.distributed import ProcessSpec, _spec_for, make_mesh, mesh_shape, resolve_process
from trainer.model import Transformer
from trainer.optim import leaf_name

AUTO = DistributedConfig()


def test_single_host_needs_no_distributed_init():
    assert resolve_process(AUTO, {}) is None
    assert resolve_process(AUTO, {"TPU_WORKER_HOSTNAMES": "h0", "TPU_WORKER_ID": "0"}) is None


def test_jobset_single_slice():
    env = {"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_WORKER_ID": "2", "JOB_COMPLETION_INDEX": "2"}
    assert resolve_process(AUTO, env) == ProcessSpec("h0:8476", 4, 2)
    env = {"TPU_WORKER_HOSTNAMES": "h0,h1", "JOB_COMPLETION_INDEX": "1"}  # no TPU_WORKER_ID
    assert resolve_process(AUTO, env) == ProcessSpec("h0:8476", 2, 1)


def test_jobset_multislice():
    env = {
        "TPU_WORKER_HOSTNAMES": "s1-h0,s1-h1",
        "TPU_WORKER_ID": "1",
        "MEGASCALE_NUM_SLICES": "3",
        "MEGASCALE_SLICE_ID": "1",
        "MEGASCALE_COORDINATOR_ADDRESS": "s0-h0",
    }
    assert resolve_process(AUTO, env) == ProcessSpec("s0-h0:8476", 6, 3)


def test_explicit_and_none():
    cfg = DistributedConfig(
        mode="explicit", coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1
    )
    assert resolve_process(
        cfg, {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"}
    ) == ProcessSpec("127.0.0.1:1234", 2, 1)
    assert (
        resolve_process(
            DistributedConfig(mode="none"), {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"}
        )
        is None
    )


def test_mesh_shapes():
    assert mesh_shape(MeshConfig(), 8) == (1, 8, 1, 1)
    assert mesh_shape(MeshConfig(replica=2, data=1, fsdp=-1, tensor=2), 16) == (2, 1, 4, 2)
    with pytest.raises(ValueError):
        mesh_shape(MeshConfig(data=3), 8)
    mesh = make_mesh(MeshConfig())
    assert mesh.axis_names == ("replica", "data", "fsdp", "tensor")
    assert mesh.devices.size == jax.device_count()


def test_param_specs_follow_logical_axes():
    class FakeMesh:
        shape: ClassVar[dict[str, int]] = {"replica": 1, "data": 1, "fsdp": 4, "tensor": 2}

    cfg = resolve_model(ModelConfig(preset="30m"), vocab_size=1000)
    shapes = jax.eval_shape(lambda k: Transformer(cfg, k), jax.random.key(0))
    specs = {
        leaf_name(p): _spec_for(p, x.shape, FakeMesh())
        for p, x in jax.tree_util.tree_flatten_with_path(shapes)[0]
    }
    assert specs["wq"] == P(None, "fsdp", "tensor", None)  # leading stacked-layer axis
    assert specs["w_down"] == P(None, "tensor", "fsdp")
    assert specs["embed"] == P("tensor", "fsdp")
    assert specs["weight"] == P(None)


def test_replica_axis_on_devices_of_one_slice_uses_the_plain_mesh():
    # CPU devices (and single-slice TPUs) may report slice_index 0 for every device: the
    # replica axis then spans processes, not slices, and must not need a hybrid mesh.
    from dataclasses import dataclass

    from trainer.config import MeshConfig
    from trainer.distributed import make_mesh

    @dataclass(frozen=True)
    class FakeDevice:  # a fake: only the attributes make_mesh reads
        id: int
        process_index: int
        slice_index: int = 0

    devices = [FakeDevice(i, i) for i in range(2)]
    mesh = make_mesh(MeshConfig(replica=2, data=1, fsdp=1, tensor=1), devices)
    assert mesh.devices.shape[0] == 2


def test_multislice_mesh_puts_slices_on_the_replica_axis(monkeypatch):
    from dataclasses import dataclass

    from trainer.distributed import device_slices

    @dataclass(frozen=True)
    class FakeDevice:  # a CPU/GPU-like device: no slice_index
        id: int
        process_index: int
        platform: str = "cpu"
        device_kind: str = "cpu"

    # 4 processes x 2 devices; 2 slices of 2 hosts (process id = slice x hosts + worker)
    devices = [FakeDevice(10 * p + i, p) for p in (3, 1, 0, 2) for i in range(2)]
    assert device_slices(devices, 1) == [0] * 8
    assert device_slices(devices, 2) == [1, 1, 0, 0, 0, 0, 1, 1]
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")  # the JobSet's multislice variable
    mesh = make_mesh(MeshConfig(replica=2, data=-1), devices)
    assert mesh.devices.shape == (2, 4, 1, 1)
    procs = [[d.process_index for d in row.ravel()] for row in mesh.devices]
    assert procs == [[0, 0, 1, 1], [2, 2, 3, 3]]  # one slice per replica, hosts contiguous
    with pytest.raises(ValueError, match="replica"):
        make_mesh(MeshConfig(replica=1, data=-1), devices)
    with pytest.raises(ValueError, match="slices"):
        device_slices(devices, 3)
