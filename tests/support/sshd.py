"""Real OpenSSH servers for skyward's tests.

Everything here is plain Python (no pytest) so fixtures, benchmarks and ad-hoc scripts
can share it. It needs root and a Debian-like machine:

* :func:`ensure_openssh_server` installs ``openssh-server`` (and ``iproute2``) with apt
  when ``/usr/sbin/sshd`` is missing, without leaving the system sshd service running.
* :class:`KeyPair` makes ed25519 key pairs with ``ssh-keygen``; :class:`SshUser` manages
  the dedicated unprivileged login user ``skyward-test`` (or root).
* :class:`SshdServer` runs ``/usr/sbin/sshd -D -e`` with its own config, host key and
  authorized keys in a private temp dir, on 127.0.0.1 (a free port) or inside a network
  namespace, and kills every process it spawned on :meth:`SshdServer.stop`.
* :class:`NetnsHosts` builds K network namespaces on a private bridge (default
  ``10.213.0.0/24``), each with its own sshd on port 22, and tears all of it down again;
  :func:`throttle` slows one host's link (a slow network) for the length of a block.

Traffic only ever goes to 127.0.0.1 and to the namespace addresses built here: the whole
``/16`` around the test subnet gets an ``unreachable`` route on the host first, so a
half-built setup can never send packets off the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Generic, Protocol, Self, TypeVar

__all__ = [
    "APT_PACKAGES",
    "DEFAULT_SUBNET",
    "NAME_PREFIX",
    "ROUTE_PROTO",
    "SSHD",
    "TEST_USER",
    "HostSet",
    "KeyPair",
    "NetnsHost",
    "NetnsHosts",
    "Process",
    "SshUser",
    "SshdServer",
    "ensure_openssh_server",
    "free_port",
    "is_root",
    "kill_processes_of",
    "known_hosts_line",
    "netns_unavailable_reason",
    "pid_alive",
    "processes_of",
    "remove_stale_resources",
    "ssh_command",
    "throttle",
]

SSHD = Path("/usr/sbin/sshd")
"""The OpenSSH server binary (it must be run by absolute path: sshd re-execs itself)."""

TEST_USER = "skyward-test"
"""Dedicated unprivileged login user for tests (so root's dotfiles never get involved)."""

APT_PACKAGES = ("openssh-server", "iproute2")
"""Debian packages :func:`ensure_openssh_server` installs."""

DEFAULT_SUBNET = "10.213.0.0/24"
"""Private subnet :class:`NetnsHosts` uses unless told otherwise."""

NAME_PREFIX = "skyt"
"""Prefix of every namespace, bridge and veth name made here."""

ROUTE_PROTO = "213"
"""Routing protocol id that tags the host routes made here (``ip route show proto 213``)."""

_WORKDIR_PREFIX = "skyward-sshd-"
_POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
_PRIVSEP_DIR = Path("/run/sshd")
_NETNS_DIR = Path("/run/netns")
_LOCK_DIR = Path(tempfile.gettempdir())


_live_subnets: set[str] = set()
_subnet_guard = threading.Lock()


def claim_subnet(subnet: str, timeout: float) -> contextlib.ExitStack:
    """Own ``subnet`` until the returned stack is closed: two live sets of hosts on one subnet
    would answer for each other. In this process a second claim is an error (close the first
    set, or pick another subnet); another process's claim (a second test run, a pytest-xdist
    worker) is waited for on a machine-wide file lock, up to ``timeout`` seconds."""
    with _subnet_guard:
        if subnet in _live_subnets:
            raise RuntimeError(
                f"subnet {subnet} is already used by a live set of test hosts in this process:"
                " close it first or pick another subnet (two sets on one subnet answer for each"
                " other)"
            )
        _live_subnets.add(subnet)
    stack = contextlib.ExitStack()
    stack.callback(lambda: _live_subnets.discard(subnet))
    try:
        path = _LOCK_DIR / f"skyward-test-subnet-{subnet.replace('/', '_')}.lock"
        fh = stack.enter_context(path.open("a"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"subnet {subnet} stayed in use by another process for {timeout:.0f}s"
                    ) from None
                time.sleep(0.2)
        stack.callback(fcntl.flock, fh, fcntl.LOCK_UN)
    except BaseException:
        stack.close()
        raise
    return stack


_apt_updated = False


# --------------------------------------------------------------------------- helpers


def is_root() -> bool:
    """Return True when running as uid 0 (everything here except key generation needs it)."""
    return os.geteuid() == 0


def _ip() -> str:
    path = shutil.which("ip") or ("/usr/sbin/ip" if Path("/usr/sbin/ip").exists() else None)
    if path is None:
        raise RuntimeError("`ip` (iproute2) is not installed; run ensure_openssh_server() as root")
    return path


def _run(
    args: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing output; on failure raise with its stderr in the message."""
    proc = subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"command failed with exit code {proc.returncode}: {' '.join(args)}\n"
            f"stdout: {proc.stdout.strip()[-2000:]}\nstderr: {proc.stderr.strip()[-2000:]}"
        )
    return proc


@contextlib.contextmanager
def _file_lock(name: str) -> Iterator[None]:
    """Serialize a critical section across processes (e.g. pytest-xdist workers)."""
    path = _LOCK_DIR / f"skyward-test-{name}.lock"
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago (nothing listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


HOST_CACHE_ENV = "SKYWARD_TEST_HOST_CACHE"
"""Set (by the test suite) to a directory: root's sessions on every sshd started here get it as
their ``SKYWARD_CACHE_DIR``, so hosts that share this machine's filesystem keep what skyward
builds in the suite's own directory, never in root's ~/.cache/skyward of earlier runs."""


def _root_cache_lines(extra_config: Sequence[str]) -> list[str]:
    """The config lines that give root's sessions the suite's host cache (last: a Match block
    ends the file), unless the server sets its own cache directory. A SetEnv in a Match block
    replaces the server's own SetEnv list for those sessions: it repeats that list."""
    cache = os.environ.get(HOST_CACHE_ENV)
    if not cache or any("SKYWARD_CACHE_DIR" in line for line in extra_config):
        return []
    own = [line.split(None, 1)[1] for line in extra_config if line.startswith("SetEnv ")]
    return ["Match User root", "    SetEnv " + " ".join([*own, f"SKYWARD_CACHE_DIR={cache}"])]


def _wait_for_ssh_banner(host: str, port: int, deadline: float) -> bool:
    """Try once to read an ``SSH-`` banner from host:port before ``deadline``."""
    timeout = max(0.05, min(1.0, deadline - time.monotonic()))
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(8).startswith(b"SSH-")
    except OSError:
        return False


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class Process:
    """One process seen by :func:`processes_of`: its pid and command line."""

    pid: int
    args: str


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """Return (ppid, start time in ticks) of ``pid``, or None when it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data.rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); ppid is field 4, starttime field 22.
    return int(fields[1]), int(fields[19])


def _descendants(root_pid: int) -> dict[int, int]:
    """Return {pid: start time} of every live descendant of ``root_pid`` (not itself)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is None:
            continue
        children.setdefault(stat[0], []).append(int(entry.name))
        starts[int(entry.name)] = stat[1]
    found: dict[int, int] = {}
    todo = list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found[pid] = starts[pid]
        todo.extend(children.get(pid, []))
    return found


def _signal_if_same(pid: int, start: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid`` if it is still the process that started at ``start``."""
    stat = _proc_stat(pid)
    if stat is None or stat[1] != start:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
        return True
    return False


def _terminate(procs: dict[int, int], grace: float = 2.0) -> None:
    """SIGTERM ``{pid: start}``, wait up to ``grace`` seconds, then SIGKILL survivors."""
    for pid, start in procs.items():
        _signal_if_same(pid, start, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = dict(procs)
    while alive and time.monotonic() < deadline:
        alive = {p: s for p, s in alive.items() if _alive_same(p, s)}
        if alive:
            time.sleep(0.02)
    for pid, start in alive.items():
        _signal_if_same(pid, start, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    """Return True when ``pid`` exists and is not a zombie.

    Killed processes whose parent died linger as zombies until init reaps them, so the
    existence of ``/proc/<pid>`` alone does not mean a process is still running.
    """
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _alive_same(pid: int, start: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[1] == start and pid_alive(pid)


def _netns_inode(netns: str) -> int:
    return os.stat(_NETNS_DIR / netns).st_ino


def _pid_in_netns(pid: int, inode: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == inode
    except OSError:
        return False


def processes_of(user: str, netns: str | None = None) -> list[Process]:
    """List processes owned by ``user`` (``ps -u user -o pid,args``).

    Network namespaces share the PID namespace, so without ``netns`` this sees the user's
    processes everywhere; with ``netns`` it keeps only those inside that namespace.
    Zombies are left out.
    """
    proc = _run(["ps", "-u", user, "-o", "pid=,stat=,args="], check=False)
    if proc.returncode not in (0, 1):  # 1: no process matched (or unknown user)
        raise RuntimeError(f"ps failed: {proc.stderr.strip()}")
    result = []
    for line in proc.stdout.splitlines():
        parts = line.split(None, 2)
        # Zombies are dead already; init may take a while to reap orphaned ones.
        if len(parts) >= 2 and parts[0].isdigit() and not parts[1].startswith("Z"):
            result.append(Process(int(parts[0]), parts[2] if len(parts) > 2 else ""))
    if netns is not None:
        inode = _netns_inode(netns)
        result = [p for p in result if _pid_in_netns(p.pid, inode)]
    return result


def kill_processes_of(user: str, netns: str | None = None, grace: float = 2.0) -> int:
    """Terminate the processes of ``user`` (optionally only inside ``netns``); return count.

    Meant for cleaning up after the dedicated :data:`TEST_USER`; refuses to touch root.
    """
    if user == "root":
        raise ValueError("refusing to kill every process of root")
    procs: dict[int, int] = {}
    for p in processes_of(user, netns):
        stat = _proc_stat(p.pid)
        if stat is not None:
            procs[p.pid] = stat[1]
    _terminate(procs, grace)
    return len(procs)


# --------------------------------------------------------------------------- install


def _sshd_pids() -> dict[int, str]:
    """Return {pid: cmdline} of every running process whose binary is /usr/sbin/sshd."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            exe = os.readlink(entry / "exe")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if exe.removesuffix(" (deleted)") == str(SSHD):
            found[int(entry.name)] = cmdline.strip()
    return found


def _stop_system_sshd(before: dict[int, int]) -> None:
    """Stop any sshd that the package install started (the system service, not ours)."""
    strays: dict[int, int] = {}
    for pid, cmdline in _sshd_pids().items():
        if pid in before or _WORKDIR_PREFIX in cmdline:
            continue
        stat = _proc_stat(pid)
        if stat is not None:
            strays[pid] = stat[1]
    if strays and Path("/etc/init.d/ssh").exists():
        _run(["/etc/init.d/ssh", "stop"], check=False)
    _terminate(strays)
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        _run(["systemctl", "disable", "--now", "ssh.service", "ssh.socket"], check=False)


def ensure_openssh_server() -> Path:
    """Make sure ``/usr/sbin/sshd`` (and ``ip``) exist, installing them with apt if needed.

    Installs :data:`APT_PACKAGES` non-interactively as root (``apt-get update`` at most once
    per process). Service start-up is blocked with a temporary ``policy-rc.d`` and any sshd
    the install still started is stopped. Returns the sshd path; raises ``RuntimeError``
    when sshd is missing and cannot be installed.
    """
    global _apt_updated
    if SSHD.exists() and shutil.which("ip"):
        return SSHD
    if not is_root():
        raise RuntimeError(
            f"{SSHD} is missing and we are not root: install it with "
            f"`apt-get install -y --no-install-recommends {' '.join(APT_PACKAGES)}`"
        )
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"{SSHD} is missing and there is no apt-get to install it with")
    with _file_lock("apt"):
        if SSHD.exists() and shutil.which("ip"):
            return SSHD
        before = {pid: 0 for pid in _sshd_pids()}
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_MODE": "l"}
        made_policy = False
        if not _POLICY_RC_D.exists():
            _POLICY_RC_D.write_text("#!/bin/sh\n# skyward tests: never start services\nexit 101\n")
            _POLICY_RC_D.chmod(0o755)
            made_policy = True
        try:
            if not _apt_updated:
                _run(["apt-get", "update"], env=env, timeout=600)
                _apt_updated = True
            _run(
                [
                    "apt-get",
                    "install",
                    "-y",
                    "--no-install-recommends",
                    "-o",
                    "Dpkg::Options::=--force-confdef",
                    "-o",
                    "Dpkg::Options::=--force-confold",
                    *APT_PACKAGES,
                ],
                env=env,
                timeout=900,
            )
        finally:
            if made_policy:
                _POLICY_RC_D.unlink(missing_ok=True)
            _stop_system_sshd(before)
    if not SSHD.exists():
        raise RuntimeError(f"installed {' '.join(APT_PACKAGES)} but {SSHD} is still missing")
    return SSHD


def netns_unavailable_reason() -> str | None:
    """Return why network namespaces cannot be used here, or None when they can.

    Checks for root and ``ip``, then creates and deletes a probe namespace.
    """
    if not is_root():
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"{NAME_PREFIX}-probe-{os.getpid()}"
    made = _run([_ip(), "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _run([_ip(), "netns", "del", probe], check=False)
    return None


# --------------------------------------------------------------------------- keys and users


@dataclass(frozen=True)
class KeyPair:
    """An OpenSSH key pair on disk: private key (mode 0600), ``.pub`` file and its text."""

    private_path: Path
    public_path: Path
    public_line: str
    """The public key line, e.g. ``ssh-ed25519 AAAA... comment``."""

    @classmethod
    def generate(
        cls, directory: Path | str, name: str = "id_ed25519", comment: str = "skyward-test"
    ) -> KeyPair:
        """Create a new ed25519 key pair ``directory/name`` (+ ``.pub``) with ssh-keygen."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        private = directory / name
        public = directory / f"{name}.pub"
        private.unlink(missing_ok=True)
        public.unlink(missing_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(private)])
        private.chmod(0o600)
        return cls(private, public, public.read_text().strip())

    @property
    def key_type(self) -> str:
        """The key algorithm, e.g. ``ssh-ed25519``."""
        return self.public_line.split()[0]

    @property
    def key_base64(self) -> str:
        """The base64 key blob (``AAAA...``)."""
        return self.public_line.split()[1]


def known_hosts_line(host: str, port: int, public_line: str) -> str:
    """Return a known_hosts line: ``[host]:port type AAAA...`` (``host type AAAA...`` on 22)."""
    key_type, blob = public_line.split()[:2]
    pattern = host if port == 22 else f"[{host}]:{port}"
    return f"{pattern} {key_type} {blob}"


def _read_shadow_password(user: str) -> str | None:
    try:
        for line in Path("/etc/shadow").read_text().splitlines():
            parts = line.split(":")
            if parts[0] == user and len(parts) > 1:
                return parts[1]
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class SshUser:
    """A login account for tests: name, home, uid and gid."""

    name: str
    home: Path
    uid: int
    gid: int

    @classmethod
    def ensure(cls, name: str = TEST_USER) -> SshUser:
        """Return the account ``name``, creating it (``useradd -m -s /bin/bash``) if missing.

        The password field is set to ``*`` (no password login) rather than useradd's ``!``,
        because sshd with ``UsePAM no`` refuses even key logins to ``!``-locked accounts.
        """
        with _file_lock("useradd"):
            try:
                pwd.getpwnam(name)
            except KeyError:
                if not is_root():
                    raise RuntimeError(f"user {name!r} is missing and we are not root") from None
                _run(["useradd", "-m", "-s", "/bin/bash", "-p", "*", "-c", "skyward tests", name])
            password = _read_shadow_password(name)
            if password is not None and password.startswith("!") and is_root():
                _run(["usermod", "-p", "*", name])
        entry = pwd.getpwnam(name)
        return cls(name, Path(entry.pw_dir), entry.pw_uid, entry.pw_gid)

    @classmethod
    def root(cls) -> SshUser:
        """Return the root account (log in with a server-level key, see :class:`SshdServer`)."""
        entry = pwd.getpwuid(0)
        return cls(entry.pw_name, Path(entry.pw_dir), 0, entry.pw_gid)

    @property
    def authorized_keys_path(self) -> Path:
        """``~/.ssh/authorized_keys`` of this user."""
        return self.home / ".ssh" / "authorized_keys"

    def authorize(self, key: KeyPair | str) -> None:
        """Append a public key to ``~/.ssh/authorized_keys`` (0700 dir, 0600 file, owned)."""
        line = key.public_line if isinstance(key, KeyPair) else key.strip()
        ssh_dir = self.authorized_keys_path.parent
        with _file_lock(f"authkeys-{self.name}"):
            ssh_dir.mkdir(mode=0o700, exist_ok=True)
            os.chown(ssh_dir, self.uid, self.gid)
            ssh_dir.chmod(0o700)
            path = self.authorized_keys_path
            lines = path.read_text().splitlines() if path.exists() else []
            if line not in lines:
                lines.append(line)
            path.write_text("".join(f"{entry}\n" for entry in lines))
            os.chown(path, self.uid, self.gid)
            path.chmod(0o600)

    def revoke(self, key: KeyPair | str) -> None:
        """Remove a public key from ``~/.ssh/authorized_keys`` (no-op when absent)."""
        line = key.public_line if isinstance(key, KeyPair) else key.strip()
        path = self.authorized_keys_path
        with _file_lock(f"authkeys-{self.name}"):
            if not path.exists():
                return
            lines = [entry for entry in path.read_text().splitlines() if entry != line]
            path.write_text("".join(f"{entry}\n" for entry in lines))

    def processes(self, netns: str | None = None) -> list[Process]:
        """Return the processes of this user (see :func:`processes_of`)."""
        return processes_of(self.name, netns)


def ssh_command(
    host: str,
    port: int,
    user: str,
    key: KeyPair,
    known_hosts: Path | str,
    *command: str,
    connect_timeout: float = 5.0,
) -> list[str]:
    """Build an ``ssh`` argv that ignores all user/system config and checks the host key."""
    return [
        "ssh",
        "-F",
        "/dev/null",
        "-i",
        str(key.private_path),
        "-p",
        str(port),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"ConnectTimeout={max(1, round(connect_timeout))}",
        "-o",
        "LogLevel=ERROR",
        f"{user}@{host}",
        *command,
    ]


# --------------------------------------------------------------------------- sshd


class SshdServer:
    """One ``sshd -D -e`` with its own config, host key, authorized keys and log.

    Everything lives in a private temp dir (``workdir``). Start with :meth:`start` (or use
    it as a context manager), stop with :meth:`stop` (restartable) or :meth:`close` (also
    removes the temp dir). Any user may log in with a key listed in ``authorized_keys``
    (a server-level ``AuthorizedKeysFile``, so root's home is never touched) or with a key
    in the user's own ``~/.ssh/authorized_keys``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        netns: str | None = None,
        authorized_keys: Sequence[KeyPair | str] = (),
        host_key: KeyPair | None = None,
        extra_config: Sequence[str] = (),
        start_timeout: float = 30.0,
    ) -> None:
        """Prepare (not start) a server on ``host:port``.

        ``port`` defaults to a free port, or 22 inside a network namespace ``netns`` (then
        sshd runs under ``ip netns exec netns``). ``host_key`` defaults to a new ed25519
        key; ``extra_config`` lines are appended to the generated sshd_config.
        """
        self.host = host
        self.netns = netns
        if port is None:
            port = 22 if netns is not None else free_port(host)
        self.port = port
        self.extra_config = list(extra_config)
        # False: sshd reads only the server-level keys file, not ~/.ssh/authorized_keys (as
        # where logins are managed centrally); takes effect at the next (re)start.
        self.user_keys = True
        self.start_timeout = start_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
        # sshd reads authorized keys files with the user's uid: let them traverse the dir.
        self.workdir.chmod(0o711)
        self.host_key = host_key or KeyPair.generate(
            self.workdir, "ssh_host_ed25519_key", comment=f"skyward-test-host@{host}"
        )
        self.authorized_keys_file = self.workdir / "authorized_keys"
        self.set_authorized_keys(authorized_keys)
        self.config_path = self.workdir / "sshd_config"
        self.pid_path = self.workdir / "sshd.pid"
        self.log_path = self.workdir / "sshd.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False

    # -- configuration

    def set_authorized_keys(self, keys: Sequence[KeyPair | str]) -> None:
        """Replace the server-level authorized keys (effective for the next login)."""
        lines = [k.public_line if isinstance(k, KeyPair) else k.strip() for k in keys]
        self.authorized_keys_file.write_text("".join(f"{line}\n" for line in lines))
        self.authorized_keys_file.chmod(0o644)

    def generate_host_key(self, name: str = "other_host_key") -> KeyPair:
        """Make another ed25519 key (e.g. for "changed host key" tests; see :meth:`restart`)."""
        return KeyPair.generate(self.workdir, name, comment=f"skyward-test-host@{self.host}")

    def _config_text(self) -> str:
        lines = [
            f"ListenAddress {self.host}:{self.port}",
            "AddressFamily inet",
            f"HostKey {self.host_key.private_path}",
            f"PidFile {self.pid_path}",
            f"AuthorizedKeysFile {'.ssh/authorized_keys ' if self.user_keys else ''}"
            f"{self.authorized_keys_file}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "MaxStartups 100",
            "MaxSessions 100",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "LogLevel INFO",
            "Subsystem sftp internal-sftp",
            *self.extra_config,
            *_root_cache_lines(self.extra_config),
        ]
        return "".join(f"{line}\n" for line in lines)

    # -- lifecycle

    @property
    def pid(self) -> int | None:
        """PID of the listening sshd, or None when not running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the listening sshd process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Start sshd and wait (bounded) until it answers with an SSH banner."""
        if self._closed:
            raise RuntimeError("this SshdServer was closed")
        if self.running:
            return self
        ensure_openssh_server()
        _PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        self.config_path.write_text(self._config_text())
        self.config_path.chmod(0o600)
        argv = [str(SSHD), "-D", "-e", "-f", str(self.config_path)]
        if self.netns is not None:
            argv = [_ip(), "netns", "exec", self.netns, *argv]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(
                    f"sshd for {self.host}:{self.port} exited with code {code} on start-up;"
                    f" log tail:\n{self.log_tail()}"
                )
            if _wait_for_ssh_banner(self.host, self.port, deadline):
                return self
            if time.monotonic() >= deadline:
                seen = self._start_diagnostics()
                self.stop()
                raise RuntimeError(
                    f"sshd for {self.host}:{self.port} did not answer within"
                    f" {self.start_timeout:.1f}s; {seen}; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _start_diagnostics(self) -> str:
        """What the machine looked like when sshd did not answer in time: whether sshd had
        accepted connections (children below it: a slow machine), and the route and neighbour
        entry towards it (none reached it: a network fault), with the load."""
        assert self._proc is not None
        facts = [f"sshd children: {len(_descendants(self._proc.pid))}"]
        with contextlib.suppress(OSError):
            facts.append("load " + " ".join(Path("/proc/loadavg").read_text().split()[:3]))
        if self.netns is not None:
            ip = _ip()
            for argv in (
                [ip, "route", "get", self.host],
                [ip, "neigh", "show", self.host],
                [ip, "-n", self.netns, "-br", "addr"],
                [ip, "-n", self.netns, "-br", "link"],
            ):
                out = _run(argv, check=False)
                facts.append(f"`{' '.join(argv[1:])}`: {(out.stdout + out.stderr).strip()}")
        return "; ".join(facts)

    def session_processes(self) -> dict[int, int]:
        """Return {pid: start time} of every process below the listening sshd."""
        if self._proc is None:
            return {}
        return _descendants(self._proc.pid)

    def stop(self, grace: float = 2.0) -> None:
        """Kill sshd, its per-connection children and their session processes.

        sshd calls setsid() for each connection, so killing its process group is not
        enough: the whole process tree is collected first and terminated too.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # Collect the tree while the listener is alive and unreaped (its pid cannot be
        # reused yet, and its children have not been reparented to init).
        procs = _descendants(proc.pid)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        _terminate(procs, grace)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def restart(self, host_key: KeyPair | None = None) -> Self:
        """Stop and start again on the same address, optionally with a new host key."""
        self.stop()
        if host_key is not None:
            self.host_key = host_key
        return self.start()

    def close(self) -> None:
        """Stop sshd and delete the temp dir (keys, config, log). Idempotent."""
        self.stop()
        self._closed = True
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        """Start the server (see :meth:`start`)."""
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the server (see :meth:`close`)."""
        self.close()

    # -- client-side helpers

    @property
    def host_public_key(self) -> str:
        """The host public key line (``ssh-ed25519 AAAA... comment``)."""
        return self.host_key.public_line

    def known_hosts_line(self, public_line: str | None = None) -> str:
        """known_hosts line for this server (optionally for a different key)."""
        return known_hosts_line(self.host, self.port, public_line or self.host_public_key)

    def write_known_hosts(self, path: Path | str) -> Path:
        """Write a known_hosts file holding just this server's line; return its path."""
        path = Path(path)
        path.write_text(self.known_hosts_line() + "\n")
        return path

    def ssh_command(
        self, user: str, key: KeyPair, known_hosts: Path | str, *command: str
    ) -> list[str]:
        """``ssh`` argv for this server (see the module-level :func:`ssh_command`)."""
        return ssh_command(self.host, self.port, user, key, known_hosts, *command)

    def log_tail(self, lines: int = 30) -> str:
        """Return the last ``lines`` lines sshd wrote to its log (stderr)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no sshd log>"
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        """Readable summary for test output."""
        where = f" netns={self.netns}" if self.netns else ""
        return f"SshdServer({self.host}:{self.port}{where}, running={self.running})"


# --------------------------------------------------------------------------- namespaces


@dataclass
class NetnsHost:
    """One namespace of :class:`NetnsHosts`: its name, address, host-side veth and sshd."""

    netns: str
    address: str
    veth: str
    server: SshdServer | None = None

    @property
    def port(self) -> int:
        """Port of this host's sshd (22)."""
        return self.server.port if self.server is not None else 22

    def run(
        self, *args: str, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the namespace (``ip netns exec``), capturing text output."""
        return _run([_ip(), "netns", "exec", self.netns, *args], check=check, timeout=timeout)

    def pids(self) -> list[int]:
        """PIDs of every process inside this namespace (``ip netns pids``)."""
        out = _run([_ip(), "netns", "pids", self.netns], check=False).stdout
        return [int(tok) for tok in out.split() if tok.isdigit()]

    def processes_of(self, user: str) -> list[Process]:
        """Return the processes of ``user`` running inside this namespace."""
        return processes_of(user, self.netns)

    def known_hosts_line(self) -> str:
        """known_hosts line for this host's sshd."""
        if self.server is None:
            raise RuntimeError(f"{self.netns} runs no sshd")
        return self.server.known_hosts_line()


@contextlib.contextmanager
def throttle(
    host: NetnsHost, mbit: float, *, to_host: bool = True, from_host: bool = True
) -> Iterator[None]:
    """Limit ``host``'s link to ``mbit`` megabits a second while the block runs (a slow network
    between the client and the host); the limit is removed on exit, even if the body raised.

    ``to_host`` shapes what the client sends the host (the host-side veth's egress, on the
    bridge), ``from_host`` what the host sends back (``eth0``'s egress, inside the namespace);
    each direction gets its own ``tbf`` qdisc (``netem`` is missing from some kernels; ``tbf``
    is in every one). The other direction is left as it is when one of them is False.
    """
    if not (to_host or from_host):
        raise ValueError("throttle nothing? set to_host, from_host or both")
    rate = int(mbit * 1_000_000)
    # The bucket must hold a whole (GSO-sized, up to 64 KiB) packet and what the rate earns in
    # a timer tick; 50 ms of queue keeps TCP's window open without hiding the limit.
    burst = max(1 << 17, rate // 8 // 100)
    shape = ["root", "tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "50ms"]
    tc = shutil.which("tc") or "/usr/sbin/tc"
    places: list[tuple[list[str], str]] = []  # (how to run tc there, the device)
    if to_host:
        places.append(([tc], host.veth))
    if from_host:
        places.append(([_ip(), "netns", "exec", host.netns, tc], "eth0"))
    shaped: list[tuple[list[str], str]] = []
    try:
        for command, device in places:
            _run([*command, "qdisc", "add", "dev", device, *shape])
            shaped.append((command, device))
        yield
    finally:
        for command, device in shaped:
            _run([*command, "qdisc", "del", "dev", device, "root"], check=False)


class _Host(Protocol):
    address: str

    def known_hosts_line(self) -> str: ...


H = TypeVar("H", bound=_Host)


class HostSet(Generic[H]):
    """A set of test hosts as a sequence (`hosts`, in order), with their addresses and the
    known_hosts lines a client needs. `NetnsHosts` and `bareroots.BareHosts` are ones."""

    hosts: list[H]

    def __iter__(self) -> Iterator[H]:
        """Iterate over the hosts."""
        return iter(self.hosts)

    def __len__(self) -> int:
        """Return the number of hosts."""
        return len(self.hosts)

    def __getitem__(self, index: int) -> H:
        """Return the ``index``-th host."""
        return self.hosts[index]

    @property
    def addresses(self) -> list[str]:
        """Addresses of all hosts, in order."""
        return [h.address for h in self.hosts]

    def known_hosts_lines(self) -> list[str]:
        """known_hosts lines of every host's sshd."""
        return [h.known_hosts_line() for h in self.hosts]

    def write_known_hosts(self, path: Path | str) -> Path:
        """Write a known_hosts file with every host's line; return its path."""
        path = Path(path)
        path.write_text("".join(f"{line}\n" for line in self.known_hosts_lines()))
        return path


def _link_exists(name: str, netns: str | None = None) -> bool:
    prefix = [_ip(), "-n", netns] if netns else [_ip()]
    return _run([*prefix, "link", "show", "dev", name], check=False).returncode == 0


def _netns_names() -> list[str]:
    out = _run([_ip(), "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_processes(netns: str) -> None:
    out = _run([_ip(), "netns", "pids", netns], check=False).stdout
    procs: dict[int, int] = {}
    for tok in out.split():
        if tok.isdigit():
            stat = _proc_stat(int(tok))
            if stat is not None:
                procs[int(tok)] = stat[1]
    _terminate(procs)


def _delete_netns(netns: str) -> None:
    if netns in _netns_names():
        _kill_netns_processes(netns)
        _run([_ip(), "netns", "del", netns], check=False)


class NetnsHosts(HostSet[NetnsHost]):
    """K network namespaces on a private bridge, each running sshd on port 22.

    Layout for run id ``ID`` (random 6 hex chars unless given) and subnet 10.213.0.0/24:
    bridge ``skytbr-ID`` holds 10.213.0.1/24; namespace ``skyt-ID-i`` (i = 0..K-1) has
    ``eth0`` = 10.213.0.(11+i)/24 and ``lo`` up, linked by veth ``skytIDh<i>`` on the
    bridge. The host gets ``unreachable`` routes for the surrounding /16 (added first)
    and for :attr:`unreachable_address`. Namespaces have no default route.

    Use as a context manager; everything (processes, veths, namespaces, bridge, routes)
    is removed on exit or when set-up fails, and leftovers with the same names from a
    crashed run are removed before building.
    """

    HOST_OFFSET = 11
    UNREACHABLE_OFFSET = 254

    def __init__(
        self,
        count: int = 2,
        *,
        subnet: str = DEFAULT_SUBNET,
        run_id: str | None = None,
        authorized_keys: Sequence[KeyPair | str] = (),
        start_sshd: bool = True,
        sshd_extra_config: Sequence[str] = (),
        sshd_timeout: float = 30.0,
        sshd_host_config: Sequence[Sequence[str]] = (),
        subnet_wait: float = 600.0,
    ) -> None:
        """Describe (not build) ``count`` hosts; ``authorized_keys`` go to every sshd.

        ``build`` waits up to ``subnet_wait`` seconds while another process's hosts use the
        subnet (`claim_subnet`).

        ``sshd_host_config[i]``, when given, adds config lines to host i's sshd only (after
        ``sshd_extra_config``), e.g. ``SetEnv`` for an environment variable of its own.
        """
        network = ipaddress.IPv4Network(subnet)
        if network.prefixlen < 17 or network.prefixlen > 24:
            raise ValueError("subnet must be between a /17 and a /24")
        if not 0 <= count <= self.UNREACHABLE_OFFSET - self.HOST_OFFSET - 1:
            raise ValueError(f"count must be between 0 and {self.UNREACHABLE_OFFSET - 12}")
        self.run_id = run_id or secrets.token_hex(3)
        if not (self.run_id.isalnum() and len(self.run_id) <= 6):
            raise ValueError("run_id must be at most 6 alphanumeric characters")
        self.count = count
        self.subnet = network
        self.guard_network = network.supernet(new_prefix=16)
        self.bridge = f"{NAME_PREFIX}br-{self.run_id}"
        self.bridge_address = str(network.network_address + 1)
        self.unreachable_address = str(network.network_address + self.UNREACHABLE_OFFSET)
        """An address on the test subnet with no host: connecting fails at once."""
        self.authorized_keys = list(authorized_keys)
        self.start_sshd = start_sshd
        self.sshd_extra_config = list(sshd_extra_config)
        self.sshd_host_config = [list(lines) for lines in sshd_host_config]
        self.sshd_timeout = sshd_timeout
        self.hosts: list[NetnsHost] = [
            NetnsHost(
                netns=f"{NAME_PREFIX}-{self.run_id}-{i}",
                address=str(network.network_address + self.HOST_OFFSET + i),
                veth=f"{NAME_PREFIX}{self.run_id}h{i}",
            )
            for i in range(count)
        ]
        self.subnet_wait = subnet_wait
        self._claim: contextlib.ExitStack | None = None
        self._built = False

    # -- build / teardown

    def __enter__(self) -> Self:
        """Build everything (see :meth:`build`)."""
        self.build()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Tear everything down; raise about leftovers only if the body did not fail."""
        self.close(raise_on_leftovers=exc_type is None)

    def build(self) -> Self:
        """Create bridge, namespaces, veths, routes and sshds; clean up if anything fails."""
        if not is_root():
            raise RuntimeError("NetnsHosts needs root")
        if self.start_sshd:
            ensure_openssh_server()
        ip = _ip()
        self._claim = claim_subnet(str(self.subnet), self.subnet_wait)
        try:
            self._remove_all()  # leftovers of a crashed run with the same names
            self._remove_stale_sets()
            self._check_guard_network_is_free()
        except BaseException:
            self._claim.close()  # nothing was built: the subnet is free again
            self._claim = None
            raise
        self._built = True
        try:
            # The guard goes first: nothing in the test /16 may ever leave the machine.
            for dst in (str(self.guard_network), f"{self.unreachable_address}/32"):
                _run([ip, "route", "replace", "unreachable", dst, "proto", ROUTE_PROTO])
            _run([ip, "link", "add", "name", self.bridge, "type", "bridge"])
            _run([ip, "addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}",
                  "dev", self.bridge])  # fmt: skip
            _run([ip, "link", "set", self.bridge, "up"])
            for host in self.hosts:
                self._build_host(host)
            if self.start_sshd:
                for i, host in enumerate(self.hosts):
                    own = self.sshd_host_config[i] if i < len(self.sshd_host_config) else []
                    host.server = SshdServer(
                        host.address,
                        22,
                        netns=host.netns,
                        authorized_keys=self.authorized_keys,
                        extra_config=[*self.sshd_extra_config, *own],
                        start_timeout=self.sshd_timeout,
                    )
                    host.server.start()
        except BaseException:
            self.close(raise_on_leftovers=False)
            raise
        return self

    def _remove_stale_sets(self) -> None:
        """Remove every other set of hosts on this subnet: a run killed before its teardown
        (a timeout, a worker killed at the end of a session, a CI job cancelled) leaves its
        bridge with this subnet's first address, and the machine then routes this set's
        traffic into that dead bridge: the new sshd listens and no connection reaches it.
        Holding the subnet's claim, any other bridge on it is such a leftover (a live set
        would hold the claim)."""
        ip = _ip()
        out = _run([ip, "-o", "-4", "addr", "show"], check=False).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 4 or not parts[1].startswith(f"{NAME_PREFIX}br-"):
                continue
            with contextlib.suppress(ValueError):
                if (
                    parts[1] == self.bridge
                    or ipaddress.IPv4Interface(parts[3]).ip not in self.subnet
                ):
                    continue
                run_id = parts[1].removeprefix(f"{NAME_PREFIX}br-")
                for netns in _netns_names():
                    if netns.startswith(f"{NAME_PREFIX}-{run_id}-"):
                        _delete_netns(netns)  # kills its processes first
                links = _run([ip, "-o", "link", "show"], check=False).stdout
                for entry in links.splitlines():
                    name = entry.split(":")[1].strip().split("@")[0] if ":" in entry else ""
                    if name.startswith(f"{NAME_PREFIX}{run_id}h") and _link_exists(name):
                        _run([ip, "link", "del", name], check=False)
                _run([ip, "link", "del", parts[1]], check=False)

    def _check_guard_network_is_free(self) -> None:
        """Refuse to build when a real network of this machine overlaps the guard /16.

        The guard route would cut the machine off from such a network, and traffic meant
        for the test hosts could reach real machines.
        """
        route_types = {"unreachable", "blackhole", "prohibit", "throw", "local", "broadcast"}
        out = _run([_ip(), "-4", "route", "show", "table", "all"], check=False).stdout
        for line in out.splitlines():
            tokens = line.split()
            if not tokens or tokens[0] in route_types:
                continue  # our own guard routes (and the kernel's local/broadcast ones)
            dst = "0.0.0.0/0" if tokens[0] == "default" else tokens[0]
            dev = tokens[tokens.index("dev") + 1] if "dev" in tokens else ""
            if dev.startswith(f"{NAME_PREFIX}br-") or dst == "0.0.0.0/0":
                continue
            with contextlib.suppress(ValueError):
                if ipaddress.IPv4Network(dst, strict=False).overlaps(self.guard_network):
                    raise RuntimeError(
                        f"test network {self.guard_network} overlaps a real route of this"
                        f" machine ({line.strip()}); pick another subnet"
                    )

    def _build_host(self, host: NetnsHost) -> None:
        ip = _ip()
        ns = ["-n", host.netns]
        _run([ip, "netns", "add", host.netns])
        _run([ip, "link", "add", "name", host.veth, "type", "veth",
              "peer", "name", "eth0", "netns", host.netns])  # fmt: skip
        _run([ip, "link", "set", host.veth, "master", self.bridge, "up"])
        _run([ip, *ns, "link", "set", "lo", "up"])
        _run([ip, *ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0"])
        _run([ip, *ns, "link", "set", "eth0", "up"])
        _run([ip, *ns, "route", "add", "unreachable", f"{self.unreachable_address}/32",
              "proto", ROUTE_PROTO])  # fmt: skip

    def _remove_all(self) -> None:
        """Best-effort removal of everything this instance's names may have created."""
        ip = _ip()
        for host in self.hosts:
            if host.server is not None:
                with contextlib.suppress(Exception):
                    host.server.close()
                host.server = None
        for host in self.hosts:
            _delete_netns(host.netns)  # kills its processes first
            if _link_exists(host.veth):
                _run([ip, "link", "del", host.veth], check=False)
        if _link_exists(self.bridge):
            _run([ip, "link", "del", self.bridge], check=False)
        _run([ip, "route", "del", "unreachable", f"{self.unreachable_address}/32"], check=False)
        if not self._guard_in_use_by_others():
            _run([ip, "route", "del", "unreachable", str(self.guard_network)], check=False)

    def _guard_in_use_by_others(self) -> bool:
        """Tell whether another NetnsHosts bridge still has an address in the guard /16."""
        out = _run([_ip(), "-o", "-4", "addr", "show"], check=False).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 4 or parts[1] == self.bridge:
                continue
            with contextlib.suppress(ValueError):
                if ipaddress.IPv4Interface(parts[3]).ip in self.guard_network:
                    return True
        return False

    def leftovers(self) -> list[str]:
        """Describe anything of this instance that still exists (empty after close)."""
        found: list[str] = []
        names = set(_netns_names())
        found += [f"netns {h.netns}" for h in self.hosts if h.netns in names]
        found += [f"link {h.veth}" for h in self.hosts if _link_exists(h.veth)]
        if _link_exists(self.bridge):
            found.append(f"link {self.bridge}")
        routes = _run([_ip(), "route", "show", "type", "unreachable"], check=False).stdout
        targets = {line.split()[1] for line in routes.splitlines() if len(line.split()) > 1}
        if self.unreachable_address in targets:
            found.append(f"route unreachable {self.unreachable_address}")
        if str(self.guard_network) in targets and not self._guard_in_use_by_others():
            found.append(f"route unreachable {self.guard_network}")
        for pid, cmdline in _sshd_pids().items():
            if any(h.server is not None and str(h.server.workdir) in cmdline for h in self.hosts):
                found.append(f"sshd pid {pid}")
        return found

    def close(self, raise_on_leftovers: bool = True) -> None:
        """Remove processes, veths, namespaces, bridge and routes. Idempotent."""
        if not self._built:
            return
        workdirs = [str(h.server.workdir) for h in self.hosts if h.server is not None]
        self._remove_all()
        self._built = False
        left = self.leftovers()
        left += [f"sshd pid {pid}" for pid, cmd in _sshd_pids().items()
                 if any(w in cmd for w in workdirs)]  # fmt: skip
        if self._claim is not None:
            self._claim.close()
            self._claim = None
        if left and raise_on_leftovers:
            raise RuntimeError(f"NetnsHosts {self.run_id} left behind: {', '.join(left)}")

    # -- conveniences

    CLIENT_OFFSET = 200

    @contextlib.contextmanager
    def client_namespace(self) -> Iterator[NetnsHost]:
        """A namespace without sshd on the same bridge (address offset 200): a client machine
        that can be taken away. On exit it is deleted with every process in it (a laptop that
        is closed), if the body has not deleted it already (`delete_namespace`)."""
        client = NetnsHost(
            netns=f"{NAME_PREFIX}-{self.run_id}-c",
            address=str(self.subnet.network_address + self.CLIENT_OFFSET),
            veth=f"{NAME_PREFIX}{self.run_id}hc",
        )
        _delete_netns(client.netns)
        try:
            self._build_host(client)
            yield client
        finally:
            self.delete_namespace(client)

    @staticmethod
    def delete_namespace(host: NetnsHost) -> None:
        """Kill every process in `host`'s namespace and delete it and its veth."""
        _delete_netns(host.netns)
        if _link_exists(host.veth):
            _run([_ip(), "link", "del", host.veth], check=False)

    def add_namespace(self, index: int, address: str) -> NetnsHost:
        """One more namespace (no sshd) on the bridge, at `address` of the subnet, named as
        host `index` (``skyt-ID-<index>``, veth ``skytIDh<index>``): a machine that comes later,
        such as a pod. It is one of `hosts` until `remove_namespace`, and goes with the set."""
        if ipaddress.IPv4Address(address) not in self.subnet:
            raise ValueError(f"{address} is not on {self.subnet}")
        host = NetnsHost(
            netns=f"{NAME_PREFIX}-{self.run_id}-{index}",
            address=address,
            veth=f"{NAME_PREFIX}{self.run_id}h{index}",
        )
        self.hosts.append(host)
        try:
            self._build_host(host)
        except BaseException:
            self.remove_namespace(host)
            raise
        return host

    def remove_namespace(self, host: NetnsHost) -> None:
        """Kill every process in `host`'s namespace, delete it and its veth, and drop it from
        `hosts` (an `add_namespace` one, or any host of the set)."""
        self.delete_namespace(host)
        with contextlib.suppress(ValueError):
            self.hosts.remove(host)

    @property
    def netns_names(self) -> list[str]:
        """Names of all namespaces."""
        return [h.netns for h in self.hosts]


def remove_stale_resources() -> list[str]:
    """Remove everything a crashed test run of this module may have left; return names.

    Kills every sshd started by :class:`SshdServer` (and its sessions), deletes every
    ``skyt-*`` namespace (and what runs in it), every ``skyt*`` link, every host route
    tagged with :data:`ROUTE_PROTO`, and the ``skyward-sshd-*`` temp dirs. Random run ids
    never collide, so a crash's leftovers would otherwise stay until reboot. Call it at
    session start only when no other test process on the machine uses this module.
    """
    removed: list[str] = []
    for pid, cmdline in _sshd_pids().items():
        if _WORKDIR_PREFIX in cmdline:
            stat = _proc_stat(pid)
            if stat is not None:
                _terminate({**_descendants(pid), pid: stat[1]})
                removed.append(f"sshd pid {pid}")
    ip = _ip()
    for name in _netns_names():
        if name.startswith(f"{NAME_PREFIX}-"):
            _delete_netns(name)
            removed.append(f"netns {name}")
    out = _run([ip, "-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@")[0]
        if link.startswith(NAME_PREFIX) and _link_exists(link):
            _run([ip, "link", "del", link], check=False)
            removed.append(f"link {link}")
    routes = _run([ip, "route", "show", "proto", ROUTE_PROTO], check=False).stdout
    for line in routes.splitlines():
        tokens = line.split()
        if len(tokens) >= 2 and tokens[0] == "unreachable":
            _run([ip, "route", "del", "unreachable", tokens[1]], check=False)
            removed.append(f"route unreachable {tokens[1]}")
    for workdir in _LOCK_DIR.glob(f"{_WORKDIR_PREFIX}*"):
        shutil.rmtree(workdir, ignore_errors=True)
        removed.append(str(workdir))
    return removed
