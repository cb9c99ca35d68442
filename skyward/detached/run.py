"""`Run`: a detached run, followed from any process on the machine that started it.

`Run(name)` loads the run's record; `status()`, `logs()`, `wait()` and `stop()` reach the
nodes (`skyward.detached.reach`). A run whose nodes cannot be reached is ``lost``: that says
nothing of how the run itself is doing, and a later look may find it again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyward.detached import reach, record
from skyward.errors import SkywardError
from skyward.worker import supervisor
from skyward.worker.supervisor import FINAL

# How often a follower of logs or of the state looks again.
POLL_SECONDS = 0.5
# How long `logs(follow=True)` and `wait()` keep trying to reach node 0 before they give up.
UNREACHABLE_SECONDS = 60.0
_EVERYTHING = 1 << 62  # an offset past any log: a look that reads no log


class FetchError(SkywardError, ConnectionError):
    """A node's log or outputs could not be brought here (the node out of reach, or a file the
    unpacking refused): the run itself is not affected, and a later try reads them again."""


@dataclass(frozen=True)
class RunStatus:
    """How a detached run stands: `state` is ``starting``, ``running``, ``succeeded``,
    ``failed`` (`rank` and `exit_status` say which rank and how), ``stopped`` or ``lost``."""

    name: str
    provider: str
    nodes: int
    state: str
    started_at: float
    duration: float  # seconds, to its end or to now
    cost: float | None  # dollars so far, when the price is known
    rank: int | None = None
    exit_status: int | None = None  # the failing rank's: -N when signal N killed it
    reason: str = ""
    # What is still to do here for an ended run: its logs and outputs not kept yet (its
    # machines then stay up), or its outputs not copied to its output directory.
    note: str = ""

    @property
    def ended(self) -> bool:
        return self.state in FINAL

    @property
    def returncode(self) -> int:
        """The run's status as a command's: 0, the failing rank's status (128+N for signal N),
        1 for a lost node, 143 for a stopped run (SIGTERM's)."""
        if self.state == "succeeded":
            return 0
        if self.state == "stopped":
            return 128 + signal.SIGTERM
        status = self.exit_status
        if status is None or status == -1:
            return 1
        return 128 - status if status < 0 else status


class Run:
    """A detached run (see the module's docstring); ``sky.Run(name)`` re-attaches to one."""

    def __init__(self, name: str) -> None:
        self.record = record.load(name)
        self._reach: reach.Reach | None = None
        self._offsets = [0] * self.record.ranks
        self._partial = [b""] * self.record.ranks
        # What the leader said once every rank had started, for a run `submit` just started.
        self.started: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self.record.name

    def __repr__(self) -> str:
        return f"<sky.Run {self.name} on {self.record.nodes} {self.record.provider} node(s)>"

    def _nodes(self) -> reach.Reach:
        if self._reach is None:
            rec = self.record
            saved = rec.reach.get("saved")
            if saved and rec.last.get("state") in FINAL:  # a cloud run's nodes are gone
                self._reach = reach.Local(saved)
            else:
                self._reach = reach.connect(
                    rec.kind, rec.reach, rec.directories, rec.ranks_per_node
                )
        return self._reach

    def close(self) -> None:
        if self._reach is not None:
            self._reach.close()
            self._reach = None

    # -- state

    def status(self) -> RunStatus:
        """How the run stands now (an ended run's answer is kept: no node is asked again,
        unless a cloud run's logs are still to be kept)."""
        if self.record.last.get("state") in FINAL:
            return self._kept_status()
        views = self._nodes().peek([_EVERYTHING] * self.record.ranks)
        return self._judge(views)

    def _kept_status(self) -> RunStatus:
        """An ended run's status from its record, once a cloud run's pool is let go."""
        if self._release_cloud():
            record.save(self.record)
        return self._status(self.record.last, reachable=True)

    def _judge(self, views: list[reach.NodeView | None]) -> RunStatus:
        if self.record.last.get("state") in FINAL:
            return self._kept_status()
        head = views[0]
        if head is None:
            return self._status({}, reachable=False)
        run = dict(head.run)
        if run.get("state") in FINAL:
            self._ended(run)
        elif run and not head.leader_alive:
            run = {**run, "state": "lost", "reason": "the supervisor on node 0 is gone"}
        return self._status(run, reachable=True)

    def _ended(self, run: dict[str, Any]) -> None:
        """Keep an ended run's state and remove what it left on the nodes (spec, key lines).
        A cloud run's logs are copied here first; then what its pool made is removed (its
        machines power themselves off, but its rules and keys stay until someone removes
        them)."""
        if self.record.last.get("state") in FINAL:
            return
        with contextlib.suppress(Exception):
            self._nodes().clean(self.record.key_tags or [None] * self.record.ranks)
        self.record.last = run
        self._release_cloud()
        record.save(self.record)

    def _release_cloud(self) -> bool:
        """For an ended cloud run not let go yet: keep its logs and outputs here, then remove
        what its pool made (its machines power themselves off, but its rules and keys stay
        until someone removes them). While they cannot be kept (a node out of reach), the
        machines stay, the record says why, and the next look tries again. Whether the record
        changed."""
        cloud = self.record.reach.get("cloud")
        if not cloud or "saved" in self.record.reach:
            return False
        try:
            saved = self._keep_logs()
        except (OSError, SkywardError) as exc:
            self.record.reach["unsaved"] = str(exc)
            self.close()  # the next look connects afresh
            return True
        self.record.reach.pop("unsaved", None)
        self.record.reach["saved"] = saved
        self.record.reach["removed"] = _remove_cloud_pool(cloud)
        if self.record.reach.get("key"):  # a copy of the pool's login key (SSH), kept here
            with contextlib.suppress(OSError):
                os.unlink(self.record.reach["key"])
        self.close()
        if self.record.output_dir and "://" not in self.record.output_dir:
            try:  # from the copy just kept: the machines are not needed for it
                self._place(reach.Local(saved), Path(self.record.output_dir))
            except (OSError, SkywardError) as exc:
                self.record.reach["unplaced"] = str(exc)
        return True

    def _keep_logs(self) -> list[str]:
        """Every rank's log and outputs, copied under ``<cache>/runs/NAME.logs/``: where `logs`
        and `fetch` read them once the nodes are gone. Raises when a node cannot be read to
        its end; a node gone for good (its pod deleted) is left out, and the record says
        so (``gone``): waiting would not bring it back, and the others' machines would wait
        for it for ever."""
        root = record.runs_dir() / f"{self.name}.logs"
        kept = [root / self.record.rank_path(rank) for rank in range(self.record.ranks)]
        handles = []
        for directory in kept:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(directory / supervisor.LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            handles.append(os.fdopen(fd, "wb"))
        nodes = self._nodes()
        gone: dict[int, str] = {}
        try:
            offsets = [0] * self.record.ranks
            more = True
            while more:  # a bounded piece of each log per look, until every one is read
                views = nodes.peek(offsets)
                for node, view in enumerate(views):
                    if view is None and nodes.gone(node):
                        gone[node] = nodes.why(node)
                    elif view is None:
                        raise FetchError(f"{self.record.rank_label(node)} cannot be reached")
                    else:
                        handles[node].write(view.data)
                        offsets[node] += len(view.data)
                more = any(view is not None and view.more for view in views)
        finally:
            for handle in handles:
                handle.close()
        self._bring(nodes, [directory / supervisor.OUTPUTS for directory in kept], set(gone))
        if gone:
            self.record.reach["gone"] = "; ".join(
                f"{self.record.rank_label(n)}: {why}" for n, why in gone.items()
            )
        return [str(directory) for directory in kept]

    # -- outputs

    def fetch(self, to: str | os.PathLike[str] | None = None) -> list[Path]:
        """Bring every rank's `sky.output_dir()` here, to ``<to>/node-<i>`` (``<to>/node-<i>/
        rank-<r>`` where a node holds several ranks; default: the run's ``output_dir``, else
        ``./NAME``); returns those directories. Once the run has ended,
        the machines kept up for this (``--keep-for``) may go."""
        given = to or self.record.output_dir
        if given is None or str(given).startswith("s3://"):
            given = self.name  # a bucket's copy is the nodes' to write: this is a local one
        try:
            placed = self._place(self._nodes(), Path(given))
        except FetchError as exc:
            raise FetchError(
                f"run {self.name}: {exc}; `skyward fetch {self.name}` tries again"
            ) from None
        if self.record.reach.pop("unplaced", None) is not None:
            record.save(self.record)
        views = self._nodes().peek([_EVERYTHING] * self.record.ranks)
        if self._judge(views).ended:  # the look just taken: no second one
            holders = [
                (node, int(view.node["holder"]))
                for node, view in enumerate(views)
                if view is not None and view.node.get("holder")
            ]
            self._nodes().signal(holders, signal.SIGTERM)
            if holders and self.record.last:  # the machines go now: billed until here
                self.record.last.setdefault("released_at", time.time())
                record.save(self.record)
        return placed

    def _place(self, nodes: reach.Reach, destination: Path) -> list[Path]:
        """Every node's outputs from `nodes` into ``destination/node-<i>``."""
        placed = [destination / self.record.rank_path(r) for r in range(self.record.ranks)]
        self._bring(nodes, placed)
        return placed

    def _bring(self, nodes: reach.Reach, targets: list[Path], gone: Collection[int] = ()) -> None:
        """Every node's outputs but those of nodes `gone` for good, into `targets`."""
        found = nodes.outputs(targets)
        failed = [
            f"{self.record.rank_label(rank)} ({why})"
            for rank, why in enumerate(found)
            if why and rank not in gone
        ]
        if failed:
            raise FetchError(f"the outputs of {', '.join(failed)} could not be fetched")

    def _status(self, run: dict[str, Any], reachable: bool) -> RunStatus:
        rec = self.record
        state = run.get("state", "starting") if reachable else "lost"
        if state in ("running", "restarting"):
            state = "running"
        started = float(run.get("running_at") or run.get("started_at") or rec.created_at)
        now = time.time()
        end = float(run.get("ended_at") or now)
        duration = max(0.0, end - started)
        cost = None
        if rec.price_per_hour is not None:
            # The machines are paid for while they wait after the end (`--keep-for`), until
            # a fetch lets them go.
            held_until = min(end + rec.keep_for, float(run.get("released_at") or now), now)
            billed = duration + max(0.0, held_until - end)
            cost = rec.price_per_hour * rec.nodes * billed / 3600
        reason = str(run.get("reason", ""))
        if not reachable:
            why = self._reach.why(0) if self._reach is not None else ""
            reason = "its nodes cannot be reached now (the run may still be going)"
            if why:
                reason = f"node 0 cannot be reached now ({why}; the run may still be going)"
            if self._reach is not None and self._reach.gone(0):
                # Node 0 held how the run ends: no later look will see it.
                reason = f"node 0 will not be reached again: {why}"
                if "cloud" in rec.reach:
                    reason += f"; `skyward down {rec.reach['cloud']['pool_id']}` removes the rest"
        note = ""
        if "unsaved" in rec.reach:
            pool = rec.reach["cloud"]["pool_id"]
            note = (
                f"its logs and outputs are not kept here yet ({rec.reach['unsaved']}): its "
                f"machines stay until a later look keeps them (`skyward down {pool}` removes "
                "them without)"
            )
        elif "unplaced" in rec.reach:
            note = str(rec.reach["unplaced"])
        elif "gone" in rec.reach:
            note = f"not kept here, gone with their nodes: {rec.reach['gone']}"
        return RunStatus(
            rec.name,
            rec.provider,
            rec.nodes,
            state,
            started,
            duration,
            cost,
            run.get("rank"),
            run.get("status"),
            reason,
            note,
        )

    # -- logs

    def logs(self, follow: bool = False, out: Callable[[str], None] | None = None) -> int | None:
        """Write every line the ranks have written, ``(node i) line`` (``(node i rank r)``
        where a node holds several ranks), to `out` (default: this
        process's stdout); with `follow`, keep going until the run ends and return its
        `RunStatus.returncode`."""
        write = out or _print
        lost_since: float | None = None
        while True:
            views = self._catch_up(write)
            if not follow:
                self._flush(write)
                return None
            status = self._judge(views)
            if status.state == "lost":
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > UNREACHABLE_SECONDS:
                    self._flush(write)
                    raise TimeoutError(
                        f"run {self.name}: {status.reason or 'node 0 cannot be reached'} for "
                        f"{UNREACHABLE_SECONDS:.0f} s; `skyward status` looks again later"
                    )
            else:
                lost_since = None
            if status.ended:
                self._catch_up(write)  # what came with the end
                self._flush(write)
                local = self.record.output_dir and "://" not in self.record.output_dir
                if local and "saved" not in self.record.reach:
                    self.fetch()  # a node that cannot be read: an error naming it
                    write(f"[skyward] run {self.name}: outputs in {self.record.output_dir}")
                return status.returncode
            time.sleep(POLL_SECONDS)

    def _catch_up(self, write: Callable[[str], None]) -> list[reach.NodeView | None]:
        """Write what every rank wrote since the last look, a bounded piece per look, looking
        again at once while a node had more; the last look."""
        while True:
            views = self._nodes().peek(self._offsets)
            self._emit(views, write)
            if not any(view is not None and view.more for view in views):
                return views

    def _emit(self, views: list[reach.NodeView | None], write: Callable[[str], None]) -> None:
        for label, line in self._taken(views):
            write(f"({label}) {line}")

    def _taken(self, views: list[reach.NodeView | None]) -> list[tuple[str, str]]:
        """The whole lines `views` brought, each with its rank's label; a line's start
        waits for its end."""
        taken: list[tuple[str, str]] = []
        for node, view in enumerate(views):
            if view is None or not view.data:
                continue
            self._offsets[node] += len(view.data)
            label = self.record.rank_label(node)
            text = self._partial[node] + view.data
            *lines, self._partial[node] = text.split(b"\n")
            taken.extend((label, line.decode(errors="replace")) for line in lines)
        return taken

    def new_lines(self) -> list[tuple[str, str]]:
        """The lines every rank wrote since the last call (``(label, line)``: ``node 1``,
        ``node 1 rank 3``), for a reader that shows them as they come (the dashboard)."""
        taken: list[tuple[str, str]] = []
        while True:
            views = self._nodes().peek(self._offsets)
            taken.extend(self._taken(views))
            if not any(view is not None and view.more for view in views):
                return taken

    def _flush(self, write: Callable[[str], None]) -> None:
        for node, rest in enumerate(self._partial):
            if rest:
                write(f"({self.record.rank_label(node)}) {rest.decode(errors='replace')}")
                self._partial[node] = b""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the run to end; its `RunStatus.returncode`. `TimeoutError` after
        `timeout` seconds, or when node 0 stays out of reach."""
        deadline = None if timeout is None else time.monotonic() + timeout
        lost_since: float | None = None
        while True:
            status = self.status()
            if status.ended:
                return status.returncode
            if status.state == "lost":
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > UNREACHABLE_SECONDS:
                    raise TimeoutError(f"run {self.name}: {status.reason}")
            else:
                lost_since = None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.name} is still {status.state} after {timeout} s")
            time.sleep(POLL_SECONDS)

    def stop(self, timeout: float = 30.0) -> RunStatus:
        """End the run on every node: SIGTERM to its supervisors (each rank gets SIGTERM, then
        SIGKILL after the run's grace), SIGKILL to whatever is left after `timeout` seconds."""
        views = self._nodes().peek([_EVERYTHING] * self.record.ranks)
        status = self._judge(views)
        if status.ended:
            return status
        targets: list[tuple[int, int]] = []
        head = views[0]
        if head is not None and head.leader_alive and head.run.get("leader_pid"):
            # The leader alone: it stops every rank and says the run was stopped. A rank
            # that another node's SIGTERM ended first would read as that rank's failure.
            targets.append((0, int(head.run["leader_pid"])))
        else:
            for node, view in enumerate(views):
                if view is not None and view.node.get("state") == "running":
                    targets.append((node, int(view.node["follower"])))
        self._nodes().signal(targets, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            views = self._nodes().peek([_EVERYTHING] * self.record.ranks)
            status = self._judge(views)
            running = [v for v in views if v is not None and v.node.get("state") == "running"]
            if status.ended and not running:
                return status
            if not (views[0] and views[0].leader_alive):
                break  # no leader to stop the ranks in order: what is left is killed now
            time.sleep(POLL_SECONDS)
        # Whatever is left: the ranks' groups and the supervisors, killed.
        views = self._nodes().peek([_EVERYTHING] * self.record.ranks)
        kills = list(targets)
        for node, view in enumerate(views):
            if view is not None and view.node.get("state") == "running":
                kills.append((node, -int(view.node["pid"])))
        self._nodes().signal(kills, signal.SIGKILL)
        final = {"state": "stopped", "reason": "stopped by skyward stop", "ended_at": time.time()}
        run = dict(views[0].run) if views[0] is not None else {}
        run = {**run, **final} if run.get("state") not in FINAL else run
        self._ended(run)
        return self._status(run, reachable=True)


def _remove_cloud_pool(cloud: dict[str, Any]) -> list[str]:
    """Remove what a cloud run's pool made (its machines, if still up, its rules and keys)
    with the provider the record names; what was removed, or why it could not be."""
    try:
        provider = reach.named_class(str(cloud["provider"]), "the pool's")(**cloud["arguments"])
        removed: list[str] = provider.remove_pool(cloud["pool_id"])
    except Exception as exc:
        why = str(exc) or type(exc).__name__  # (a timeout says nothing more)
        return [f"not removed ({why}); `skyward down {cloud['pool_id']}` removes it"]
    return removed


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
