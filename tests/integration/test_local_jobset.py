"""The local backend runs a rendered JobSet's pods as processes, with the identity JobSet and
GKE would give them, restarting all pods on retryable failures and killing them cleanly.

The "trainer" here is a small fake script (the real one is tested on its own): it records
its environment, fails on cue, or hangs, so each test checks one behaviour quickly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from operators.jobset import (
    Backend,
    JobSetNotFound,
    JobSetStatus,
    LocalBackend,
    TrainingLaunch,
    UnsupportedManifest,
)

pytestmark = pytest.mark.timeout(60)

FAKE = r"""
import json, os, signal, subprocess, sys, time

mode, out = sys.argv[1], sys.argv[2]
me = f"{os.environ['JOB_INDEX']}-{os.environ['JOB_COMPLETION_INDEX']}"

def mark(tag, text=""):
    with open(os.path.join(out, f"{me}.{tag}"), "a") as f:
        f.write(f"{text or os.getpid()}\n")

def count(tag):
    try:
        with open(os.path.join(out, f"{me}.{tag}")) as f:
            return len(f.read().splitlines())
    except FileNotFoundError:
        return 0

def on_term(signum, frame):  # like the trainer: checkpoint, then "restart me"
    mark("term")
    sys.exit(42)

signal.signal(signal.SIGTERM, on_term)
mark("start")

if mode == "env":
    with open(os.path.join(out, f"{me}.json"), "w") as f:
        json.dump({"env": dict(os.environ), "argv": sys.argv, "exe": sys.executable}, f)
elif mode == "flaky":
    # pod TARGET exits CODE on its first TIMES starts; everyone else waits for its success.
    code, times, target = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    if me == target:
        time.sleep(0.2)
        if count("start") <= times:
            sys.exit(code)
        open(os.path.join(out, "ok"), "w").close()
    else:
        deadline = time.time() + 30
        while not os.path.exists(os.path.join(out, "ok")):
            if time.time() > deadline:
                sys.exit(3)
            time.sleep(0.02)
elif mode == "logs":
    print(f"hello from {me}")
    print(f"warning from {me}", file=sys.stderr, flush=True)
    print("no newline at the end", end="")
elif mode == "hang":
    # a grandchild in the pod, and (on worker 1) a pod that ignores SIGTERM
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    mark("pids", f"{os.getpid()} {child.pid}")
    if os.environ["JOB_COMPLETION_INDEX"] == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)
"""


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE)
    (tmp_path / "out").mkdir()
    return script


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


def launch(fake: Path, *args: str, **kw: Any) -> dict:
    spec = TrainingLaunch(
        name=kw.pop("name", "run-1"),
        image="us-docker.pkg.dev/proj/slipway/trainer:test",  # ignored locally
        command=("python", str(fake)),
        args=(args[0], str(fake.parent / "out"), *args[1:]),
        **kw,
    )
    return spec.render()


def run(manifest: dict, grace: float = 2.0, timeout: float = 45) -> tuple[JobSetStatus, Lines]:
    lines = Lines()
    status = LocalBackend(lines, grace_period=grace).run(manifest, timeout=timeout)
    return status, lines


def out(fake: Path) -> Path:
    return fake.parent / "out"


def starts(fake: Path, pod: str) -> int:
    path = out(fake) / f"{pod}.start"
    return len(path.read_text().splitlines()) if path.exists() else 0


# --------------------------------------------------------------------------------------------
# identity


def test_multislice_env_per_pod(fake, monkeypatch):
    monkeypatch.setenv("TPU_WORKER_ID", "99")  # stale identity in the parent: not inherited
    monkeypatch.setenv("SLIPWAY_PARENT_VAR", "kept")
    manifest = launch(fake, "env", "a b", 'q"uote', accelerator="cpu", topology="2", slices=2)
    status, _ = run(manifest)
    assert status.succeeded and status.reason == "AllJobsCompleted"
    assert status.exit_codes == {f"slice-{j}/worker-{i}": 0 for j in (0, 1) for i in (0, 1)}
    pods = {
        (j, i): json.loads((out(fake) / f"{j}-{i}.json").read_text())
        for j in (0, 1)
        for i in (0, 1)
    }
    hostnames = {}
    for (j, i), rec in pods.items():
        env = rec["env"]
        assert env["JOB_COMPLETION_INDEX"] == env["TPU_WORKER_ID"] == str(i)
        assert env["JOBSET_NAME"] == "run-1" and env["REPLICATED_JOB_NAME"] == "slice"
        assert env["JOB_INDEX"] == env["MEGASCALE_SLICE_ID"] == str(j)
        assert env["MEGASCALE_NUM_SLICES"] == "2"
        assert env["SLIPWAY_PARENT_VAR"] == "kept" and env["PYTHONUNBUFFERED"] == "1"
        hosts = env["TPU_WORKER_HOSTNAMES"].split(",")
        assert len(hosts) == 2 and all(h.startswith("127.0.0.1:") for h in hosts)
        hostnames[j, i] = hosts
        # args are an argv list: no shell ever splits or unquotes them
        assert rec["argv"][1:] == ["env", str(out(fake)), "a b", 'q"uote']
        assert rec["exe"] == sys.executable  # "python" ran this interpreter
    # same slice: same host list; the two slices have different hosts
    assert hostnames[0, 0] == hostnames[0, 1] != hostnames[1, 0] == hostnames[1, 1]
    assert len({h for hs in hostnames.values() for h in hs}) == 4
    # the coordinator is slice 0, worker 0, on its own port, for everyone
    coords = {rec["env"]["MEGASCALE_COORDINATOR_ADDRESS"] for rec in pods.values()}
    assert coords == {hostnames[0, 0][0]}


def test_trainer_resolves_one_process_group(fake):
    """The env above is what trainer.distributed expects: 4 distinct process ids, one
    coordinator, 4 processes (checked with its pure function; JAX is not initialised)."""
    from trainer import distributed
    from trainer.config import DistributedConfig

    run(launch(fake, "env", accelerator="cpu", topology="2", slices=2))
    specs = [
        distributed.resolve_process(
            DistributedConfig(), json.loads((out(fake) / f"{j}-{i}.json").read_text())["env"]
        )
        for j in (0, 1)
        for i in (0, 1)
    ]
    assert sorted(s.process_id for s in specs) == [0, 1, 2, 3]
    assert {s.num_processes for s in specs} == {4}
    (coord,) = {s.coordinator_address for s in specs}
    host, port = coord.split(":")
    assert host == "127.0.0.1" and 1024 <= int(port) < 65536


def test_tpu_manifest_gets_webhook_env_and_single_slice_has_no_megascale(fake, monkeypatch):
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "7")
    manifest = launch(fake, "env", accelerator="v5e", topology="4x4")  # 4 hosts, 1 slice
    status, _ = run(manifest)
    assert status.succeeded
    envs = [json.loads((out(fake) / f"0-{i}.json").read_text())["env"] for i in range(4)]
    assert [e["TPU_WORKER_ID"] for e in envs] == ["0", "1", "2", "3"]
    (hosts,) = {e["TPU_WORKER_HOSTNAMES"] for e in envs}
    assert len(set(hosts.split(","))) == 4
    assert not any(k.startswith("MEGASCALE_") for e in envs for k in e)


# --------------------------------------------------------------------------------------------
# failure policy


def test_retryable_failure_restarts_all_pods(fake):
    # worker 1 exits 42 ("restart me") on its first two starts; worker 0 is running each time
    manifest = launch(fake, "flaky", "42", "2", "0-1", topology="2", max_restarts=3)
    status, lines = run(manifest)
    assert status.succeeded, status
    assert (status.restarts, status.restarts_counted) == (2, 2)
    assert starts(fake, "0-1") == 3
    assert starts(fake, "0-0") == 3  # restarted with it, although it never failed
    assert len((out(fake) / "0-0.term").read_text().splitlines()) == 2  # got SIGTERM twice
    assert [(e.pod, e.attempt, e.exit_code) for e in status.exits if e.pod.endswith("1")] == [
        ("slice-0/worker-1", 0, 42),
        ("slice-0/worker-1", 1, 42),
        ("slice-0/worker-1", 2, 0),
    ]
    assert sum("restarting all pods" in line for line in lines.lines) == 2


def test_gives_up_after_max_restarts(fake):
    manifest = launch(fake, "flaky", "42", "99", "0-1", topology="2", max_restarts=1)
    status, _ = run(manifest)
    assert not status.succeeded and status.terminal_state == "Failed"
    assert status.reason == "ReachedMaxRestarts" and status.restarts == 1
    assert starts(fake, "0-1") == 2


@pytest.mark.parametrize("code", [1, 2])
def test_fatal_exit_code_fails_fast(fake, code):
    manifest = launch(fake, "flaky", str(code), "99", "0-1", topology="2", max_restarts=3)
    status, lines = run(manifest)
    assert status.terminal_state == "Failed" and status.reason == "FailurePolicyRule"
    assert "failFastOnFatalExitCode" in status.message and status.restarts == 0
    assert starts(fake, "0-1") == 1
    assert status.exit_codes == {"slice-0/worker-1": code, "slice-0/worker-0": 42}
    assert any(f"exit code {code} matching FailJob rule" in line for line in lines.lines)


def test_fatal_codes_are_configurable(fake):
    manifest = launch(
        fake, "flaky", "2", "1", "0-1", topology="2", max_restarts=2, fatal_exit_codes=()
    )
    status, _ = run(manifest)
    assert status.succeeded and status.restarts == 1


# --------------------------------------------------------------------------------------------
# logs, kill, the backend contract


def test_logs_are_prefixed_per_pod(fake):
    status, lines = run(launch(fake, "logs", topology="2", slices=2))
    assert status.succeeded
    for j in (0, 1):
        for i in (0, 1):
            prefix = f"[slice-{j}/worker-{i}] "
            mine = [line[len(prefix) :] for line in lines.lines if line.startswith(prefix)]
            assert sorted(mine) == sorted(
                [f"hello from {j}-{i}", f"warning from {j}-{i}", "no newline at the end"]
            )
    assert lines.lines[-1].startswith("[jobset/run-1] completed")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _still_alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` alive once init has had 10 s to reap the orphaned grandchildren."""
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_kill_terminates_every_process(fake):
    lines = Lines()
    backend = LocalBackend(lines, grace_period=1.0)
    handle = backend.submit(launch(fake, "hang", topology="2", slices=2))
    pidfiles = [out(fake) / f"{j}-{i}.pids" for j in (0, 1) for i in (0, 1)]
    deadline = time.monotonic() + 20
    while not all(p.exists() and p.read_text().strip() for p in pidfiles):
        assert time.monotonic() < deadline, "pods did not start"
        time.sleep(0.05)
    pids = [int(x) for p in pidfiles for x in p.read_text().split()]
    assert len(pids) == 8 and all(_alive(pid) for pid in pids)
    assert backend.poll(handle).terminal_state is None
    status = backend.cancel(handle)
    assert status.terminal_state == "Failed" and status.reason == "Cancelled"
    assert _still_alive(pids) == []
    # worker 0 took SIGTERM (exit 42 via its handler); worker 1 ignored it: SIGKILL (137)
    assert status.exit_codes == {
        "slice-0/worker-0": 42,
        "slice-0/worker-1": 137,
        "slice-1/worker-0": 42,
        "slice-1/worker-1": 137,
    }
    assert backend.cancel(handle) == status  # idempotent


def test_wait_timeout_and_run_timeout_kill(fake):
    backend = LocalBackend(Lines(), grace_period=0.5)
    handle = backend.submit(launch(fake, "hang", topology="1"))
    with pytest.raises(TimeoutError):
        backend.wait(handle, timeout=0.3)
    assert backend.cancel(handle).reason == "Cancelled"
    with pytest.raises(TimeoutError):
        backend.run(launch(fake, "hang", topology="1", name="run-2"), timeout=3)
    pids = [int(x) for x in (out(fake) / "0-0.pids").read_text().split()]
    assert len(pids) == 4, pids  # each run's pod and its grandchild (the file is appended to)
    assert _still_alive(pids) == []


def test_backend_contract_and_handles(fake):
    backend = LocalBackend(Lines())
    assert isinstance(backend, Backend)
    handle = backend.submit(launch(fake, "env"))
    status = backend.wait(handle, timeout=30)
    assert status.succeeded and backend.poll(handle) == status
    assert type(handle).from_dict(json.loads(json.dumps(handle.to_dict()))) == handle
    json.dumps(status.to_dict())
    with pytest.raises(JobSetNotFound):
        LocalBackend().poll(handle)


def test_a_follower_sees_the_run_through_the_backend_protocol(fake):
    """The calls the GKE trigger makes (observe, wait_for_change, leader_log_tail,
    with_exits, close) work on the local backend too: one protocol for both."""
    backend = LocalBackend(Lines())
    handle = backend.submit(launch(fake, "logs", topology="2", slices=2))
    first = backend.observe(handle)
    changed = backend.wait_for_change(handle, first.version, timeout=30)  # at the end
    seen = backend.observe(handle)
    assert changed == seen and seen.status.succeeded and seen.version != first.version
    assert seen.status.exits == () and seen.max_restarts == 3  # TrainingLaunch's default
    pod, tail = backend.leader_log_tail(handle, 10)
    assert pod == "slice-0/worker-0"  # its lines only, in the order its one stream gave them
    assert sorted(tail) == ["hello from 0-0", "no newline at the end", "warning from 0-0"]
    assert backend.leader_log_tail(handle, 1) == (pod, tail[-1:])
    done = backend.with_exits(seen.status)
    assert sorted(done.exit_codes) == [
        "slice-0/worker-0",
        "slice-0/worker-1",
        "slice-1/worker-0",
        "slice-1/worker-1",
    ]
    assert set(done.exit_codes.values()) == {0}
    # nothing changes any more: the wait ends at its timeout, saying so
    assert backend.wait_for_change(handle, seen.version, timeout=0.3) is None
    backend.close()
    assert backend.poll(handle).succeeded  # closing released nothing the run needs


def test_unsupported_manifests_are_refused(fake):
    manifest = launch(fake, "env")
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["envFrom"] = [{"secretRef": {"name": "s"}}]
    with pytest.raises(UnsupportedManifest, match="envFrom"):
        LocalBackend().submit(manifest)
    with pytest.raises(UnsupportedManifest, match="JobSet"):
        LocalBackend().submit({"apiVersion": "batch/v1", "kind": "Job"})


def test_cancel_from_another_thread_ends_wait(fake):
    # The Airflow operator's on_kill calls cancel from another thread while wait() blocks.
    backend = LocalBackend(Lines(), grace_period=0.5)
    handle = backend.submit(launch(fake, "hang", topology="1"))
    while not (out(fake) / "0-0.pids").exists():
        time.sleep(0.05)
    killer = threading.Timer(0.2, backend.cancel, args=(handle,))
    killer.start()
    status = backend.wait(handle, timeout=20)
    killer.join()
    assert status.reason == "Cancelled"


def test_a_command_that_cannot_start_fails_the_run(fake):
    spec = TrainingLaunch(
        name="run-1",
        image="img:1",
        command=("slipway-no-such-program",),
        args=(),
        accelerator="cpu",
        topology="2",
    )
    lines = Lines()
    status = LocalBackend(lines, grace_period=0.5).run(spec.render(), timeout=20)
    assert status.terminal_state == "Failed" and status.reason == "ControllerError"
    assert "slipway-no-such-program" in status.message


OWNER = r"""
import json, sys
from operators.jobset import LocalBackend
manifest = json.loads(sys.argv[1])
LocalBackend(lambda line: None, grace_period=1.0).run(manifest, timeout=60)
"""


def test_pods_get_sigterm_when_the_process_running_them_is_killed(fake, tmp_path):
    """An Airflow task killed with SIGKILL runs no on_kill: its pods must not live on, writing
    into the step's output while a retry starts new ones. Like pods on a node that went away,
    they get SIGTERM (the trainer checkpoints and exits) from the kernel."""
    import signal
    import subprocess

    manifest = launch(fake, "hang", topology="2")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, json.dumps(manifest)])
    pidfiles = [out(fake) / f"0-{i}.pids" for i in (0, 1)]
    deadline = time.monotonic() + 30
    while not all(p.exists() and p.read_text().strip() for p in pidfiles):
        assert time.monotonic() < deadline and owner.poll() is None, "pods did not start"
        time.sleep(0.05)
    pods = [int(p.read_text().split()[0]) for p in pidfiles]
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    # Worker 0 handles SIGTERM (records it, exits 42); worker 1 ignores it, as a stuck
    # process would, and is left to the kernel: only the first must be gone.
    deadline = time.monotonic() + 10
    while _alive(pods[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pods[0]), "the pod outlived the process that ran it"
    # The kernel sends the parent-death signal each time the pod is handed to another parent:
    # once when the controller thread dies, and again if the owner's last threads were still
    # exiting then (the pod passed to one of them first). Once or twice, it is this pod's.
    terms = (out(fake) / "0-0.term").read_text().split()
    assert terms and set(terms) == {str(pods[0])}, terms
    for pid in pods:  # tidy up what ignored SIGTERM, grandchildren included
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
                p.kill()


def test_a_lost_step_lease_cancels_a_local_jobset_and_leaves_a_gke_one(fake, tmp_path):
    # An evaluation's JobSet on the local backend, run under its step's lease; another runner
    # takes the step over (this process stalled past the lease): the heartbeat cancels the
    # pods, which are this process's alone, and the step ends in LeaseLost.
    from types import SimpleNamespace

    from operators.launching import JobSetRunner
    from operators.steps import HeldLease, LeaseLost, Step, StepRunner

    operator = SimpleNamespace(log=logging.getLogger("test-lease-lost"))
    jobset = JobSetRunner(operator, "local")
    step = Step("evaluate", {"store": "heldout"})
    pidfile = out(fake) / "0-0.pids"

    def evaluate(spec):
        def take_over() -> None:
            deadline = time.monotonic() + 20
            while not (pidfile.exists() and pidfile.read_text().strip()):
                assert time.monotonic() < deadline, "pod did not start"
                time.sleep(0.05)
            other = HeldLease(spec.output_path, step.name, spec.version, "other", 1, 0.0, 30.0)
            assert other.acquire()

        threading.Thread(target=take_over, daemon=True).start()
        return jobset.run(launch(fake, "hang"), poll_seconds=0.05)

    started = time.monotonic()
    runner = StepRunner(str(tmp_path / "steps"), owner="stalled", lease_seconds=0.9)
    with pytest.raises(LeaseLost):
        runner.run(step, evaluate, on_lost=jobset.cancel_if_local)
    assert time.monotonic() - started < 30  # not the pod's 120 s
    pids = [int(x) for x in pidfile.read_text().split()]
    assert _still_alive(pids) == []
    assert (out(fake) / "0-0.term").exists()  # SIGTERM, as a cancel gives it

    # A GKE JobSet is found again by name and adopted by the step's next owner: left alone.
    gke = JobSetRunner(operator, "gke", {"cluster_name": "c", "location": "l"})
    gke.handle = SimpleNamespace(name="eval-x")
    cancels: list[Any] = []
    gke.hook.cancel = cancels.append  # type: ignore[method-assign]
    gke.cancel_if_local()
    assert cancels == []
