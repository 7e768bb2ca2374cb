"""GkeBackend on the real ``kubernetes`` client, over HTTP, against FakeKubernetesApiServer.

The fake is a fake: a local HTTP server speaking the JobSet and pod REST paths and objects
(tests/fakes/k8s_api.py). Covered: create/get/poll/delete, 409 (adopt, replace, conflict),
404, 401 with credentials refresh (static token, exec plugin, proactive bearer refresh), 403,
500 retries with backoff, leader pod logs, watch, and the hook that builds the backend.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from operators.jobset import TrainingLaunch
from operators.jobset.gke import (
    STEP_VERSION_LABEL,
    ClusterSettings,
    GkeBackend,
    JobSetApiError,
    JobSetAuthError,
    JobSetConflict,
    JobSetNotFound,
    bearer_client,
    status_from_object,
)

NS = "train"
VERSION = "a" * 63
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def backend(kubeconfig, sleeps):
    b = GkeBackend(
        ClusterSettings(namespace=NS, kubeconfig=str(kubeconfig)), sleep=sleeps, poll_interval=0.01
    )
    yield b
    b.close()


def manifest(name: str = "slipway-train-0123abcd", version: str = VERSION, **kw) -> dict:
    return TrainingLaunch(
        name=name,
        image="us-docker.pkg.dev/proj/slipway/trainer:1",
        config_uri="gs://bucket/run/trainer_config.json",
        namespace=NS,
        topology="2",
        labels={STEP_VERSION_LABEL: version},
        **kw,
    ).render()


# -- create / get / poll / delete -------------------------------------------------------------


def test_submit_sends_exactly_the_rendered_manifest(fake, backend):
    m = manifest()
    handle = backend.submit(m)
    assert fake.created == [m]  # byte for byte what render() produced, nothing added
    (post,) = fake.requests_to("POST")
    assert post.path == JOBSETS
    assert post.token == next(iter(fake.tokens))
    obj = fake.jobset(NS, handle.name)
    assert (handle.backend, handle.namespace, handle.uid) == ("gke", NS, obj["metadata"]["uid"])
    status = backend.poll(handle)
    assert not status.done and status.restarts == 0
    assert backend.get(handle)["spec"] == m["spec"]


def test_poll_reads_restarts_conditions_and_terminal_state(fake, backend):
    handle = backend.submit(manifest())
    fake.restart(NS, handle.name)  # counted toward maxRestarts
    fake.restart(NS, handle.name, counted=False)  # RestartJobSetAndIgnoreMaxRestarts
    status = backend.poll(handle)
    assert (status.restarts, status.restarts_counted, status.done) == (2, 1, False)
    fake.fail(NS, handle.name, "ReachedMaxRestarts", "jobset failed: max restarts", exit_code=42)
    status = backend.poll(handle)
    assert status.terminal_state == "Failed" and not status.succeeded
    assert (status.reason, status.message) == ("ReachedMaxRestarts", "jobset failed: max restarts")
    assert status.exit_codes == {"slice-0/worker-0": 42, "slice-0/worker-1": 42}
    assert {e.attempt for e in status.exits} == {2}  # older attempts' pods are gone


def test_completed(fake, backend):
    handle = backend.submit(manifest())
    fake.complete(NS, handle.name)
    status = backend.wait(handle, timeout=5)
    assert status.succeeded and status.reason == "AllJobsCompleted"
    assert set(status.exit_codes.values()) == {0}


def test_status_from_conditions_when_terminal_state_is_absent():
    from operators.jobset import JobSetHandle

    handle = JobSetHandle("gke", NS, "x", "u")
    obj = {
        "status": {
            "restarts": 3,
            "conditions": [
                {"type": "Suspended", "status": "False", "reason": "ResumeJobs", "message": ""},
                {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "m"},
            ],
        }
    }
    status = status_from_object(handle, obj)
    assert (status.terminal_state, status.reason, status.restarts) == ("Failed", "FailedJobs", 3)
    assert status.restarts_counted == 3  # JobSet versions without restartsCountTowardsMax


def test_wait_times_out(fake, backend):
    handle = backend.submit(manifest())
    with pytest.raises(TimeoutError):
        backend.wait(handle, timeout=0.05)


def test_cancel_deletes_foreground_and_is_idempotent(fake, backend):
    handle = backend.submit(manifest())
    status = backend.cancel(handle)
    assert status.terminal_state == "Failed" and status.reason == "Cancelled"
    assert fake.deletions == [
        {
            "name": handle.name,
            "namespace": NS,
            "propagationPolicy": "Foreground",
            "preconditions": {"uid": handle.uid},
        }
    ]
    assert (NS, handle.name) not in fake.jobsets and not fake.pods
    assert backend.cancel(handle).message == "already gone"  # 404: nothing to do
    with pytest.raises(JobSetNotFound, match="not found"):
        backend.poll(handle)


def test_cancel_spares_a_newer_jobset_of_the_same_name(fake, backend):
    old = backend.submit(manifest())
    fake.delete(NS, old.name)
    new = backend.submit(manifest())
    assert "not deleted" in backend.cancel(old).message  # uid precondition: 409
    assert fake.jobset(NS, new.name)["metadata"]["uid"] == new.uid


def test_foreground_deletion_is_waited_for(fake, backend):
    fake.hold_deletions = True
    handle = backend.submit(manifest())
    backend.cancel(handle)
    assert fake.jobset(NS, handle.name)["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert not backend.wait_deleted(handle, timeout=0.05)
    fake.finish_deletions()
    assert backend.wait_deleted(handle, timeout=1)


# -- 409: adopt, replace, or refuse -----------------------------------------------------------


def test_409_for_the_same_step_adopts_the_running_jobset(fake, backend):
    first = backend.submit(manifest())
    fake.restart(NS, first.name)
    again = backend.submit(manifest())
    assert again == first  # followed, not started twice
    assert len(fake.created) == 1 and not fake.deletions


def test_409_for_a_failed_attempt_of_the_step_replaces_it(fake, backend):
    first = backend.submit(manifest())
    fake.fail(NS, first.name)
    second = backend.submit(manifest())
    assert second.uid != first.uid
    assert [d["preconditions"]["uid"] for d in fake.deletions] == [first.uid]
    assert len(fake.created) == 2
    assert not backend.poll(second).done


def test_409_from_another_owner_is_a_clear_error(fake, backend):
    backend.submit(manifest(version="b" * 63))
    with pytest.raises(JobSetConflict, match="already exists and is not this step's"):
        backend.submit(manifest())
    assert not fake.deletions


def test_create_retried_after_500_adopts_its_own_first_attempt(fake, backend, sleeps):
    # The first POST reached the server but its reply was a 500: the retry gets 409 for the
    # object it created itself, and follows it.
    original = fake._create

    def create_then_fail(ns, body):
        original(ns, body)
        fake._create = original
        from tests.fakes.k8s_api import ApiError

        raise ApiError(500, "etcd timeout after write")

    fake._create = create_then_fail
    handle = backend.submit(manifest())
    assert len(fake.created) == 1 and handle.uid == fake.jobset(NS, handle.name)["metadata"]["uid"]
    assert sleeps == [1.0]


# -- errors -----------------------------------------------------------------------------------


def test_404(fake, backend):
    from operators.jobset import JobSetHandle

    with pytest.raises(JobSetNotFound, match='"nope" not found'):
        backend.poll(JobSetHandle("gke", NS, "nope", "u"))


def _pod_labels(m: dict) -> dict:
    return m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize(
    ("break_it", "says"),
    [
        # A sweep cell's step name as its label value once was: no label value may hold '/'.
        (
            lambda m: m["metadata"]["labels"].update({"slipway/step": "sweep/train/C1e10-s0"}),
            'metadata.labels: Invalid value: "sweep/train/C1e10-s0": a valid label must be',
        ),
        (
            lambda m: m["metadata"]["labels"].update({"slipway/step": "x" * 64}),
            "must be no more than 63 characters",
        ),
        (lambda m: m["metadata"]["labels"].update({"a/b/c": "v"}), "a qualified name must"),
        (lambda m: m["metadata"]["labels"].update({"Slipway.dev/x": "v"}), "prefix part"),
        (lambda m: m["metadata"].update(annotations={"-x": "v"}), "metadata.annotations: "),
        (
            lambda m: _pod_labels(m).update({"slipway/step": "a/b"}),
            "spec.replicatedJobs[0].template.spec.template.metadata.labels: Invalid value",
        ),
        # The JobSet CRD's schema: a type, an enum.
        (
            lambda m: m["spec"]["replicatedJobs"][0].update(replicas="two"),
            "spec.replicatedJobs.0.replicas: 'two' is not of type 'integer'",
        ),
        (
            lambda m: m["spec"].update(successPolicy={"operator": "Most"}),
            "spec.successPolicy.operator: 'Most' is not one of ['All', 'Any']",
        ),
    ],
)
def test_what_the_api_server_refuses_is_a_422_and_nothing_is_created(
    fake, backend, sleeps, break_it, says
):
    """The fake validates a JobSet as the API server does (the rendered manifest is valid:
    broken here after rendering), so a test through it fails where a cluster would."""
    m = manifest()
    break_it(m)
    with pytest.raises(JobSetApiError, match="HTTP 422") as err:
        backend.submit(m)
    assert says in str(err.value)
    assert err.value.status == 422 and not err.value.transient and sleeps == []  # no retry
    assert fake.created == [] and fake.jobsets == {}


def test_500_is_retried_with_backoff_then_reported(fake, backend, sleeps):
    handle = backend.submit(manifest())
    fake.inject(500, method="GET", times=2, message="etcdserver: request timed out")
    assert not backend.poll(handle).done
    assert sleeps == [1.0, 2.0]
    sleeps.clear()
    fake.inject(503, method="GET", times=100)
    with pytest.raises(JobSetApiError, match="HTTP 503") as err:
        backend.poll(handle)
    assert err.value.status == 503 and err.value.transient
    assert sleeps == [1.0, 2.0, 4.0, 8.0]  # retries=4, exponential


def test_unreachable_api_is_retried_then_reported(tmp_path, sleeps):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    config = tmp_path / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    b = GkeBackend(ClusterSettings(namespace=NS, kubeconfig=str(config)), sleep=sleeps, retries=2)
    with pytest.raises(JobSetApiError, match="cannot reach the Kubernetes API"):
        b.submit(manifest())
    assert sleeps == [1.0, 2.0]


def test_unloadable_credentials_are_a_transient_error_naming_the_source(tmp_path):
    from operators.jobset.gke import CredentialsUnavailable

    missing = tmp_path / "no-such-kubeconfig"
    b = GkeBackend(ClusterSettings(namespace=NS, kubeconfig=str(missing)))
    with pytest.raises(CredentialsUnavailable, match=f"kubeconfig {missing}") as err:
        b.submit(manifest())
    assert err.value.transient  # a trigger retries: the file may be rotated back in place


def test_403_names_the_credentials_source_and_the_rbac_needed(fake, backend, kubeconfig):
    fake.inject(403, message='jobsets.jobset.x-k8s.io is forbidden: User "sa" cannot create')
    with pytest.raises(JobSetAuthError) as err:
        backend.submit(manifest())
    text = str(err.value)
    assert "forbidden (403)" in text and f"kubeconfig {kubeconfig}" in text
    assert f"namespace {NS}" in text and "cannot create" in text


def test_expired_token_is_refreshed_and_retried_once(fake, backend, kubeconfig):
    handle = backend.submit(manifest())
    # Weeks later: the token expired, the kubeconfig (re-issued by its tooling) has a new one.
    fake.accept_tokens("fake-token-2")
    fake.write_kubeconfig(kubeconfig, token="fake-token-2")
    assert not backend.poll(handle).done
    assert backend.refreshes == 1
    tokens = [r.token for r in fake.requests_to("GET", "/jobsets/")]
    assert tokens == ["fake-token-1", "fake-token-2"]


def test_401_after_refresh_is_a_clear_error(fake, backend, kubeconfig):
    handle = backend.submit(manifest())
    fake.accept_tokens("somebody-elses")
    with pytest.raises(JobSetAuthError, match=f"unauthorized \\(401\\).*kubeconfig {kubeconfig}"):
        backend.poll(handle)
    assert backend.refreshes == 1  # one refresh, not a loop


def test_exec_plugin_tokens_are_refreshed(fake, tmp_path):
    """A kubeconfig whose user is an exec plugin (like gke-gcloud-auth-plugin): refreshing
    re-runs the plugin, which hands out the current token."""
    token_file = tmp_path / "token"
    token_file.write_text("fake-token-1")
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json, pathlib\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1beta1',\n"
        "  'kind': 'ExecCredential',\n"
        f"  'status': {{'token': pathlib.Path({str(token_file)!r}).read_text()}}}}))\n"
    )
    config = json.loads(fake.write_kubeconfig(tmp_path / "kc").read_text())
    config["users"][0]["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(plugin)],
            "interactiveMode": "Never",
        }
    }
    (tmp_path / "kc").write_text(json.dumps(config))
    b = GkeBackend(ClusterSettings(namespace=NS, kubeconfig=str(tmp_path / "kc")))
    handle = b.submit(manifest())
    token_file.write_text("fake-token-2")
    fake.accept_tokens("fake-token-2")
    assert not b.poll(handle).done and b.refreshes == 1


def test_bearer_client_refreshes_before_expiry_without_a_401(fake):
    """The GKE path: google-auth credentials renew themselves before each request."""
    current = {"token": "fake-token-1"}
    asked = []

    def token() -> str:
        asked.append(current["token"])
        return current["token"]

    b = GkeBackend(
        ClusterSettings(namespace=NS, cluster_name="c", location="us-central2"),
        client_factory=lambda: bearer_client(fake.url, token),
    )
    handle = b.submit(manifest())
    current["token"] = "fake-token-2"
    fake.accept_tokens("fake-token-2")
    assert not b.poll(handle).done
    assert b.refreshes == 0 and asked[-1] == "fake-token-2"
    assert not [r for r in fake.requests if r.token != "fake-token-1" and r.token != "fake-token-2"]


# -- pods, logs, watch ------------------------------------------------------------------------


def test_leader_log_tail(fake, backend):
    handle = backend.submit(manifest(slices=1))
    assert backend.leader_log_tail(handle) == (fake.leader_pod(NS, handle.name), [])
    pod = fake.log(NS, handle.name, *[f"line {i}" for i in range(10)])
    name, lines = backend.leader_log_tail(handle, lines=3)
    assert (name, lines) == (pod, ["line 7", "line 8", "line 9"])
    (*_, listing) = [r for r in fake.requests_to("GET", "/pods") if r.path.endswith("/pods")]
    selector = listing.query["labelSelector"]
    assert set(selector.split(",")) == {
        f"jobset.sigs.k8s.io/jobset-name={handle.name}",
        "jobset.sigs.k8s.io/job-index=0",
        "batch.kubernetes.io/job-completion-index=0",
    }
    fake.restart(NS, handle.name)
    name, lines = backend.leader_log_tail(handle)
    assert name != pod and lines == []  # the new attempt's leader
    assert fake.pods[(NS, name)]["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1"


def test_wait_for_change_returns_at_once_on_a_change(fake, backend):
    handle = backend.submit(manifest())
    version = backend.get(handle)["metadata"]["resourceVersion"]
    threading.Timer(0.2, lambda: fake.restart(NS, handle.name)).start()
    changed = backend.wait_for_change(handle, version, timeout=10)
    assert changed["status"]["restarts"] == 1
    (watch,) = fake.requests_to("WATCH")
    assert watch.query["fieldSelector"] == f"metadata.name={handle.name}"
    assert watch.query["resourceVersion"] == version
    assert backend.wait_for_change(handle, changed["metadata"]["resourceVersion"], 1) is None
    threading.Timer(0.2, lambda: fake.delete(NS, handle.name)).start()
    with pytest.raises(JobSetNotFound):
        backend.wait_for_change(handle, changed["metadata"]["resourceVersion"], timeout=10)


def test_watch_from_an_expired_version_is_an_error(fake, backend):
    handle = backend.submit(manifest())
    fake.min_watch_version = 10**9
    with pytest.raises(JobSetApiError, match="too old resource version") as err:
        backend.wait_for_change(handle, "1001", timeout=5)
    assert err.value.status == 410 and not err.value.transient


# -- settings and the hook --------------------------------------------------------------------


def test_cluster_settings():
    s = ClusterSettings.from_dict({"namespace": NS, "cluster_name": "tpu", "location": "us-east5"})
    assert s.source == "gke" and "GKE cluster tpu in us-east5" in s.describe()
    assert ClusterSettings.from_dict(s.to_dict()) == s
    assert ClusterSettings().source == "auto"
    assert ClusterSettings(in_cluster=True).source == "in-cluster"
    bad = ClusterSettings(namespace="Not_A_Label", kubeconfig="/k", in_cluster=True)
    problems = " | ".join(bad.problems())
    assert "DNS-1123" in problems and "choose one source" in problems
    assert ClusterSettings(cluster_name="c").problems() == [
        "location: a GKE cluster_name needs its location (region or zone)"
    ]
    with pytest.raises(ValueError, match="unknown cluster settings"):
        ClusterSettings.from_dict({"token": "x"})


def test_form_keys_match_the_cluster_settings():
    from dataclasses import fields

    from operators.params import pipeline_params
    from operators.pipeline.form import GKE_CLUSTER_KEYS

    assert set(GKE_CLUSTER_KEYS) == {f.name for f in fields(ClusterSettings)}
    form = set(pipeline_params()["gke"].schema["properties"])
    assert form == {*GKE_CLUSTER_KEYS, "service_account", "queue"}


def test_hook_builds_the_gke_backend(fake, kubeconfig):
    from operators.hooks.jobset import BackendUnavailable, JobSetHook

    b = JobSetHook("gke", cluster={"namespace": NS, "kubeconfig": str(kubeconfig)}).get_conn()
    assert isinstance(b, GkeBackend) and b.name == "gke"
    assert not b.poll(b.submit(manifest())).done
    with pytest.raises(BackendUnavailable, match="DNS-1123"):
        JobSetHook("gke", cluster={"namespace": "Bad_NS"}).get_conn()
    with pytest.raises(BackendUnavailable, match="unknown JobSet backend 'aws'"):
        JobSetHook("aws").get_conn()


def test_hook_reads_the_kubernetes_connection_when_no_source_is_given(kubeconfig, monkeypatch):
    from operators.hooks.jobset import JobSetHook

    extra = {"kube_config_path": str(kubeconfig), "cluster_context": "fake", "namespace": NS}
    monkeypatch.setenv(
        "AIRFLOW_CONN_SLIPWAY_K8S", json.dumps({"conn_type": "kubernetes", "extra": extra})
    )
    settings = JobSetHook("gke", kubernetes_conn_id="slipway_k8s").cluster_settings()
    assert (settings.kubeconfig, settings.context, settings.namespace) == (
        str(kubeconfig),
        "fake",
        NS,
    )
    # No connection: 'auto' stays (in-cluster in a pod, else the default kubeconfig).
    assert JobSetHook("gke", kubernetes_conn_id="missing").cluster_settings().source == "auto"


def test_gke_credentials_through_the_google_provider(fake, monkeypatch):
    """The GKE factory: the GCP connection's credentials, the cluster's endpoint and CA from
    the GKE API, a token refreshed by google-auth when it is no longer valid."""
    import base64
    from types import SimpleNamespace

    import google.cloud.container_v1 as container_v1
    from airflow.providers.google.common.hooks import base_google

    from operators.hooks.jobset import JobSetHook

    class Credentials:
        def __init__(self) -> None:
            self.token, self.valid, self.refreshed = None, False, 0

        def refresh(self, request) -> None:
            self.refreshed += 1
            self.token, self.valid = f"fake-token-{self.refreshed}", True

    creds = Credentials()
    seen = {}

    class Hook:
        def __init__(self, gcp_conn_id: str) -> None:
            seen["conn"] = gcp_conn_id
            self.project_id = "conn-project"

        def get_credentials(self):
            return creds

    class Manager:
        def __init__(self, credentials) -> None:
            assert credentials is creds

        def get_cluster(self, name: str):
            seen["cluster"] = name
            return SimpleNamespace(
                endpoint="10.0.0.1",
                private_cluster_config=SimpleNamespace(private_endpoint="10.1.0.1"),
                master_auth=SimpleNamespace(
                    cluster_ca_certificate=base64.b64encode(b"-----BEGIN CERT-----").decode()
                ),
            )

    monkeypatch.setattr(base_google, "GoogleBaseHook", Hook)
    monkeypatch.setattr(container_v1, "ClusterManagerClient", Manager)
    cluster = {"namespace": NS, "cluster_name": "tpu", "location": "us-east5", "gcp_conn_id": "g"}
    backend = JobSetHook("gke", cluster=cluster).get_conn()
    api = backend._client()
    assert seen == {"conn": "g", "cluster": "projects/conn-project/locations/us-east5/clusters/tpu"}
    assert api.configuration.host == "https://10.0.0.1"
    assert Path(api.configuration.ssl_ca_cert).read_bytes() == b"-----BEGIN CERT-----"
    assert api.configuration.auth_settings()["BearerToken"]["value"] == "Bearer fake-token-1"
    creds.valid = False  # an hour later
    assert api.configuration.auth_settings()["BearerToken"]["value"] == "Bearer fake-token-2"
    backend.close()


def test_a_jobset_gone_between_the_409_and_the_read_is_created(fake, backend):
    # The existing JobSet's foreground delete finishes just as a cleared task resubmits: the
    # create gets 409, the read that follows 404. The name is free: create it, don't fail.
    first = backend.submit(manifest())
    original = fake._get

    def vanished(ns, name):
        with fake._cond:
            fake.jobsets.pop((ns, name), None)
        fake._get = original
        return original(ns, name)

    fake._get = vanished
    second = backend.submit(manifest())
    assert second.uid != first.uid and len(fake.created) == 2
    assert fake.jobset(NS, second.name)["metadata"]["uid"] == second.uid
