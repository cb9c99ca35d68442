"""How the client reaches a detached run's nodes: read their state and logs, stop the run, and
remove what the run left once it has ended.

`Local` reads this machine's files; `Remote` runs one shell command per node over a verified
SSH connection (an SSH host). Each `peek` asks every node at once and returns, per node, what
its files say: node 0 also says whether its leader is alive. A node that cannot be reached is
`None`, never a failed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from skyward.worker import supervisor
from skyward.worker.supervisor import LOG, NODE_STATE, RUN_STATE, read_json

# How long one look at a node may take before the node counts as unreachable.
PEEK_TIMEOUT = 20.0


@dataclass
class NodeView:
    """What one node's files said at one look."""

    node: dict[str, Any]  # node.json: the follower's state
    run: dict[str, Any] = field(default_factory=dict)  # run.json (node 0 only)
    leader_alive: bool = False  # node 0 only
    data: bytes = b""  # the rank's log from the offset asked


class Reach(Protocol):
    """A run's nodes as the client reaches them."""

    def peek(self, offsets: Sequence[int]) -> list[NodeView | None]: ...
    def outputs(self) -> list[bytes | None]: ...
    def signal(self, pids: Sequence[tuple[int, int]], signum: int) -> None: ...
    def clean(self, key_tags: Sequence[str | None]) -> None: ...
    def close(self) -> None: ...


class Local:
    """Nodes on this machine (`sky.Local`, or a Slurm cluster whose run directories are shared)."""

    def __init__(self, directories: Sequence[str]) -> None:
        self.directories = [Path(d) for d in directories]

    def peek(self, offsets: Sequence[int]) -> list[NodeView | None]:
        views: list[NodeView | None] = []
        for index, (directory, offset) in enumerate(zip(self.directories, offsets, strict=True)):
            view = NodeView(read_json(directory / NODE_STATE))
            if index == 0:
                view.run = read_json(directory / RUN_STATE)
                view.leader_alive = supervisor.alive(int(view.run.get("leader_pid", 0)))
            with contextlib.suppress(OSError), open(directory / LOG, "rb") as handle:
                handle.seek(offset)
                view.data = handle.read()
            views.append(view)
        return views

    def outputs(self) -> list[bytes | None]:
        """Each node's output directory as a tar stream."""
        import io
        import tarfile

        found: list[bytes | None] = []
        for directory in self.directories:
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as tar:
                source = directory / supervisor.OUTPUTS
                if source.is_dir():
                    tar.add(source, arcname=".")
            found.append(buffer.getvalue())
        return found

    def signal(self, pids: Sequence[tuple[int, int]], signum: int) -> None:
        for _, pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def clean(self, key_tags: Sequence[str | None]) -> None:
        for directory, tag in zip(self.directories, key_tags, strict=True):
            supervisor.finish_node(directory, tag)

    def close(self) -> None:
        return None


# Node i's look, as one shell command: run.json, node.json, whether the leader lives, then
# the log's bytes from the offset (tail -c +K starts at byte K, counted from 1).
_PEEK = (
    'D={dir}; cat "$D/{run}" 2>/dev/null; echo; cat "$D/{node}" 2>/dev/null; echo; '
    'p=$(sed -n \'s/.*"leader_pid": \\([0-9]*\\).*/\\1/p\' "$D/{run}" 2>/dev/null); '
    # alive: the process is there and not a zombie (an orphan's reaper may be slow to come)
    's=$([ -n "$p" ] && sed "s/.*) //" "/proc/$p/stat" 2>/dev/null | cut -c1); '
    'if [ -n "$s" ] && [ "$s" != Z ]; then echo alive; else echo dead; fi; '
    'tail -c +{start} "$D/{log}" 2>/dev/null; true'
)


class Remote:
    """Nodes on SSH hosts, reached with the pool's login options and the host keys the pool
    verified (pinned in the record)."""

    def __init__(self, reach: dict[str, Any], directories: Sequence[str]) -> None:
        import asyncssh

        from skyward.providers.remote.connect import ConnectOptions
        from skyward.transport.sshhost import Endpoint

        self.directories = list(directories)
        self.endpoints = [Endpoint(e["host"], e["port"], e["user"]) for e in reach["endpoints"]]
        self.options = ConnectOptions(
            known_hosts=asyncssh.import_known_hosts("\n".join(reach["known_hosts"]) + "\n"),
            key=reach.get("key"),
            config=tuple(reach.get("config", ())),
            timeout=float(reach.get("timeout", 10.0)),
            keepalive=5.0,
        )
        self._loop = asyncio.new_event_loop()
        self._hosts: dict[int, Any] = {}

    def _each(self, command_of: Any) -> list[Any]:
        async def one(index: int) -> Any:
            command = command_of(index)
            if command is None:
                return None
            try:
                host = self._hosts.get(index)
                if host is None or host.conn.is_closed():
                    host = await self.options.connect(self.endpoints[index])
                    self._hosts[index] = host
                running = host.conn.run(command, check=False, encoding=None)
                done = await asyncio.wait_for(running, PEEK_TIMEOUT)
                return done.stdout
            except Exception:
                host = self._hosts.pop(index, None)
                if host is not None:
                    host.conn.close()
                return None

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(i) for i in range(len(self.endpoints)))))

        return self._loop.run_until_complete(every())

    def peek(self, offsets: Sequence[int]) -> list[NodeView | None]:
        def command(index: int) -> str:
            return _PEEK.format(
                dir=shlex.quote(self.directories[index]),
                run=RUN_STATE,
                node=NODE_STATE,
                log=LOG,
                start=offsets[index] + 1,
            )

        return [None if out is None else _parse(out) for out in self._each(command)]

    def outputs(self) -> list[bytes | None]:
        def command(index: int) -> str:
            source = shlex.quote(f"{self.directories[index]}/{supervisor.OUTPUTS}")
            return (
                f"if [ -d {source} ]; then tar -C {source} -cf - .; else tar -cf - -T /dev/null; fi"
            )

        return [out if isinstance(out, bytes) else None for out in self._each(command)]

    def signal(self, pids: Sequence[tuple[int, int]], signum: int) -> None:
        by_node: dict[int, list[int]] = {}
        for node, pid in pids:
            by_node.setdefault(node, []).append(pid)

        def command(index: int) -> str | None:
            found = by_node.get(index)
            if not found:
                return None
            return (
                f"kill -{int(signum)} -- {' '.join(str(int(p)) for p in found)} 2>/dev/null; true"
            )

        self._each(command)

    def clean(self, key_tags: Sequence[str | None]) -> None:
        def command(index: int) -> str:
            spec = shlex.quote(f"{self.directories[index]}/{supervisor.SPEC}")
            tag = key_tags[index]
            if not tag:
                return f"rm -f {spec}"
            # sed's address: the lines ending in " <tag>" (the tag has no regex characters
            # but '.', which only widens the match to the same run's line)
            return (
                f"rm -f {spec}; f=$HOME/.ssh/authorized_keys; "
                f'[ -f "$f" ] && sed -i \'/ {tag}$/d\' "$f"; true'
            )

        self._each(command)

    def close(self) -> None:
        async def close_all() -> None:
            for host in self._hosts.values():
                host.conn.close()

        with contextlib.suppress(Exception):
            self._loop.run_until_complete(close_all())
        self._hosts.clear()
        self._loop.close()


def _parse(out: Any) -> NodeView:
    raw = out if isinstance(out, bytes) else str(out).encode()
    run, node, alive, data = ([*raw.split(b"\n", 3), b"", b"", b"", b""])[:4]
    view = NodeView(_json(node), _json(run), alive.strip() == b"alive", data)
    return view


def _json(raw: bytes) -> dict[str, Any]:
    import json

    try:
        value = json.loads(raw.decode(errors="replace") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Batch(Local):
    """A Slurm batch job whose directories this machine shares: the files are read here, the
    leader is alive while the job is queued, signals go through ``scancel``."""

    def __init__(self, job_id: str, directories: Sequence[str]) -> None:
        super().__init__(directories)
        self.job_id = job_id

    def peek(self, offsets: Sequence[int]) -> list[NodeView | None]:
        from skyward.detached.batch import job_state

        views = super().peek(offsets)
        if views[0] is not None:
            views[0].leader_alive = job_state(self.job_id) is not None
        return views

    def signal(self, pids: Sequence[tuple[int, int]], signum: int) -> None:
        import subprocess

        # SIGTERM: to the batch script (the leader) and every step (the followers), which stop
        # their ranks; SIGKILL: the job is cancelled.
        if signum == signal.SIGKILL:
            command = ["scancel", self.job_id]
        else:
            command = ["scancel", "--full", f"--signal={int(signum)}", self.job_id]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(command, capture_output=True, timeout=30)


def connect(kind: str, reach: dict[str, Any], directories: Sequence[str]) -> Reach:
    """The `Reach` for a record's `kind` and `reach` data."""
    if kind == "ssh":
        return Remote(reach, directories)
    if kind == "slurm":
        return Batch(str(reach["job_id"]), directories)
    return Local(directories)
