"""``skyward run --detach``, ``skyward logs``, ``skyward stop`` and the detached runs in
``skyward status``: the command line over `skyward.detached`."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from skyward.cli.packages import unresolved
from skyward.cli.profiles import Profile
from skyward.cli.runner import script_packages, script_plugins
from skyward.console.progress import clock
from skyward.cost import dollars
from skyward.detached import record
from skyward.detached.run import Run, RunStatus
from skyward.detached.submit import submit
from skyward.errors import BootstrapError
from skyward.worker.supervisor import FINAL


@dataclass(frozen=True)
class Options:
    """``skyward run``'s flags for a detached run."""

    name: str | None = None
    restarts: int = 0
    output_dir: str | None = None
    keep_for: float = 0.0


def start(profile: Profile, script: str, args: Sequence[str], options: Options) -> int:
    """``skyward run --detach``: start the run, say how to follow it, exit 0 once every rank
    has started."""
    packages = script_packages(profile, Path(script))
    try:
        run = submit(
            script,
            args,
            provider=profile.build_provider(),
            nodes=profile.nodes,
            processes_per_node=profile.processes_per_node,
            accelerator=profile.accelerator,
            image=packages.image(),
            plugins=script_plugins(profile, ranks_per_gpu=True),
            env=profile.env,
            workdir=profile.workdir,
            name=options.name,
            restarts=options.restarts,
            max_cost=profile.max_cost,
            output_dir=options.output_dir,
            keep_for=options.keep_for,
        )
    except BootstrapError as exc:
        better = unresolved(exc, packages) if packages.pip else None
        if better is None:
            raise
        raise better from exc
    # What the leader said once every rank had started: no node is asked again here.
    ranks = f", {run.record.ranks} ranks" if run.record.ranks_per_node > 1 else ""
    print(f"run {run.name} started on {run.record.nodes} node(s){ranks}: every rank is running")
    if run.started.get("state") in FINAL:
        print(f"it has ended already: {run.started['state']} {run.started.get('reason', '')}")
    for command, what in (
        (f"skyward logs -f {run.name}", "follow its output until it ends"),
        ("skyward status", "how it stands, and what it has cost"),
        (f"skyward stop {run.name}", "end it on every node"),
    ):
        print(f"  {command:<{len(run.name) + 18}}  {what}")
    return 0


def logs(name: str, follow: bool) -> int:
    run = Run(name)
    try:
        code = run.logs(follow=follow)
    except KeyboardInterrupt:
        print(f"skyward logs: stopped following; run {name} goes on", file=sys.stderr)
        return 130
    finally:
        run.close()
    if code is None:
        return 0
    status = run.status()
    if code != 0:
        print(f"skyward logs: run {name} {_state(status)}", file=sys.stderr)
    return code


def fetch(name: str, to: str | None) -> int:
    run = Run(name)
    try:
        placed = run.fetch(to)
    finally:
        run.close()
    for path in placed:
        print(f"{path}")
    return 0


def stop(name: str) -> int:
    run = Run(name)
    try:
        status = run.stop()
    finally:
        run.close()
    print(f"run {name}: {_state(status)}")
    return 0


def _state(status: RunStatus) -> str:
    if status.state == "failed":
        said = f"failed: {status.reason}" if status.reason else "failed"
    elif status.state in ("lost", "stopped") and status.reason:
        said = f"{status.state} ({status.reason})"
    else:
        said = status.state
    return f"{said}; {status.note}" if status.note else said


def _status_of(rec: record.RunRecord) -> RunStatus | str:
    """How run `rec` stands, or why that cannot be told now: its row says so, and the other
    runs are listed all the same."""
    try:
        run = Run(rec.name)
        try:
            return run.status()
        finally:
            run.close()
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return f"unreachable ({why})"


def print_runs() -> int:
    """`skyward status` for detached runs: one line each; how many it listed."""
    runs = record.all_records()
    if not runs:
        return 0
    print(
        f"{'RUN':<24} {'PROVIDER':<10} {'NODES':>5}  {'STATE':<40} {'STARTED':<16} "
        f"{'DURATION':>8} {'COST':>9}"
    )
    # Every run is asked at once: an unreachable one costs its timeout, not the others'.
    with ThreadPoolExecutor(max_workers=min(8, len(runs))) as pool:
        statuses = list(pool.map(_status_of, runs))
    for rec, status in zip(runs, statuses, strict=True):
        if isinstance(status, str):
            said, begun, duration, cost = status, rec.created_at, "-", "-"
        else:
            said, begun = _state(status), status.started_at
            duration = clock(status.duration)
            cost = dollars(status.cost) if status.cost is not None else "-"
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(begun))
        print(
            f"{rec.name:<24} {rec.provider:<10} {rec.nodes:>5}  {said[:40]:<40} "
            f"{started:<16} {duration:>8} {cost:>9}"
        )
        if len(said) > 40:  # the whole of it, under its row
            print(f"{'':<24} {said}")
    return len(runs)


def forget(names: Sequence[str], every_ended: bool = False) -> int:
    """``skyward status --forget RUN`` / ``--forget-ended``: remove ended runs' records and
    what was kept of them here, each named as it goes; a run not known to have ended (running,
    or lost: it may still be going) is refused and kept. 1 if any was refused."""
    chosen = list(names)
    if every_ended:
        chosen += [rec.name for rec in record.all_records() if rec.name not in chosen]
    refused = 0
    for name in chosen:
        run = Run(name)
        try:
            status = run.status()
        finally:
            run.close()
        if not status.ended:
            if name in names:
                print(
                    f"skyward status: run {name} is {_state(status)}; `skyward stop {name}` "
                    "ends it, then it can be forgotten",
                    file=sys.stderr,
                )
                refused += 1
            continue
        record.forget(name)
        print(f"forgot run {name} ({_state(status)})")
    return 1 if refused else 0
