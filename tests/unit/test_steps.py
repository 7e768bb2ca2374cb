"""The step model: versions, output paths, markers, leases, races and the dry-run plan."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from operators import steps
from operators.steps import (
    Action,
    Lease,
    Outcome,
    Status,
    Step,
    StepFailedElsewhere,
    StepRunner,
    StepSpec,
    StepWaitTimeout,
    output_of,
    output_path,
    plan,
    step_version,
)


def _chain(tokenizer_vocab: int = 32000, workers: int = 4) -> tuple[Step, Step, Step]:
    ingest = Step(
        "ingest", {"inputs": ["gs://raw/brown"], "shards": 8}, unversioned={"workers": workers}
    )
    quality = Step("quality", {"input": output_of(ingest), "min_words": 5})
    tokenize = Step(
        "tokenize",
        {"input": output_of(quality, "data"), "vocab": tokenizer_vocab},
        unversioned={"runner": "DirectRunner"},
    )
    return ingest, quality, tokenize


# -- versions --------------------------------------------------------------------------------


def test_version_is_stable_sha256_of_canonical_json():
    a, _, _ = _chain()
    b = Step("ingest", {"shards": 8, "inputs": ["gs://raw/brown"]})  # other key order
    assert a.version == b.version == step_version(a)
    assert len(a.version) == 64 and int(a.version, 16) >= 0
    # Pinned: a change here silently invalidates every cached output in every bucket.
    x = Step("x", {"a": 1})
    assert x.version == "73ffffc0ee282a365a356563e64a4d703347ed97b916fbfa939164712e6d93b0"
    y = Step("y", {"in": output_of(x, "data"), "f": 0.5})
    assert y.version == "eacb09a20c30592ab0f21b3586eee3f8fdadb78e6e78a2097940e2f5ae33793a"
    assert Step("x", {"a": 1}).version != Step("y", {"a": 1}).version


def test_versioned_change_propagates_to_every_downstream_step():
    base = _chain()
    changed = _chain(tokenizer_vocab=50000)
    assert [s.version for s in base[:2]] == [s.version for s in changed[:2]]
    assert base[2].version != changed[2].version

    ingest2 = Step("ingest", {"inputs": ["gs://raw/brown"], "shards": 16})
    quality2 = Step("quality", {"input": output_of(ingest2), "min_words": 5})
    tokenize2 = Step("tokenize", {"input": output_of(quality2, "data"), "vocab": 32000})
    for old, new in zip(base, (ingest2, quality2, tokenize2), strict=True):
        assert old.version != new.version, old.name


def test_unversioned_fields_and_root_do_not_change_versions(tmp_path):
    base = _chain(workers=4)
    other = _chain(workers=64)
    assert [s.version for s in base] == [s.version for s in other]
    local = steps.resolve(base[2], str(tmp_path))
    remote = steps.resolve(base[2], "gs://bucket/slipway")
    assert local.version == remote.version
    assert local.output_path == str(tmp_path / base[2].key)
    assert remote.output_path == f"gs://bucket/slipway/{base[2].key}"
    # Upstream outputs are resolved per root, not baked into the hash.
    assert remote.config["input"] == f"gs://bucket/slipway/{base[1].key}/data"
    assert local.upstream == {"quality": str(tmp_path / base[1].key)}
    assert remote.unversioned == {"runner": "DirectRunner"}


def test_explicit_deps_count_and_configs_are_frozen():
    a = Step("a", {"x": 1})
    b1 = Step("b", {"y": 1}, deps=[a])
    b2 = Step("b", {"y": 1})
    assert b1.version != b2.version
    config = {"items": [1, 2]}
    s = Step("s", config)
    before = s.version
    config["items"].append(3)
    assert Step("s", {"items": [1, 2]}).version == before
    with pytest.raises(TypeError):
        s.config["items"] = []  # type: ignore[index]


def test_bad_configs_fail_at_definition():
    with pytest.raises(ValueError):
        Step("bad name!")
    with pytest.raises(TypeError):
        Step("s", {"x": {1, 2}})
    with pytest.raises(ValueError):
        Step("s", {"x": float("nan")})
    with pytest.raises(TypeError):
        Step("s", unversioned={"x": output_of(Step("a"))})


def test_output_path_layout(tmp_path):
    s = Step("tokenized/brown", {"v": 1})
    assert output_path("gs://b/r/", s) == f"gs://b/r/tokenized/brown-{s.version[: steps.HASH_LEN]}"
    assert output_path(str(tmp_path), s) == os.path.join(tmp_path, s.key)


# -- running -----------------------------------------------------------------------------------


def _counting(calls: list[str], value=None, sleep: float = 0.0):
    def fn(spec: StepSpec):
        calls.append(spec.name)
        if sleep:
            time.sleep(sleep)
        Path(spec.output_path, "data.txt").write_text(spec.name)
        return value

    return fn


def _marker(root: Path, step: Step) -> dict:
    return json.loads((root / step.key / steps.STATUS_FILE).read_text())


def test_success_is_cached_with_its_result(tmp_path):
    step = Step("ingest", {"n": 1})
    calls: list[str] = []
    runner = StepRunner(str(tmp_path))
    first = runner.run(step, _counting(calls, {"records_out": 7}))
    second = StepRunner(str(tmp_path)).run(step, _counting(calls))
    assert (first.outcome, second.outcome) == (Outcome.RAN, Outcome.CACHED)
    assert calls == ["ingest"]
    assert second.result == {"records_out": 7}
    marker = _marker(tmp_path, step)
    assert marker["status"] == "SUCCESS" and marker["version"] == step.version


def test_a_result_with_nan_is_kept_with_null_in_its_place(tmp_path):
    # A diverged evaluation's NaN loss once dropped the whole result from the marker.
    step = Step("evaluate", {})
    result = {"results": {"heldout": {"loss": float("nan"), "tokens": 512}}, "step": (6,)}
    StepRunner(str(tmp_path)).run(step, lambda spec: result)
    assert _marker(tmp_path, step)["result"] == {
        "results": {"heldout": {"loss": None, "tokens": 512}},
        "step": [6],
    }


def test_failed_step_records_error_and_reruns(tmp_path):
    step = Step("quality", {"n": 1})

    def boom(spec: StepSpec):
        raise ValueError("bad shard 3")

    with pytest.raises(ValueError, match="bad shard 3"):
        StepRunner(str(tmp_path)).run(step, boom)
    marker = _marker(tmp_path, step)
    assert marker["status"] == "FAILED"
    assert marker["error"] == "ValueError: bad shard 3"
    assert "in boom" in marker["traceback"]

    [entry] = plan([step], str(tmp_path))
    assert entry.action is Action.RUN and "FAILED: ValueError: bad shard 3" in entry.reason

    calls: list[str] = []
    result = StepRunner(str(tmp_path)).run(step, _counting(calls))
    assert result.outcome is Outcome.RAN and calls == ["quality"]
    assert _marker(tmp_path, step)["status"] == "SUCCESS"
    assert _marker(tmp_path, step)["generation"] == 1  # a new lease generation


def _write_lease(root: Path, step: Step, lease: Lease) -> None:
    out = root / step.key
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{steps.LEASE_PREFIX}{lease.generation:06d}").write_text(json.dumps(lease.__dict__))


def test_live_lease_is_waited_for(tmp_path):
    step = Step("train", {"steps": 10})
    calls: list[str] = []
    started = threading.Event()

    def slow(spec: StepSpec):
        started.set()
        time.sleep(0.6)
        return {"loss": 1.5}

    holder = StepRunner(str(tmp_path), owner="A", lease_seconds=1.0)
    outcome: dict[str, object] = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("a", holder.run(step, slow)))
    thread.start()
    assert started.wait(5)
    [entry] = plan([step], str(tmp_path))
    assert entry.action is Action.WAIT and "RUNNING by A" in entry.reason
    waiter = StepRunner(str(tmp_path), owner="B", poll_seconds=0.05)
    result = waiter.run(step, _counting(calls))
    thread.join()
    assert result.outcome is Outcome.WAITED and calls == []
    assert result.result == {"loss": 1.5}


def test_heartbeat_keeps_a_long_step_alive(tmp_path):
    # The step outlives its lease three times over; only the heartbeat keeps it live. The
    # heartbeat renews every third of the lease, so a stall of the machine must pass ~0.6 s
    # before the lease would lapse.
    step = Step("long", {})
    runner = StepRunner(str(tmp_path), owner="A", lease_seconds=1.0)
    seen: list[Action] = []

    def long(spec: StepSpec):
        for _ in range(6):
            time.sleep(0.5)
            seen.append(plan([step], str(tmp_path))[0].action)

    assert runner.run(step, long).outcome is Outcome.RAN
    assert set(seen) == {Action.WAIT}


def test_wait_times_out(tmp_path):
    step = Step("train", {})
    _write_lease(tmp_path, step, Lease(0, "elsewhere", time.time() + 60))
    runner = StepRunner(str(tmp_path), poll_seconds=0.02, wait_timeout=0.1)
    with pytest.raises(StepWaitTimeout, match="RUNNING by elsewhere"):
        runner.run(step, _counting([]))


def _owner_ending_with(tmp_path: Path, step: Step, error: BaseException) -> threading.Thread:
    """Runner "A" holding ``step`` in a thread, its work ending with ``error`` 0.3 s after it
    started; returned once the work has started (joined by the caller)."""
    started = threading.Event()

    def work(spec: StepSpec):
        started.set()
        time.sleep(0.3)
        raise error

    def hold():
        with pytest.raises(type(error)):
            StepRunner(str(tmp_path), owner="A").run(step, work)

    thread = threading.Thread(target=hold)
    thread.start()
    assert started.wait(5)
    return thread


def test_waiter_does_not_rerun_a_failure_it_waited_for(tmp_path):
    step = Step("flaky", {})
    owner = _owner_ending_with(tmp_path, step, RuntimeError("oom"))
    with pytest.raises(StepFailedElsewhere, match="oom"):
        StepRunner(str(tmp_path), owner="B", poll_seconds=0.02).run(step, _counting([]))
    owner.join()


def _held_by(tmp_path: Path, step: Step, owner: str = "A") -> steps.HeldLease:
    """``owner`` holding ``step`` RUNNING under a lease that the test ends (``run_held``)."""
    held: list[steps.HeldLease] = []
    StepRunner(str(tmp_path), owner=owner, lease_seconds=30).run_held(
        step, lambda spec, lease: held.append(lease) or {}
    )
    return held[0]


def _before_lease_reads(monkeypatch, actions: dict[int, Callable[[], object]]) -> list[int]:
    """Run ``actions[n]`` right before the runner's ``n``-th lease read, i.e. between its
    reads of the status marker and of the lease; an action returning False fails the test.
    Returns the list that counts the reads."""
    from operators.steps import runner as runner_module

    real = runner_module.current_lease
    reads: list[int] = []

    def read(store, out):
        reads.append(1)
        if len(reads) in actions:
            assert actions[len(reads)]() is not False
        return real(store, out)

    monkeypatch.setattr(runner_module, "current_lease", read)
    return reads


def test_a_waiter_does_not_rerun_a_failure_that_lands_between_its_two_reads(tmp_path, monkeypatch):
    """The waiter reads the owner's RUNNING marker, then its lease; the owner writes FAILED and
    releases in between. The lease then looks free and the marker says RUNNING: under the
    lease it takes, the waiter reads FAILED by the runner it waited for, and raises instead of
    running the failure again."""
    step = Step("racy", {})
    a = _held_by(tmp_path, step)
    # the waiter has seen A's live lease once: A fails right now
    reads = _before_lease_reads(monkeypatch, {2: lambda: a.fail("oom")})
    calls: list[str] = []
    with pytest.raises(StepFailedElsewhere, match="run by A failed: oom"):
        StepRunner(str(tmp_path), owner="B", poll_seconds=0.01).run(step, _counting(calls))
    assert calls == [] and len(reads) == 2
    current = steps.current_lease(steps.LocalStore(), output_path(str(tmp_path), step))
    assert current is not None and current.released and current.owner == "B"  # given back


def test_a_waiter_does_not_rerun_a_failure_after_another_waiter_checked_it(tmp_path, monkeypatch):
    """C waits on A. A fails; waiter B takes the next lease to check, finds A's failure and
    gives the lease back. C, which saw B's lease live in between, still raises: it waited on A
    too, and A's failure is the step's."""
    from operators.steps.version import resolve

    step = Step("racy3", {})
    a = _held_by(tmp_path, step)
    b = StepRunner(str(tmp_path), owner="B", lease_seconds=30)
    b_lease = b._held(step, resolve(step, str(tmp_path)), a.generation + 1, None)
    reads = _before_lease_reads(
        monkeypatch,
        {
            2: lambda: a.fail("oom") and b_lease.acquire(),  # C has waited on A once
            3: b_lease.release,  # C has waited on B once: B found the failure, gave it back
        },
    )
    calls: list[str] = []
    with pytest.raises(StepFailedElsewhere, match="run by A failed: oom"):
        StepRunner(str(tmp_path), owner="C", poll_seconds=0.01).run(step, _counting(calls))
    assert calls == [] and len(reads) == 3


def test_a_waiter_runs_a_step_whose_owner_was_killed(tmp_path):
    """A task killed while it ran the step (AirflowTaskTerminated: marked failed from the UI,
    a timeout) did not fail the step: a runner that waited on it (the cleared task, another
    DAG sharing the step) runs it instead of failing with StepFailedElsewhere."""
    from airflow.sdk.exceptions import AirflowTaskTerminated

    step = Step("killed", {})
    owner = _owner_ending_with(tmp_path, step, AirflowTaskTerminated("Task received SIGTERM"))
    calls: list[str] = []
    result = StepRunner(str(tmp_path), owner="B", poll_seconds=0.02).run(step, _counting(calls))
    owner.join()
    assert result.outcome is Outcome.RAN and len(calls) == 1
    assert result.status.status is Status.SUCCESS and result.status.owner == "B"


def test_an_empty_lease_file_is_held_only_while_its_creator_may_still_write_it(tmp_path):
    """Without hard links a lease is created empty, then written: a creator killed in between
    leaves it empty for good. Held for a while, then stale: taken over, never a deadlock."""
    import os

    step = Step("empty-lease", {})
    lease_file = tmp_path / step.key / f"{steps.LEASE_PREFIX}{0:06d}"
    lease_file.parent.mkdir(parents=True)
    lease_file.write_bytes(b"")
    [entry] = plan([step], str(tmp_path))
    assert entry.action is Action.WAIT  # just created: its creator may be writing it
    old = time.time() - steps.lease.UNREADABLE_LEASE_S - 1
    os.utime(lease_file, (old, old))
    [entry] = plan([step], str(tmp_path))
    assert entry.action is Action.RUN and "stale lease" in entry.reason
    result = StepRunner(str(tmp_path)).run(step, _counting([]))
    assert result.outcome is Outcome.TOOK_OVER and result.status.generation == 1


def test_stale_lease_is_taken_over(tmp_path):
    step = Step("tokenize", {})
    _write_lease(tmp_path, step, Lease(0, "dead-host:123", time.time() - 5))
    [entry] = plan([step], str(tmp_path))
    assert entry.action is Action.RUN and "stale lease of dead-host:123" in entry.reason
    calls: list[str] = []
    result = StepRunner(str(tmp_path), owner="new").run(step, _counting(calls))
    assert result.outcome is Outcome.TOOK_OVER and calls == ["tokenize"]
    assert result.status.generation == 1 and result.status.owner == "new"


def test_a_taken_over_runner_does_not_mark_success(tmp_path):
    step = Step("zombie", {})
    runner = StepRunner(str(tmp_path), owner="zombie", lease_seconds=30)

    def taken_over(spec: StepSpec):
        # Another runner decides our lease is stale and creates the next generation.
        _write_lease(tmp_path, step, Lease(1, "other", time.time() + 30))

    with pytest.raises(steps.LeaseLost):
        runner.run(step, taken_over)
    assert _marker(tmp_path, step)["status"] == "RUNNING"  # never SUCCESS from the zombie


@pytest.mark.parametrize("stop_fails", [False, True])
def test_a_taken_over_runner_stops_its_work(tmp_path, stop_fails):
    # The runner's process stalled past its lease and another took the step over: the next
    # heartbeat stops the work (on_lost), and the step ends in LeaseLost, not in whatever the
    # stopped work raised, and not in a marker over the new owner's.
    step = Step("stalled", {})
    runner = StepRunner(str(tmp_path), owner="zombie", lease_seconds=0.6)
    stopped = threading.Event()
    stops: list[float] = []

    def on_lost() -> None:
        stops.append(time.monotonic())
        if stop_fails:
            raise OSError("could not signal the pod")
        stopped.set()

    def work(spec: StepSpec):
        _write_lease(tmp_path, step, Lease(1, "other", time.time() + 30))
        deadline = time.monotonic() + 10
        while not stops and time.monotonic() < deadline:
            time.sleep(0.01)
        if stopped.is_set():
            raise RuntimeError("killed by on_lost")
        return "ran to its end"

    with pytest.raises(steps.LeaseLost) as lost:
        runner.run(step, work, on_lost=on_lost)
    assert len(stops) == 1
    # stopped: the work's error is the cause; not stopped: it ran on, and still lost
    assert isinstance(lost.value.__cause__, RuntimeError) is not stop_fails
    assert _marker(tmp_path, step)["status"] == "RUNNING"  # the zombie wrote no ending


def test_a_lease_names_the_process_whose_heartbeat_renews_it(tmp_path):
    """A step run in-process names this process (boot id, pid namespace, pid) in its lease,
    so a reader can tell when nobody will renew it again; a held lease, which a trigger renews
    from another process, names none. Either way the lease counts until it expires."""
    import subprocess
    import sys

    here = steps.this_process()
    assert here is not None and here.endswith(f":{os.getpid()}")
    # A lease file naming a pid in other digits ("²" passes str.isdigit) is simply not known
    # to have exited, as one from another machine, instead of an error.
    assert not steps.lease.process_exited(here.rpartition(":")[0] + ":²")
    seen: list[Lease | None] = []

    def work(spec: StepSpec) -> None:
        seen.append(steps.current_lease(steps.store_for(spec.output_path), spec.output_path))

    StepRunner(str(tmp_path)).run(Step("beating", {}), work)
    (lease,) = seen
    assert lease is not None and lease.holder == here and not lease.holder_exited()
    held = Step("held", {})
    StepRunner(str(tmp_path)).run_held(held, lambda spec, lease: None)
    held_out = str(tmp_path / held.key)
    held_lease = steps.current_lease(steps.store_for(held_out), held_out)
    assert held_lease is not None and held_lease.holder is None
    assert not held_lease.holder_exited()
    # no holder, no key: the lease file and a trigger's kwargs read as before holders
    assert "holder" not in json.loads((tmp_path / held.key / ".lease-000000").read_text())

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    machine = here.rpartition(":")[0]
    gone = Lease(0, "killed-worker", time.time() + 60, holder=f"{machine}:{child.pid}")
    assert gone.holder_exited() and gone.live(time.time())
    # a process of another machine or container, or a holder that is not one: nothing
    assert not Lease(0, "x", time.time() + 60, holder=f"another-boot:1:{child.pid}").holder_exited()
    assert not Lease(0, "x", time.time() + 60, holder=123).holder_exited()  # type: ignore[arg-type]
    # a lease file of a later version, with a field this one does not know, still reads
    step = Step("newer", {})
    _write_lease(tmp_path, step, Lease(0, "newer-runner", time.time() + 60))
    path = tmp_path / step.key / f"{steps.LEASE_PREFIX}000000"
    path.write_text(json.dumps({**json.loads(path.read_text()), "renewals": 3}))
    (entry,) = plan([step], str(tmp_path))
    assert entry.action is Action.WAIT and "newer-runner" in entry.reason, entry


# -- a lease held across a deferral (StepRunner.run_held / HeldLease) ------------------------


def test_held_lease_leaves_the_step_running_until_it_is_ended(tmp_path):
    step = Step("deferred", {"k": 1})
    runner = StepRunner(str(tmp_path), owner="submitter", lease_seconds=30)
    held: list[steps.HeldLease] = []

    def submit(spec: StepSpec, lease: steps.HeldLease) -> dict:
        held.append(lease)
        assert _marker(tmp_path, step)["status"] == "RUNNING"  # claimed before the work starts
        return {"handle": "jobset-1"}

    result = runner.run_held(step, submit)
    (lease,) = held
    assert result.outcome is Outcome.RAN and result.status.status is Status.RUNNING
    assert result.result == {"handle": "jobset-1"}
    # Plain data: what a trigger's kwargs carry, and what another process rebuilds (with no
    # holder key: the trigger renews it from another process, as before holders).
    assert "holder" not in lease.to_dict()
    lease = steps.HeldLease.from_dict(json.loads(json.dumps(lease.to_dict())))
    assert lease.owned() and lease.renew_every == 10
    # Nobody else may run it while held: the plan waits on the live lease.
    (entry,) = plan([step], str(tmp_path))
    assert entry.action is Action.WAIT and "submitter" in entry.reason
    before = _marker(tmp_path, step)["lease_expires_at"]
    time.sleep(0.01)
    assert lease.renew() and _marker(tmp_path, step)["lease_expires_at"] > before
    record = lease.succeed({"loss": 1.5})
    assert record.status is Status.SUCCESS and _marker(tmp_path, step)["result"] == {"loss": 1.5}
    current = steps.current_lease(steps.LocalStore(), output_path(str(tmp_path), step))
    assert current is not None and current.released  # released, so a rerun need not wait
    # Ended is ended: a late renew (in flight when the step ended) or fail changes nothing.
    assert not lease.owned() and not lease.renew() and not lease.fail("late")
    assert _marker(tmp_path, step)["status"] == "SUCCESS"
    again = StepRunner(str(tmp_path), owner="later").run(step, lambda spec: pytest.fail("ran"))
    assert again.outcome is Outcome.CACHED


def test_held_lease_failures_and_takeovers(tmp_path):
    step = Step("deferred", {"k": 2})
    runner = StepRunner(str(tmp_path), owner="submitter", lease_seconds=30)

    def refused(spec: StepSpec, lease: steps.HeldLease) -> None:
        raise RuntimeError("quota")

    with pytest.raises(RuntimeError, match="quota"):
        runner.run_held(step, refused)
    marker = _marker(tmp_path, step)
    assert marker["status"] == "FAILED" and marker["error"] == "RuntimeError: quota"
    # FAILED reruns; this time the submission works, then another runner takes over.
    result = runner.run_held(step, lambda spec, lease: None)
    lease = steps.HeldLease(
        output=output_path(str(tmp_path), step),
        step=step.name,
        version=step.version,
        owner="submitter",
        generation=result.status.generation,
        started_at=result.status.started_at,
        lease_seconds=30,
    )
    assert lease.owned()
    _write_lease(tmp_path, step, Lease(lease.generation + 1, "other", time.time() + 30))
    assert not lease.owned() and not lease.renew() and not lease.fail("too late")
    with pytest.raises(steps.LeaseLost):
        lease.succeed({})
    assert _marker(tmp_path, step)["status"] == "RUNNING"  # the new owner's run is untouched


def _race_worker(root: str, barrier, results) -> None:
    step = Step("race", {"k": 1})

    def work(spec: StepSpec):
        # O_EXCL on a file only the winner may create: a second writer would crash here.
        fd = os.open(os.path.join(spec.output_path, "writer"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep(0.3)

    barrier.wait()
    result = StepRunner(root, poll_seconds=0.02).run(step, work)
    results.put(str(result.outcome))


def test_concurrent_threads_exactly_one_writer(tmp_path):
    import queue

    barrier = threading.Barrier(8)
    results: queue.Queue[str] = queue.Queue()
    threads = [
        threading.Thread(target=_race_worker, args=(str(tmp_path), barrier, results))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outcomes = sorted(results.get_nowait() for _ in range(8))
    assert outcomes.count("RAN") == 1
    assert set(outcomes) <= {"RAN", "WAITED", "CACHED"}


def test_concurrent_processes_exactly_one_writer(tmp_path):
    # spawn: separate processes, separate file descriptors; not fork, which can deadlock a
    # child beside the suite's JAX threads.
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(str(tmp_path), barrier, results)) for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    outcomes = sorted(results.get(timeout=5) for _ in range(4))
    assert outcomes.count("RAN") == 1, outcomes


def test_many_racers_on_a_stale_lease_one_takes_over(tmp_path):
    step = Step("race", {"k": 1})
    _write_lease(tmp_path, step, Lease(0, "dead", time.time() - 1))
    import queue

    barrier = threading.Barrier(6)
    results: queue.Queue[str] = queue.Queue()
    threads = [
        threading.Thread(target=_race_worker, args=(str(tmp_path), barrier, results))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outcomes = [results.get_nowait() for _ in range(6)]
    assert outcomes.count("TOOK_OVER") == 1 and "RAN" not in outcomes, outcomes


def test_object_store_path_through_fsspec_memory():
    # The fsspec code path (gs:// in production) on the in-memory filesystem.
    root = "memory://slipway-test-steps"
    step = Step("remote", {"n": 1})
    calls: list[str] = []

    def fn(spec: StepSpec):
        calls.append(spec.name)
        return 3

    runner = StepRunner(root)
    assert isinstance(runner.store, steps.FsspecStore) and runner.store.atomic_create
    assert runner.run(step, fn).outcome is Outcome.RAN
    assert StepRunner(root).run(step, fn).outcome is Outcome.CACHED
    assert calls == ["remote"]
    assert not runner.store.create(f"{root}/{step.key}/{steps.LEASE_PREFIX}000000", b"{}")


# -- dry run -------------------------------------------------------------------------------------


def test_plan_lists_every_step_with_its_reason(tmp_path):
    ingest, quality, tokenize = _chain()
    root = str(tmp_path)
    entries = plan([tokenize], root)
    assert [e.step.name for e in entries] == ["ingest", "quality", "tokenize"]
    assert [e.action for e in entries] == [Action.RUN] * 3
    assert entries[0].reason == "no status marker: never run"
    assert entries[2].reason.endswith("after upstream quality")

    StepRunner(root).run(ingest, _counting([]))
    _write_lease(tmp_path, quality, Lease(0, "worker-7", time.time() + 60))
    entries = plan([tokenize], root)
    assert [e.action for e in entries] == [Action.SKIP, Action.WAIT, Action.RUN]
    assert "cache hit" in entries[0].reason
    assert "RUNNING by worker-7" in entries[1].reason
    assert entries[2].path == output_path(root, tokenize)
    text = steps.format_plan(entries)
    assert "SKIP" in text and tokenize.key in text
    assert text.splitlines()[-1] == "3 steps: 1 to run, 1 cache hit, 1 waiting"
    # A dry run writes nothing.
    assert not (tmp_path / tokenize.key).exists()


def test_corrupt_marker_is_not_a_cache_hit(tmp_path):
    step = Step("s", {})
    (tmp_path / step.key).mkdir()
    (tmp_path / step.key / steps.STATUS_FILE).write_text("{not json")
    assert plan([step], str(tmp_path))[0].action is Action.RUN
    assert Status.SUCCESS == "SUCCESS"


def test_foundations_import_without_airflow_or_heavy_libraries():
    import subprocess
    import sys

    heavy = ("airflow", "jax", "apache_beam", "tensorstore", "fsspec")
    code = (
        "import sys, operators.steps, operators.lineage, operators.cli;"
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert done.stdout.strip() == "[]"
