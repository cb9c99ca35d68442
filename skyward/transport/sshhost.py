"""The shared SSH layer: verified connections, and remote commands in killable groups.

Used by the SSH provider and by any provider whose nodes are reached over SSH (AWS). One
`SSHHost` is one asyncssh connection to one host, kept for the pool's life. Every remote command
starts under a wrapper that prints its pid first: OpenSSH runs each exec request in a new session
(setsid), so that pid is also the process group of everything the command starts, and
``kill -KILL -PID`` on the host removes all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from skyward.errors import ConfigError, ProvisionError

PID_MARKER = b"SKYWARD-PID "


def find_pid(preamble: bytes) -> tuple[int, bytes] | None:
    """The pid a command's ``PID_MARKER`` line tells, and what came after that line; None
    while the line is not whole yet. Anything before the marker (a login shell's rc files'
    output) is skipped."""
    start = preamble.find(PID_MARKER)
    end = preamble.find(b"\n", start) if start >= 0 else -1
    if end < 0:
        return None
    return int(preamble[start + len(PID_MARKER) : end].strip()), preamble[end + 1 :]


OUTPUT_TAIL_LINES = 40
_STREAM_LIMIT = 1 << 20
# user@host:port, user@[v6]:port, host, [v6]
_HOST = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]*)@)?"
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9._-]+))"
    r"(?::(?P<port>[0-9]{1,5}))?$"
)

KnownHosts = str | Path | Sequence[str] | asyncssh.SSHKnownHosts | None

# AES-GCM first: asyncssh's default, ChaCha20-Poly1305, sets up several cipher contexts per
# packet in Python, which made a small call's round trip measurably slower (bench_ssh.py) and
# caps bulk transfers; the others stay as fallbacks for servers without GCM (all are OpenSSH's
# defaults).
ENCRYPTION_ALGS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
    "aes192-ctr",
    "aes256-ctr",
)


class SSHConnectError(ProvisionError):
    """A host could not be reached or logged into; `host` names it."""

    def __init__(self, message: str, *, host: str) -> None:
        super().__init__(message)
        self.host = host


class SSHAuthError(SSHConnectError):
    """The host refused our user or key."""


class HostKeyError(SSHConnectError):
    """The host's key is unknown or differs from the recorded one; `fingerprint` is what it sent."""

    def __init__(self, message: str, *, host: str, fingerprint: str | None) -> None:
        super().__init__(message, host=host)
        self.fingerprint = fingerprint


class HostUnreachableError(SSHConnectError):
    """Nothing answered (refused, no route, or no SSH banner within the timeout)."""


@dataclass(frozen=True)
class Endpoint:
    """Where one host's sshd is: address, port and login user (None: config or local user)."""

    host: str
    port: int = 22
    user: str | None = None

    @classmethod
    def parse(cls, text: str, user: str | None = None, port: int = 22) -> Endpoint:
        """Parse ``host``, ``user@host``, ``host:port`` or ``user@[v6addr]:port``."""
        if not isinstance(text, str):
            raise ConfigError(f"an SSH host must be a string, got {text!r}")
        match = _HOST.match(text.strip())
        if not match:
            raise ConfigError(
                f"SSH host {text!r} is not of the form host, user@host or user@host:port"
            )
        number = int(match["port"]) if match["port"] else port
        if not 0 < number < 65536:
            raise ConfigError(f"SSH host {text!r}: port {number} is not in 1..65535")
        return cls(match["v6"] or match["host"], number, match["user"] or user)

    def __str__(self) -> str:
        where = f"[{self.host}]" if ":" in self.host else self.host
        who = f"{self.user}@" if self.user else ""
        return f"{who}{where}:{self.port}"


def load_known_hosts(known_hosts: KnownHosts) -> asyncssh.SSHKnownHosts | tuple[()]:
    """What asyncssh should verify host keys against; ``()`` is the user's own known_hosts.

    Accepts a path, a list of ``"host keytype base64"`` lines, or an asyncssh object. Never
    returns None: asyncssh would then accept any host key.
    """
    if known_hosts is None:
        return ()
    if isinstance(known_hosts, asyncssh.SSHKnownHosts):
        return known_hosts
    if isinstance(known_hosts, str | Path):
        path = Path(known_hosts).expanduser()
        if not path.is_file():
            raise ConfigError(f"known_hosts file {str(path)!r} does not exist")
        return asyncssh.read_known_hosts(str(path))
    if not isinstance(known_hosts, list | tuple) or not all(
        isinstance(line, str) for line in known_hosts
    ):
        raise ConfigError("known_hosts must be a path or a list of 'host keytype base64' lines")
    lines: list[str] = list(known_hosts)  # [] trusts no host key: every login is refused
    try:
        return asyncssh.import_known_hosts("".join(f"{line.strip()}\n" for line in lines))
    except (ValueError, asyncssh.KeyImportError) as exc:
        raise ConfigError(f"known_hosts lines could not be read: {exc}") from None


async def connect(
    endpoint: Endpoint,
    *,
    known_hosts: asyncssh.SSHKnownHosts | tuple[()],
    key: str | None = None,
    config: Sequence[str] | tuple[()] = (),
    timeout: float = 10.0,
    keepalive: float = 15.0,
) -> SSHHost:
    """Open one verified connection; raise a `SSHConnectError` naming the host on failure."""
    options: dict[str, Any] = {
        "known_hosts": known_hosts,
        "config": config,
        "connect_timeout": timeout,
        "keepalive_interval": keepalive,
        "keepalive_count_max": 3,
        "encryption_algs": ENCRYPTION_ALGS,
        # Never the user's agent, whatever an ssh_config says (``ForwardAgent yes``, maybe
        # from a profile in the current directory): a host's root could log in with it
        # wherever the user's keys open. Skyward needs no agent on its hosts.
        "agent_forwarding": False,
    }
    if endpoint.user:
        options["username"] = endpoint.user
    if key:
        options["client_keys"] = [key]
    label = str(endpoint)
    try:
        # asyncssh's own timeout covers TCP, key exchange and auth; ours is a backstop.
        conn = await asyncio.wait_for(
            asyncssh.connect(endpoint.host, endpoint.port, **options), timeout + 2
        )
    except asyncssh.HostKeyNotVerifiable:
        raise await _host_key_error(endpoint, known_hosts, timeout) from None
    except asyncssh.PermissionDenied as exc:
        raise SSHAuthError(
            f"SSH authentication to {label} failed ({exc.reason}): check the user and key "
            "(key=..., the SSH agent, or IdentityFile in ~/.ssh/config)",
            host=label,
        ) from None
    except TimeoutError:
        raise HostUnreachableError(
            f"SSH host {label} did not answer within {timeout:g} s: is it up and is sshd "
            "listening on that port?",
            host=label,
        ) from None
    except (OSError, asyncssh.Error) as exc:
        raise HostUnreachableError(
            f"cannot connect to SSH host {label}: {exc}", host=label
        ) from None
    return SSHHost(endpoint, conn)


async def _host_key_error(
    endpoint: Endpoint, known_hosts: asyncssh.SSHKnownHosts | tuple[()], timeout: float
) -> HostKeyError:
    """Describe a rejected host key with its fingerprint, and whether it is new or changed."""
    label = str(endpoint)
    fingerprint: str | None = None
    keytype = ""
    with contextlib.suppress(Exception):
        # A second, unauthenticated handshake only to show the user what the host presents.
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(endpoint.host, endpoint.port), timeout
        )
        if key is not None:
            fingerprint = key.get_fingerprint("sha256")
            keytype = key.get_algorithm()
    recorded = False
    with contextlib.suppress(Exception):
        table = known_hosts
        if table == ():
            path = Path("~/.ssh/known_hosts").expanduser()
            table = asyncssh.read_known_hosts(str(path)) if path.is_file() else ()
        if isinstance(table, asyncssh.SSHKnownHosts):
            port = None if endpoint.port == 22 else endpoint.port
            recorded = bool(table.match(endpoint.host, endpoint.host, port)[0])
    shown = f"{keytype} {fingerprint}" if fingerprint else "(its key could not be fetched)"
    if recorded:
        what = (
            f"the host key of {label} has CHANGED: it now presents {shown}, which does not match "
            "known_hosts. Someone may be intercepting the connection; if the host was really "
            "reinstalled, remove its old line (ssh-keygen -R) and add the new key"
        )
    else:
        what = (
            f"the host key of {label} is unknown: it presents {shown}, which is not in "
            "known_hosts. Verify it out of band, then add it to known_hosts (the known_hosts= "
            "argument or ~/.ssh/known_hosts)"
        )
    return HostKeyError(what, host=label, fingerprint=fingerprint)


@dataclass
class Completed:
    """A finished remote command: exit status, stdout, and the tail of stderr."""

    status: int | None
    stdout: bytes
    tail: str


class SSHHost:
    """One connection to one host and every process group started through it."""

    def __init__(self, endpoint: Endpoint, conn: asyncssh.SSHClientConnection) -> None:
        self.endpoint = endpoint
        self.conn = conn
        self.groups: set[int] = set()  # pids (= process groups) of commands still running
        self.closed = False
        self._kills: set[asyncio.Task[None]] = set()
        self._killing: dict[int, asyncio.Future[None]] = {}  # group -> its kill, once asked

    def __str__(self) -> str:
        return str(self.endpoint)

    @property
    def address(self) -> str:
        """The host's name or address, as the client reaches it."""
        return self.endpoint.host

    def wrap(self, command: str) -> str:
        """`command` behind the wrapper that prints its pid (its process group) first."""
        if self.closed:
            raise ProvisionError(f"the connection to {self} was closed")
        return f"echo {PID_MARKER.decode()}$$; {command}"

    def adopt(self, pid: int) -> None:
        """Count process group `pid` as this connection's (killed with it)."""
        self.groups.add(pid)
        if self.closed:  # terminated while the channel opened: take it down at once
            self.schedule_kill(pid)

    async def start(self, command: str) -> RemoteProcess:
        """Start `command` (a shell command line) in its own process group on the host."""
        process = await self.conn.create_process(self.wrap(command), encoding=None)
        try:
            pid = await asyncio.wait_for(_read_pid(process.stdout), 30)
        except BaseException:
            process.close()
            raise
        self.adopt(pid)
        return RemoteProcess(self, process, pid)

    async def run(
        self,
        command: str,
        input: bytes = b"",
        log: Callable[[str], None] | None = None,
    ) -> Completed:
        """Run `command` to completion; stderr lines go to `log`. Cancelled: its group is killed."""
        proc = await self.start(command)
        tail: list[str] = []
        try:
            # The command may exit without reading its input (e.g. it failed at once).
            with contextlib.suppress(OSError, asyncssh.Error):
                proc.process.stdin.write(input)
                proc.process.stdin.write_eof()

            async def pump() -> None:
                while line := await proc.process.stderr.readline():
                    text = line.decode(errors="replace").rstrip("\r\n")
                    tail[:] = [*tail[-(OUTPUT_TAIL_LINES - 1) :], text]
                    if log is not None:
                        log(text)

            out, _ = await asyncio.gather(proc.process.stdout.read(), pump())
            status = await proc.exit_status()
        except BaseException:
            await self.kill_groups([proc.pid])
            raise
        self.groups.discard(proc.pid)
        return Completed(status, out, "\n".join(tail))

    def schedule_kill(self, pid: int) -> None:
        """Kill a group from synchronous code; `kill_all` waits for what was scheduled."""
        task = asyncio.get_running_loop().create_task(self.kill_groups([pid]))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    def kill_at_close(self, pid: int) -> None:
        """Kill group `pid` in the one command of this connection's close (`kill_all`), or now
        when that close has begun: a pool's end then costs one channel and shell a host, not
        one for each agent and another for the rest (on the loop)."""
        if self.closed:
            self.schedule_kill(pid)
        else:
            self.groups.add(pid)

    def schedule_signal(self, pid: int, signum: int) -> None:
        """Send process `pid` on the host signal `signum` (best effort; on the loop)."""
        if self.closed:
            return
        command = f"kill -{int(signum)} {int(pid)} 2>/dev/null; true"
        task = asyncio.get_running_loop().create_task(self._quietly(command))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _quietly(self, command: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.run(command, check=False), 10)

    async def kill_groups(self, pids: Sequence[int], then: str = "") -> None:
        """``kill -KILL`` the process groups `pids` on the host (best effort, bounded), and run
        `then` (a shell command line, best effort) in the same command. A group whose kill is
        already on its way waits for that one: each kill is a channel and a shell on the host,
        and a pool's end asks for the same agent's several times (its stream, then the
        connection's close)."""
        pids = [pid for pid in pids if pid > 1]
        if not pids and not then:
            return
        fresh = [pid for pid in pids if pid not in self._killing]
        pending = {id(k): k for pid in pids if (k := self._killing.get(pid)) is not None}
        if fresh or then:
            mine = asyncio.ensure_future(self._kill(fresh, then))
            for pid in fresh:
                self._killing[pid] = mine
            pending[id(mine)] = mine
        # Shielded: a caller cancelled while it waits leaves the kill to finish for the others.
        await asyncio.gather(*(asyncio.shield(k) for k in pending.values()))
        self.groups.difference_update(pids)

    async def _kill(self, pids: Sequence[int], then: str = "") -> None:
        targets = " ".join(f"-{pid}" for pid in pids)
        # No `--` before the groups: dash (a login shell of /bin/sh) takes it for a pid.
        steps = [f"kill -KILL {targets} 2>/dev/null"] if pids else []
        command = "; ".join([*steps, *([then] if then else []), "true"])
        with contextlib.suppress(Exception):
            # Not through `start`: a kill must work even after close() began.
            await asyncio.wait_for(self.conn.run(command, check=False), 10)

    async def kill_all(self, last: str = "") -> None:
        """Kill every group this connection started, running `last` (a shell command line,
        best effort; once, on the first call) in the same command on the host, then wait for
        scheduled kills. One command: each is a channel and a shell on the host, which a pool's
        end pays for every host."""
        already, self.closed = self.closed, True
        await self.kill_groups(sorted(self.groups), "" if already else last)
        if self._kills:
            await asyncio.gather(*self._kills, return_exceptions=True)

    async def close(self, last: str = "") -> None:
        """Kill what we started, run `last` on the host (see `kill_all`) and close the
        connection; idempotent."""
        await self.kill_all(last)
        self.conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.wait_closed(), 5)


async def _read_pid(stdout: asyncssh.SSHReader[bytes]) -> int:
    # A login shell's rc files may print first; skip anything before the marker line.
    while True:
        line = await stdout.readline()
        if not line:
            raise ProvisionError("the remote command ended before reporting its pid")
        if line.startswith(PID_MARKER):
            return int(line[len(PID_MARKER) :].strip())


class RemoteProcess:
    """A command started on a host (see `SSHHost.run`); agents use `channels.ChannelStream`."""

    def __init__(self, host: SSHHost, process: asyncssh.SSHClientProcess[bytes], pid: int) -> None:
        self.host = host
        self.process = process
        self.pid = pid

    async def exit_status(self) -> int | None:
        try:
            await self.process.wait_closed()
        except Exception:
            return None
        return self.process.returncode  # negative: the signal that ended it (as a channel's)
