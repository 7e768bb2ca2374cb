"""The dry run: what each step would do, and why, from the same probe the runner uses."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from operators.steps.lease import Status, StepState, probe
from operators.steps.store import store_for
from operators.steps.version import Step, topological


class Action(enum.StrEnum):
    RUN = "RUN"
    SKIP = "SKIP"
    WAIT = "WAIT"


@dataclass(frozen=True)
class PlanEntry:
    step: Step
    action: Action
    reason: str
    path: str


def decide(state: StepState, now: float) -> tuple[Action, str]:
    """The runner's decision for one step, with a reason a person can read."""
    status, lease = state.status, state.lease
    if status is not None and status.status is Status.SUCCESS:
        return Action.SKIP, f"SUCCESS at {_when(status.updated_at)}: cache hit"
    if lease is not None and lease.live(now):
        return Action.WAIT, (
            f"RUNNING by {lease.owner}, lease live for {lease.expires_at - now:.0f}s more"
        )
    if lease is not None and not lease.released:
        return Action.RUN, (
            f"stale lease of {lease.owner} expired {now - lease.expires_at:.0f}s ago: take over"
        )
    if status is not None and status.status is Status.FAILED:
        return Action.RUN, f"last attempt FAILED: {status.error}"
    return Action.RUN, "no status marker: never run"


def plan(steps: Iterable[Step], root: str, *, now: float | None = None) -> list[PlanEntry]:
    """Dry run: every step (ancestors included, upstream first) with what a run would do."""
    store = store_for(root)
    now = time.time() if now is None else now
    entries: list[PlanEntry] = []
    actions: dict[str, Action] = {}
    for step in topological(steps):
        state = probe(root, step, store)
        action, reason = decide(state, now)
        if action is Action.RUN:
            pending = [u.name for u in step.upstream if actions.get(u.key) is not Action.SKIP]
            if pending:
                reason += f"; after upstream {', '.join(pending)}"
        actions[step.key] = action
        entries.append(PlanEntry(step, action, reason, state.path))
    return entries


def format_plan(entries: Sequence[PlanEntry]) -> str:
    """One line per step (action, key, why), then the totals: ``N steps: a to run, b cache
    hits, c waiting``."""
    width = max((len(e.step.key) for e in entries), default=0)
    lines = [f"{e.action:<4}  {e.step.key:<{width}}  {e.reason}" for e in entries]
    counts = {a: sum(e.action is a for e in entries) for a in Action}
    hits = counts[Action.SKIP]
    lines.append(
        f"{len(entries)} steps: {counts[Action.RUN]} to run, {hits} cache hit"
        f"{'' if hits == 1 else 's'}, {counts[Action.WAIT]} waiting"
    )
    return "\n".join(lines)


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))
