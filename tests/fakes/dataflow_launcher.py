#!/usr/bin/env python3
"""FakeDataflowLauncher: stands in for ``python`` launching a stage on Dataflow (a FAKE).

The Beam stage hook runs ``<interpreter> -m pipelines.<stage> --runner=DataflowRunner ...``;
pointed at this script as its interpreter, it gets the same argument list, but nothing is
submitted anywhere. It writes its arguments as JSON to ``$FAKE_LAUNCHER_RECORD`` and then,
depending on ``$FAKE_LAUNCHER_MODE``:

* ``submit`` (default): prints the line Beam's DataflowRunner logs once the job exists
  (``Created job with id: [<id>]``, the id from ``$FAKE_LAUNCHER_JOB_ID``) on stderr, as Beam
  does, and exits 0 (the job "finished");
* ``running``: prints that line, then waits until killed (the launcher waiting on its job);
* ``hang``: prints a staging line and sleeps until killed (a launcher still submitting);
* ``fail``: prints a traceback-like line and exits 3;
* ``silent``: prints nothing about its job and exits 0.

Standard library only, so that it starts in milliseconds.
"""

import json
import os
import sys
import time

args = sys.argv[1:]
with open(os.environ["FAKE_LAUNCHER_RECORD"], "w") as record:
    json.dump(args, record)
mode = os.environ.get("FAKE_LAUNCHER_MODE", "submit")
if mode == "hang":
    print("INFO:apache_beam.runners.portability.stager:Staging the pipeline", flush=True)
    time.sleep(600)
elif mode == "silent":
    print("INFO:root:done", file=sys.stderr, flush=True)
elif mode == "fail":
    print("ValueError: the stage refused its input", file=sys.stderr, flush=True)
    sys.exit(3)
else:
    job_id = os.environ.get("FAKE_LAUNCHER_JOB_ID", "2026-05-01_01_02_03-1")
    print(f"INFO:apiclient:Created job with id: [{job_id}]", file=sys.stderr, flush=True)
    if mode == "running":
        time.sleep(600)
