"""The Helm chart (``charts/slipway``), checked offline with helm-python-sdk (Helm's Go SDK, no
helm binary, no cluster): it lints; it renders with the default values and with
``values-production.yaml``; every rendered object is valid for Kubernetes (kubernetes-validate,
strict, 1.31 and the newest it ships); the RBAC is namespaced and exactly least-privilege; the
service accounts carry Workload Identity; ``values.schema.json`` refuses bad values; Kueue
objects appear only when enabled; and the chart agrees with the operators' code (environment
names, pod labels, TPU catalogue, run-form fields).

The Airflow dependency. ``Chart.yaml`` declares the official Apache Airflow chart with
``condition: airflow.enabled``; no chart repository is reachable here, so it is never
downloaded and every render sets ``airflow.enabled=false``. The helm CLI (``helm template`` /
``helm install``) refuses a chart whose declared dependency is missing from ``charts/``, even
when its condition is false; the SDK's ``Chart.render`` runs Helm's template engine on the
loaded chart without that check. So that nothing rests on this difference, the tests also
render a temporary copy of the chart whose ``Chart.yaml`` has no dependency list (exactly what
the CLI would accept) and require identical output, lint that copy strictly, and check the
declaration itself (name, repository, pinned version, condition) separately.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from operators.jobset.catalogue import CATALOGUE, resolve
from operators.jobset.manifest import API_VERSION as JOBSET_API_VERSION
from operators.jobset.manifest import KUEUE_QUEUE_KEY, TrainingLaunch

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slipway"
VALUES_FILES = {
    "default": None,
    "production": CHART / "values-production.yaml",
}
RELEASE, NAMESPACE = "slipway", "slipway"
# Oldest minor GKE's regular channel still runs, and the newest kubernetes-validate knows
# (the same pair the JobSet manifest tests use).
K8S_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())
WI_ANNOTATION = "iam.gke.io/gcp-service-account"
GSA_RE = re.compile(
    r"^[a-z][a-z0-9-]{4,28}[a-z0-9]@[a-z][a-z0-9-]{4,28}[a-z0-9]\.iam\.gserviceaccount\.com$"
)
KUEUE_KINDS = frozenset({"ResourceFlavor", "ClusterQueue", "LocalQueue"})
CLUSTER_SCOPED = frozenset({"ResourceFlavor", "ClusterQueue"})
# Every kind the chart may render. Anything else is a new, unreviewed object.
KINDS = (
    frozenset(
        {
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ConfigMap",
            "NetworkPolicy",
        }
    )
    | KUEUE_KINDS
)

# ConfigMap keys the operators read by these literal names (each must appear in operators/
# source); SLIPWAY_DATAFLOW_<FIELD> keys, which operators/dataflow.py reads by prefix; and
# the run form's training defaults, which operators/pipeline/form.py reads (PLATFORM_ENV).
READ_BY_OPERATORS = frozenset(
    {
        "SLIPWAY_HOME",
        "SLIPWAY_LINEAGE_DB",
        "SLIPWAY_DATA_DIR",
        "SLIPWAY_IMAGE",
        "SLIPWAY_ALLOWED_DATA_ROOTS",
        "SLIPWAY_PIPELINE_SCHEDULE",
        "SLIPWAY_SWEEP_SCHEDULE",
        "SLIPWAY_SWEEP_CONF",
        *(
            f"SLIPWAY_ALLOWED_{k}"
            for k in (
                "IMAGES",
                "NAMESPACES",
                "SERVICE_ACCOUNTS",
                "DATAFLOW_SERVICE_ACCOUNTS",
                "GCP_CONN_IDS",
                "KUBECONFIGS",
                "GKE_CLUSTERS",
                "DATAFLOW_PROJECTS",
                "DATAFLOW_LOCATIONS",
            )
        ),
    }
)
STANDARD_ENV = frozenset({"GOOGLE_CLOUD_PROJECT"})


def form_default_env_names() -> frozenset[str]:
    from operators.pipeline.form import PLATFORM_ENV

    return frozenset(PLATFORM_ENV.values())


# --------------------------------------------------------------------------------------------
# rendering


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's coalescing for two values documents: maps merge, anything else is replaced."""
    out = dict(copy.deepcopy(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def file_values(which: str) -> dict[str, Any]:
    """The values a ``-f`` file supplies (empty for the chart defaults)."""
    path = VALUES_FILES[which]
    return {} if path is None else yaml.safe_load(path.read_text())


def user_values(which: str, **overrides: Any) -> dict[str, Any]:
    """What ``helm template -f <file> --set airflow.enabled=false ...`` passes to Helm."""
    values = deep_merge(file_values(which), {"airflow": {"enabled": False}})
    return deep_merge(values, overrides)


@cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render_files(values: Mapping[str, Any], chart_obj: helm.Chart | None = None) -> dict[str, str]:
    return (chart_obj or chart()).render(dict(values), name=RELEASE, namespace=NAMESPACE)


def objects_of(files: Mapping[str, str]) -> list[dict[str, Any]]:
    """Rendered manifests as objects (NOTES.txt is text for the user, not a manifest)."""
    objs: list[dict[str, Any]] = []
    for name, text in sorted(files.items()):
        if not name.endswith((".yaml", ".yml")):
            continue
        objs += [d for d in yaml.safe_load_all(text) if d]
    return objs


def render(which: str = "default", **overrides: Any) -> list[dict[str, Any]]:
    return objects_of(render_files(user_values(which, **overrides)))


def merged_values(which: str) -> dict[str, Any]:
    """The values a release would use: chart defaults coalesced with the file."""
    return chart().merge_values(file_values(which))


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = of_kind(objs, kind)
    return obj


def config_of(objs: list[dict[str, Any]]) -> dict[str, str]:
    (cm,) = [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == "slipway-config"]
    return cm["data"]


@pytest.fixture(scope="module", params=sorted(VALUES_FILES))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


# --------------------------------------------------------------------------------------------
# the dependency, lint, and rendering without the dependency declared


def test_airflow_dependency_is_declared_pinned_and_conditioned() -> None:
    meta = chart().metadata
    assert meta["apiVersion"] == "v2"
    (dep,) = meta["dependencies"]
    assert dep["name"] == "airflow"
    assert dep["repository"] == "https://airflow.apache.org"
    assert re.fullmatch(r"\d+\.\d+\.\d+", dep["version"]), "pin an exact chart version"
    assert tuple(map(int, dep["version"].split("."))) >= (1, 16, 0)  # first with Airflow 3
    assert dep["condition"] == "airflow.enabled"
    # Declared, not vendored: `helm dependency update` fetches it (no repository reachable here).
    (listed,) = helm.dependency_list(CHART)
    assert listed["name"] == "airflow"
    assert listed["status"] in {"missing", "ok"}
    # Both values files turn it on: a real install deploys Airflow with our values.
    for which in VALUES_FILES:
        assert merged_values(which)["airflow"]["enabled"] is True


def test_airflow_values_pin_our_airflow_version() -> None:
    # The slipway-airflow image is built from this project's lock: same Airflow minor.
    installed = metadata.version("apache-airflow")
    for which in VALUES_FILES:
        af = merged_values(which)["airflow"]
        assert af["airflowVersion"].split(".")[:2] == installed.split(".")[:2]
        assert af["airflowVersion"].startswith("3.")


@pytest.fixture(scope="module")
def chart_without_dependency(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart whose Chart.yaml declares no dependency: what helm's CLI renders."""
    dest = tmp_path_factory.mktemp("chart") / "slipway"
    shutil.copytree(CHART, dest, ignore=shutil.ignore_patterns("charts"))
    meta = yaml.safe_load((dest / "Chart.yaml").read_text())
    assert meta.pop("dependencies")
    (dest / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return dest


@pytest.mark.parametrize("which", sorted(VALUES_FILES))
def test_lint(which: str, chart_without_dependency: Path) -> None:
    values = deep_merge(file_values(which), {"airflow": {"enabled": False}})
    for version in K8S_VERSIONS:
        kube = f"v{version}.0"
        # The real chart: the only finding above "info" is the undownloaded dependency.
        report = helm.lint(CHART, values, namespace=NAMESPACE, kube_version=kube)
        assert report["errors"] == []
        findings = [m["error"] for m in report["messages"] if m["severity"] >= 2]
        assert findings == ["chart directory is missing these dependencies: airflow"]
        # The same chart minus the dependency list: clean under --strict.
        report = helm.lint(
            chart_without_dependency, values, strict=True, namespace=NAMESPACE, kube_version=kube
        )
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("which", sorted(VALUES_FILES))
def test_render_does_not_depend_on_the_dependency(
    which: str, chart_without_dependency: Path
) -> None:
    values = user_values(which, kueue={"enabled": True, "clusterScoped": {"create": True}})
    with helm.Chart.load(chart_without_dependency) as bare:
        assert render_files(values, bare) == render_files(values)


# --------------------------------------------------------------------------------------------
# every object valid


def _kueue_schemas() -> dict[str, dict[str, Any]]:
    """Structure of the Kueue objects the chart renders, written from Kueue's v1beta2 API
    types (apis/kueue/v1beta2: resourceflavor_types.go, clusterqueue_types.go,
    localqueue_types.go). kubernetes-validate ships only Kubernetes' own schemas, so Kueue's
    kinds are checked here instead, for the fields the chart uses (and nothing unknown)."""
    name = {
        "type": "string",
        "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        "maxLength": 253,
    }
    quantity = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[mkMGTPE])?$"}

    def obj(kind: str, spec: dict[str, Any], namespaced: bool) -> dict[str, Any]:
        meta_required = ["name", "namespace"] if namespaced else ["name"]
        return {
            "type": "object",
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "additionalProperties": False,
            "properties": {
                "apiVersion": {"enum": ["kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1"]},
                "kind": {"const": kind},
                "metadata": {
                    "type": "object",
                    "required": meta_required,
                    "properties": {
                        "name": name,
                        "namespace": {"type": "string"},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                    # Cluster-scoped objects have no namespace.
                    **({} if namespaced else {"not": {"required": ["namespace"]}}),
                },
                "spec": spec,
            },
        }

    return {
        "ResourceFlavor": obj(
            "ResourceFlavor",
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "nodeLabels": {
                        "type": "object",
                        "maxProperties": 8,
                        "additionalProperties": {"type": "string", "maxLength": 63},
                    }
                },
            },
            namespaced=False,
        ),
        "ClusterQueue": obj(
            "ClusterQueue",
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["resourceGroups", "namespaceSelector"],
                "properties": {
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matchLabels": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            }
                        },
                    },
                    "queueingStrategy": {"enum": ["StrictFIFO", "BestEffortFIFO"]},
                    "resourceGroups": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 16,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["coveredResources", "flavors"],
                            "properties": {
                                "coveredResources": {
                                    "type": "array",
                                    "minItems": 1,
                                    "maxItems": 64,
                                    "items": {"type": "string"},
                                },
                                "flavors": {
                                    "type": "array",
                                    "minItems": 1,
                                    "maxItems": 64,
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["name", "resources"],
                                        "properties": {
                                            "name": name,
                                            "resources": {
                                                "type": "array",
                                                "minItems": 1,
                                                "items": {
                                                    "type": "object",
                                                    "additionalProperties": False,
                                                    "required": ["name", "nominalQuota"],
                                                    "properties": {
                                                        "name": {"type": "string"},
                                                        "nominalQuota": quantity,
                                                    },
                                                },
                                            },
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
            namespaced=False,
        ),
        "LocalQueue": obj(
            "LocalQueue",
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["clusterQueue"],
                "properties": {"clusterQueue": name},
            },
            namespaced=True,
        ),
    }


def kueue_errors(obj: dict[str, Any]) -> list[str]:
    schema = _kueue_schemas()[obj["kind"]]
    errors = [
        f"{list(e.absolute_path)}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(obj)
    ]
    if obj["kind"] == "ClusterQueue":
        # Kueue's CEL rule: every flavor lists exactly the covered resources (same order).
        for group in obj["spec"]["resourceGroups"]:
            for flavor in group["flavors"]:
                if [r["name"] for r in flavor["resources"]] != group["coveredResources"]:
                    errors.append(f"flavor {flavor['name']}: resources != coveredResources")
    return errors


def validate_all(objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        json.dumps(obj)  # plain data, as the API server receives it
        if obj["kind"] in KUEUE_KINDS:
            assert kueue_errors(obj) == [], obj
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("kueue", ["off", "local-queue-only", "all"])
@pytest.mark.parametrize("which", sorted(VALUES_FILES))
def test_every_object_is_valid(which: str, kueue: str) -> None:
    overrides = {
        "off": {"enabled": False},
        "local-queue-only": {"enabled": True, "clusterScoped": {"create": False}},
        "all": {"enabled": True, "clusterScoped": {"create": True}},
    }[kueue]
    objs = render(which, kueue=overrides)
    assert {o["kind"] for o in objs} <= KINDS
    validate_all(objs)
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "two objects with one name"
    for obj in objs:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"]
        else:
            assert obj["metadata"]["namespace"] in {
                NAMESPACE,
                merged_values(which)["training"]["namespace"],
            }
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


def test_validators_catch_mistakes() -> None:
    # The validation above is only worth something if it can fail.
    objs = render("production", kueue={"enabled": True, "clusterScoped": {"create": True}})
    role = copy.deepcopy(one(objs, "Role"))
    role["rules"][0]["verbz"] = ["get"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, K8S_VERSIONS[0], strict=True)
    policy = copy.deepcopy(one(objs, "NetworkPolicy"))
    policy["spec"]["podSelector"]["matchLabel"] = policy["spec"]["podSelector"].pop("matchLabels")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)
    cq = copy.deepcopy(one(objs, "ClusterQueue"))
    cq["spec"]["queueingStrategy"] = "LIFO"
    cq["spec"]["resourceGroups"][0]["coveredResources"].append("cpu")
    errors = kueue_errors(cq)
    assert any("LIFO" in e for e in errors) and any("coveredResources" in e for e in errors)
    rf = copy.deepcopy(one(objs, "ResourceFlavor"))
    rf["metadata"]["namespace"] = "slipway-training"
    assert kueue_errors(rf)
    lq = copy.deepcopy(one(objs, "LocalQueue"))
    lq["spec"]["clusterQueues"] = lq["spec"].pop("clusterQueue")
    assert kueue_errors(lq)


# --------------------------------------------------------------------------------------------
# RBAC: namespaced, exactly least privilege


LEAST_PRIVILEGE = {
    ("jobset.x-k8s.io", "jobsets", verb) for verb in ("create", "get", "list", "watch", "delete")
} | {("", "pods", "get"), ("", "pods", "list"), ("", "pods/log", "get")}


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    out = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, "no resourceNames/nonResourceURLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), "no wildcards"
                    out.add((group, resource, verb))
    return out


@pytest.mark.parametrize("training_ns", [None, "slipway", "tpu-jobs"])
def test_rbac_is_namespaced_and_least_privilege(
    rendered: tuple[str, list[dict[str, Any]]], training_ns: str | None
) -> None:
    which, objs = rendered
    if training_ns is not None:
        objs = render(which, training={"namespace": training_ns})
    values = merged_values(which)
    ns = training_ns or values["training"]["namespace"]
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, "nothing cluster-wide"
    role, binding = one(objs, "Role"), one(objs, "RoleBinding")
    assert role["metadata"]["namespace"] == ns == binding["metadata"]["namespace"]
    assert grants(role) == LEAST_PRIVILEGE
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    airflow_sa = values["serviceAccounts"]["airflow"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": airflow_sa, "namespace": NAMESPACE}
    ]
    # The trainer's service account gets no Kubernetes API rights at all.
    trainer_sa = values["serviceAccounts"]["trainer"]["name"]
    assert all(s["name"] != trainer_sa for s in binding["subjects"])


def test_rbac_can_be_left_to_the_admin() -> None:
    objs = render(training={"rbac": {"create": False}})
    assert not of_kind(objs, "Role") and not of_kind(objs, "RoleBinding")


# --------------------------------------------------------------------------------------------
# Workload Identity


def test_service_accounts_carry_workload_identity(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    which, objs = rendered
    values = merged_values(which)
    project = values["gcp"]["projectId"]
    sas = {sa["metadata"]["name"]: sa for sa in of_kind(objs, "ServiceAccount")}
    assert set(sas) == {
        values["serviceAccounts"]["airflow"]["name"],
        values["serviceAccounts"]["trainer"]["name"],
    }
    for role, ns in (("airflow", NAMESPACE), ("trainer", values["training"]["namespace"])):
        sa = sas[values["serviceAccounts"][role]["name"]]
        assert sa["metadata"]["namespace"] == ns
        gsa = sa["metadata"]["annotations"][WI_ANNOTATION]
        assert GSA_RE.match(gsa), gsa
        assert gsa == f"{sa['metadata']['name']}@{project}.iam.gserviceaccount.com"
    # Trainer pods never call the Kubernetes API: no token mounted.
    assert (
        sas[values["serviceAccounts"]["trainer"]["name"]]["automountServiceAccountToken"] is False
    )


def test_explicit_google_service_account() -> None:
    gsa = "ml-trainer@other-project-42.iam.gserviceaccount.com"
    objs = render(serviceAccounts={"trainer": {"gcpServiceAccount": gsa}})
    trainer = next(
        sa for sa in of_kind(objs, "ServiceAccount") if sa["metadata"]["name"] == "slipway-trainer"
    )
    assert trainer["metadata"]["annotations"][WI_ANNOTATION] == gsa


# --------------------------------------------------------------------------------------------
# values.schema.json


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"training": {"namespace": "Slipway-Training"}}, "/training/namespace"),
        ({"training": {"namespace": "slipway_training"}}, "/training/namespace"),
        ({"training": {"namespace": "x" * 64}}, "/training/namespace"),
        ({"images": {"trainer": None}}, "missing property 'trainer'"),
        ({"images": {"beam": {"repository": None}}}, "missing property 'repository'"),
        ({"images": {"airflow": {"tag": ""}}}, "/images/airflow/tag"),
        (
            {"images": {"trainer": {"repository": "us-docker.pkg.dev/p/r/slipway-beam"}}},
            "/images/trainer/repository",
        ),
        (
            {"images": {"trainer": {"repository": "slipway-trainer; rm -rf /"}}},
            "/images/trainer/repository",
        ),
        ({"images": {"trainer": {"digest": "sha256:abc"}}}, "/images/trainer/digest"),
        ({"gcp": {"projectId": "My_Project"}}, "/gcp/projectId"),
        ({"storage": {"root": "/tmp/slipway"}}, "/storage/root"),
        ({"storage": {"root": "s3://bucket/slipway"}}, "/storage/root"),
        ({"lineage": {"url": "postgresql://slipway:hunter2@db:5432/lineage"}}, "/lineage/url"),
        ({"lineage": {"url": "postgresql://db:5432/lineage?password=hunter2"}}, "/lineage/url"),
        ({"lineage": {"url": "sqlite:////tmp/lineage.db"}}, "/lineage/url"),
        ({"lineage": {"passwordSecret": None}}, "missing property 'passwordSecret'"),
        ({"training": {"tpu": {"accelerator": "v9"}}}, "/training/tpu/accelerator"),
        ({"training": {"tpu": {"topology": "4x4x4x4"}}}, "/training/tpu/topology"),
        ({"training": {"tpu": {"slices": 0}}}, "/training/tpu/slices"),
        ({"training": {"tpu": {"slices": "2"}}}, "/training/tpu/slices"),
        ({"training": {"backend": "ray"}}, "/training/backend"),
        (
            {"serviceAccounts": {"trainer": {"gcpServiceAccount": "trainer@gmail.com"}}},
            "gcpServiceAccount",
        ),
        ({"serviceAccounts": {"airflow": {"name": "Airflow"}}}, "/serviceAccounts/airflow/name"),
        ({"dataflow": {"location": "US"}}, "/dataflow/location"),
        ({"dataflow": {"maxNumWorkers": 0}}, "/dataflow/maxNumWorkers"),
        ({"dataflow": {"experiments": ["disable_runner_v2"]}}, "/dataflow/experiments/0"),
        ({"dataflow": {"experiments": ["shuffle_mode=service,x"]}}, "/dataflow/experiments/0"),
        # The ConfigMap joins these lists with commas: a comma inside one would add an entry.
        (
            {"runPolicy": {"dataRoots": ["gs://platform-bucket/corpora,/"]}},
            "/runPolicy/dataRoots/0",
        ),
        (
            {"runPolicy": {"dataflowLocations": ["gs://platform-bucket/df,gs://x"]}},
            "/runPolicy/dataflowLocations/0",
        ),
        ({"networkPolicy": {"googleApisCidrs": ["storage.googleapis.com"]}}, "googleApisCidrs"),
        (
            {"kueue": {"enabled": True, "clusterQueue": {"queueingStrategy": "LIFO"}}},
            "queueingStrategy",
        ),
        ({"kueue": {"enabled": "yes"}}, "/kueue/enabled"),
        ({"airflow": {"enabled": "false"}}, "/airflow/enabled"),
        ({"trainnig": {"namespace": "x"}}, "'trainnig' not allowed"),
        # Corpora on gs:// only: a local folder would not outlive the fetch task's pod.
        ({"storage": {"dataDir": "/opt/airflow/corpora"}}, "/storage/dataDir"),
        ({"storage": {"dataDir": ""}}, "/storage/dataDir"),
        ({"storage": {"dataDir": None}}, "missing property 'dataDir'"),
        ({"storage": {"corporaVolume": {"create": True}}}, "'corporaVolume' not allowed"),
        ({"schedules": {"sweep": "0 2 * *; rm -rf /"}}, "/schedules/sweep"),
        # Labels the API server would refuse, or the chart's own keys (a duplicate key).
        ({"commonLabels": {"team": "a b"}}, "/commonLabels/team"),
        ({"commonLabels": {"Bad Key": "x"}}, "invalid propertyName 'Bad Key'"),
        (
            {"commonLabels": {"app.kubernetes.io/name": "other"}},
            "invalid propertyName 'app.kubernetes.io/name'",
        ),
        ({"commonLabels": {"helm.sh/chart": "mine"}}, "invalid propertyName 'helm.sh/chart'"),
        ({"kueue": {"localQueue": {"name": "q" * 64}}}, "/kueue/localQueue/name"),
        ({"schedules": {"pipeline": "@sometimes"}}, "/schedules/pipeline"),
    ],
)
def test_schema_refuses_bad_values(overrides: dict[str, Any], where: str) -> None:
    # Render is what `helm install`/`template` does: values are checked against the schema first.
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render_files(user_values("default", **overrides))


def test_schema_accepts_good_variants() -> None:
    digest = "sha256:" + "0" * 64
    objs = render(
        "production",
        images={"trainer": {"digest": digest}},
        training={
            "namespace": "ml",
            "tpu": {"accelerator": "v5p", "topology": "2x2x4", "slices": 4},
        },
        lineage={"url": "postgresql+psycopg://lineage@[fd00::3]:5432/lineage?sslmode=verify-full"},
        networkPolicy={"googleApisCidrs": ["199.36.153.4/30"]},
        schedules={"pipeline": "none", "sweep": "30 3 * * 1-5"},
    )
    data = config_of(objs)
    assert data["SLIPWAY_PIPELINE_SCHEDULE"] == "none"
    assert data["SLIPWAY_SWEEP_SCHEDULE"] == "30 3 * * 1-5"
    assert data["SLIPWAY_TRAINER_IMAGE"].endswith(f"/slipway-trainer@{digest}")
    assert data["SLIPWAY_TPU_SLICES"] == "4"


def test_the_nightly_sweep_is_set_in_the_values_and_checked_at_parse() -> None:
    """``sweepForm`` reaches the sweep DAG's form as its defaults (what every night runs); a
    bad field surfaces as the DAG's import error, naming it."""
    from operators.pipeline.form import PlatformDefaultsError
    from operators.sweep.form import sweep_form_fields

    assert "SLIPWAY_SWEEP_CONF" not in config_of(render("production"))  # the form's own
    nightly = {
        "budgets": [1.0e16, 3.0e16, 1.0e17],
        "forecast_budgets": [1.0e18],
        "points": 5,
        "seeds": [0],
        "backend": "gke",
    }
    data = config_of(render("production", sweepForm=nightly))
    fields = sweep_form_fields({"SLIPWAY_SWEEP_CONF": data["SLIPWAY_SWEEP_CONF"]})
    assert {name: fields[name]["default"] for name in nightly} == nightly
    # Larger budgets with the form's own forecast (3e13) would fail every night's validate:
    # refused when the DAG is parsed instead, naming the field to set.
    no_forecast = {k: v for k, v in nightly.items() if k != "forecast_budgets"}
    data = config_of(render("production", sweepForm=no_forecast))
    with pytest.raises(PlatformDefaultsError) as err:
        sweep_form_fields({"SLIPWAY_SWEEP_CONF": data["SLIPWAY_SWEEP_CONF"]})
    assert "forecast_budgets: [3e+13] not above the largest fitted budget (1e+17)" in str(err.value)
    bad = config_of(render("production", sweepForm={"points": 1, "lr": 0.1}))
    with pytest.raises(PlatformDefaultsError) as err:
        sweep_form_fields({"SLIPWAY_SWEEP_CONF": bad["SLIPWAY_SWEEP_CONF"]})
    assert "points: " in str(err.value) and "lr: not a field of the sweep form" in str(err.value)


def test_schema_is_valid_draft7_and_matches_the_code() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    for which in VALUES_FILES:
        jsonschema.Draft7Validator(schema).validate(merged_values(which))
    training = schema["properties"]["training"]["properties"]
    # The accelerator names are the TPU catalogue's; the backends the run form's.
    assert set(training["tpu"]["properties"]["accelerator"]["enum"]) == set(CATALOGUE)
    from operators.params import pipeline_params

    params = pipeline_params()
    assert set(training["backend"]["enum"]) == set(params["backend"].schema["enum"])
    assert set(training["tpu"]["properties"]["accelerator"]["enum"]) == set(
        params["accelerator"].schema["enum"]
    )


# --------------------------------------------------------------------------------------------
# Kueue: only when enabled


def test_kueue_objects_only_when_enabled() -> None:
    assert not {o["kind"] for o in render("default")} & KUEUE_KINDS
    assert "SLIPWAY_KUEUE_QUEUE" not in config_of(render("default"))
    off = render("production", kueue={"enabled": False})
    assert not {o["kind"] for o in off} & KUEUE_KINDS
    assert "SLIPWAY_KUEUE_QUEUE" not in config_of(off)
    # The admin owns the cluster-scoped objects: only the LocalQueue.
    local = render("default", kueue={"enabled": True, "clusterScoped": {"create": False}})
    assert sorted(o["kind"] for o in local if o["kind"] in KUEUE_KINDS) == ["LocalQueue"]
    assert config_of(local)["SLIPWAY_KUEUE_QUEUE"] == one(local, "LocalQueue")["metadata"]["name"]


def test_production_kueue_objects_fit_together() -> None:
    objs = render("production")
    values = merged_values("production")
    flavors = {f["metadata"]["name"]: f for f in of_kind(objs, "ResourceFlavor")}
    cq, lq = one(objs, "ClusterQueue"), one(objs, "LocalQueue")
    assert lq["metadata"]["namespace"] == values["training"]["namespace"]
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert cq["spec"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": values["training"]["namespace"]}
    }
    (group,) = cq["spec"]["resourceGroups"]
    assert {f["name"] for f in group["flavors"]} == set(flavors)
    assert "google.com/tpu" in group["coveredResources"]
    gke_labels = {a.gke_accelerator: a.name for a in CATALOGUE.values() if a.is_tpu}
    for flavor in flavors.values():
        labels = flavor["spec"]["nodeLabels"]
        # Node labels GKE really sets, for a shape the catalogue accepts.
        accelerator = gke_labels[labels["cloud.google.com/gke-tpu-accelerator"]]
        shape = resolve(accelerator, labels["cloud.google.com/gke-tpu-topology"], 1)
        quota = next(f for f in group["flavors"] if f["name"] == flavor["metadata"]["name"])
        tpus = int(
            next(r for r in quota["resources"] if r["name"] == "google.com/tpu")["nominalQuota"]
        )
        assert tpus % shape.chips_per_slice == 0, "quota in whole slices"
    # The run default fits the queue's flavor.
    tpu = values["training"]["tpu"]
    default = resolve(tpu["accelerator"], tpu["topology"], tpu["slices"])
    assert any(
        f["spec"]["nodeLabels"]
        == {
            "cloud.google.com/gke-tpu-accelerator": default.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": default.topology,
        }
        for f in flavors.values()
    )


def test_kueue_flavor_without_quota_is_refused() -> None:
    flavor = {"name": "f", "nodeLabels": {"a": "b"}, "nominalQuota": {"cpu": 8}}
    with pytest.raises(helm.HelmError, match=re.escape("no quota for google.com/tpu")):
        render_files(
            user_values(
                "default",
                kueue={"enabled": True, "clusterScoped": {"create": True}, "flavors": [flavor]},
            )
        )


# --------------------------------------------------------------------------------------------
# NetworkPolicy


def test_network_policy(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    which, objs = rendered
    values = merged_values(which)
    policy = one(objs, "NetworkPolicy")
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == values["training"]["namespace"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    trainer = spec["podSelector"]
    # Ingress only from trainer pods (same namespace: a podSelector without namespaceSelector).
    assert spec["ingress"] == [{"from": [{"podSelector": trainer}]}]
    egress = spec["egress"]
    assert {"to": [{"podSelector": trainer}]} in egress
    ports = {(p["protocol"], p["port"]) for rule in egress for p in rule.get("ports", [])}
    assert ports == {("UDP", 53), ("TCP", 53), ("TCP", 80), ("TCP", 988), ("TCP", 443)}
    for rule in egress:
        for peer in rule.get("to", []):
            if "ipBlock" in peer:
                ipaddress.ip_network(peer["ipBlock"]["cidr"])
                # Only 443 leaves the node's link-local range.
                if not peer["ipBlock"]["cidr"].startswith("169.254."):
                    assert rule["ports"] == [{"protocol": "TCP", "port": 443}]
    assert not of_kind(render(which, networkPolicy={"enabled": False}), "NetworkPolicy")


# --------------------------------------------------------------------------------------------
# the chart and the code agree


def operators_source() -> str:
    return "\n".join(p.read_text() for p in sorted((REPO / "operators").rglob("*.py")))


def dataflow_env_names() -> frozenset[str]:
    """The SLIPWAY_DATAFLOW_<FIELD> names operators/beam_stage.py reads."""
    from operators.dataflow import DATAFLOW_ENV_PREFIX, DATAFLOW_FIELDS

    return frozenset(DATAFLOW_ENV_PREFIX + f.upper() for f in DATAFLOW_FIELDS)


def test_config_keys_are_the_env_names_the_code_reads(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objs = rendered
    keys = set(config_of(objs))
    source = operators_source()
    for key in READ_BY_OPERATORS & keys:
        assert f'"{key}"' in source, f"{key}: the operators no longer read it"
    assert {"SLIPWAY_HOME", "SLIPWAY_LINEAGE_DB", "SLIPWAY_IMAGE"} <= keys
    dataflow = {k for k in keys if k.startswith("SLIPWAY_DATAFLOW_")}
    assert dataflow <= dataflow_env_names(), (
        f"beam_stage.py does not read {dataflow - dataflow_env_names()}"
    )
    unknown = keys - READ_BY_OPERATORS - dataflow - form_default_env_names() - STANDARD_ENV
    assert not unknown, f"ConfigMap keys nobody reads: {unknown}"
    # Every form default the code reads is set (the queue only with Kueue on, the TPU zone
    # only when given) and documented.
    optional = {"SLIPWAY_KUEUE_QUEUE", "SLIPWAY_TPU_ZONE"}
    assert form_default_env_names() - optional <= keys
    readme = (REPO / "charts" / "README.md").read_text()
    for key in form_default_env_names():
        assert key in readme, f"{key} missing from charts/README.md"
    # Every field of the run form's `dataflow` object has its platform default.
    from operators.params import pipeline_params

    fields = pipeline_params()["dataflow"].schema["properties"]
    assert {f"SLIPWAY_DATAFLOW_{f.upper()}" for f in fields} <= keys


def test_config_values(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    which, objs = rendered
    values = merged_values(which)
    data = config_of(objs)
    assert all(isinstance(v, str) for v in data.values())
    assert data["SLIPWAY_HOME"].startswith("gs://")
    assert data["SLIPWAY_DATAFLOW_TEMP_LOCATION"].startswith("gs://")
    # No credentials in the lineage URL: user@host only.
    assert not re.search(r"://[^/@]*:[^/@]*@", data["SLIPWAY_LINEAGE_DB"])
    for name, image in (
        ("slipway-trainer", data["SLIPWAY_TRAINER_IMAGE"]),
        ("slipway-beam", data["SLIPWAY_DATAFLOW_SDK_CONTAINER_IMAGE"]),
        ("slipway-airflow", data["SLIPWAY_IMAGE"]),
    ):
        assert re.fullmatch(rf"(.+/)?{name}[:@].+", image), image
    resolve(
        data["SLIPWAY_TPU_ACCELERATOR"],
        data["SLIPWAY_TPU_TOPOLOGY"],
        int(data["SLIPWAY_TPU_SLICES"]),
    )
    assert data["SLIPWAY_TRAINING_NAMESPACE"] == values["training"]["namespace"]
    assert data["SLIPWAY_TRAINER_SERVICE_ACCOUNT"] == values["serviceAccounts"]["trainer"]["name"]
    assert data["SLIPWAY_DATAFLOW_SERVICE_ACCOUNT"].endswith(".iam.gserviceaccount.com")


def test_a_jobset_from_the_chart_settings_fits_the_chart(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Launch a run the way the GKE backend will: with the ConfigMap's settings. The JobSet
    lands in the namespace the Role covers, runs as the trainer service account the chart
    created there, carries the labels the NetworkPolicy selects, and names the LocalQueue."""
    which, objs = rendered
    objs = render(which, kueue={"enabled": True})
    data = config_of(objs)
    manifest = TrainingLaunch(
        name="run-1",
        image=data["SLIPWAY_TRAINER_IMAGE"],
        config_uri=f"{data['SLIPWAY_HOME']}/runs/run-1/config.json",
        accelerator=data["SLIPWAY_TPU_ACCELERATOR"],
        topology=data["SLIPWAY_TPU_TOPOLOGY"],
        slices=int(data["SLIPWAY_TPU_SLICES"]),
        namespace=data["SLIPWAY_TRAINING_NAMESPACE"],
        service_account=data["SLIPWAY_TRAINER_SERVICE_ACCOUNT"],
        queue=data["SLIPWAY_KUEUE_QUEUE"],
    ).render()
    ns = manifest["metadata"]["namespace"]
    role = one(objs, "Role")
    assert role["metadata"]["namespace"] == ns
    group = JOBSET_API_VERSION.split("/")[0]
    assert (group, "jobsets", "create") in grants(role)
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    sa = next(
        s
        for s in of_kind(objs, "ServiceAccount")
        if s["metadata"]["name"] == pod["spec"]["serviceAccountName"]
    )
    assert sa["metadata"]["namespace"] == ns
    selector = one(objs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert one(objs, "NetworkPolicy")["metadata"]["namespace"] == ns
    lq = one(objs, "LocalQueue")
    assert manifest["metadata"]["labels"][KUEUE_QUEUE_KEY] == lq["metadata"]["name"]
    assert lq["metadata"]["namespace"] == ns


def _airflow_env_from(values: Mapping[str, Any]) -> Iterator[str]:
    for item in yaml.safe_load(values["airflow"]["extraEnvFrom"]):
        yield item["configMapRef"]["name"]


@pytest.mark.parametrize("which", sorted(VALUES_FILES))
def test_airflow_values_use_our_objects(which: str) -> None:
    """The Airflow sub-chart's values cannot reference ours, so they repeat names: check
    they name what this chart creates."""
    values = merged_values(which)
    af = values["airflow"]
    image = values["images"]["airflow"]
    assert af["images"]["airflow"]["repository"] == image["repository"]
    assert str(af["images"]["airflow"]["tag"]) == str(image["tag"])
    assert af["defaultAirflowRepository"] == image["repository"]
    assert af["executor"] == "KubernetesExecutor"
    sa = values["serviceAccounts"]["airflow"]["name"]
    for section in (af["workers"], af["workers"]["kubernetes"], af["triggerer"]):
        assert section["serviceAccount"] == {"create": False, "name": sa}
    objs = render(which)
    assert list(_airflow_env_from(values)) == [
        m["metadata"]["name"] for m in of_kind(objs, "ConfigMap")
    ]
    (pg,) = [s for s in af["secret"] if s["envName"] == "PGPASSWORD"]
    assert (pg["secretName"], pg["secretKey"]) == (
        values["lineage"]["passwordSecret"]["name"],
        values["lineage"]["passwordSecret"]["key"],
    )
    assert af["createUserJob"]["enabled"] is False  # no admin/admin default user
    transport = json.loads(af["config"]["openlineage"]["transport"])
    assert transport["type"] in {"console", "http"}
    if which == "production":
        assert af["postgresql"]["enabled"] is False and af["data"]["metadataSecretName"]
        assert transport["type"] == "http"
        assert af["config"]["logging"]["remote_base_log_folder"].startswith("gs://")


@pytest.mark.parametrize("which", sorted(VALUES_FILES))
def test_user_run_ids_cannot_pass_for_the_schedulers(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's allowed_run_id_pattern, through Airflow's own run-id validator: the
    scheduler's, backfills' and ordinary ids pass; an id that names a scheduled night's run
    folder (':' spelled '_' or '~'), or ends in a newline, is refused."""
    from airflow.models.dagrun import DagRun

    pattern = merged_values(which)["airflow"]["config"]["scheduler"]["allowed_run_id_pattern"]
    monkeypatch.setenv("AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN", pattern)
    check = DagRun().validate_run_id
    for ok in (
        "scheduled__2026-01-09T02:00:00+00:00",
        "manual__2026-01-09T10:11:12+00:00",
        "backfill__2026-01-09T02:00:00+00:00",
        "manual__2026-01-09T10:11:12.123456+00:00",
        "nightly-rerun_2",
        "my_experiment:v2",
    ):
        assert check("run_id", ok) == ok
    for bad in (
        "scheduled__2026-01-09T02_00_00+00_00",
        "scheduled__2026-01-09T02~00~00+00~00",
        "scheduled:_2026-01-09T02:00:00+00:00",
        "manual__2026-01-09T10_11_12+00_00",
        "nightly\n",
    ):
        with pytest.raises(ValueError, match="does not match"):
            check("run_id", bad)


def test_corpora_live_in_the_bucket(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """KubernetesExecutor runs each task in its own pod: the corpora the fetch task gets must
    be where every later task (and Dataflow's workers) can read them, on gs://, with no
    shared volume to mount."""
    which, objs = rendered
    values = merged_values(which)
    data = config_of(objs)
    assert data["SLIPWAY_DATA_DIR"] == values["storage"]["dataDir"]
    assert data["SLIPWAY_DATA_DIR"].startswith("gs://")
    assert not {"volumes", "volumeMounts"} & set(values["airflow"])
    from operators.pipeline.form import DATA_DIR_PATTERN

    assert re.match(DATA_DIR_PATTERN, data["SLIPWAY_DATA_DIR"])  # the run form accepts it


def _env_of(data: Mapping[str, str]) -> dict[str, str]:
    """The Airflow containers' environment from the ConfigMap (extraEnvFrom), nothing else."""
    return {k: v for k, v in data.items() if k.startswith("SLIPWAY_") or k in STANDARD_ENV}


def test_dataflow_experiments_reach_every_job() -> None:
    """The chart's dataflow.experiments become SLIPWAY_DATAFLOW_EXPERIMENTS, which every
    Dataflow launch reads, after Runner v2 (none set: no key, Runner v2 alone)."""
    from operators.dataflow import RUNNER_V2, dataflow_settings, platform_dataflow_settings

    assert "SLIPWAY_DATAFLOW_EXPERIMENTS" not in config_of(render())
    data = config_of(
        render(
            dataflow={
                "experiments": ["enable_prime", "max_workflow_runtime_walltime_seconds=86400"]
            }
        )
    )
    platform = platform_dataflow_settings(_env_of(data))
    assert platform["experiments"] == [
        "enable_prime",
        "max_workflow_runtime_walltime_seconds=86400",
    ]
    settings = dataflow_settings({}, platform)
    assert settings.experiments == (
        RUNNER_V2,
        "enable_prime",
        "max_workflow_runtime_walltime_seconds=86400",
    )


@pytest.mark.parametrize("kueue", [False, True])
def test_the_configmap_prefills_a_valid_run_form(
    rendered: tuple[str, list[dict[str, Any]]], kueue: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A platform deploy's form: its defaults come from slipway-config (read at DAG parse
    time) and trigger a valid gke run as they stand, on DirectRunner and on DataflowRunner
    with nothing but the platform's Dataflow settings."""
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import pipeline_params
    from operators.pipeline.form import check_run_config

    which, _ = rendered
    data = config_of(render(which, kueue={"enabled": kueue}))
    env = _env_of(data)
    for name in [n for n in os.environ if n.startswith("SLIPWAY_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    values = ParamsDict(pipeline_params()).validate()
    assert values["backend"] == data["SLIPWAY_TRAINING_BACKEND"] == "gke"
    assert values["image"] == data["SLIPWAY_TRAINER_IMAGE"]
    assert (values["accelerator"], values["topology"], values["slices"]) == (
        data["SLIPWAY_TPU_ACCELERATOR"],
        data["SLIPWAY_TPU_TOPOLOGY"],
        int(data["SLIPWAY_TPU_SLICES"]),
    )
    expected_gke = {
        "namespace": data["SLIPWAY_TRAINING_NAMESPACE"],
        "service_account": data["SLIPWAY_TRAINER_SERVICE_ACCOUNT"],
    }
    if kueue:
        expected_gke["queue"] = data["SLIPWAY_KUEUE_QUEUE"]
    if "SLIPWAY_TPU_ZONE" in data:
        expected_gke["tpu_zone"] = data["SLIPWAY_TPU_ZONE"]
    assert values["gke"] == expected_gke
    check_run_config(values)
    check_run_config({**values, "runner": "DataflowRunner"})


def test_run_policy_values_become_the_allow_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """runPolicy lists render as SLIPWAY_ALLOWED_* keys, and the run form's checks follow
    them: an extra namespace listed there is accepted, one not listed is refused."""
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import pipeline_params
    from operators.pipeline.form import RunConfigError, check_run_config

    assert not [k for k in config_of(render()) if k.startswith("SLIPWAY_ALLOWED_")]
    data = config_of(
        render(
            runPolicy={
                "namespaces": ["research-a", "research-b"],
                "dataRoots": ["gs://example-project-slipway/shared-corpora"],
                "gkeClusters": ["research-proj/us-east5/tpu-v5e"],
                "dataflowProjects": ["research-proj"],
                "dataflowLocations": ["gs://research-scratch/dataflow"],
            }
        )
    )
    assert data["SLIPWAY_ALLOWED_GKE_CLUSTERS"] == "research-proj/us-east5/tpu-v5e"
    assert data["SLIPWAY_ALLOWED_DATAFLOW_PROJECTS"] == "research-proj"
    assert data["SLIPWAY_ALLOWED_DATAFLOW_LOCATIONS"] == "gs://research-scratch/dataflow"
    assert data["SLIPWAY_ALLOWED_NAMESPACES"] == "research-a,research-b"
    assert data["SLIPWAY_ALLOWED_DATA_ROOTS"] == "gs://example-project-slipway/shared-corpora"
    for name in [n for n in os.environ if n.startswith("SLIPWAY_")]:
        monkeypatch.delenv(name)
    for name, value in _env_of(data).items():
        monkeypatch.setenv(name, value)
    values = ParamsDict(pipeline_params()).validate()
    check_run_config(
        {
            **values,
            "gke": {**values["gke"], "namespace": "research-b"},
            "data_dir": "gs://example-project-slipway/shared-corpora/2026",
        }
    )
    with pytest.raises(RunConfigError, match=r"gke\.namespace 'kube-system' is not allowed"):
        check_run_config({**values, "gke": {**values["gke"], "namespace": "kube-system"}})


def test_a_gke_run_keeps_the_platforms_identity_and_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run form's gke object replaces the pre-filled one whole: leaving out the service
    account or the Kueue queue must be refused, not run the pods as the namespace's default
    account around the TPU quota; another queue only where runPolicy lists it."""
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import pipeline_params
    from operators.pipeline.form import RunConfigError, check_run_config

    data = config_of(
        render(
            "production",
            kueue={"enabled": True, "clusterScoped": {"create": False}},
            runPolicy={"kueueQueues": ["research-queue"]},
        )
    )
    assert data["SLIPWAY_ALLOWED_KUEUE_QUEUES"] == "research-queue"
    for name in [n for n in os.environ if n.startswith("SLIPWAY_")]:
        monkeypatch.delenv(name)
    for name, value in _env_of(data).items():
        monkeypatch.setenv(name, value)
    values = ParamsDict(pipeline_params()).validate()
    gke = values["gke"]
    check_run_config(values)
    check_run_config({**values, "gke": {**gke, "queue": "research-queue"}})
    with pytest.raises(RunConfigError, match=r"gke\.queue 'other' is not allowed"):
        check_run_config({**values, "gke": {**gke, "queue": "other"}})
    alone = {"namespace": gke["namespace"]}  # the whole object replaced by a trigger's conf
    with pytest.raises(RunConfigError) as refused:
        check_run_config({**values, "gke": alone})
    assert "gke.service_account: a gke run on this platform names its trainer" in str(refused.value)
    queue_needed = "gke.queue: a gke run on this platform names its Kueue queue (TPU quota)"
    assert f"{queue_needed}: one of research-queue, {gke['queue']}" in str(refused.value)


def test_the_airflow_values_must_name_our_account_and_password_secret() -> None:
    """The Airflow sub-chart's values repeat two of ours: renaming one side alone would bind
    the Role to an account no Airflow pod runs as, or hand the pods another password."""
    renamed = {"serviceAccounts": {"airflow": {"name": "renamed-airflow"}}}
    with pytest.raises(helm.HelmRenderError, match=r"serviceAccount\.name is \"slipway-airflow\""):
        render_files(user_values("default", **renamed))
    other = {"lineage": {"passwordSecret": {"name": "other-db", "key": "password"}}}
    with pytest.raises(helm.HelmRenderError, match=r"lineage\.passwordSecret is other-db/password"):
        render_files(user_values("default", **other))
    sa = {"create": False, "name": "renamed-airflow"}
    both = render(
        "default",
        **renamed,
        airflow={
            "workers": {"serviceAccount": sa, "kubernetes": {"serviceAccount": sa}},
            "triggerer": {"serviceAccount": sa},
        },
    )
    (account,) = [o for o in of_kind(both, "ServiceAccount") if "airflow" in o["metadata"]["name"]]
    assert account["metadata"]["name"] == "renamed-airflow"
