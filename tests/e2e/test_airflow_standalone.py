"""The pipeline DAG on a real ``airflow standalone``, driven only through the REST API.

What a user does from the UI, in one test (the phases share one Airflow, ~1 min to start):

1. start ``make airflow`` (``airflow standalone``: scheduler, dag-processor, API server,
   triggerer; LocalExecutor on SQLite) on a free loopback port, in a throwaway ``OUT`` (its
   ``AIRFLOW_HOME``), with the repo's ``dags/`` and ``plugins/`` (the lineage listener) and
   tiny synthetic corpora;
2. read the generated admin password, ``POST /auth/token``, unpause ``slipway_pipeline``;
3. trigger a run (``POST /api/v2/dags/slipway_pipeline/dagRuns`` with a tiny ``conf``): it
   succeeds and every step is COMPLETE in lineage;
4. trigger a run with a new training seed and ``fail_at_step``: it fails at ``train``; lineage
   has the upstream steps CACHED, ``train`` FAILED with the injected error and its last
   checkpoint, and the run summary names the step;
5. clear the failed tasks (``POST /api/v2/dags/slipway_pipeline/clearTaskInstances``,
   ``only_failed``): the conf of a run cannot change, and fault injection fires only when
   training starts below the fault step, so the cleared ``train`` resumes from its checkpoint
   and completes; nothing that succeeded runs again (still CACHED) and the run succeeds.

A second test kills a running ``train`` task the way the UI's "mark as failed" does
(``PATCH .../taskInstances/train``): the lineage listener (``plugins/`` ->
``operators/listener.py``) closes its execution in the API server, the task's ``on_kill``
cancels the JobSet and the trainer saves a checkpoint on SIGTERM; clearing the task then
resumes training from that checkpoint (lineage: ``resumed_from_step``) to the end.

A third test kills a training task's worker for real (SIGKILL of its supervisor and task
process: no ``on_kill``, no callback, no heartbeat): the scheduler fails the task when its
heartbeat times out, the listener closes the execution FAILED with the reason in the
scheduler, the trainer pods get SIGTERM from the kernel and checkpoint, and ``record`` ends
the run with nothing RUNNING.

Lineage never keeps a RUNNING execution. The standalone (``tests/e2e/conftest.py``, shared
with the browser tests) is always stopped, its whole process group.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import httpx
import pytest

from tests.support.tiny_pipeline import TINY_STEPS, tiny_conf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DAG_ID = "slipway_pipeline"
STEPS = set(TINY_STEPS)
UPSTREAM = STEPS - {"train", "evaluate", "export"} | {"fetch"}


def test_trigger_fail_clear_and_resume_through_the_rest_api(airflow):
    af = airflow
    dag = af.api("GET", f"/dags/{DAG_ID}")
    assert dag["is_paused"], "new DAGs start paused"
    af.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})

    # -- 1. a good run: every step COMPLETE ---------------------------------------------------
    t0 = time.monotonic()
    af.trigger("e2e_ok", tiny_conf(af.data))
    state = af.wait_run("e2e_ok")
    print(f"e2e_ok: {state} in {time.monotonic() - t0:.0f}s")
    states, nodes, executions = af.lineage("e2e_ok")
    assert state == "success", (af.task_states("e2e_ok"), states, af.log_tail())
    assert {k: v for k, v in states.items() if k in STEPS} == dict.fromkeys(STEPS, "COMPLETE")
    assert states["fetch"] == "COMPLETE" and states["record"] == "COMPLETE"
    assert not [e for e in executions if str(e.state) == "RUNNING"]
    assert set(af.task_states("e2e_ok").values()) == {"success"}

    # -- 2. a run that fails at train (fault injection) ---------------------------------------
    # A new seed is a new training step (everything upstream is a cache hit); enough steps
    # for the fault to fire midway.
    conf = tiny_conf(af.data, seed=7, steps=300, fail_at_step=5)
    t0 = time.monotonic()
    af.trigger("e2e_fault", conf)
    state = af.wait_run("e2e_fault")
    print(f"e2e_fault: {state} in {time.monotonic() - t0:.0f}s")
    tasks = af.task_states("e2e_fault")
    states, nodes, executions = af.lineage("e2e_fault")
    assert state == "failed", (tasks, states)
    assert tasks["train"] == "failed", tasks
    assert tasks["evaluate"] == "upstream_failed" and tasks["record"] == "failed", tasks
    assert {k: v for k, v in states.items() if k in UPSTREAM} == dict.fromkeys(
        UPSTREAM - {"fetch"}, "CACHED"
    ) | {"fetch": "COMPLETE"}
    train = nodes["train"].execution
    assert states["train"] == "FAILED", af.task_log("e2e_fault", "train")
    assert "fail_at_step=5" in train.error
    assert train.properties["resumable"] and train.properties["last_checkpoint_step"] >= 5
    # the loss it stopped at, for the runs list: the trainer's last logged step
    loss, at = train.properties["last_logged_loss"], train.properties["last_logged_loss_step"]
    assert at == train.properties["last_logged_step"] >= 5 and math.isfinite(loss), train
    # OpenLineage (the provider, from our operators' facets): train's FAIL names its output.
    fails = af.openlineage_events("e2e_fault", "train", "FAIL")
    assert fails, "no OpenLineage FAIL event for train"
    assert any("train-" in d["name"] for d in fails[-1]["outputs"]), fails[-1]
    assert "evaluate" not in states and "export" not in states  # upstream failed: never started
    assert not [e for e in executions if str(e.state) == "RUNNING"]
    summary = next(o.artifact.properties for o in nodes["record"].outputs)
    assert summary["state"] == "FAILED"
    assert summary["failed"][0]["step"] == "train"
    resume_step = summary["resume"]["training_resumes_from"]["step"]
    assert resume_step == train.properties["last_checkpoint_step"]
    # The run's page in the Airflow UI (the Slipway plugin) says the same: which step failed,
    # why, and what a clear-and-rerun resumes. Without a login it is refused.
    page = af.client.get("/slipway/runs/e2e_fault")
    assert page.status_code == 200, page.text
    listed = af.client.get("/slipway/", params={"q": "e2e_fault"}).text
    assert f"{loss:.4f} <br><span" in listed and f">at step {at}</span>" in listed, listed
    text = " ".join(page.text.split())
    assert 'Failed at <span id="failed-step">train</span>' in text, text
    assert "fail_at_step=5" in text
    assert f"Training resumes from its checkpoint at step {resume_step}" in text, text
    assert (af.slipway_home / "runs" / "e2e_fault" / "report.html").is_file()
    anonymous = httpx.get(f"{af.url}/slipway/runs/e2e_fault")
    assert anonymous.status_code == 401, anonymous.text
    browser = httpx.get(f"{af.url}/slipway/", headers={"Accept": "text/html"})
    assert browser.status_code == 302 and "/auth/login" in browser.headers["location"]

    # -- 3. clear the failed tasks: train resumes, nothing else reruns --------------------------
    cleared = af.api(
        "POST",
        f"/dags/{DAG_ID}/clearTaskInstances",
        json={"dry_run": False, "dag_run_id": "e2e_fault", "only_failed": True},
    )
    assert {ti["task_id"] for ti in cleared["task_instances"]} == {
        "train",
        "evaluate",
        "export",
        "gate",
        "record",
    }
    t0 = time.monotonic()
    time.sleep(3)  # let the scheduler pick the cleared run up
    state = af.wait_run("e2e_fault")
    print(f"e2e_fault after clear: {state} in {time.monotonic() - t0:.0f}s")
    tasks = af.task_states("e2e_fault")
    states, nodes, executions = af.lineage("e2e_fault")
    assert state == "success", (tasks, states, af.task_log("e2e_fault", "train", 2))
    assert set(tasks.values()) == {"success"}, tasks
    assert {k: v for k, v in states.items() if k in UPSTREAM - {"fetch"}} == dict.fromkeys(
        UPSTREAM - {"fetch"}, "CACHED"
    )
    # Only train, evaluate and record ran again: one execution each per attempt.
    names = [e.name for e in executions]
    assert names.count("train") == 2 and names.count("ingest") == 1, names
    assert states["train"] == "COMPLETE" and states["evaluate"] == "COMPLETE"
    assert states["export"] == "COMPLETE"
    ckpt = next(o.artifact for o in nodes["train"].outputs if o.artifact.type == "checkpoint")
    assert ckpt.uri.endswith("step-000000300")
    assert "resuming from checkpoint" in af.task_log("e2e_fault", "train", 2)
    assert not [e for e in executions if str(e.state) == "RUNNING"]
    summary = next(o.artifact.properties for o in nodes["record"].outputs)
    assert summary["state"] == "SUCCESS"


def _metrics_lines(output: str) -> int:
    try:
        return len((Path(output) / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _wait_for_training(af, run_id: str, timeout: float = 300) -> str:
    """Wait until the run's ``train`` step is RUNNING and its trainer is past compiling;
    returns the step's output directory."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, nodes, _ = af.lineage(run_id)
        except Exception:  # no lineage for this run yet
            nodes = {}
        train = nodes.get("train")
        if train is not None and str(train.execution.state) == "RUNNING":
            output = train.execution.properties["output"]
            if _metrics_lines(output) >= 50:  # compiled and training
                return output
        time.sleep(1)
    raise AssertionError(f"train never got going: {af.task_states(run_id)}")


def test_training_killed_from_the_api_resumes_from_its_checkpoint(airflow):
    af = airflow
    af.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    # A new training step, long enough to be killed midway (the tiny model does ~1-10 ms/step;
    # the kill, through the API and the task's supervisor, takes a few seconds).
    steps = 10_000
    t0 = time.monotonic()
    af.trigger("e2e_killed", tiny_conf(af.data, seed=8, steps=steps))
    output = _wait_for_training(af, "e2e_killed")

    # -- kill it: what "mark as failed" on a running task does from the UI ------------------------
    af.api(
        "PATCH",
        f"/dags/{DAG_ID}/dagRuns/e2e_killed/taskInstances/train",
        json={"new_state": "failed"},
    )
    state = af.wait_run("e2e_killed")
    print(f"e2e_killed: {state} in {time.monotonic() - t0:.0f}s")
    tasks = af.task_states("e2e_killed")
    states, nodes, executions = af.lineage("e2e_killed")
    assert state == "failed" and tasks["train"] == "failed", tasks
    train = nodes["train"].execution
    # The listener closed it in the API server (FAILED, "manually set"); the killed task then
    # records its own ending on top, with the checkpoint its trainer saved on SIGTERM.
    assert str(train.state) in ("FAILED", "CANCELED"), train
    assert train.properties.get("closed_by") == "listener", train
    assert "manually set to `failed`" in train.properties["listener_reason"], train
    assert not [e for e in executions if str(e.state) == "RUNNING"], executions
    killed_at = train.properties.get("last_checkpoint_step")
    assert train.properties.get("resumable") and 0 < killed_at < steps, (
        train.properties,
        af.task_log("e2e_killed", "train"),
    )
    summary = next(o.artifact.properties for o in nodes["record"].outputs)
    assert summary["state"] == "FAILED" and summary["failed"][0]["step"] == "train"
    assert summary["resume"]["training_resumes_from"]["step"] == killed_at
    logged = _metrics_lines(output)
    assert logged < steps, "the trainer ran to the end: nothing was killed"

    # -- clear it: the rerun resumes from that checkpoint and finishes ----------------------------
    af.api(
        "POST",
        f"/dags/{DAG_ID}/clearTaskInstances",
        json={"dry_run": False, "dag_run_id": "e2e_killed", "only_failed": True},
    )
    time.sleep(3)
    state = af.wait_run("e2e_killed")
    tasks = af.task_states("e2e_killed")
    states, nodes, executions = af.lineage("e2e_killed")
    assert state == "success", (tasks, states, af.task_log("e2e_killed", "train", 2))
    train = nodes["train"].execution
    assert str(train.state) == "COMPLETE" and train.properties["resumed_from_step"] == killed_at
    assert "resuming from checkpoint" in af.task_log("e2e_killed", "train", 2)
    ckpt = next(o.artifact for o in nodes["train"].outputs if o.artifact.type == "checkpoint")
    assert ckpt.uri.endswith(f"step-{steps:09d}")
    assert [e.name for e in executions].count("train") == 2
    summary = next(o.artifact.properties for o in nodes["record"].outputs)
    assert summary["state"] == "SUCCESS"


def _trainer_processes(output: str) -> list:
    """The trainer pods (local JobSet processes) training into ``output``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "trainer.train" in cmdline and any(output in arg for arg in cmdline):
            found.append(proc)
    return found


def test_a_task_whose_worker_died_is_failed_by_the_scheduler_and_closed_in_lineage(airflow):
    """The scheduler's kill path, for real: the training task's supervisor and task process
    are SIGKILLed (a worker that died: no on_kill, no callback, no heartbeat). The scheduler
    fails the task once its heartbeat times out; the lineage listener, in the scheduler,
    closes ``train`` FAILED with the reason; its trainer pods got SIGTERM from the kernel and
    checkpointed; ``record`` ends the run with nothing left RUNNING and says where training
    resumes."""
    import signal

    import psutil

    af = airflow
    af.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    steps = 10_000
    af.trigger("e2e_worker_died", tiny_conf(af.data, seed=9, steps=steps))
    trainers = _trainer_processes(_wait_for_training(af, "e2e_worker_died"))
    assert trainers

    # -- the worker dies: its task process (which runs the local JobSet) and its supervisor ----
    task_process = trainers[0].parent()
    supervisor = task_process.parent()
    assert "trainer.train" not in task_process.cmdline()
    for proc in (supervisor, task_process):
        proc.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(trainers, timeout=60)
    assert not alive, f"trainer pods outlived their task: {alive}"
    state = af.wait_run("e2e_worker_died", timeout=af.heartbeat_timeout_s + 360)
    tasks = af.task_states("e2e_worker_died")
    _, nodes, executions = af.lineage("e2e_worker_died")
    assert state == "failed" and tasks["train"] == "failed", tasks
    assert tasks["evaluate"] == "upstream_failed" and tasks["record"] == "failed", tasks
    train = nodes["train"].execution
    assert str(train.state) == "FAILED", train
    assert train.properties.get("closed_by") == "listener", train.properties
    assert "task failed (from outside the task)" in train.error, train.error
    assert not [e for e in executions if str(e.state) == "RUNNING"], executions
    summary = next(o.artifact.properties for o in nodes["record"].outputs)
    assert summary["state"] == "FAILED" and summary["failed"][0]["step"] == "train"
    resume = summary["resume"]["training_resumes_from"]
    assert resume is not None and 0 < resume["step"] < steps, summary["resume"]
