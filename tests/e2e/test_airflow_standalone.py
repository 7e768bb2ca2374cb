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

Lineage never keeps a RUNNING execution. The standalone process group is always stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operators.testing import TINY_STEPS, make_corpora, tiny_conf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
DAG_ID = "slipway_pipeline"
STEPS = set(TINY_STEPS)
UPSTREAM = STEPS - {"train", "evaluate"} | {"fetch"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Airflow:
    """A running ``airflow standalone`` and an authenticated REST client for it."""

    def __init__(self, base: Path) -> None:
        import httpx

        self.base = base
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # `make airflow OUT=base DATA=...`: Airflow home base/airflow, steps and lineage in base.
        self.home = base / "airflow"
        self.slipway_home = base
        self.data = make_corpora(base / "data")
        self.env = {
            **os.environ,
            "AIRFLOW__API__WORKERS": "1",
            # The DAG is @weekly without catchup: unpausing it would start the latest scheduled
            # run (the full default form) ahead of ours (max_active_runs=1). Manual runs only.
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
        }
        for name in list(self.env):  # nothing of the caller's Airflow or Slipway settings
            if name.startswith(("AIRFLOW", "SLIPWAY_")) and name not in (
                "AIRFLOW__API__WORKERS",
                "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE",
            ):
                del self.env[name]
        self.log_path = base / "standalone.log"
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.url, timeout=30)

    # -- process ------------------------------------------------------------------------------

    def start(self, timeout: float = 240) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            # What the README tells a user to run (it runs `airflow standalone`).
            [
                "make",
                "airflow",
                f"AIRFLOW_PORT={self.port}",
                f"OUT={self.base}",
                f"DATA={self.data}",
            ],
            env=self.env,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends all of it
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"standalone exited:\n{self.log_tail()}"
            try:
                health = self.client.get("/api/v2/monitor/health").json()
                if health["scheduler"]["status"] == "healthy" and self._password():
                    break
            except Exception:
                pass
            time.sleep(2)
        else:
            raise AssertionError(f"standalone not healthy in {timeout}s:\n{self.log_tail()}")
        token = self.client.post(
            "/auth/token", json={"username": "admin", "password": self._password()}
        )
        assert token.status_code in (200, 201), token.text
        self.client.headers["Authorization"] = f"Bearer {token.json()['access_token']}"

    def _password(self) -> str | None:
        path = self.home / "simple_auth_manager_passwords.json.generated"
        try:
            return json.loads(path.read_text())["admin"]
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            pgid = os.getpgid(self.proc.pid)
            os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            # anything of the group still alive (tasks, API server workers)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.client.close()
        if hasattr(self, "_log"):
            self._log.close()

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # -- REST ---------------------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs) -> dict:
        r = self.client.request(method, f"/api/v2{path}", **kwargs)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def wait_for_dag(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.client.get(f"/api/v2/dags/{DAG_ID}")
            if r.status_code == 200:
                return
            time.sleep(2)
        errors = self.client.get("/api/v2/importErrors").text
        raise AssertionError(f"{DAG_ID} not parsed in {timeout}s: {errors}\n{self.log_tail()}")

    def trigger(self, run_id: str, conf: dict) -> None:
        self.api(
            "POST",
            f"/dags/{DAG_ID}/dagRuns",
            json={"dag_run_id": run_id, "logical_date": None, "conf": conf},
        )

    def wait_run(self, run_id: str, timeout: float = 420) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(3)
        raise AssertionError(f"run {run_id} not done in {timeout}s: {self.task_states(run_id)}")

    def task_states(self, run_id: str) -> dict[str, str]:
        tis = self.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")
        return {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}

    def task_log(self, run_id: str, task_id: str, try_number: int = 1) -> str:
        r = self.client.get(
            f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            headers={"Accept": "application/json"},
        )
        return r.text  # JSON: the log lines' text is in there

    # -- lineage ------------------------------------------------------------------------------

    def lineage(self, run_id: str) -> tuple[dict[str, str], dict, list]:
        """Latest state per step, the latest node per step, and every execution of the run."""
        from operators.lineage import LineageStore

        with LineageStore(f"sqlite:///{self.slipway_home}/lineage.db", create=False) as store:
            graph = store.run_graph(run_id)
        latest = {}
        for node in graph.steps:  # start order: the last attempt of each step wins
            latest[node.execution.name] = node
        states = {name: str(node.execution.state) for name, node in latest.items()}
        return states, latest, [node.execution for node in graph.steps]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(f"signal {signum}")  # runs the fixture's finally: no orphaned Airflow


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    af = Airflow(tmp_path_factory.mktemp("standalone"))
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        t0 = time.monotonic()
        af.start()
        af.wait_for_dag()
        print(f"standalone up and {DAG_ID} parsed in {time.monotonic() - t0:.0f}s")
        yield af
    finally:
        af.stop()
        signal.signal(signal.SIGTERM, previous)


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
    assert "evaluate" not in states  # upstream failed: never started
    assert not [e for e in executions if str(e.state) == "RUNNING"]
    summary = next(o.artifact.properties for o in nodes["record"].outputs)
    assert summary["state"] == "FAILED"
    assert summary["failed"][0]["step"] == "train"
    resume_step = summary["resume"]["training_resumes_from"]["step"]
    assert resume_step == train.properties["last_checkpoint_step"]

    # -- 3. clear the failed tasks: train resumes, nothing else reruns --------------------------
    cleared = af.api(
        "POST",
        f"/dags/{DAG_ID}/clearTaskInstances",
        json={"dry_run": False, "dag_run_id": "e2e_fault", "only_failed": True},
    )
    assert {ti["task_id"] for ti in cleared["task_instances"]} == {"train", "evaluate", "record"}
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


def test_training_killed_from_the_api_resumes_from_its_checkpoint(airflow):
    af = airflow
    af.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    # A new training step, long enough to be killed midway (the tiny model does ~1-10 ms/step).
    steps = 10_000
    t0 = time.monotonic()
    af.trigger("e2e_killed", tiny_conf(af.data, seed=8, steps=steps))
    deadline = time.monotonic() + 300
    output = None
    while time.monotonic() < deadline:
        try:
            _, nodes, _ = af.lineage("e2e_killed")
        except Exception:  # no lineage for this run yet
            nodes = {}
        train = nodes.get("train")
        if train is not None and str(train.execution.state) == "RUNNING":
            output = train.execution.properties["output"]
            if _metrics_lines(output) >= 50:  # compiled and training
                break
        time.sleep(1)
    else:
        raise AssertionError(f"train never got going: {af.task_states('e2e_killed')}")

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
