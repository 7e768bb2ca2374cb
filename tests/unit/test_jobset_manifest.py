"""JobSet manifests: valid against the JobSet CRD and Kubernetes' own schemas for every
catalogue type and 1, 2 and 4 slices; shaped as GKE TPU JobSets need; unsafe input refused."""

from __future__ import annotations

import ast
import copy
import json
import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from operators.jobset import manifest as m
from operators.jobset.catalogue import CATALOGUE
from operators.jobset.local import expand
from operators.jobset.manifest import ManifestError, TrainingLaunch
from tests.support.jobset_crd import crd_validator

REPO = Path(__file__).resolve().parents[2]
# Oldest minor GKE's regular channel still runs, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())

# One multi-host topology per type (single-host too for the 2D ones, whose VMs differ).
SHAPES = [
    ("v4", "2x2x4"),
    ("v5e", "2x4"),
    ("v5e", "4x4"),
    ("v5p", "2x2x1"),
    ("v5p", "4x4x4"),
    ("v6e", "2x2"),
    ("v6e", "4x8"),
    ("tpu7x", "2x2x4"),
    ("cpu", "2"),
]
assert {a for a, _ in SHAPES} == set(CATALOGUE)


def launch(**kw: Any) -> TrainingLaunch:
    base: dict[str, Any] = {
        "name": "run-1",
        "image": "us-docker.pkg.dev/proj/slipway/trainer:abc123",
        "config_uri": "gs://bucket/runs/run-1/config.yaml",
    }
    return TrainingLaunch(**{**base, **kw})


def crd_errors(manifest: dict) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in crd_validator(reject_unknown=True).iter_errors(manifest)
    ]


def as_job(manifest: dict, index: int = 0) -> dict:
    """The Job JobSet creates for replica ``index``: the embedded JobTemplateSpec wrapped so
    kubernetes-validate (which knows top-level kinds) checks it, pod template included."""
    rj = manifest["spec"]["replicatedJobs"][0]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": f"{manifest['metadata']['name']}-{rj['name']}-{index}",
            "namespace": manifest["metadata"]["namespace"],
            **rj["template"].get("metadata", {}),
        },
        "spec": rj["template"]["spec"],
    }


def pod_spec(manifest: dict) -> dict:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def env_of(manifest: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod_spec(manifest)["containers"][0]["env"]}


# --------------------------------------------------------------------------------------------
# schema validation


@pytest.mark.parametrize("slices", [1, 2, 4])
@pytest.mark.parametrize(("acc", "topo"), SHAPES)
def test_valid_against_crd_and_kubernetes(acc, topo, slices):
    spec = launch(
        accelerator=acc,
        topology=topo,
        slices=slices,
        service_account="slipway-trainer",
        queue="tpu-queue",
        env={"WANDB_MODE": "offline"},
        labels={"slipway.dev/sweep": "isoflop-1e18"},
    )
    manifest = spec.render()
    json.dumps(manifest)  # plain data: goes through the Kubernetes API as is
    assert crd_errors(manifest) == []
    for version in K8S_VERSIONS:
        # Every slice's Job has the same spec; the name is the longest for the last one.
        kubernetes_validate.validate(as_job(manifest, slices - 1), version, strict=True)
        template = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, **template}
        kubernetes_validate.validate(pod, version, strict=True)


def test_validators_catch_mistakes():
    # The checks above are only worth something if they can fail.
    manifest = launch(accelerator="v5p", topology="2x2x4").render()
    typo = copy.deepcopy(manifest)
    pod_spec(typo)["containers"][0]["imagePullPolicyy"] = "Always"
    assert any("imagePullPolicyy" in e for e in crd_errors(typo))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(as_job(typo), K8S_VERSIONS[0], strict=True)
    wrong = copy.deepcopy(manifest)
    wrong["spec"]["failurePolicy"]["rules"][0]["action"] = "Explode"
    assert any("Explode" in e for e in crd_errors(wrong))
    wrong = copy.deepcopy(manifest)
    wrong["spec"]["replicatedJobs"][0]["template"]["spec"]["completionMode"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(as_job(wrong), K8S_VERSIONS[0], strict=True)


# --------------------------------------------------------------------------------------------
# shape of the manifest


@pytest.mark.parametrize("slices", [1, 2, 4])
def test_tpu_manifest_shape(slices):
    spec = launch(
        accelerator="v5p",
        topology="2x2x4",
        slices=slices,
        max_restarts=5,
        service_account="slipway-trainer",
        queue="tpu-queue",
        ttl_seconds_after_finished=600,
        labels={"team": "pretrain"},
    )
    doc = spec.render()
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-queue"
    assert doc["metadata"]["labels"]["team"] == "pretrain"
    assert doc["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    js = doc["spec"]
    assert js["network"]["enableDNSHostnames"] is True
    assert js["ttlSecondsAfterFinished"] == 600
    assert js["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["slice"]}
    assert js["failurePolicy"]["maxRestarts"] == 5
    assert js["failurePolicy"]["rules"] == [
        {
            "name": "failFastOnFatalExitCode",
            "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"],
        }
    ]
    (rj,) = js["replicatedJobs"]
    assert rj["replicas"] == slices
    job = rj["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rules[0]["action"] == "Count"  # preemption restarts, whatever the exit code
    assert rules[1] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [1, 2]},
    }
    pod = pod_spec(doc)
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x4",
    }
    assert pod["tolerations"] == [
        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["serviceAccountName"] == "slipway-trainer"
    assert pod["automountServiceAccountToken"] is False  # no Kubernetes API token in a pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    (c,) = pod["containers"]
    assert c["resources"] == {
        "requests": {"google.com/tpu": "4"},
        "limits": {"google.com/tpu": "4"},
    }
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["command"] == ["python", "-m", "trainer.train"]
    assert c["args"] == ["--config", "gs://bucket/runs/run-1/config.yaml"]
    env = env_of(doc)
    assert "TPU_WORKER_ID" not in env  # GKE's TPU webhook sets these for TPU pods
    if slices == 1:
        assert not any(k.startswith("MEGASCALE_") for k in env)
    else:
        ann = "metadata.annotations['jobset.sigs.k8s.io/{}']"
        assert env["MEGASCALE_NUM_SLICES"]["valueFrom"]["fieldRef"]["fieldPath"] == ann.format(
            "replicatedjob-replicas"
        )
        assert env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == ann.format(
            "job-index"
        )
        addr = env["MEGASCALE_COORDINATOR_ADDRESS"]["value"]
        assert addr == "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME)"
        # $(VAR) only expands variables defined earlier in the list.
        names = list(env)
        assert names.index("JOBSET_NAME") < names.index("MEGASCALE_COORDINATOR_ADDRESS")
        assert expand(addr, {"JOBSET_NAME": "run-1", "REPLICATED_JOB_NAME": "slice"}) == (
            "run-1-slice-0-0.run-1"
        )


def test_single_host_tpu_requests_all_its_chips():
    pod = pod_spec(launch(accelerator="v6e", topology="2x4").render())
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "8"}
    job = launch(accelerator="v6e", topology="2x4").render()["spec"]["replicatedJobs"][0]
    assert job["template"]["spec"]["parallelism"] == 1


def test_cpu_manifest_has_no_tpu_parts_and_spells_out_worker_identity():
    doc = launch(accelerator="cpu", topology="3", slices=2).render()
    assert "annotations" not in doc["metadata"]
    pod = pod_spec(doc)
    for key in ("nodeSelector", "tolerations", "hostNetwork", "dnsPolicy"):
        assert key not in pod
    assert "resources" not in pod["containers"][0]
    env = env_of(doc)
    assert env["TPU_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    hosts = expand(
        env["TPU_WORKER_HOSTNAMES"]["value"],
        {"JOBSET_NAME": "run-1", "REPLICATED_JOB_NAME": "slice", "JOB_INDEX": "1"},
    )
    assert hosts == "run-1-slice-1-0.run-1,run-1-slice-1-1.run-1,run-1-slice-1-2.run-1"


def test_env_and_args():
    spec = launch(
        args=("--config", "gs://b/c.yaml", "--set", "data.sources=[{path: gs://b/tok}]"),
        env={"B": "x", "A": "price $(HOME) $$5"},
    )
    c = pod_spec(spec.render())["containers"][0]
    assert c["args"][-1] == "data.sources=[{path: gs://b/tok}]"
    env = env_of(spec.render())
    assert env["PYTHONUNBUFFERED"]["value"] == "1"
    # '$' escaped so Kubernetes does not expand it: the process sees the value as given.
    assert expand(env["A"]["value"], {"HOME": "/root"}) == "price $(HOME) $$5"
    assert list(env)[-2:] == ["A", "B"]  # user env last, sorted (stable manifests)


def test_no_fatal_codes_means_no_fail_fast_rules():
    doc = launch(fatal_exit_codes=()).render()
    assert "rules" not in doc["spec"]["failurePolicy"]
    rules = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["Count"]


def test_spec_is_frozen_and_normalised():
    spec = launch(env={"X": "1"}, fatal_exit_codes=(2, 1, 2), command=["python", "-m", "x"])
    assert spec.fatal_exit_codes == (1, 2) and spec.command == ("python", "-m", "x")
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env["Y"] = "2"  # type: ignore[index]
    assert spec.render() == spec.render()


def test_exit_codes_match_the_trainer():
    # operators may not import the trainer (JAX); read its constants from the source instead.
    tree = ast.parse((REPO / "trainer" / "train.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            names = [t.id for t in node.targets[0].elts]
            if "EXIT_RESTART" in names:
                values = dict(zip(names, ast.literal_eval(node.value), strict=True))
                break
    else:
        pytest.fail("trainer/train.py no longer defines EXIT_RESTART")
    assert values["EXIT_RESTART"] == m.EXIT_RESTART
    assert values["EXIT_FAILED"] == m.EXIT_FAILED
    assert values["EXIT_CONFIG"] == m.EXIT_CONFIG


# --------------------------------------------------------------------------------------------
# refused before rendering


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"name": "Run1"}, "name 'Run1': must be a DNS-1123 label"),
        ({"name": "run_1"}, "DNS-1123 label"),
        ({"name": "-run"}, "DNS-1123 label"),
        ({"name": "r" * 64}, "DNS-1123 label"),
        ({"name": "r" * 55, "accelerator": "cpu", "topology": "16"}, "exceed 63 characters"),
        ({"namespace": "ns;rm"}, "namespace"),
        ({"image": "img:1; rm -rf /"}, "image"),
        ({"image": ""}, "image"),
        ({"config_uri": ""}, "config_uri is required"),
        ({"config_uri": "gs://b/c.yaml; curl evil"}, "shell metacharacters"),
        ({"args": ("--config", "$(cat /etc/passwd)")}, "shell metacharacters"),
        ({"args": ("--config", "a`id`")}, "shell metacharacters"),
        ({"args": ("--config", "a\nb")}, "shell metacharacters"),
        ({"args": "--config c.yaml"}, "not a shell string"),
        ({"args": ("--config", 3)}, "must be a string"),
        ({"command": ("bash", "-c", "python -m trainer.train")}, "is a shell"),
        ({"command": ("/bin/sh",)}, "is a shell"),
        ({"command": ()}, "command must not be empty"),
        ({"env": {"TPU_WORKER_ID": "0"}}, "set by JobSet/GKE"),
        ({"env": {"MEGASCALE_SLICE_ID": "0"}}, "set by JobSet/GKE"),
        ({"env": {"1BAD": "x"}}, "environment variable name"),
        ({"env": {"A": 1}}, "must be a string"),
        ({"env": {"A": "a\x00b"}}, "NUL"),
        ({"labels": {"jobset.sigs.k8s.io/jobset-name": "x"}}, "reserved"),
        ({"labels": {"team": "a b"}}, "label 'team' value"),
        ({"labels": {"Bad_Prefix.io/x": "a"}}, "prefix"),
        ({"labels": {"x" * 64: "a"}}, "name part"),
        ({"service_account": "SA"}, "service account"),
        ({"queue": "q" * 64}, "Kueue queue"),
        ({"accelerator": "v9"}, "unknown accelerator"),
        ({"accelerator": "v5p", "topology": "4x4"}, "AxBxC"),
        ({"accelerator": "v5p", "topology": "2x2x1", "slices": 0}, "at least 1"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"max_restarts": True}, "max_restarts"),
        ({"fatal_exit_codes": (42,)}, "restart me"),
        ({"fatal_exit_codes": (0,)}, "fatal exit code"),
        ({"fatal_exit_codes": (256,)}, "fatal exit code"),
        ({"run_as_user": 0}, "run_as_user"),
        ({"ttl_seconds_after_finished": -5}, "ttl_seconds_after_finished"),
    ],
)
def test_refused(kw, match):
    with pytest.raises(ManifestError, match=match):
        launch(**kw)


# --------------------------------------------------------------------------------------------
# the device mesh a launch implies (operators/jobset/mesh.py), as the trainer reads it


def _mesh_of(args: list[str]) -> dict[str, int]:
    """The trainer's MeshConfig from a container's args, parsed as trainer.config does."""
    from trainer.config import MeshConfig, from_dict, parse_overrides

    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    mesh = from_dict(MeshConfig, parse_overrides(sets).get("mesh", {}), "mesh")
    return {"replica": mesh.replica, "data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}


def _run_form(**conf: Any) -> dict[str, Any]:
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import pipeline_params

    params = ParamsDict(pipeline_params())
    params.update(conf)
    return params.validate()


def _gke_platform(monkeypatch) -> None:
    """A platform's trainer image and training namespace, pre-filled into the form's gke
    object: a gke run without a namespace is refused (validate, and the launch's policy)."""
    monkeypatch.setenv("SLIPWAY_TRAINER_IMAGE", "us-docker.pkg.dev/proj/slipway/trainer:1")
    monkeypatch.setenv("SLIPWAY_TRAINING_NAMESPACE", "slipway-training")


def test_multislice_v5p_manifest_carries_the_matching_mesh(monkeypatch):
    """The rendered GKE JobSet of an 8b run on 2 v5p slices: replica across the slices, the
    parameters sharded (fsdp) inside each, and the megascale settings the mesh relies on."""
    from operators.launching import trainer_launch
    from trainer.distributed import mesh_shape

    _gke_platform(monkeypatch)
    params = _run_form(
        model_preset="8b",
        accelerator="v5p",
        topology="2x2x4",
        slices=2,
        backend="gke",
        image="us-docker.pkg.dev/proj/slipway/trainer:abc123",
    )
    manifest = trainer_launch(
        "slipway-train-12345678", params, config_uri="gs://b/run/cfg.json"
    ).render()
    assert crd_errors(manifest) == []
    assert manifest["spec"]["replicatedJobs"][0]["replicas"] == 2
    container = pod_spec(manifest)["containers"][0]
    args = container["args"]
    assert args[:2] == ["--config", "gs://b/run/cfg.json"]
    mesh = _mesh_of(args)
    assert mesh == {"replica": 2, "data": 1, "fsdp": -1, "tensor": 1}
    # 2 slices x 16 chips: the trainer lays it out as 2 x 16 fsdp, every slice on its own.
    assert mesh_shape(_mesh_config(mesh), 32) == (2, 1, 16, 1)
    assert {"MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS"} <= set(
        env_of(manifest)
    )


def _mesh_config(mesh: dict[str, int]) -> Any:
    from trainer.config import MeshConfig

    return MeshConfig(**mesh)


@pytest.mark.parametrize(
    ("preset", "accelerator", "topology", "slices", "expected"),
    [
        ("nano", "cpu", "1", 1, {"replica": 1, "data": -1, "fsdp": 1, "tensor": 1}),
        ("nano", "cpu", "2", 2, {"replica": 2, "data": -1, "fsdp": 1, "tensor": 1}),
        ("150m", "v5e", "4x4", 1, {"replica": 1, "data": -1, "fsdp": 1, "tensor": 1}),
        ("300m", "v5e", "4x4", 1, {"replica": 1, "data": 1, "fsdp": -1, "tensor": 1}),
        ("600m", "v4", "2x2x4", 4, {"replica": 4, "data": 1, "fsdp": -1, "tensor": 1}),
        ("1.4b", "v5p", "2x2x4", 1, {"replica": 1, "data": -1, "fsdp": 1, "tensor": 1}),
        ("8b", "v5p", "4x4x4", 2, {"replica": 2, "data": 1, "fsdp": -1, "tensor": 1}),
    ],
)
def test_default_mesh_follows_the_slices_and_the_chip_memory(
    preset, accelerator, topology, slices, expected
):
    from operators.jobset.catalogue import resolve
    from operators.jobset.mesh import launch_mesh

    assert launch_mesh(resolve(accelerator, topology, slices), preset) == expected


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"tensor": 2}, {"replica": 1, "data": -1, "fsdp": 1, "tensor": 2}),
        ({"fsdp": 4}, {"replica": 1, "data": -1, "fsdp": 4, "tensor": 1}),
        ({"data": 2, "fsdp": 2, "tensor": 4}, {"replica": 1, "data": 2, "fsdp": 2, "tensor": 4}),
        ({"fsdp": -1, "tensor": 2}, {"replica": 1, "data": 1, "fsdp": -1, "tensor": 2}),
    ],
)
def test_mesh_override_on_a_slice(override, expected):
    from operators.jobset.catalogue import resolve
    from operators.jobset.mesh import launch_mesh

    assert launch_mesh(resolve("v5e", "4x4"), "150m", override) == expected


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"data": 3}, "does not lay out on the 16 chips"),
        ({"data": 2, "fsdp": 2, "tensor": 2}, "does not lay out on the 16 chips"),
        ({"data": -1, "fsdp": -1}, "at most one axis may be -1"),
        ({"replica": 2}, "unknown axis replica"),
        ({"tensor": 0}, "mesh.tensor: must be -1"),
    ],
)
def test_bad_mesh_override_is_refused_naming_the_axis(override, match):
    from operators.jobset.catalogue import resolve
    from operators.jobset.mesh import MeshError, launch_mesh

    with pytest.raises(MeshError, match=match):
        launch_mesh(resolve("v5e", "4x4"), "150m", override)


def test_preset_sizes_are_the_trainers_exact_counts():
    from operators.jobset.mesh import preset_params

    assert preset_params("nano") == 8_241_312 and preset_params("8b") == 8_030_261_248
    assert preset_params("not-a-preset") == 0


def test_run_form_mesh_override_is_checked_before_the_run():
    from operators.pipeline.form import RunConfigError, check_run_config

    check_run_config(_run_form(accelerator="cpu", topology="2", mesh={"data": 2}))
    with pytest.raises(RunConfigError, match=r"mesh: .* does not lay out on the 2 chips"):
        check_run_config(_run_form(accelerator="cpu", topology="2", mesh={"data": 4}))


@pytest.mark.parametrize(
    ("form", "dp"),
    [
        ({"accelerator": "v5e", "topology": "2x2", "batch_size": 6}, 4),
        # the default batch on two 16-chip slices: 32 ways, the replica axis included
        ({"accelerator": "v5e", "topology": "4x4", "slices": 2, "batch_size": 16}, 32),
        ({"accelerator": "v5e", "topology": "2x4", "batch_size": 6, "mesh": {"tensor": 2}}, 4),
    ],
)
def test_a_batch_the_mesh_cannot_split_is_refused_before_the_run(form, dp):
    # The trainer refuses it at its start, after the whole data plane: validate says it first.
    from operators.jobset.mesh import data_parallel_size, launch_mesh, resolved
    from operators.pipeline.form import RunConfigError, check_run_config

    bad = _run_form(**form)
    with pytest.raises(
        RunConfigError,
        match=rf"batch_size: {form['batch_size']} is not "
        rf"divisible by the data-parallel size {dp} ",
    ):
        check_run_config(bad)
    check_run_config({**bad, "batch_size": 2 * dp})
    # the mesh it counted lays out on every chip of the launch, its -1 axis resolved
    shape = launch(
        accelerator=form["accelerator"], topology=form["topology"], slices=form.get("slices", 1)
    ).shape
    mesh = resolved(
        launch_mesh(shape, bad["model_preset"], form.get("mesh")), shape.chips_per_slice
    )
    assert data_parallel_size(mesh) == dp
    assert math.prod(mesh.values()) == shape.chips_per_slice * shape.slices


def test_a_sweep_cells_jobset_renders_with_its_step_named_in_a_label(monkeypatch):
    """A sweep cell's step name has slashes, which no label value may hold: its gke launch
    once failed at submit (every cell of a gke sweep night)."""
    from operators.jobset.gke import STEP_LABEL
    from operators.launching import gke_launch_options, trainer_launch
    from operators.steps import Step, resolve

    _gke_platform(monkeypatch)
    params = _run_form(
        backend="gke",
        accelerator="v5e",
        topology="2x2",
        batch_size=16,
        image="us-docker.pkg.dev/proj/slipway/trainer:abc123",
    )
    name = "sweep/train/C1e16-N" + "1234567" * 9 + "-s0"  # long, too: cut to 63
    spec = resolve(Step(name, {"seed": 0}, unversioned={"backend": "gke"}), "/steps")
    options = gke_launch_options(spec, params)
    manifest = trainer_launch(
        "slipway-train-12345678", params, config_uri="gs://b/c.json", **options
    ).render()
    assert crd_errors(manifest) == []
    label = manifest["metadata"]["labels"][STEP_LABEL]
    assert label.startswith("sweep.train.C1e16-N1234567") and len(label) <= 63
    assert label[-1].isalnum()
