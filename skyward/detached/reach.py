"""How the client reaches a detached run's nodes: read their state and logs, bring their
outputs here, stop the run, and remove what the run left once it has ended.

`Local` reads this machine's files; a `Shell` runs one shell command per node: `Remote` over a
verified SSH connection (an SSH host), `Commands` through the provider's own way in (a pod's
exec stream: `Provider.detached_commands`). Each `peek` asks every node at once and returns,
per node, what its files say: node 0 also says whether its leader is alive. A node that cannot
be reached is `None` (`why` says why), never a failed run.

Logs and outputs of any size travel in bounded memory: a look reads at most `LOG_LIMIT` bytes
of each rank's log (the caller looks again while a node had more), and a node's outputs are
unpacked as their tar stream comes. A node counts as unreachable when it sends nothing for
`PROGRESS_TIMEOUT` seconds, never because a transfer is long.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shlex
import signal
import tarfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from skyward.errors import ConfigError, SkywardError
from skyward.providers.base import NodeCommands, NodeGone, Provider
from skyward.worker import supervisor
from skyward.worker.supervisor import LOG, NODE_STATE, RUN_STATE, read_json

# How long a node may send nothing, while it is asked something, before it counts as
# unreachable: a transfer of any length goes on as long as its bytes keep coming.
PROGRESS_TIMEOUT = 20.0
# The most of one rank's log a look reads: a look stays quick and its memory bounded on a
# slow link or a huge log; `Run.logs` looks again at once while a node had this much.
LOG_LIMIT = 4 << 20
# One read from a node's stream (outputs, logs).
_CHUNK = 1 << 20
_T = TypeVar("_T")


@dataclass
class NodeView:
    """What one node's files said at one look."""

    node: dict[str, Any]  # node.json: the follower's state
    run: dict[str, Any] = field(default_factory=dict)  # run.json (node 0 only)
    leader_alive: bool = False  # node 0 only
    data: bytes = b""  # the rank's log from the offset asked, at most LOG_LIMIT bytes

    @property
    def more(self) -> bool:
        """Whether the log may go on past what this look read (it read all it may)."""
        return len(self.data) >= LOG_LIMIT


class Reach(Protocol):
    """A run's nodes as the client reaches them."""

    def peek(self, offsets: Sequence[int]) -> list[NodeView | None]: ...
    def outputs(self, targets: Sequence[Path]) -> list[str | None]:
        """Unpack node i's output directory into ``targets[i]``; per node, ``None`` once
        it is all there, else why not."""
        ...

    def signal(self, pids: Sequence[tuple[int, int]], signum: int) -> None: ...
    def clean(self, key_tags: Sequence[str | None]) -> None: ...
    def why(self, node: int) -> str:
        """Why node `node` could not be reached at the last look ("" when it was)."""
        ...

    def gone(self, node: int) -> bool:
        """Whether node `node` will never be reached again (its pod gone: `NodeGone`)."""
        ...

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
                view.data = handle.read(LOG_LIMIT)
            views.append(view)
        return views

    def outputs(self, targets: Sequence[Path]) -> list[str | None]:
        failed: list[str | None] = []
        for directory, target in zip(self.directories, targets, strict=True):
            try:
                _copy_tree(directory / supervisor.OUTPUTS, target)
            except (OSError, tarfile.TarError) as exc:
                failed.append(f"{type(exc).__name__}: {exc}")
            else:
                failed.append(None)
        return failed

    def signal(self, pids: Sequence[tuple[int, int]], signum: int) -> None:
        for _, pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def clean(self, key_tags: Sequence[str | None]) -> None:
        for directory, tag in zip(self.directories, key_tags, strict=True):
            supervisor.finish_node(directory, tag)

    def why(self, node: int) -> str:
        return ""

    def gone(self, node: int) -> bool:
        return False

    def close(self) -> None:
        return None


# Node i's look, as one shell command: run.json, node.json, whether the leader lives, then
# at most LOG_LIMIT bytes of the log from the offset (tail -c +K starts at byte K, from 1).
_PEEK = (
    'D={dir}; cat "$D/{run}" 2>/dev/null; echo; cat "$D/{node}" 2>/dev/null; echo; '
    'p=$(sed -n \'s/.*"leader_pid": \\([0-9]*\\).*/\\1/p\' "$D/{run}" 2>/dev/null); '
    # alive: the process is there and not a zombie (an orphan's reaper may be slow to come)
    's=$([ -n "$p" ] && sed "s/.*) //" "/proc/$p/stat" 2>/dev/null | cut -c1); '
    'if [ -n "$s" ] && [ "$s" != Z ]; then echo alive; else echo dead; fi; '
    'tail -c +{start} "$D/{log}" 2>/dev/null | head -c {limit}; true'
)


# Remove the authorized_keys lines that end in " <tag>" (a run's node; the tag has no regex
# characters) as the supervisor does (`supervisor.remove_authorized`): under the same lock
# (flock(2) on the file, which flock(1) takes too) and in place, so that a symlinked file
# stays a symlink and a line another run appends meanwhile is kept.
_UNAUTHORIZE = (
    'f=$HOME/.ssh/authorized_keys; [ -f "$f" ] && flock "$f" sh -c \''
    'umask 077; t="$1.skyward.$$"; grep -v -- " {tag}$" "$1" > "$t"; '
    'cat "$t" > "$1"; rm -f "$t"\' _ "$f"; '
    "true"
)


class Shell:
    """Nodes reached with one shell command each (`_run`, which a subclass implements): the
    looks, transfers, signals and clean-up every such node gets, on one event loop of its own
    that each call runs to its end."""

    def __init__(self, directories: Sequence[str]) -> None:
        self.directories = list(directories)
        self._loop = asyncio.new_event_loop()
        self._why: dict[int, str] = {}
        self._gone: set[int] = set()

    async def _run(self, index: int, command: str, sink: Callable[[bytes], Awaitable[None]]) -> int:
        """Run `command` on node `index`, handing its output to `sink` as it comes; its exit
        status. `TimeoutError` when the node sends nothing for `PROGRESS_TIMEOUT` seconds."""
        raise NotImplementedError

    async def _drop(self, index: int) -> None:
        """Forget node `index`'s connection (a command failed): the next connects again."""

    async def _close_all(self) -> None:
        """Close every connection."""

    def _each(self, job: Callable[[int], Awaitable[_T]]) -> list[_T | Exception]:
        """`job` for every node at once; per node, what it returned or what it raised (that
        node's connection is then dropped: the next call connects again)."""

        async def one(index: int) -> _T | Exception:
            try:
                found = await job(index)
            except Exception as exc:
                self._why[index] = _why(exc)
                if isinstance(exc, NodeGone):
                    self._gone.add(index)
                with contextlib.suppress(Exception):
                    await self._drop(index)
                return exc
            self._why.pop(index, None)
            return found

        async def every() -> list[_T | Exception]:
            return list(await asyncio.gather(*(one(i) for i in range(len(self.directories)))))

        return self._loop.run_until_complete(every())

    def why(self, node: int) -> str:
        return self._why.get(node, "")

    def gone(self, node: int) -> bool:
        return node in self._gone

    async def _read(self, index: int, command: str) -> bytes:
        """`command`'s whole output (the caller's command bounds it)."""
        got = bytearray()

        async def keep(chunk: bytes) -> None:
            got.extend(chunk)

        await self._run(index, command, keep)
        return bytes(got)

    def peek(self, offsets: Sequence[int]) -> list[NodeView | None]:
        async def look(index: int) -> NodeView:
            command = _PEEK.format(
                dir=shlex.quote(self.directories[index]),
                run=RUN_STATE,
                node=NODE_STATE,
                log=LOG,
                start=offsets[index] + 1,
                limit=LOG_LIMIT,
            )
            return _parse(await self._read(index, command))

        return [view if isinstance(view, NodeView) else None for view in self._each(look)]

    def outputs(self, targets: Sequence[Path]) -> list[str | None]:
        # Each node's unpacking, and each write to it, take a thread of their own: a shared
        # pool that many unpackings filled would leave their writes waiting for ever.
        async def fetch(index: int) -> None:
            source = shlex.quote(f"{self.directories[index]}/{supervisor.OUTPUTS}")
            command = (
                f"if [ -d {source} ]; then tar -C {source} -cf - .; else tar -cf - -T /dev/null; fi"
            )
            loop = asyncio.get_running_loop()
            read_end, write_end = os.pipe()
            unpacking = loop.run_in_executor(threads, _unpack_from, read_end, targets[index])
            try:
                with open(write_end, "wb") as sink:

                    async def write(chunk: bytes) -> None:
                        await loop.run_in_executor(threads, sink.write, chunk)

                    status: int | None = await self._run(index, command, write)
            except BrokenPipeError:
                status = None  # the unpacking stopped reading: its own error says why
            except BaseException:
                with contextlib.suppress(Exception):
                    await unpacking  # it ends with the stream cut short: this error is why
                raise
            await unpacking
            # tar's 1: a file changed as it was read (a rank writing it mid-run); 2: fatal
            if status is None or status > 1:
                raise ConnectionError(f"tar on the node exited with status {status}")

        with ThreadPoolExecutor(max_workers=2 * len(self.directories)) as threads:
            fetched = self._each(fetch)
        return [None if done is None else _why(done) for done in fetched]

    def signal(self, pids: Sequence[tuple[int, int]], signum: int) -> None:
        by_node: dict[int, list[int]] = {}
        for node, pid in pids:
            by_node.setdefault(node, []).append(pid)

        async def send(index: int) -> None:
            found = by_node.get(index)
            if found:
                # No ``--``: dash (a pod's sh, Debian's) takes it for a pid and signals
                # nothing; after the signal, every shell reads ``-N`` as group N.
                listed = " ".join(str(int(p)) for p in found)
                await self._read(index, f"kill -{int(signum)} {listed} 2>/dev/null; true")

        self._each(send)

    def clean(self, key_tags: Sequence[str | None]) -> None:
        async def remove(index: int) -> None:
            spec = shlex.quote(f"{self.directories[index]}/{supervisor.SPEC}")
            tag = key_tags[index]
            if not tag:
                await self._read(index, f"rm -f {spec}")
                return
            await self._read(index, f"rm -f {spec}; {_UNAUTHORIZE.format(tag=tag)}")

        self._each(remove)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(self._close_all())
        self._loop.close()


class Remote(Shell):
    """Nodes on SSH hosts, reached with the pool's login options and the host keys the pool
    verified (pinned in the record)."""

    def __init__(
        self, reach: dict[str, Any], directories: Sequence[str], per_node: int = 1
    ) -> None:
        import asyncssh

        from skyward.providers.remote.connect import ConnectOptions
        from skyward.transport.sshhost import Endpoint

        super().__init__(directories)
        self.endpoints = [Endpoint(e["host"], e["port"], e["user"]) for e in reach["endpoints"]]
        self.options = ConnectOptions(
            known_hosts=asyncssh.import_known_hosts("\n".join(reach["known_hosts"]) + "\n"),
            key=reach.get("key"),
            config=tuple(reach.get("config", ())),
            timeout=float(reach.get("timeout", 10.0)),
            keepalive=5.0,
        )
        self.per_node = per_node  # the directories are the ranks', `per_node` to a host
        self._hosts: dict[int, Any] = {}  # a connection per rank: its looks run concurrently

    async def _run(self, index: int, command: str, sink: Callable[[bytes], Awaitable[None]]) -> int:
        """Run `command` on rank `index`'s node, handing its output to `sink` as it comes; its
        exit status. `TimeoutError` when the node sends nothing for `PROGRESS_TIMEOUT` s."""
        import asyncssh

        host = self._hosts.get(index)
        if host is None or host.conn.is_closed():
            host = await self.options.connect(self.endpoints[index // self.per_node])
            self._hosts[index] = host
        process = await asyncio.wait_for(
            host.conn.create_process(command, encoding=None, stdin=asyncssh.DEVNULL),
            PROGRESS_TIMEOUT,
        )
        try:
            while chunk := await asyncio.wait_for(process.stdout.read(_CHUNK), PROGRESS_TIMEOUT):
                await sink(chunk)
            done = await asyncio.wait_for(process.wait(), PROGRESS_TIMEOUT)
        finally:
            process.close()
        if done.exit_status is None:
            raise ConnectionError(f"the command ended without a status ({done.exit_signal})")
        return int(done.exit_status)

    async def _drop(self, index: int) -> None:
        host = self._hosts.pop(index, None)
        if host is not None:
            host.conn.close()

    async def _close_all(self) -> None:
        for host in self._hosts.values():
            host.conn.close()
        self._hosts.clear()


class Commands(Shell):
    """Nodes reached through their provider's own commands (`NodeCommands`: a pod's exec
    stream), made from what the run's record kept (`Provider.detached_commands`). A node that
    sends nothing for `PROGRESS_TIMEOUT` seconds while a command runs there is given up on,
    whatever the provider's transport does meanwhile."""

    def __init__(self, commands: NodeCommands, directories: Sequence[str]) -> None:
        super().__init__(directories)
        self.commands = commands

    async def _run(self, index: int, command: str, sink: Callable[[bytes], Awaitable[None]]) -> int:
        heard = time.monotonic()
        busy = False  # the sink is writing here: a slow disk is not a silent node

        async def take(chunk: bytes) -> None:
            nonlocal heard, busy
            heard, busy = time.monotonic(), True
            try:
                await sink(chunk)
            finally:
                heard, busy = time.monotonic(), False

        running = asyncio.ensure_future(self.commands.run(index, command, take))
        try:
            while True:
                done, _ = await asyncio.wait({running}, timeout=1.0)
                if done:
                    return running.result()
                if not busy and time.monotonic() - heard > PROGRESS_TIMEOUT:
                    raise TimeoutError(f"node {index} sent nothing for {PROGRESS_TIMEOUT:.0f} s")
        finally:
            if not running.done():
                running.cancel()
                with contextlib.suppress(BaseException):
                    await running

    async def _drop(self, index: int) -> None:
        await self.commands.drop(index)

    async def _close_all(self) -> None:
        await self.commands.close()


def _why(error: Exception) -> str:
    if isinstance(error, TimeoutError):
        return f"it sent nothing for {PROGRESS_TIMEOUT:.0f} s"
    if isinstance(error, SkywardError):
        return str(error)  # whole words already (a provider's: "pod ... has ended")
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _unpack_from(fd: int, target: Path) -> None:
    """The tar stream on file descriptor `fd` into `target` as it comes (closing `fd`): the
    ``data`` filter refuses any member that would land outside it (an absolute path, ``..``,
    a link out), as a node's listing is not trusted."""
    with open(fd, "rb") as stream:
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            archive.extractall(target, filter="data")


def _copy_tree(source: Path, target: Path) -> None:
    """`source`'s files into `target` through a tar stream on a pipe, with the same filter as
    a node's: a tree of any size in bounded memory."""
    read_end, write_end = os.pipe()
    failed: list[BaseException] = []

    def pack() -> None:
        try:
            with open(write_end, "wb") as sink, tarfile.open(fileobj=sink, mode="w|") as tar:
                if source.is_dir():
                    tar.add(source, arcname=".")
        except BrokenPipeError:
            pass  # the unpacking stopped reading: its own error says why
        except BaseException as exc:
            failed.append(exc)

    packing = threading.Thread(target=pack, name="skyward-outputs", daemon=True)
    packing.start()
    try:
        _unpack_from(read_end, target)
    except tarfile.TarError:
        packing.join()
        if failed:  # the stream ended early because packing failed: that is the reason
            raise failed[0] from None
        raise
    finally:
        packing.join()
    if failed:
        raise failed[0]


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


def connect(
    kind: str, reach: dict[str, Any], directories: Sequence[str], per_node: int = 1
) -> Reach:
    """The `Reach` for a record's `kind` and `reach` data; `directories` are the ranks',
    `per_node` to a node."""
    if kind == "ssh":
        return Remote(reach, directories, per_node)
    if kind == "slurm":
        return Batch(str(reach["job_id"]), directories)
    if kind == "tcp":
        provider = named_class(str(reach["provider"]), "its provider")
        if not (isinstance(provider, type) and issubclass(provider, Provider)):
            raise ConfigError(f"the run's record names {reach['provider']}, not a provider")
        return Commands(provider.detached_commands(dict(reach["data"])), directories)
    return Local(directories)


def named_class(name: str, what: str) -> Any:
    """The object a record names as ``module:qualname`` (a provider class, or the class that
    removes a kept pool); `ConfigError` saying so where this process cannot load it."""
    module, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"the run's record names {what} {name}, which cannot be loaded here ({exc}): "
            "install the extra it needs (pip install 'skyward[...]')"
        ) from None
    return found
