"""BeamStageHook: one data-plane stage, followed to its end.

On the DirectRunner with this interpreter the stage's ``main`` runs **in the task's own
process**, with the arguments its command line would get: a new interpreter per stage cost
2-4 s of start-up and imports (Beam, TensorStore, SentencePiece), more than the stage itself
for the small token stores, and the task's process is already the unit Airflow kills. Its
exit status (``parser.exit(2, ...)`` for a refused option) and exceptions become
:class:`BeamStageFailed` with the last lines it wrote to stderr.

Otherwise (DataflowRunner, or another ``py_interpreter``) ``python -m pipelines.<stage>
--runner=... <options>`` runs as a subprocess (``-m``: ``pipelines.tokenize`` as a script
would shadow the standard library's ``tokenize``). The hook keeps the process handle, so a
killed task stops exactly its own launcher (no scan of the task's children) and a non-zero
exit fails with the last lines the stage printed.

On Dataflow the hook adds what the job needs on the launcher's command line (a job name
unique per launch, project, region, service account, labels), reads the job id from the line
Beam's DataflowRunner prints once the job exists (the google provider's parser), and, after
the launcher returns (``with beam.Pipeline`` waits for the job), asks Dataflow for the job's
own verdict (the provider's ``DataflowHook.wait_for_done``). ``kill`` cancels the job by id,
or by its unique name while the launcher is still submitting.

The options are formatted by the apache-beam provider's ``beam_options_to_args`` (lists
repeat the flag, dicts become JSON, ``None`` is left out), so a command line reads as the
provider's would.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import io
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from airflow.sdk import BaseHook

from operators.dataflow import DataflowJob

__all__ = ["BeamStageFailed", "BeamStageHook", "DataflowJob", "gcp_connection_project"]

# Lines of the stage's output quoted in a failure (the traceback's end, usually).
FAILURE_TAIL_LINES = 30
# After SIGTERM, how long the launcher has to stop before SIGKILL.
# Airflow's supervisor SIGKILLs the task 5 s after SIGTERM: on_kill must be done before that.
KILL_GRACE_SECONDS = 3.0


class BeamStageFailed(RuntimeError):
    """The stage process exited non-zero (``returncode``: negative for a signal)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class _TailWriter(io.TextIOBase):
    """Passes text on to ``stream`` and keeps its last :data:`FAILURE_TAIL_LINES` lines."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lines: collections.deque[str] = collections.deque(maxlen=FAILURE_TAIL_LINES)
        self._partial = ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        *done, self._partial = (self._partial + text).split("\n")
        self.lines.extend(line for line in done if line)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def traceback_tail(err: BaseException) -> list[str]:
    """The last lines of ``err``'s traceback, as a failed stage process would have printed."""
    import traceback

    lines = "".join(traceback.format_exception(err)).splitlines()
    return lines[-FAILURE_TAIL_LINES:]


def gcp_connection_project(gcp_conn_id: str) -> str | None:
    """The Airflow GCP connection's project (its ``project`` extra, else its credentials'),
    or None: the Dataflow project's last fallback."""
    try:
        from airflow.providers.google.common.hooks.base_google import GoogleBaseHook

        return GoogleBaseHook(gcp_conn_id=gcp_conn_id).project_id or None
    except Exception as exc:  # no such connection, no credentials: settings must name it
        BaseHook().log.info("No project from connection %s: %s", gcp_conn_id, exc)
        return None


class BeamStageHook(BaseHook):
    """Runs stage modules with one runner; on Dataflow, one job per :meth:`run_module`."""

    hook_name = "Slipway Beam stage"

    def __init__(
        self,
        runner: str = "DirectRunner",
        *,
        dataflow: DataflowJob | None = None,
        py_interpreter: str = sys.executable,
        in_process: bool = True,
    ) -> None:
        super().__init__()
        if (runner == "DataflowRunner") != (dataflow is not None):
            raise ValueError("a DataflowJob is given exactly when the runner is DataflowRunner")
        self.runner = runner
        self.dataflow = dataflow
        self.py_interpreter = py_interpreter
        # A DirectRunner stage under this interpreter runs in this process (module docstring).
        self.in_process = (
            in_process
            and dataflow is None
            and runner == "DirectRunner"
            and py_interpreter == sys.executable
        )
        self.job_name: str | None = None  # the launched Dataflow job's unique name
        self.job_id: str | None = None  # read from the launcher's output
        self._proc: subprocess.Popen[str] | None = None

    # -- the command ------------------------------------------------------------------------

    def arguments(self, options: Mapping[str, Any]) -> list[str]:
        """The stage's arguments after ``python -m pipelines.<stage>``."""
        from airflow.providers.apache.beam.hooks.beam import beam_options_to_args

        return [f"--runner={self.runner}", *beam_options_to_args(dict(options))]

    def command(self, module: str, options: Mapping[str, Any]) -> list[str]:
        return [self.py_interpreter, "-m", module, *self.arguments(options)]

    def _dataflow_options(self, job: DataflowJob, job_name: str) -> dict[str, Any]:
        from airflow.version import version as airflow_version

        labels = {
            **(job.labels or {}),
            "airflow-version": "v" + airflow_version.replace(".", "-").replace("+", "-"),
        }
        options: dict[str, Any] = {"job_name": job_name}
        if job.service_account:
            # Beam Python reads --service_account_email (Java's --serviceAccount is refused).
            options["service_account_email"] = job.service_account
        options["project"] = job.project_id
        options["region"] = job.location
        options["labels"] = [f"{k}={v}" for k, v in labels.items()]
        return options

    # -- running ----------------------------------------------------------------------------

    def run_module(self, module: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """Run one stage to its end; raise :class:`BeamStageFailed` on a non-zero exit.

        Returns what identifies the run outside this machine (the Dataflow job), else ``{}``.
        """
        if self.in_process:
            self._run_in_process(module, options)
            return {}
        options = dict(options)
        job = self.dataflow
        on_line: Callable[[str], None] = lambda line: None  # noqa: E731
        if job is not None:
            from airflow.providers.google.cloud.hooks.dataflow import (
                DataflowHook,
                process_line_and_extract_dataflow_job_id_callback,
            )

            self.job_name = DataflowHook.build_dataflow_job_name(job.job_name, True)
            self.job_id = None
            options.update(self._dataflow_options(job, self.job_name))
            on_line = process_line_and_extract_dataflow_job_id_callback(self._found_job_id)
        cmd = self.command(module, options)
        self.log.info("Running: %s", shlex.join(cmd))
        tail: collections.deque[str] = collections.deque(maxlen=FAILURE_TAIL_LINES)
        # One stream (stderr into stdout): the stage's log lines stay in the order written.
        # Undecodable bytes are replaced: a stage's odd output must not stop the reading.
        with subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
        ) as proc:
            self._proc = proc
            assert proc.stdout is not None
            try:
                for raw in proc.stdout:
                    line = raw.rstrip("\n")
                    tail.append(line)
                    on_line(line)
                    self.log.info("%s", line)
                returncode = proc.wait()
            except BaseException:
                # execution_timeout, or anything raised while reading: leaving this block
                # would wait for the stage to end on its own, and its job would run on.
                self.kill()
                raise
            finally:
                self._proc = None
        if returncode != 0:
            raise BeamStageFailed(
                f"python -m {module} exited with {returncode}; its last lines:\n  "
                + "\n  ".join(tail),
                returncode,
            )
        if job is None:
            return {}
        if not self.job_id:
            # The launcher's log did not say (another Beam's wording): the unique name finds it.
            self.log.warning(
                "python -m %s printed no Dataflow job id: following job %s by its name",
                module,
                self.job_name,
            )
        self._dataflow_hook(job).wait_for_done(
            job_name=self.job_name,
            location=job.location,
            job_id=self.job_id,
            project_id=job.project_id,
        )
        return {"dataflow_job_id": self.job_id, "dataflow_job_name": self.job_name}

    def _run_in_process(self, module: str, options: Mapping[str, Any]) -> None:
        """The stage's ``main`` in this process. What it writes to stderr (a refused option's
        one line) still goes there and its tail goes into a failure's message; its manifest,
        printed on stdout for a caller of the command line, is left out of the log: the
        operator records it from the output."""
        argv = self.arguments(options)
        self.log.info("Running in this process: python -m %s %s", module, shlex.join(argv))
        # A logging handler the stage sets up may keep the wrapper: it passes text on, and
        # keeps a bounded tail, so nothing is lost after the stage either.
        stderr = _TailWriter(sys.stderr)
        code: int | str | None = 0
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
                importlib.import_module(module).main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except Exception as err:
            raise BeamStageFailed(
                f"python -m {module} failed: {type(err).__name__}: {err}; its last lines:\n  "
                + "\n  ".join(traceback_tail(err)),
                1,
            ) from err
        if code not in (0, None):
            returncode = code if isinstance(code, int) else 1
            tail = list(stderr.lines)
            if isinstance(code, str):
                tail.append(code)
            raise BeamStageFailed(
                f"python -m {module} exited with {returncode}; its last lines:\n  "
                + "\n  ".join(tail),
                returncode,
            )

    def _found_job_id(self, job_id: str) -> None:
        if job_id != self.job_id:
            self.job_id = job_id
            job = self.dataflow
            assert job is not None
            self.log.info(
                "Dataflow job %s: https://console.cloud.google.com/dataflow/jobs/%s/%s?project=%s",
                job_id,
                job.location,
                job_id,
                job.project_id,
            )

    @staticmethod
    def _dataflow_hook(job: DataflowJob) -> Any:
        from airflow.providers.google.cloud.hooks.dataflow import DataflowHook

        # Batch jobs: cancel (not drain) on kill, and wait for the job to finish; a cancel is
        # sent, not waited for (on_kill has seconds before the task is SIGKILLed).
        return DataflowHook(
            gcp_conn_id=job.gcp_conn_id,
            drain_pipeline=False,
            wait_until_finished=True,
            cancel_timeout=None,
        )

    # -- stopping ---------------------------------------------------------------------------

    def kill(self) -> None:
        """Stop the launcher (SIGTERM, then SIGKILL) and cancel its Dataflow job, if any.

        Safe to call from a signal handler while :meth:`run_module` waits on the process. A
        stage running in this process has nothing to stop here: it ends with the task's
        process, which Airflow terminates after ``on_kill``.
        """
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(KILL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
        job = self.dataflow
        if job is None or not self.job_name:
            return  # nothing was submitted to Dataflow
        where = {"project_id": job.project_id, "location": job.location}
        # Before the launcher printed the id, the job may exist already; its unique name
        # finds whatever was submitted. The request first, the log line after.
        ident = {"job_id": self.job_id} if self.job_id else {"job_name": self.job_name}
        try:
            self._dataflow_hook(job).cancel_job(**ident, **where)
        except Exception:  # the task is being killed anyway: say what may be left running
            self.log.exception("Could not cancel Dataflow job %s: cancel it in the console", ident)
        else:
            self.log.info("Cancel requested for Dataflow job %s", next(iter(ident.values())))
