"""The gke path end to end against FakeKubernetesApiServer (a fake API server, not a cluster).

The trigger's ``run()`` follows a JobSet through scripted status transitions (restarts,
Completed, Failed), survives a serialize/deserialize round trip, renews the step lease; the
TrainingOperator submits, defers, and finishes in ``execute_complete``; a killed deferred task
(trigger ``on_kill``) and a trigger timeout (``__fail__``) delete the JobSet.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.gke import IMAGE, NS, Collect, run_trigger, trainer_writes_results
from tests.support.tiny_pipeline import make_corpora, tiny_conf

# -- fixtures (fake, kubeconfig, home and gke_platform: conftest.py) --------------------------


@pytest.fixture
def params(tmp_path, kubeconfig, gke_platform):
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import pipeline_params
    from operators.pipeline.form import check_run_config

    p = ParamsDict()
    p.update(pipeline_params())
    conf = tiny_conf(make_corpora(tmp_path / "data"))
    conf.update(
        backend="gke",
        image=IMAGE,
        gke={"namespace": NS, "kubeconfig": str(kubeconfig), "service_account": "trainer"},
    )
    p.update(conf)
    values = p.validate()
    check_run_config(values)  # the form accepts gke with its settings
    return values


def _context(params, run_id="manual__gke"):
    return {"params": params, "run_id": run_id, "ti": None}


def _trigger(handle, kubeconfig, lease=None, **kw):
    from operators.triggers.jobset import JobSetTrigger

    kw = {"poll_seconds": 0.5, "log_seconds": 0.05, "log_lines": 5, "error_backoff": 0.05, **kw}
    trigger = JobSetTrigger(
        handle=handle.to_dict(),
        cluster={"namespace": NS, "kubeconfig": str(kubeconfig)},
        lease=lease,
        **kw,
    )
    sink = Collect()
    trigger._say = sink
    return trigger, sink


def _submit(fake, kubeconfig, name="slipway-train-0123abcd"):
    from operators.jobset import TrainingLaunch
    from operators.jobset.gke import STEP_VERSION_LABEL, ClusterSettings, GkeBackend

    backend = GkeBackend(ClusterSettings(namespace=NS, kubeconfig=str(kubeconfig)))
    manifest = TrainingLaunch(
        name=name,
        image=IMAGE,
        config_uri="gs://bucket/c.json",
        namespace=NS,
        topology="2",
        labels={STEP_VERSION_LABEL: "f" * 63},
    ).render()
    return backend.submit(manifest)


def _later(*actions: Callable[[], Any], every: float = 0.3) -> Callable[[], None]:
    """A controller script: each action after ``every`` seconds (time for the trigger to see)."""

    def play() -> None:
        for action in actions:
            time.sleep(every)
            action()

    return play


def until(predicate: Callable[[], Any], timeout: float = 10.0) -> Callable[[], None]:
    """A script step that waits for the trigger to have done something (no timing guesses)."""

    def wait() -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "the trigger did not get there in time"
            time.sleep(0.02)

    return wait


# -- the trigger ------------------------------------------------------------------------------


def test_trigger_follows_restarts_and_logs_to_completion(fake, kubeconfig):
    handle = _submit(fake, kubeconfig)
    trigger, said = _trigger(handle, kubeconfig)
    event = run_trigger(
        trigger,
        _later(
            lambda: fake.log(NS, handle.name, "step 1 loss 9.1", "step 2 loss 8.7"),
            until(lambda: said.having("step 2 loss 8.7")),
            lambda: fake.restart(NS, handle.name),  # counted (preemption -> exit 42)
            lambda: fake.log(NS, handle.name, "restored step 2", "step 3 loss 8.2"),
            until(lambda: said.having("step 3 loss 8.2")),
            lambda: fake.restart(NS, handle.name, counted=False),
            lambda: fake.set_condition(NS, handle.name, "StartupPolicyCompleted", "Done", "ok"),
            lambda: fake.log(NS, handle.name, "step 4 loss 7.9"),
            until(lambda: said.having("step 4 loss 7.9")),
            lambda: fake.complete(NS, handle.name),
            every=0.05,
        ),
    )
    assert event.payload["event"] == "terminal"
    status = event.payload["status"]
    assert status["terminal_state"] == "Completed"
    assert status["reason"] == "AllJobsCompleted"
    assert (status["restarts"], status["restarts_counted"]) == (2, 1)
    assert {e["exit_code"] for e in status["exits"] if e["attempt"] == 2} == {0}
    # Each restart reported once, as it happened.
    restarts = said.having("restarted: restart")
    assert len(restarts) == 2, said.lines
    assert "restart 1 (1/3 counted" in restarts[0] and "restart 2 (1/3 counted" in restarts[1]
    assert said.having("condition StartupPolicyCompleted: Done: ok")
    # The leader's log lines, each once, across the pods of three attempts.
    shown = [line.split("] ", 1)[1] for line in said.lines if line.startswith("[slipway-")]
    assert shown == [
        "step 1 loss 9.1",
        "step 2 loss 8.7",
        "restored step 2",
        "step 3 loss 8.2",
        "step 4 loss 7.9",
    ], said.lines
    assert said.having(f"kubectl logs -n {NS} ")


def test_trigger_reports_failure_with_reason_and_exit_codes(fake, kubeconfig):
    handle = _submit(fake, kubeconfig)
    trigger, said = _trigger(handle, kubeconfig)
    event = run_trigger(
        trigger,
        _later(
            lambda: fake.restart(NS, handle.name),
            lambda: fake.fail(
                NS,
                handle.name,
                reason="FailJobSetFailurePolicyRuleAction",
                message="rule failFastOnFatalExitCode: job slice-0 failed (PodFailurePolicy)",
                exit_code=1,
            ),
        ),
    )
    status = event.payload["status"]
    assert event.payload["event"] == "terminal"
    assert status["terminal_state"] == "Failed"
    assert status["reason"] == "FailJobSetFailurePolicyRuleAction"
    assert "failFastOnFatalExitCode" in status["message"]
    from operators.jobset.gke import status_from_dict

    assert status_from_dict(status).exit_codes == {"slice-0/worker-0": 1, "slice-0/worker-1": 1}
    assert said.having("Failed: FailJobSetFailurePolicyRuleAction")


def test_trigger_rides_out_api_errors_and_notices_deletion(fake, kubeconfig):
    handle = _submit(fake, kubeconfig)
    trigger, said = _trigger(handle, kubeconfig)
    # 500s beyond one call's retries: the loop keeps going (a weeks-long run outlives blips).
    fake.inject(500, method="GET", path="/jobsets/", times=6, message="etcdserver: leader changed")
    event = run_trigger(
        trigger,
        _later(lambda: fake.delete(NS, handle.name), every=0.8),
    )
    assert said.having("Kubernetes API unavailable")
    assert event.payload["event"] == "vanished"


def test_trigger_error_event_on_forbidden(fake, kubeconfig):
    handle = _submit(fake, kubeconfig)
    trigger, _ = _trigger(handle, kubeconfig)
    fake.inject(403, path="/jobsets/", times=1, message="jobsets is forbidden: User cannot get")
    event = run_trigger(trigger)
    assert event.payload["event"] == "error"
    assert "forbidden (403)" in event.payload["message"]
    assert str(kubeconfig) in event.payload["message"]  # names the credentials source


def test_trigger_survives_a_serialize_round_trip(fake, kubeconfig, tmp_path):
    from airflow.sdk.serde import deserialize, serialize

    from operators.triggers.jobset import JobSetTrigger

    handle = _submit(fake, kubeconfig)
    lease = {"output": str(tmp_path), "step": "train", "version": "v", "owner": "o"}
    lease |= {"generation": 0, "started_at": 1.0, "lease_seconds": 600.0}
    trigger = JobSetTrigger(
        handle.to_dict(), {"namespace": NS, "kubeconfig": str(kubeconfig)}, lease
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "operators.triggers.jobset.JobSetTrigger"
    # What the triggerer stores: plain data through Airflow's serde, no token anywhere.
    stored = json.dumps(serialize(kwargs))
    assert next(iter(fake.tokens)) not in stored
    module, _, name = classpath.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    rebuilt = cls(**deserialize(json.loads(stored)))
    assert rebuilt.serialize() == (classpath, kwargs)
    # ...and the rebuilt trigger (a restarted triggerer) follows the same JobSet.
    rebuilt.lease = None
    rebuilt._say = Collect()
    fake.restart(NS, handle.name)
    event = run_trigger(rebuilt, _later(lambda: fake.complete(NS, handle.name)))
    assert event.payload["status"]["restarts"] == 1
    assert rebuilt._say.having("has restarted 1 time(s) so far")


def test_trigger_on_kill_deletes_the_jobset_and_cleanup_does_not(fake, kubeconfig):
    handle = _submit(fake, kubeconfig)
    trigger, _ = _trigger(handle, kubeconfig, owns_jobset=True)
    asyncio.run(trigger.cleanup())  # every exit, e.g. a triggerer restart: JobSet untouched
    assert (NS, handle.name) in fake.jobsets
    asyncio.run(trigger.on_kill())
    assert (NS, handle.name) not in fake.jobsets
    assert fake.deletions[-1]["propagationPolicy"] == "Foreground"
    assert fake.deletions[-1]["preconditions"] == {"uid": handle.uid}


# -- the operator: defer -> trigger -> execute_complete ---------------------------------------


def _defer(op, params, run_id="manual__gke"):
    from airflow.sdk.exceptions import TaskDeferred

    with pytest.raises(TaskDeferred) as deferred:
        op.execute(_context(params, run_id))
    return deferred.value


def _train_spec(params):
    from operators.pipeline.graph import build_graph
    from operators.settings import steps_root
    from operators.steps import resolve

    step = build_graph(params).train
    return step, resolve(step, steps_root())


def _status(spec):
    from operators.steps import store_for

    marker = json.loads(Path(spec.output_path, ".status.json").read_text())
    return marker, store_for(spec.output_path)


def _executions(home, state=None):
    from operators.lineage import LineageStore

    with LineageStore(f"sqlite:///{home / 'lineage.db'}") as store:
        graph = store.run_graph("manual__gke")
        return [n.execution for n in graph.steps if state is None or n.execution.state == state]


def _operator():
    from operators.training import TrainingOperator

    return TrainingOperator(gke_poll_seconds=0.5, gke_log_seconds=0.05)


def test_operator_defers_and_completes(fake, kubeconfig, home, params):
    from operators.jobset.gke import STEP_VERSION_LABEL
    from operators.triggers.jobset import JobSetTrigger

    op = _operator()
    deferred = _defer(op, params)
    step, spec = _train_spec(params)
    assert isinstance(deferred.trigger, JobSetTrigger)
    assert deferred.method_name == "execute_complete"
    # The JobSet sent is the rendered manifest kept in the step directory, with its step label.
    sent = fake.created[-1]
    assert sent == json.loads(Path(spec.output_path, "jobset.json").read_text())
    assert sent["metadata"]["namespace"] == NS
    assert sent["metadata"]["labels"][STEP_VERSION_LABEL] == step.version[:63]
    assert (
        sent["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "serviceAccountName"
        ]
        == "trainer"
    )
    # While deferred: the step is RUNNING under a long lease the trigger renews.
    marker, _ = _status(spec)
    assert marker["status"] == "RUNNING"
    assert marker["lease_expires_at"] - time.time() > 500
    assert len(_executions(home, "RUNNING")) == 1

    trigger = deferred.trigger
    trigger._say = Collect()
    before = marker["lease_expires_at"]
    fake.restart(NS, sent["metadata"]["name"])
    event = run_trigger(trigger, _later(lambda: fake.complete(NS, sent["metadata"]["name"])))
    assert _status(spec)[0]["lease_expires_at"] > before  # the trigger renewed it
    trainer_writes_results(spec.output_path)
    result = op.execute_complete(_context(params), event.payload, **deferred.kwargs)

    assert result["outcome"] == "RAN"
    assert (result["steps"], result["restarts"], result["checkpoint_step"]) == (6, 1, 6)
    assert _status(spec)[0]["status"] == "SUCCESS"
    (execution,) = _executions(home)
    assert execution.state == "COMPLETE"
    assert execution.properties["restarts"] == 1

    # A rerun is a cache hit: nothing sent to the cluster.
    posts = len(fake.requests_to("POST"))
    again = _operator().execute(_context(params, "manual__again"))
    assert again["outcome"] == "CACHED"
    assert len(fake.requests_to("POST")) == posts


def test_operator_failed_jobset_fails_step_and_lineage(fake, kubeconfig, home, params):
    from operators.launching import TrainingFailed

    op = _operator()
    deferred = _defer(op, params)
    _, spec = _train_spec(params)
    name = fake.created[-1]["metadata"]["name"]
    fake.fail(NS, name, reason="ReachedMaxRestarts", exit_code=42)
    event = run_trigger(deferred.trigger)
    with pytest.raises(TrainingFailed, match="ReachedMaxRestarts"):
        op.execute_complete(_context(params), event.payload, **deferred.kwargs)
    marker, _ = _status(spec)
    assert marker["status"] == "FAILED"
    (execution,) = _executions(home)
    assert execution.state == "FAILED"
    assert "ReachedMaxRestarts" in execution.error
    # The retry replaces the failed JobSet (it resumes from the checkpoint) instead of adopting it.
    _defer(_operator(), params)
    assert [d["name"] for d in fake.deletions] == [name]
    assert fake.jobsets[(NS, name)]["status"].get("terminalState") is None


def test_trigger_timeout_deletes_the_jobset(fake, kubeconfig, home, params):
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
    from airflow.sdk.exceptions import TaskDeferralTimeout

    op = _operator()
    _defer(op, params)
    _, spec = _train_spec(params)
    name = fake.created[-1]["metadata"]["name"]
    # What the scheduler does when execution_timeout passes while deferred: the task resumes
    # on a worker with __fail__ (no kwargs of ours); a fresh operator instance runs it.
    with pytest.raises(TaskDeferralTimeout):
        _operator().resume_execution(
            TRIGGER_FAIL_REPR, {"error": "Trigger timeout"}, _context(params)
        )
    assert (NS, name) not in fake.jobsets
    assert fake.deletions[-1]["propagationPolicy"] == "Foreground"
    marker, _ = _status(spec)
    assert marker["status"] == "FAILED" and "Trigger timeout" in marker["error"]
    (execution,) = _executions(home)
    assert execution.state == "FAILED"


def test_a_timeout_whose_delete_fails_still_ends_the_step(fake, kubeconfig, home, params):
    """The deferral times out and the cluster refuses the delete: the step and its lineage
    execution are still FAILED (a rerun adopts the JobSet), and the task fails as Airflow
    fails it, the delete's error logged."""
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
    from airflow.sdk.exceptions import TaskDeferralTimeout

    _defer(_operator(), params)
    _, spec = _train_spec(params)
    fake.inject(403, method="DELETE", path="/jobsets/", times=10, message="jobsets is forbidden")
    with pytest.raises(TaskDeferralTimeout):
        _operator().resume_execution(
            TRIGGER_FAIL_REPR, {"error": "Trigger timeout"}, _context(params)
        )
    marker, _ = _status(spec)
    assert marker["status"] == "FAILED" and "Trigger timeout" in marker["error"]
    assert "deleting JobSet" in marker["error"] and "forbidden" in marker["error"]
    (execution,) = _executions(home)
    assert execution.state == "FAILED"


def test_killed_while_deferred_deletes_jobset_and_frees_the_step(fake, kubeconfig, home, params):
    op = _operator()
    deferred = _defer(op, params)
    _, spec = _train_spec(params)
    name = fake.created[-1]["metadata"]["name"]
    # Airflow 3.3: a user marking the deferred task failed (or clearing it) -> trigger.on_kill.
    asyncio.run(deferred.trigger.on_kill())
    assert (NS, name) not in fake.jobsets
    marker, _ = _status(spec)
    assert marker["status"] == "FAILED" and "killed while deferred" in marker["error"]
    # The lease is released: a rerun submits at once (no 10-minute wait for it to expire).
    _defer(_operator(), params, run_id="manual__rerun")
    assert (NS, name) in fake.jobsets


def test_lease_taken_over_ends_the_trigger_without_deleting(fake, kubeconfig, home, params):
    from operators.steps import HeldLease, LeaseLost

    op = _operator()
    deferred = _defer(op, params)
    _, spec = _train_spec(params)
    name = fake.created[-1]["metadata"]["name"]
    # Another runner creates the next lease generation (as a takeover of a stale lease does).
    other = HeldLease(spec.output_path, spec.name, spec.version, "other", 1, 0.0, 60.0)
    assert other.acquire()
    event = run_trigger(deferred.trigger)
    assert event.payload["event"] == "lease_lost"
    with pytest.raises(LeaseLost):
        op.execute_complete(_context(params), event.payload, **deferred.kwargs)
    assert (NS, name) in fake.jobsets  # the new owner adopts it


def test_a_kill_whose_delete_fails_still_ends_the_step(fake, kubeconfig, home, params):
    """The cluster refuses the delete (403): the kill's error is raised, and the step is still
    ended as killed, its lease released, so the cleared task's rerun neither waits out the
    lease nor follows the JobSet its own kill was deleting."""
    from operators.steps import current_lease

    owner = _operator()
    first = _defer(owner, params)
    fake.inject(403, method="DELETE", path="/jobsets/", times=10, message="jobsets is forbidden")
    with pytest.raises(Exception, match="forbidden"):
        asyncio.run(first.trigger.on_kill())
    _, spec = _train_spec(params)
    marker, store = _status(spec)
    assert marker["status"] == "FAILED" and marker["terminated"] is True
    assert "deleting JobSet" in marker["error"] and "failed" in marker["error"]
    lease = current_lease(store, spec.output_path)
    assert lease is not None and lease.released


def test_a_follower_runs_the_step_when_the_owners_task_was_killed(fake, kubeconfig, home, params):
    """Killing the owner's task (mark failed from the UI) is no failure of the step: the run
    following it submits the step's JobSet itself instead of failing with it."""
    from airflow.sdk.exceptions import TaskDeferred

    owner, second = _operator(), _operator()
    first = _defer(owner, params)
    follower = _defer(second, params, run_id="manual__second")
    asyncio.run(first.trigger.on_kill())  # the owner's task is killed: JobSet deleted
    _, spec = _train_spec(params)
    marker, _ = _status(spec)
    assert marker["status"] == "FAILED" and marker["terminated"] is True
    seen = run_trigger(follower.trigger)
    assert seen.payload["event"] == "vanished"
    with pytest.raises(TaskDeferred) as again:
        second.execute_complete(_context(params, "manual__second"), seen.payload, **follower.kwargs)
    assert len(fake.created) == 2 and (NS, fake.created[-1]["metadata"]["name"]) in fake.jobsets
    assert again.value.kwargs["lease"]["owner"] != first.kwargs["lease"]["owner"]  # its own


def test_second_run_follows_the_owner_instead_of_waiting(fake, kubeconfig, home, params):
    owner, second = _operator(), _operator()
    first = _defer(owner, params)
    follower = _defer(second, params, run_id="manual__second")
    assert follower.kwargs["follow"] == first.kwargs["lease"]["owner"]
    assert follower.trigger.lease is None  # not its lease to renew...
    assert not follower.trigger.owns_jobset and first.trigger.owns_jobset  # ...nor JobSet
    assert follower.trigger.handle == first.trigger.handle
    assert len(fake.created) == 1  # one JobSet for one step
    _, spec = _train_spec(params)
    fake.complete(NS, fake.created[-1]["metadata"]["name"])
    event = run_trigger(first.trigger)
    trainer_writes_results(spec.output_path)
    owner.execute_complete(_context(params), event.payload, **first.kwargs)
    seen = run_trigger(follower.trigger)
    result = second.execute_complete(
        _context(params, "manual__second"), seen.payload, **follower.kwargs
    )
    assert result["outcome"] == "CACHED" and result["steps"] == 6
    assert len(fake.created) == 1


def test_a_follower_refuses_cluster_settings_the_platform_does_not_allow(
    fake, kubeconfig, home, params
):
    """The owner's handle file lies in the bucket, which trainer and Dataflow accounts may
    write: a follower checks the cluster settings it reads there, as the run's own."""
    from operators.policy import PolicyViolation
    from operators.triggers.lease import handle_file

    _defer(_operator(), params)
    _, spec = _train_spec(params)
    path = Path(handle_file(spec.output_path))
    saved = json.loads(path.read_text())
    saved["cluster"] = {**saved["cluster"], "kubeconfig": "/home/airflow/.kube/admin-config"}
    path.write_text(json.dumps(saved))
    with pytest.raises(PolicyViolation, match=r"gke\.kubeconfig '/home/airflow/.kube/admin"):
        _operator().execute(_context(params, "manual__second"))
    assert len(fake.created) == 1  # nothing sent to another cluster


def test_a_timeout_deletes_only_this_steps_jobset(fake, kubeconfig, home, params):
    """The handle file lies in the bucket, which other accounts may write: a timed-out task
    deletes the JobSet the file names only if it is this step's (its name, the stored
    cluster's namespace, a uid), and a follower follows only that one. Pointed at another
    JobSet, nothing is deleted and the step still ends FAILED, saying why."""
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
    from airflow.sdk.exceptions import TaskDeferralTimeout

    from operators.policy import PolicyViolation
    from operators.triggers.lease import handle_file

    _defer(_operator(), params)
    _, spec = _train_spec(params)
    name = fake.created[-1]["metadata"]["name"]
    victim = {**fake.jobsets[(NS, name)], "metadata": {"name": "someone-elses", "uid": "u-9"}}
    fake.jobsets[(NS, "someone-elses")] = victim
    path = Path(handle_file(spec.output_path))
    saved = json.loads(path.read_text())
    saved["handle"] = {**saved["handle"], "name": "someone-elses", "uid": "u-9"}
    path.write_text(json.dumps(saved))
    with pytest.raises(PolicyViolation, match="not this step's JobSet"):
        _operator().execute(_context(params, "manual__second"))  # a follower
    with pytest.raises(TaskDeferralTimeout):
        _operator().resume_execution(
            TRIGGER_FAIL_REPR, {"error": "Trigger timeout"}, _context(params)
        )
    assert fake.deletions == []
    assert (NS, "someone-elses") in fake.jobsets and (NS, name) in fake.jobsets
    marker, _ = _status(spec)
    assert marker["status"] == "FAILED" and "not this step's JobSet" in marker["error"]
    # Without the uid the delete would have no precondition: refused too.
    saved["handle"] = {**saved["handle"], "name": name, "uid": ""}
    with pytest.raises(PolicyViolation, match="no uid"):
        from operators.policy import checked_handle

        checked_handle(saved["handle"], saved["cluster"], name)


def test_killing_a_follower_leaves_the_owners_jobset_training(fake, kubeconfig, home, params):
    """A second run follows the owner's JobSet; marking the second run's task failed (or
    clearing it) must not delete the JobSet the first run is training, nor fail its step."""
    owner, second = _operator(), _operator()
    first = _defer(owner, params)
    follower = _defer(second, params, run_id="manual__second")
    name = fake.created[-1]["metadata"]["name"]
    asyncio.run(follower.trigger.on_kill())
    assert (NS, name) in fake.jobsets and fake.deletions == []
    _, spec = _train_spec(params)
    assert _status(spec)[0]["status"] == "RUNNING"  # the owner still holds the step
    fake.complete(NS, name)
    event = run_trigger(first.trigger)
    trainer_writes_results(spec.output_path)
    assert owner.execute_complete(_context(params), event.payload, **first.kwargs)["steps"] == 6


def test_a_trigger_serialized_before_owns_jobset_owns_only_with_a_lease(fake, kubeconfig):
    """Triggers persisted by the triggerer before the flag existed carry no owns_jobset: an
    owner's has the step's lease, a follower's none, and that decides what a kill deletes."""
    from operators.triggers.jobset import JobSetTrigger

    handle = _submit(fake, kubeconfig)
    owner, _ = _trigger(handle, kubeconfig, lease={"owner": "a", "generation": 0})
    _, kwargs = owner.serialize()
    old = {k: v for k, v in kwargs.items() if k != "owns_jobset"}
    assert JobSetTrigger(**old).owns_jobset
    assert not JobSetTrigger(**{**old, "lease": None}).owns_jobset
    follower, _ = _trigger(handle, kubeconfig)  # no lease, no flag: a follower's
    asyncio.run(follower.on_kill())
    assert (NS, handle.name) in fake.jobsets and fake.deletions == []


def test_a_follower_does_not_rerun_the_owners_failure(fake, kubeconfig, home, params):
    from operators.launching import TrainingFailed
    from operators.steps import StepFailedElsewhere

    owner, second = _operator(), _operator()
    first = _defer(owner, params)
    follower = _defer(second, params, run_id="manual__second")
    fake.fail(NS, fake.created[-1]["metadata"]["name"], "OOMKilled")  # the step's own failure
    event = run_trigger(first.trigger)
    with pytest.raises(TrainingFailed):
        owner.execute_complete(_context(params), event.payload, **first.kwargs)
    seen = run_trigger(follower.trigger)
    with pytest.raises(StepFailedElsewhere, match="OOMKilled"):
        second.execute_complete(_context(params, "manual__second"), seen.payload, **follower.kwargs)
    # ...and its timeout deletes nothing: the JobSet it followed was not its own.
    _defer(_operator(), params, run_id="manual__third")  # the owner's failure reruns here
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
    from airflow.sdk.exceptions import TaskDeferralTimeout

    deletions = len(fake.deletions)
    with pytest.raises(TaskDeferralTimeout):
        _operator().resume_execution(
            TRIGGER_FAIL_REPR, {"error": "Trigger timeout"}, _context(params, "manual__second")
        )
    assert len(fake.deletions) == deletions


def test_on_kill_while_submitting_deletes(fake, kubeconfig, home, params):
    op = _operator()
    _defer(op, params)
    name = fake.created[-1]["metadata"]["name"]
    op.on_kill()  # the worker got SIGTERM before the deferral took effect
    assert (NS, name) not in fake.jobsets


# -- the TPU preflight before the JobSet is created -----------------------------------------

PROJECT, ZONE = "slipway-test", "us-east5-a"


@pytest.fixture
def tpu_params(tmp_path, kubeconfig, monkeypatch, gke_platform):
    """A v5e 2x2 run on a GKE cluster named by cluster_name + zone: the settings the preflight
    takes its zone and project from. The GKE credentials (google provider) are replaced by the
    fake API server's kubeconfig; everything after that is the real path."""
    from airflow.sdk.definitions.param import ParamsDict

    from operators.hooks import jobset as hook_module
    from operators.jobset.gke import ClusterSettings, kubeconfig_client
    from operators.params import pipeline_params
    from operators.pipeline.form import check_run_config

    fake_cluster = ClusterSettings(namespace=NS, kubeconfig=str(kubeconfig))
    monkeypatch.setattr(hook_module, "gke_api_client", lambda _: kubeconfig_client(fake_cluster))
    monkeypatch.setenv("SLIPWAY_ALLOWED_GKE_CLUSTERS", f"{PROJECT}/{ZONE}/tpu-cluster")
    p = ParamsDict()
    p.update(pipeline_params())
    conf = tiny_conf(make_corpora(tmp_path / "data"))
    conf.update(
        backend="gke",
        image=IMAGE,
        accelerator="v5e",
        topology="2x2",
        gke={
            "namespace": NS,
            "cluster_name": "tpu-cluster",
            "location": ZONE,
            "project_id": PROJECT,
            "service_account": "trainer",
        },
    )
    p.update(conf)
    values = p.validate()
    check_run_config(values)
    return values


def _preflight_operator(fake, **client):
    from tests.fakes.tpu_api import FakeTpuClient

    op = _operator()
    jobsets_at_call: list[int] = []
    op.tpu_client = FakeTpuClient(
        on_call=lambda: jobsets_at_call.append(len(fake.created)), **client
    )
    return op, jobsets_at_call


def test_preflight_asks_the_cluster_zone_before_creating_the_jobset(fake, home, tpu_params):
    from tests.fakes.tpu_api import accelerator_type

    op, jobsets_at_call = _preflight_operator(
        fake, types=[accelerator_type("v5litepod-4", "2x2"), accelerator_type("v5p-8", "2x2x1")]
    )
    _defer(op, tpu_params)
    assert op.tpu_client.calls == [
        {"parent": f"projects/{PROJECT}/locations/{ZONE}", "timeout": 20.0, "retry": None}
    ]
    assert jobsets_at_call == [0]  # asked first, then the JobSet was created
    node_selector = fake.created[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]["nodeSelector"]
    assert node_selector["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"


def test_preflight_not_offered_fails_the_step_before_any_jobset(fake, home, tpu_params):
    from operators.jobset.preflight import AcceleratorNotOffered
    from tests.fakes.tpu_api import accelerator_type

    op, _ = _preflight_operator(fake, types=[accelerator_type("v6e-8", "2x4")])
    with pytest.raises(AcceleratorNotOffered, match=f"v5e .* not offered in zone {ZONE}"):
        op.execute(_context(tpu_params))
    assert fake.created == []  # nothing created, so nothing to delete
    _, spec = _train_spec(tpu_params)
    marker, _ = _status(spec)
    assert marker["status"] == "FAILED" and "AcceleratorNotOffered" in marker["error"]
    (execution,) = _executions(home)
    assert execution.state == "FAILED"


def test_preflight_that_cannot_reach_the_api_only_warns(fake, home, tpu_params, caplog):
    import logging

    from google.api_core import exceptions

    op, _ = _preflight_operator(fake, error=exceptions.ServiceUnavailable("unreachable"))
    with caplog.at_level(logging.WARNING, logger="operators.jobset.preflight"):
        _defer(op, tpu_params)
    assert len(fake.created) == 1  # launched anyway
    assert any("launching without that check" in r.getMessage() for r in caplog.records)


def test_preflight_is_skipped_without_a_zone(fake, kubeconfig, home, params):
    # kubeconfig / in-cluster settings name no zone: nothing is asked.
    from tests.fakes.tpu_api import FakeTpuClient

    op = _operator()
    op.tpu_client = FakeTpuClient(error=AssertionError("must not be called"))
    params = {**params, "accelerator": "v5e", "topology": "2x2"}
    _defer(op, params)
    assert op.tpu_client.calls == [] and len(fake.created) == 1


def test_deferral_holds_no_thread(fake, kubeconfig):
    """The trigger shares the triggerer's event loop: other coroutines keep running."""
    handle = _submit(fake, kubeconfig)
    # Each wait a real 1 s watch (no log tail in between): a loop it blocked would not tick.
    trigger, _ = _trigger(handle, kubeconfig, poll_seconds=1.0, log_seconds=30)
    ticks: list[float] = []
    completed: list[float] = []

    async def main() -> Any:
        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        tick = asyncio.ensure_future(ticker())

        def complete() -> None:
            completed.append(time.monotonic())
            fake.complete(NS, handle.name)

        timer = threading.Timer(0.8, complete)
        timer.start()
        async for event in trigger.run():
            tick.cancel()
            await trigger.cleanup()
            return event

    event = asyncio.run(main())
    assert event.payload["event"] == "terminal"
    # The ticker kept running while the trigger waited for the JobSet to end (~16 ticks). A
    # trigger that blocked the loop in its watch lets it tick not once before the end.
    assert len([t for t in ticks if t < completed[0]]) >= 3, (ticks, completed)


def test_preflight_asks_in_the_tpu_zone_setting_with_in_cluster_credentials(monkeypatch):
    """A regional, in-cluster deploy names no zone: ``gke.tpu_zone`` says where to ask."""
    from airflow.providers.google.common.hooks import base_google

    from operators.jobset.catalogue import resolve
    from operators.jobset.gke import ClusterSettings
    from operators.training import TrainingOperator
    from tests.fakes.tpu_api import FakeTpuClient, accelerator_type

    class ConnectionHook:  # the GCP connection's project and credentials (none reachable here)
        def __init__(self, gcp_conn_id: str) -> None:
            self.project_id = PROJECT

        def get_credentials(self) -> None:
            return None

    monkeypatch.setattr(base_google, "GoogleBaseHook", ConnectionHook)
    shape = resolve("v5e", "2x4", 1)
    op = TrainingOperator(task_id="train")
    op.tpu_client = FakeTpuClient(types=[accelerator_type("v5litepod-8", "2x4")])
    in_cluster = {"namespace": "t", "in_cluster": True}
    result = op._tpu_preflight(shape, {**in_cluster, "tpu_zone": "us-central1-a"})
    assert [c["parent"] for c in op.tpu_client.calls] == [
        f"projects/{PROJECT}/locations/us-central1-a"
    ]
    assert result.status != "skipped", result
    skipped = op._tpu_preflight(shape, in_cluster)
    assert skipped.status == "skipped" and "tpu_zone" in skipped.message
    assert len(op.tpu_client.calls) == 1  # not asked without a zone
    assert ClusterSettings(tpu_zone="us-central1").problems() == [
        "tpu_zone: 'us-central1' is not a zone (e.g. us-central2-b)"
    ]
