"""What the gke tests against FakeKubernetesApiServer share (tests/integration/test_gke_*.py).

The platform's namespace and trainer image, :class:`Collect` (the trigger's log),
:func:`run_trigger` (a trigger's ``run()`` to its first event while a script plays the JobSet
controller) and :func:`trainer_writes_results` (what the trainer's pods leave in the step's
directory). Their fixtures (the fake, its kubeconfig, ``SLIPWAY_HOME``, the platform's
allow-lists) are ``tests/integration/conftest.py``'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

NS = "train"
IMAGE = "us-docker.pkg.dev/proj/slipway/slipway-trainer:test"


class Collect:
    """Stands in for the trigger's log: every line it would show in the task log."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def having(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]


def run_trigger(trigger: Any, script: Callable[[], None] | None = None, timeout: float = 15):
    """Run ``trigger.run()`` to its first event while ``script`` plays the controller."""

    async def first_event() -> Any:
        async for event in trigger.run():
            return event
        return None

    async def main() -> Any:
        task = asyncio.ensure_future(first_event())
        if script is not None:
            await asyncio.to_thread(script)
        try:
            return await asyncio.wait_for(task, timeout)
        finally:
            await trigger.cleanup()

    return asyncio.run(main())


def trainer_writes_results(out: str, steps: int = 6) -> None:
    """What the trainer's pods would have written to the (shared) step directory."""
    root = Path(out)
    with (root / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "loss": 10.0 - step}) + "\n")
    ckpt = root / "checkpoints" / f"step-{steps:09d}"
    ckpt.mkdir(parents=True)
    (ckpt / "commit.json").write_text("{}")
    (root / "result.json").write_text(
        json.dumps({"status": "succeeded", "steps": steps, "params": 1234, "final_loss": 4.0})
    )
