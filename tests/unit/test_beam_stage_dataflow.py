"""BeamStageOperator on Dataflow, up to the network boundary.

Nothing here reaches GCP. The operator and its hook run for real (settings, job name with
the provider's unique suffix, option formatting, the launcher subprocess, job-id parsing,
kill); the boundary is the launcher -- ``tests/fakes/dataflow_launcher.py``, a FAKE
interpreter that records its arguments and prints the job-id line Beam prints -- and the
google provider's DataflowHook API calls (``wait_for_done``, ``cancel_job``), recorded here.
The last test runs the same module with the same options on the DirectRunner, as a real
subprocess.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import pytest

from operators.dataflow import (
    DATAFLOW_FIELDS,
    JOB_NAME_MAX,
    DataflowSettingsError,
    RunIdentity,
    dataflow_job_name,
    dataflow_labels,
    dataflow_settings,
)
from operators.pipeline.graph import StageStep
from operators.steps import Step, resolve

PROJECT = "slipway-test"
BUCKET = "gs://slipway-test-bucket"
IMAGE = "us-central1-docker.pkg.dev/slipway-test/slipway/slipway-beam:0.1.0"
ACCOUNT = "slipway-dataflow@slipway-test.iam.gserviceaccount.com"
ROOT = f"{BUCKET}/slipway/steps"
RAW = f"{BUCKET}/data/raw/brown.jsonl.gz"
# The stage config is the step's (what its version hashes); the run form holds the same.
STEP = Step("ingest", {"stage": "ingest", "config": {"source": "web"}, "input": [RAW]})
VERSION = STEP.version
OUT = f"{ROOT}/ingest-{VERSION[:8]}/output"
JOB_ID = "2026-05-01_01_02_03-1234567890123456789"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DATAFLOW = {
    "project_id": PROJECT,
    "location": "europe-west4",
    "temp_location": f"{BUCKET}/dataflow/tmp",
    "sdk_container_image": IMAGE,
    "service_account": ACCOUNT,
    "max_num_workers": 16,
}


class FakeTaskInstance:
    """Stands in for Airflow's RuntimeTaskInstance: identity fields and XCom pushes."""

    def __init__(self, dag_id: str = "slipway_pipeline", run_id: str = "manual__2026-05-01"):
        self.dag_id, self.run_id, self.try_number = dag_id, run_id, 2
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


LAUNCHER = Path(__file__).resolve().parents[1] / "fakes" / "dataflow_launcher.py"


class FakeDataflow:
    """The network boundary: what the launcher was run with and what Dataflow was asked."""

    record: ClassVar[Path]
    waited: ClassVar[list[dict[str, Any]]] = []
    cancelled: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def reset(cls, record: Path) -> None:
        cls.record, cls.waited, cls.cancelled = record, [], []

    @classmethod
    def command(cls) -> list[str]:
        """The launch command, as the hook ran it (the fake interpreter first)."""
        return [str(LAUNCHER), *json.loads(cls.record.read_text())]

    @classmethod
    def launched(cls) -> bool:
        return cls.record.exists()


@pytest.fixture(autouse=True)
def boundary(monkeypatch, tmp_path):
    from airflow.providers.google.cloud.hooks.dataflow import DataflowHook

    import operators.beam_stage

    FakeDataflow.reset(tmp_path / "launch.json")
    monkeypatch.setenv("FAKE_LAUNCHER_RECORD", str(FakeDataflow.record))
    monkeypatch.setenv("FAKE_LAUNCHER_JOB_ID", JOB_ID)
    monkeypatch.setattr(
        DataflowHook, "wait_for_done", lambda self, **kw: FakeDataflow.waited.append(kw)
    )
    monkeypatch.setattr(
        DataflowHook, "cancel_job", lambda self, **kw: FakeDataflow.cancelled.append(kw)
    )
    # The job's manifest would be read from gs:// once it finished: there is none here.
    monkeypatch.setattr(operators.beam_stage, "describe_stage_output", lambda out: {})
    # An anonymous connection with a project: the provider builds its hooks offline.
    extra = {"project": "slipway-conn", "is_anonymous": True}
    conn = {"conn_type": "google_cloud_platform", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps(conn))
    for name in DATAFLOW_FIELDS:
        monkeypatch.delenv(f"SLIPWAY_DATAFLOW_{name.upper()}", raising=False)
    # The platform's run policy allows the test project's identity, image, project and bucket
    # (operators/policy.py; the launch checks it again: tests/unit/test_run_validation.py).
    monkeypatch.setenv("SLIPWAY_ALLOWED_DATAFLOW_SERVICE_ACCOUNTS", ACCOUNT)
    monkeypatch.setenv("SLIPWAY_ALLOWED_IMAGES", IMAGE.rsplit(":", 1)[0])
    monkeypatch.setenv("SLIPWAY_ALLOWED_DATAFLOW_PROJECTS", PROJECT)
    monkeypatch.setenv("SLIPWAY_ALLOWED_DATAFLOW_LOCATIONS", BUCKET)
    return FakeDataflow


def _params(dataflow: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "runner": "DataflowRunner",
        "dataflow": dict(DATAFLOW if dataflow is None else dataflow),
        "stage_configs": {"ingest": {"source": "web"}},
    }


def _launch(op: Any, params: dict[str, Any], ti: FakeTaskInstance, raw: str = RAW) -> Any:
    """Run the operator's stage code path for one ingest step, up to the boundary."""
    stage = StageStep(STEP, "ingest", {"input": [raw], "num_shards": 2}, "dataset")
    context = {"params": params, "run_id": ti.run_id, "ti": ti, "task_instance": ti}
    return op._run_stage(context, params, stage, resolve(STEP, op.steps_root()))


def _operator(monkeypatch, root: str = ROOT) -> Any:
    from operators.beam_stage import BeamStageOperator

    op = BeamStageOperator(stage_task="ingest", py_interpreter=str(LAUNCHER))
    monkeypatch.setattr(op, "steps_root", lambda: root)
    return op


def _launch_in_background(op: Any) -> tuple[threading.Thread, list[BaseException]]:
    """Launch while the test plays the user who kills the task."""
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            _launch(op, _params(), FakeTaskInstance())
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    thread = threading.Thread(target=launch)
    thread.start()
    return thread, errors


def _until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the launcher did not get there in time"
        time.sleep(0.02)


# -- the command and the job ------------------------------------------------------------------


def test_dataflow_command_and_job_are_exact(monkeypatch):
    from airflow.version import version as airflow_version

    op, ti = _operator(monkeypatch), FakeTaskInstance()
    result = _launch(op, _params(), ti)

    cmd = FakeDataflow.command()
    job = result["dataflow_job_name"]
    identity = RunIdentity("slipway_pipeline", "manual__2026-05-01", "ingest", 2)
    base = dataflow_job_name(identity, "ingest", VERSION)
    assert base == f"slipway-pipeline-ingest-{VERSION[:8]}-{identity.run_hash}"
    assert re.fullmatch(rf"{base}-[0-9a-f]{{8}}", job) and len(job) <= 63

    assert cmd[:4] == [str(LAUNCHER), "-m", "pipelines.ingest", "--runner=DataflowRunner"]
    labels = {
        "slipway-dag": "slipway_pipeline",
        "slipway-run": "manual__2026-05-01",
        "slipway-run-hash": identity.run_hash,
        "slipway-task": "ingest",
        "slipway-try": "2",
        "slipway-step": "ingest",
        "slipway-version": VERSION[:16],
        "airflow-version": "v" + airflow_version.replace(".", "-").replace("+", "-"),
    }
    expected = [
        f"--job_name={job}",
        f"--service_account_email={ACCOUNT}",
        f"--project={PROJECT}",
        "--region=europe-west4",
        *(f"--labels={k}={v}" for k, v in labels.items()),
        f"--input={RAW}",
        "--num_shards=2",
        f"--output={OUT}",
        '--config={"source": "web"}',
        f"--temp_location={BUCKET}/dataflow/tmp",
        f"--staging_location={BUCKET}/dataflow/tmp/staging",
        f"--sdk_container_image={IMAGE}",
        "--sdk_location=container",
        "--experiments=use_runner_v2",
        "--max_num_workers=16",
    ]
    # Exact: every argument, each once (argparse does not care about their order).
    assert Counter(cmd[4:]) == Counter(expected)

    # The job id was read from the launcher's output, recorded with the step's result, and
    # Dataflow was asked for that job's verdict.
    assert result["dataflow_job_id"] == JOB_ID
    assert FakeDataflow.waited == [
        {"job_name": job, "location": "europe-west4", "job_id": JOB_ID, "project_id": PROJECT}
    ]


def test_on_kill_stops_the_launcher_and_cancels_the_running_job(monkeypatch):
    from operators.hooks.beam import BeamStageFailed

    monkeypatch.setenv("FAKE_LAUNCHER_MODE", "running")  # job submitted, launcher waiting on it
    op = _operator(monkeypatch)
    thread, errors = _launch_in_background(op)
    _until(lambda: op._hook is not None and op._hook.job_id == JOB_ID)
    op.on_kill()
    thread.join(30)
    assert not thread.is_alive()
    (error,) = errors
    assert isinstance(error, BeamStageFailed) and error.returncode == -15
    assert FakeDataflow.cancelled == [
        {"job_id": JOB_ID, "project_id": PROJECT, "location": "europe-west4"}
    ]
    assert FakeDataflow.waited == []


def test_on_kill_while_submitting_cancels_by_the_unique_name(monkeypatch):
    monkeypatch.setenv("FAKE_LAUNCHER_MODE", "hang")  # killed before the job id was printed
    op = _operator(monkeypatch)
    thread, errors = _launch_in_background(op)
    _until(lambda: FakeDataflow.launched() and op._hook is not None and op._hook._proc)
    op.on_kill()
    thread.join(30)
    assert "exited with -15" in str(errors[0])
    (cancel,) = FakeDataflow.cancelled
    assert cancel["project_id"] == PROJECT and cancel["location"] == "europe-west4"
    assert re.fullmatch(
        rf"slipway-pipeline-ingest-{VERSION[:8]}-[0-9a-f]{{8}}-[0-9a-f]{{8}}", cancel["job_name"]
    )


def test_a_failed_launch_fails_with_the_stage_output(monkeypatch):
    from operators.hooks.beam import BeamStageFailed

    monkeypatch.setenv("FAKE_LAUNCHER_MODE", "fail")
    op = _operator(monkeypatch)
    with pytest.raises(BeamStageFailed, match="the stage refused its input") as err:
        _launch(op, _params(), FakeTaskInstance())
    assert err.value.returncode == 3 and "exited with 3" in str(err.value)
    assert FakeDataflow.waited == [] and FakeDataflow.cancelled == []
    op.on_kill()  # after the end: nothing left to stop or cancel
    assert FakeDataflow.cancelled == []


def test_platform_defaults_connection_project_and_run_overrides(monkeypatch):
    monkeypatch.setenv("SLIPWAY_DATAFLOW_LOCATION", "us-central1")
    monkeypatch.setenv("SLIPWAY_DATAFLOW_TEMP_LOCATION", f"{BUCKET}/platform/tmp")
    monkeypatch.setenv("SLIPWAY_DATAFLOW_SDK_CONTAINER_IMAGE", IMAGE)
    monkeypatch.setenv("SLIPWAY_DATAFLOW_EXPERIMENTS", "enable_data_sampling, use_runner_v2")
    op = _operator(monkeypatch)
    _launch(op, _params({"location": "europe-west1"}), FakeTaskInstance())
    args = FakeDataflow.command()
    assert "--project=slipway-conn" in args  # neither the run nor the platform named one
    assert "--region=europe-west1" in args  # the run's value wins
    assert f"--temp_location={BUCKET}/platform/tmp" in args
    assert [a for a in args if a.startswith("--experiments")] == [
        "--experiments=use_runner_v2",
        "--experiments=enable_data_sampling",
    ]
    assert not any(a.startswith(("--service_account_email", "--max_num_workers")) for a in args)


def test_a_platform_worker_count_in_other_digits_is_refused_not_crashed():
    """str.isdigit() holds for "²", which int() refuses: the platform's value is checked
    like any other, and the refusal names it."""
    from operators.dataflow import platform_dataflow_settings

    found = platform_dataflow_settings({"SLIPWAY_DATAFLOW_MAX_NUM_WORKERS": "²"})
    assert found == {"max_num_workers": "²"}
    with pytest.raises(DataflowSettingsError, match="max_num_workers"):
        dataflow_settings({**DATAFLOW, "max_num_workers": None}, found)


def test_no_project_anywhere_is_refused_before_launch(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT")
    op = _operator(monkeypatch)
    with pytest.raises(DataflowSettingsError, match="project_id is not set"):
        _launch(
            op,
            _params({k: v for k, v in DATAFLOW.items() if k != "project_id"}),
            FakeTaskInstance(),
        )
    assert not FakeDataflow.launched()


def test_local_paths_are_refused_for_dataflow(monkeypatch, tmp_path):
    op = _operator(monkeypatch, root=str(tmp_path / "steps"))
    with pytest.raises(DataflowSettingsError, match=r"gs:// paths.*--input=/data/raw"):
        _launch(op, _params(), FakeTaskInstance(), raw="/data/raw/brown.jsonl.gz")
    assert not FakeDataflow.launched()


# -- job names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dag_id", "run_id", "step"),
    [
        ("slipway_pipeline", "manual__2026-05-01T10:00:00.123456+00:00", "ingest"),
        ("Slipway_Pipeline", "scheduled__2026-05-01T00:00:00+00:00", "tokens/train/python-stdlib"),
        (
            "2026_nightly_sweep_with_a_very_long_dag_identifier",
            "backfill__x",
            "tokens/eval/lambada",
        ),
        ("ščťž", "r", "ingest"),
        ("---", "r", "///"),
        ("a" * 250, "b" * 250, "c" * 250),
    ],
)
def test_job_names_are_dns_safe_short_and_traceable(dag_id, run_id, step):
    from airflow.providers.google.cloud.hooks.dataflow import DataflowHook

    identity = RunIdentity(dag_id, run_id, "tokenize", 1)
    name = dataflow_job_name(identity, step, VERSION)
    assert DNS_LABEL.match(name) and len(name) <= JOB_NAME_MAX
    assert name.endswith(f"-{VERSION[:8]}-{identity.run_hash}")
    # The provider accepts it and its unique suffix keeps it within Dataflow's 63.
    final = DataflowHook.build_dataflow_job_name(name, append_job_name=True)
    assert DNS_LABEL.match(final) and len(final) <= 63
    # Deterministic per (run, step, version); another run or version gets another name.
    assert dataflow_job_name(identity, step, VERSION) == name
    other_run = RunIdentity(dag_id, run_id + "x", "tokenize", 1)
    assert dataflow_job_name(other_run, step, VERSION) != name
    assert dataflow_job_name(identity, step, "f" * 64) != name
    for key, value in dataflow_labels(identity, step, VERSION).items():
        assert re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", key)
        assert re.fullmatch(r"[a-z0-9_-]{0,63}", value), (key, value)


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("project_id", "Slipway Test", "not a GCP project id"),
        ("project_id", "slipway-test --runner=DirectRunner", "not a GCP project id"),
        ("location", "us-central1-a", "not a Dataflow region"),
        ("location", "europe-west4;id", "not a Dataflow region"),
        ("temp_location", "/tmp/dataflow", "temp_location"),
        ("temp_location", "gs://Bad_Bucket/tmp", "temp_location"),
        ("temp_location", "gs://bucket/tmp dir", "temp_location"),
        ("staging_location", "s3://bucket/staging", "staging_location"),
        ("sdk_container_image", "slipway-beam", "needs a tag or digest"),
        ("sdk_container_image", "slipway-beam:latest", "not reproducible"),
        ("sdk_container_image", "slipway-beam:0.1 --x", "not an image reference"),
        ("sdk_container_image", "", "sdk_container_image is not set"),
        ("service_account", "alice@example.com", "not a service account"),
        ("max_num_workers", 0, "max_num_workers"),
        ("max_num_workers", 100_000, "max_num_workers"),
        ("max_num_workers", True, "max_num_workers"),
        ("max_num_workers", "8", "max_num_workers"),
        ("experiments", "use_runner_v2", "must be a list"),
        ("experiments", ["shuffle_mode=service --x"], "not NAME or NAME=VALUE"),
        ("experiments", ["disable_runner_v2"], "needs Runner v2"),
        ("region", "us-central1", "unknown Dataflow setting 'region'"),
    ],
)
def test_each_bad_value_is_refused_with_its_field(field, value, message):
    with pytest.raises(DataflowSettingsError, match=re.escape(message)):
        dataflow_settings({**DATAFLOW, field: value})


def test_every_problem_is_listed_at_once():
    with pytest.raises(DataflowSettingsError) as err:
        dataflow_settings({"location": "x", "temp_location": "y", "max_num_workers": -1})
    text = str(err.value)
    for field in ("project_id", "location", "temp_location", "staging_location"):
        assert field in text
    assert "sdk_container_image" in text and "max_num_workers" in text


@pytest.mark.parametrize(
    "image",
    [
        "slipway-beam:123",
        "localhost:5000/slipway-beam:0.1.0",
        "europe-docker.pkg.dev/p/repo/slipway-beam:0.1.0-rc1",
        f"slipway-beam:0.1.0@sha256:{'b' * 64}",
    ],
)
def test_image_references_that_are_accepted(image):
    assert (
        dataflow_settings({**DATAFLOW, "sdk_container_image": image}).sdk_container_image == image
    )


def test_valid_settings_are_completed():
    digest = "sha256:" + "a" * 64
    settings = dataflow_settings(
        {"location": "us-central1", "temp_location": f"{BUCKET}/t/", "experiments": ["a_b=1"]},
        {"sdk_container_image": f"slipway-beam@{digest}"},
        connection_project="example.com:slipway-test",
    )
    assert settings.project_id == "example.com:slipway-test"
    assert settings.staging_location == f"{BUCKET}/t/staging"
    assert settings.experiments == ("use_runner_v2", "a_b=1")


# -- the same module, the same options, on the DirectRunner -----------------------------------


def test_the_dataflow_options_run_the_module_locally(monkeypatch, tmp_path):
    """The argument list built for Dataflow, with the runner switched to DirectRunner and the
    gs:// paths switched to local ones, runs the real stage module in a subprocess."""
    op = _operator(monkeypatch)
    _launch(op, _params(), FakeTaskInstance())
    cmd = FakeDataflow.command()

    docs = [{"id": f"d{i}", "text": f"document number {i} " * 8, "source": "web"} for i in range(5)]
    docs.append({"id": "empty", "text": "", "source": "web"})
    raw = tmp_path / "raw.jsonl.gz"
    raw.write_bytes(gzip.compress("".join(json.dumps(d) + "\n" for d in docs).encode()))
    out = tmp_path / "out"
    local = {
        str(LAUNCHER): sys.executable,
        "--runner=DataflowRunner": "--runner=DirectRunner",
        f"--input={RAW}": f"--input={raw}",
        f"--output={OUT}": f"--output={out}",
    }
    argv = [local.get(arg, arg) for arg in cmd]
    assert sum(a != b for a, b in zip(argv, cmd, strict=True)) == 4

    subprocess.run(argv, check=True, capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["records_in"] == 6
    assert manifest["records_out"] + sum(manifest["dropped"].values()) == 6
    assert manifest["config"]["source"] == "web"
    assert Path(out / "data").is_dir()


def test_the_stage_logging_lets_dataflows_job_id_line_through_to_the_hook(capsys):
    """The stage's own logging setup must not hide the line the hook reads the job id from
    (Beam's DataflowRunner logs it at INFO under its apiclient logger; the rest of Beam is
    kept at WARNING)."""
    import logging

    from airflow.providers.google.cloud.hooks.dataflow import (
        process_line_and_extract_dataflow_job_id_callback,
    )

    from pipelines.stage import setup_logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        for h in list(root.handlers):
            root.removeHandler(h)
        setup_logging()
        apiclient = logging.getLogger("apache_beam.runners.dataflow.internal.apiclient")
        apiclient.info("Created job with id: [%s]", JOB_ID)  # Beam's own call and words
        logging.getLogger("apache_beam.runners.worker").info("chatter")  # still hidden
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    printed = capsys.readouterr().err.splitlines()
    assert not any("chatter" in line for line in printed)
    found: list[str] = []
    parse = process_line_and_extract_dataflow_job_id_callback(found.append)
    for line in printed:
        parse(line)
    assert found == [JOB_ID]


def test_a_dataflow_launch_without_a_job_id_line_is_followed_by_its_name(monkeypatch):
    monkeypatch.setenv("FAKE_LAUNCHER_JOB_ID", "")  # a launcher that says nothing of its job
    monkeypatch.setenv("FAKE_LAUNCHER_MODE", "silent")
    op = _operator(monkeypatch)
    result = _launch(op, _params(), FakeTaskInstance())
    (waited,) = FakeDataflow.waited
    assert waited["job_id"] is None and waited["job_name"] == result["dataflow_job_name"]


def test_an_exception_while_following_kills_the_launcher_and_cancels(monkeypatch):
    """What Airflow's execution_timeout does: an exception raised in the task while the hook
    reads the stage's output. The launcher must not be left to run on, nor its job."""
    import signal

    from operators.hooks.beam import BeamStageHook

    class Timeout(Exception):
        pass

    monkeypatch.setenv("FAKE_LAUNCHER_MODE", "running")
    op = _operator(monkeypatch)
    seen: list[BeamStageHook] = []
    real = op.beam_hook
    monkeypatch.setattr(
        op, "beam_hook", lambda runner, job: seen.append(real(runner, job)) or seen[-1]
    )

    def alarm(signum, frame):
        raise Timeout

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(Timeout):
            _launch(op, _params(), FakeTaskInstance())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    (hook,) = seen
    assert hook._proc is None and hook.job_id == JOB_ID
    assert FakeDataflow.cancelled == [
        {"job_id": JOB_ID, "project_id": PROJECT, "location": "europe-west4"}
    ]
