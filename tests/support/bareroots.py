"""Test hosts that look like fresh cloud VMs: debootstrapped Debian roots behind sshd.

Plain Python (no pytest), root only. Builds on :mod:`tests.support.sshd`:

* :func:`cached_root` debootstraps a minimal Debian root (``minbase`` plus ``python3``,
  ``openssh-server`` and ``ca-certificates``: no venv, no pip) once per machine into a cache
  dir, under a file lock, and prepares what every image already has (``/run/sshd``,
  ``/root/.ssh``; no host keys: each host makes its own).
* :class:`BareHosts` starts K such hosts: each a network namespace of a
  :class:`~tests.support.sshd.NetnsHosts` (private bridge, no default route) running
  ``sshd -D -e`` chrooted into its own overlayfs copy of the cached root, so every
  :class:`BareHosts` starts from the clean root and writes never reach the cache.
* :class:`PackageIndex` serves a directory of wheels on the bridge address (a flat page and a
  PEP 503 simple index): the only thing the hosts can reach.
* :func:`download_wheels` fetches wheels for the hosts' Python from PyPI once (cached).
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import http.server
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from skyward.worker.filelock import locked
from tests.support import sshd
from tests.support.sshd import KeyPair

__all__ = [
    "BARE_NAME_PREFIX",
    "DEFAULT_BARE_SUBNET",
    "INCLUDE",
    "MIRROR",
    "SSHD_CONFIG",
    "SUITE_PYTHON",
    "VARIANT",
    "BareHost",
    "BareHosts",
    "PackageIndex",
    "cached_root",
    "client_uv_version",
    "download_wheels",
    "ensure_debootstrap",
    "mounts_with",
    "remove_stale_bare_resources",
    "roots_dir",
    "wheels_dir",
    "write_owner",
]

VARIANT = "minbase"
INCLUDE = ("python3", "openssh-server", "ca-certificates")
"""Packages on top of ``minbase``: what a fresh cloud image has that matters here."""

MIRROR = "http://deb.debian.org/debian"
SUITE_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}
"""The ``python3`` each suite ships."""
_SUITE_GLIBC = {"3.11": "2.36", "3.13": "2.41"}
"""glibc of the suite that ships each Python (bookworm, trixie): the manylinux tags it takes."""

_PREP_VERSION = 1
"""Bump when :func:`_prepare_root` changes, so cached roots are rebuilt."""

DEFAULT_BARE_SUBNET = "10.213.12.0/24"
BARE_NAME_PREFIX = "skyward-bare-"
"""Prefix of every per-run temp dir (overlay upper/work/merged, logs, host keys)."""

SSHD_CONFIG = "/etc/ssh/sshd_config_skyward"
"""Path, inside each host's root, of the sshd config written for it."""

_CACHE = Path("/var/cache/skyward-tests")
_HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_HOST_ENV = {"PATH": _HOST_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
"""Environment of everything started inside a host: none of the client's variables leak in."""
_apt_updated = False


# --------------------------------------------------------------------------- cache dirs


def roots_dir() -> Path:
    """Where cached roots live: ``$SKYWARD_TEST_ROOTS`` or /var/cache/skyward-tests/roots."""
    return Path(os.environ.get("SKYWARD_TEST_ROOTS") or _CACHE / "roots")


def wheels_dir() -> Path:
    """Where downloaded wheels live: ``$SKYWARD_TEST_WHEELS`` or .../skyward-tests/wheels."""
    return Path(os.environ.get("SKYWARD_TEST_WHEELS") or _CACHE / "wheels")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (its folder made if needed) across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        yield


def _short_hash(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def mounts_with(token: str, pids: Sequence[int] | None = None) -> dict[int, list[str]]:
    """Return {pid: mountinfo lines containing ``token``} over ``pids`` (default: all).

    Every mount namespace is seen through some process's ``/proc/<pid>/mountinfo``, so a
    mount that survives in a forgotten namespace still shows up here.
    """
    if pids is None:
        pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    found: dict[int, list[str]] = {}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/mountinfo").read_text()
        except OSError:
            continue
        lines = [line for line in text.splitlines() if token in line]
        if lines:
            found[pid] = lines
    return found


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` in our own mount namespace, deepest first."""
    prefix = str(path)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def _unmount_all(path: Path) -> list[str]:
    """Unmount everything at or below ``path``; return what is still mounted after that."""
    for point in _mounts_under(path):
        if sshd._run(["umount", point], check=False).returncode != 0:
            sshd._run(["umount", "-l", point], check=False)
    return _mounts_under(path)


def _remove_tree(path: Path) -> None:
    """Delete ``path`` after unmounting anything below it (never recurse into a mount)."""
    if not path.exists():
        return
    left = _unmount_all(path)
    if left:
        raise RuntimeError(f"cannot remove {path}: still mounted: {', '.join(left)}")
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- roots


def _apt_env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_MODE": "l"}


def ensure_debootstrap() -> Path:
    """Return the ``debootstrap`` path, installing it with apt-get when missing.

    ``apt-get update`` runs only when the first install attempt fails (stale lists).
    """
    global _apt_updated
    found = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin")
    if found:
        return Path(found)
    if not sshd.is_root():
        raise RuntimeError("debootstrap is missing and we are not root")
    if shutil.which("apt-get") is None:
        raise RuntimeError("debootstrap is missing and there is no apt-get to install it with")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "debootstrap"]
    with sshd._file_lock("apt"):
        proc = sshd._run(install, check=False, env=_apt_env(), timeout=900)
        if proc.returncode != 0 and not _apt_updated:
            sshd._run(["apt-get", "update"], env=_apt_env(), timeout=600)
            _apt_updated = True
            sshd._run(install, env=_apt_env(), timeout=900)
    found = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin")
    if not found:
        raise RuntimeError("installed debootstrap but cannot find it")
    return Path(found)


def _recipe(suite: str) -> dict[str, object]:
    return {
        "suite": suite,
        "variant": VARIANT,
        "include": sorted(INCLUDE),
        "mirror": MIRROR,
        "prep": _PREP_VERSION,
    }


def _prepare_root(root: Path) -> None:
    """One-time changes a cloud image would already have made to a fresh root."""
    (root / "run" / "sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
    ssh_dir = root / "root" / ".ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    for key in (root / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()  # every host gets its own
    lists = root / "var" / "lib" / "apt" / "lists"
    for entry in lists.glob("*"):
        if entry.is_file() and entry.name != "lock":
            entry.unlink()
    for deb in (root / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        deb.unlink()
    for cache in (root / "var" / "cache" / "apt").glob("*.bin"):
        cache.unlink()
    # debootstrap copies this machine's files; each host writes its own.
    (root / "etc" / "resolv.conf").unlink(missing_ok=True)
    (root / "etc" / "hostname").write_text("localhost\n")


def cached_root(suite: str = "bookworm", *, timeout: float = 1800.0) -> Path:
    """Return a cached minimal Debian ``suite`` root, debootstrapping it on first use.

    The root lives in :func:`roots_dir` as ``<suite>-<hash of the recipe>``. It is built
    under a file lock (concurrent processes build it once) into a temp dir beside it, which
    is renamed into place only when complete. Never write into the result: use it as the
    lower layer of an overlay (see :class:`BareHosts`). Raises ``RuntimeError`` when
    debootstrap fails (e.g. no network).
    """
    if not re.fullmatch(r"[a-z]+", suite):
        raise ValueError(f"bad suite name {suite!r}")
    parent = roots_dir()
    final = parent / f"{suite}-{_short_hash(_recipe(suite))}"
    if final.is_dir():
        return final
    if not sshd.is_root():
        raise RuntimeError("building a Debian root needs root")
    with _locked(parent / f".{final.name}.lock"):
        if final.is_dir():
            return final
        for stale in parent.glob(f".{final.name}.building-*"):  # a crashed earlier build
            _remove_tree(stale)
        debootstrap = ensure_debootstrap()
        building = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=parent))
        try:
            building.chmod(0o755)
            sshd._run(
                [
                    str(debootstrap),
                    f"--variant={VARIANT}",
                    f"--include={','.join(INCLUDE)}",
                    suite,
                    str(building),
                    MIRROR,
                ],
                env=_apt_env(),
                timeout=timeout,
            )
            _prepare_root(building)
            if _mounts_under(building):
                raise RuntimeError(f"debootstrap left mounts in {building}")
            building.rename(final)
        except BaseException:
            _remove_tree(building)
            raise
    return final


# --------------------------------------------------------------------------- hosts

# Run inside a host's network namespace, in a private mount and UTS namespace that dies
# with its last process: give the root /proc, /sys, /dev (with its own /dev/shm and pty
# instance) and the hostname, then chroot into it.
# $1 = merged root, $2 = hostname, the rest = the command.
_LAUNCH = """\
set -e
root=$1
name=$2
shift 2
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
mount --rbind /dev "$root/dev"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts "$root/dev/pts"
mount --bind "$root/dev/pts/ptmx" "$root/dev/ptmx"
mount -t tmpfs -o nosuid,nodev,mode=1777 shm "$root/dev/shm"
hostname "$name"
exec chroot "$root" "$@"
"""


def _sshd_config(address: str, extra: Sequence[str]) -> str:
    lines = [
        "AddressFamily inet",
        f"ListenAddress {address}:22",
        "HostKey /etc/ssh/ssh_host_ed25519_key",
        "PidFile /run/sshd.pid",
        "AuthorizedKeysFile .ssh/authorized_keys",
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
        "X11Forwarding no",
        "AcceptEnv LANG LC_*",  # Debian's default
        "Subsystem sftp /usr/lib/openssh/sftp-server",
        "LogLevel INFO",
        *extra,
    ]
    return "".join(f"{line}\n" for line in lines)


@dataclass
class BareHost:
    """One host of :class:`BareHosts`: a namespace running sshd chrooted into ``root``."""

    name: str
    """Its hostname (``/etc/hostname``, ``uname -n`` inside)."""
    netns: str
    address: str
    workdir: Path
    """Per-host temp dir on the client: ``upper``, ``work``, ``merged``, ``sshd.log``."""
    lower: Path
    """The cached root (read-only lower layer)."""
    host_key: KeyPair
    bridge_address: str
    resolver: str
    authorized_keys: list[str] = field(default_factory=list)
    sshd_extra_config: list[str] = field(default_factory=list)
    start_timeout: float = 15.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def root(self) -> Path:
        """The host's filesystem (the overlay's merged dir), readable from the client."""
        return self.workdir / "merged"

    @property
    def upper(self) -> Path:
        """The overlay's upper dir: every file the host wrote or changed."""
        return self.workdir / "upper"

    @property
    def log_path(self) -> Path:
        """sshd's stderr (``-e``), on the client."""
        return self.workdir / "sshd.log"

    @property
    def port(self) -> int:
        """Port of the host's sshd."""
        return 22

    # -- filesystem

    def mount(self) -> None:
        """Mount a fresh overlay (lower = cached root) and write the host's own files."""
        for sub in ("upper", "work", "merged"):
            (self.workdir / sub).mkdir(mode=0o755, exist_ok=True)
        options = f"lowerdir={self.lower},upperdir={self.upper},workdir={self.workdir / 'work'}"
        sshd._run(["mount", "-t", "overlay", "overlay", "-o", options, str(self.root)])
        etc = self.root / "etc"
        key = etc / "ssh" / "ssh_host_ed25519_key"
        shutil.copyfile(self.host_key.private_path, key)
        key.chmod(0o600)
        pub = etc / "ssh" / "ssh_host_ed25519_key.pub"
        pub.write_text(self.host_key.public_line + "\n")
        pub.chmod(0o644)
        config = self.root / SSHD_CONFIG.lstrip("/")
        config.write_text(_sshd_config(self.address, self.sshd_extra_config))
        config.chmod(0o600)
        self.set_authorized_keys(self.authorized_keys)
        (etc / "hostname").write_text(f"{self.name}\n")
        (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n{self.address}\t{self.name}\n")
        (etc / "resolv.conf").write_text(f"nameserver {self.resolver}\n")

    def set_authorized_keys(self, keys: Sequence[KeyPair | str]) -> None:
        """Replace root's ``~/.ssh/authorized_keys`` on the host."""
        lines = [k.public_line if isinstance(k, KeyPair) else k.strip() for k in keys]
        self.authorized_keys = lines
        path = self.root / "root" / ".ssh" / "authorized_keys"
        path.write_text("".join(f"{line}\n" for line in lines))
        path.chmod(0o600)

    def unmount(self) -> list[str]:
        """Unmount the overlay (in the client's mount namespace); return what stays mounted."""
        return _unmount_all(self.root)

    # -- processes

    def _argv(self, command: Sequence[str]) -> list[str]:
        return [
            sshd._ip(), "netns", "exec", self.netns,
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", _LAUNCH, "sh", str(self.root), self.name, *command,
        ]  # fmt: skip

    def run(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = 60.0,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as root inside the host (its namespace and chroot), capture text.

        It gets a clean environment (PATH, HOME=/root, LANG=C.UTF-8), not the client's.
        """
        proc = subprocess.run(
            self._argv(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(_HOST_ENV),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{self.name}: command failed with exit code {proc.returncode}: {list(argv)}\n"
                f"stdout: {proc.stdout.strip()[-2000:]}\nstderr: {proc.stderr.strip()[-2000:]}"
            )
        return proc

    @property
    def sshd_pid(self) -> int | None:
        """PID of the listening sshd (as the client sees it), or None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the host's listening sshd is alive."""
        return self._proc is not None and self._proc.poll() is None

    def launch(self) -> None:
        """Start sshd without waiting for it (see :meth:`start`)."""
        if self.running:
            return
        argv = self._argv(["/usr/sbin/sshd", "-D", "-e", "-f", SSHD_CONFIG])
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=dict(_HOST_ENV),
                start_new_session=True,
                close_fds=True,
            )

    def wait_ready(self) -> None:
        """Wait (bounded) until sshd answers with a banner; raise with its log if not."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                self._proc = None
                raise RuntimeError(
                    f"sshd of {self.name} exited with code {code} on start-up; log tail:\n"
                    f"{self.log_tail()}"
                )
            if sshd._wait_for_ssh_banner(self.address, 22, deadline):
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise RuntimeError(
                    f"sshd of {self.name} did not answer within {self.start_timeout:.1f}s;"
                    f" log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def start(self) -> Self:
        """Start the host's sshd (again) and wait until it answers."""
        self.launch()
        self.wait_ready()
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Kill the host's sshd and every session below it (not processes that detached)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        procs = sshd._descendants(proc.pid)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGTERM)
        sshd._terminate(procs, grace)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def pids(self) -> list[int]:
        """PIDs of every process of this host (``ip netns pids``), as the client sees them."""
        out = sshd._run([sshd._ip(), "netns", "pids", self.netns], check=False).stdout
        return [int(tok) for tok in out.split() if tok.isdigit()]

    def kill_all(self) -> None:
        """Kill every process of the host (sshd, sessions, detached ones): a power cut."""
        self.stop(grace=0.5)
        sshd._kill_netns_processes(self.netns)

    # -- client side

    def known_hosts_line(self) -> str:
        """known_hosts line for this host's sshd."""
        return sshd.known_hosts_line(self.address, 22, self.host_key.public_line)

    def ssh_command(
        self, key: KeyPair, known_hosts: Path | str, *command: str, user: str = "root"
    ) -> list[str]:
        """``ssh`` argv that logs into this host (see :func:`tests.support.sshd.ssh_command`)."""
        return sshd.ssh_command(self.address, 22, user, key, known_hosts, *command)

    def log_tail(self, lines: int = 30) -> str:
        """Last lines of sshd's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no sshd log>"
        return "\n".join(text.splitlines()[-lines:])


class BareHosts(sshd.HostSet[BareHost]):
    """K fresh Debian hosts (network namespaces running a chrooted sshd) on a private bridge.

    Each host is a namespace of a :class:`~tests.support.sshd.NetnsHosts` (its own address,
    the bridge's subnet as its only route) whose sshd runs chrooted into a new overlayfs
    copy of :func:`cached_root`: hostname ``bare<i>-<run id>``, its own ed25519 host key,
    ``authorized_keys`` for root. The overlay is mounted in the client's mount namespace
    (``host.root`` is readable from the test); /proc, /sys, /dev live in a private mount
    namespace per process tree, which vanishes with it. Use as a context manager; ``close``
    kills every process of the hosts, unmounts, deletes the temp dirs and the network.
    """

    def __init__(
        self,
        count: int = 1,
        *,
        suite: str = "bookworm",
        subnet: str = DEFAULT_BARE_SUBNET,
        authorized_keys: Sequence[KeyPair | str] = (),
        run_id: str | None = None,
        root: Path | None = None,
        sshd_extra_config: Sequence[str] = (),
        start_timeout: float = 15.0,
        subnet_wait: float = 600.0,
        host_offset: int | None = None,
    ) -> None:
        """Describe (not build) ``count`` hosts; ``root`` overrides ``cached_root(suite)``.

        ``host_offset`` places host i at the subnet's address ``host_offset + i`` (default:
        :attr:`tests.support.sshd.NetnsHosts.HOST_OFFSET`), e.g. 4 where the hosts must sit
        where a cloud's API hands out addresses (EC2 reserves .0-.3 of a subnet).
        """
        net_class: type[sshd.NetnsHosts] = sshd.NetnsHosts
        if host_offset is not None:
            if host_offset < 2:
                raise ValueError("host_offset must be at least 2 (.1 is the bridge)")
            offset: int = host_offset

            class NetnsHostsAt(sshd.NetnsHosts):
                HOST_OFFSET = offset

            net_class = NetnsHostsAt
        self.net = net_class(
            count, subnet=subnet, run_id=run_id, start_sshd=False, subnet_wait=subnet_wait
        )
        self.run_id = self.net.run_id
        self.suite = suite
        self.subnet = str(self.net.subnet)
        self.authorized_keys = [
            k.public_line if isinstance(k, KeyPair) else k.strip() for k in authorized_keys
        ]
        self.lower = root
        self.sshd_extra_config = list(sshd_extra_config)
        self.start_timeout = start_timeout
        self.subnet_wait = subnet_wait
        self.workdir: Path | None = None
        self.hosts: list[BareHost] = []
        self._claim: contextlib.ExitStack | None = None

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
        """Tear down; raise about leftovers only if the body did not fail."""
        self.close(raise_on_leftovers=exc_type is None)

    def build(self) -> Self:
        """Network, overlays, host files and sshds; everything is undone if a step fails."""
        if not sshd.is_root():
            raise RuntimeError("BareHosts needs root")
        if self._claim is not None:
            return self
        lower = self.lower or cached_root(self.suite)
        self.lower = lower
        self._claim = contextlib.ExitStack()  # marks it built; the subnet is net.build's claim
        self.hosts = []
        try:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{BARE_NAME_PREFIX}{self.run_id}-"))
            write_owner(self.workdir, self.net)
            self.net.build()
            for i, nh in enumerate(self.net.hosts):
                folder = self.workdir / f"host{i}"
                folder.mkdir()
                name = f"bare{i}-{self.run_id}"
                self.hosts.append(
                    BareHost(
                        name=name,
                        netns=nh.netns,
                        address=nh.address,
                        workdir=folder,
                        lower=lower,
                        host_key=KeyPair.generate(
                            folder / "keys", "ssh_host_ed25519_key", comment=f"root@{name}"
                        ),
                        bridge_address=self.net.bridge_address,
                        resolver=self.net.unreachable_address,
                        authorized_keys=list(self.authorized_keys),
                        sshd_extra_config=list(self.sshd_extra_config),
                        start_timeout=self.start_timeout,
                    )
                )
            for host in self.hosts:
                host.mount()
            for host in self.hosts:
                host.launch()
            for host in self.hosts:
                host.wait_ready()
        except BaseException:
            self.close(raise_on_leftovers=False)
            raise
        return self

    def leftovers(self) -> list[str]:
        """Describe anything of this instance that still exists (empty after close).

        The guard route over the test /16 is not this instance's to report: every test network
        on the machine shares it, and another run may be adding it this very moment (before its
        bridge, which is how `NetnsHosts.leftovers` tells it is in use).
        """
        guard = f"route unreachable {self.net.guard_network}"
        found = [item for item in self.net.leftovers() if item != guard]
        if self.workdir is not None:
            found += [f"mount in pid {pid}" for pid in mounts_with(str(self.workdir))]
            if self.workdir.exists():
                found.append(f"dir {self.workdir}")
        return found

    def close(self, raise_on_leftovers: bool = True) -> None:
        """Kill the hosts' processes, unmount, delete temp dirs and network. Idempotent."""
        if self._claim is None:
            return
        errors: list[str] = []
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.stop(grace=1.0)
        try:
            self.net.close(raise_on_leftovers=False)  # kills every process in the namespaces
        except Exception as exc:
            errors.append(f"network teardown: {exc}")
        for host in self.hosts:
            errors += [f"still mounted: {point}" for point in host.unmount()]
        if self.workdir is not None and not errors:
            with contextlib.suppress(RuntimeError):
                _remove_tree(self.workdir)
        left = errors + self.leftovers()
        self._claim.close()
        self._claim = None
        if left and raise_on_leftovers:
            raise RuntimeError(f"BareHosts {self.run_id} left behind: {', '.join(left)}")

    # -- conveniences

    @property
    def bridge_address(self) -> str:
        """The client's address on the hosts' bridge (bind a server here for the hosts)."""
        return self.net.bridge_address

    @property
    def unreachable_address(self) -> str:
        """An address on the hosts' subnet with no host: connecting fails at once."""
        return self.net.unreachable_address

    @property
    def netns_names(self) -> list[str]:
        """Names of all namespaces."""
        return self.net.netns_names

    def pids(self) -> list[int]:
        """PIDs of every process on every host."""
        return [pid for host in self.hosts for pid in host.pids()]


def write_owner(workdir: Path, net: sshd.NetnsHosts) -> None:
    """Record in ``workdir/owner.json`` this process and what `net` holds now (its namespaces,
    veths, bridge), so that :func:`remove_stale_bare_resources` removes them and ``workdir``
    once this process is gone without its teardown. Call it again when `net` changes."""
    stat = sshd._proc_stat(os.getpid())
    owner = {
        "pid": os.getpid(),
        "start": stat[1] if stat else 0,
        "netns": net.netns_names,
        "veths": [h.veth for h in net.hosts],
        "bridge": net.bridge,
        "unreachable": net.unreachable_address,
    }
    partial = workdir / "owner.json.partial"
    partial.write_text(json.dumps(owner))
    partial.replace(workdir / "owner.json")


def remove_stale_bare_resources() -> list[str]:
    """Remove what crashed :class:`BareHosts` left (their owner process is gone); return names.

    Safe beside live test runs: only temp dirs whose ``owner.json`` names a dead process are
    touched (their namespaces with the processes in them, veths, bridge, mounts, files).
    """
    removed: list[str] = []
    for folder in Path(tempfile.gettempdir()).glob(f"{BARE_NAME_PREFIX}*"):
        try:
            owner = json.loads((folder / "owner.json").read_text())
            pid, start = int(owner["pid"]), int(owner["start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        stat = sshd._proc_stat(pid)
        if stat is not None and stat[1] == start:
            continue  # its owner still runs
        ip = sshd._ip()
        for netns in owner.get("netns", []):
            sshd._delete_netns(netns)
        for link in [*owner.get("veths", []), owner.get("bridge", "")]:
            if link and sshd._link_exists(link):
                sshd._run([ip, "link", "del", link], check=False)
        if owner.get("unreachable"):
            sshd._run([ip, "route", "del", "unreachable", f"{owner['unreachable']}/32"],
                      check=False)  # fmt: skip
        try:
            _remove_tree(folder)
            removed.append(str(folder))
        except RuntimeError:
            pass
    return removed


# --------------------------------------------------------------------------- package index


def _normalize(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _project_of(filename: str) -> str | None:
    if filename.endswith(".whl"):
        return _normalize(filename.split("-", 1)[0])
    for suffix in (".tar.gz", ".zip"):
        if filename.endswith(suffix):
            return _normalize(filename.removesuffix(suffix).rsplit("-", 1)[0])
    return None


class PackageIndex:
    """A tiny HTTP package index over a directory of wheels, in a thread of the client.

    ``<url>/flat/`` is one page linking every file (pip ``--find-links``, uv
    ``--find-links``); ``<url>/simple/`` is a PEP 503 index (``--index-url``); files are
    under ``<url>/files/<name>``; links carry ``#sha256=`` fragments, and wheels' links
    their PEP 658 metadata (``<file>.metadata``), as PyPI does. The directory is read
    on every request, so files added later are served too. Bind it to
    :attr:`BareHosts.bridge_address` so only the hosts (and the client) reach it.
    :attr:`requests` lists every path asked for, in order.
    """

    def __init__(self, directory: Path | str, host: str = "127.0.0.1", port: int = 0) -> None:
        """Describe (not start) an index of ``directory`` on ``host:port`` (0: a free port)."""
        self.directory = Path(directory)
        self.host = host
        self._port = port
        self.requests: list[str] = []
        """Every path asked for (GET and HEAD), in order."""
        self.request_log: list[tuple[str, str]] = []
        """(method, path) of every request, in order."""
        self._hashes: dict[tuple[str, int, int], str] = {}
        self._metadata: dict[tuple[str, int, int], bytes | None] = {}
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on (known once started)."""
        if self._server is None:
            raise RuntimeError("the index is not running")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def flat_url(self) -> str:
        """The flat page of links (``--find-links``)."""
        return f"{self.url}/flat/"

    @property
    def simple_url(self) -> str:
        """The PEP 503 simple index (``--index-url``)."""
        return f"{self.url}/simple/"

    def files(self) -> list[Path]:
        """The distribution files served, sorted by name."""
        return sorted(p for p in self.directory.iterdir() if p.is_file() and _project_of(p.name))

    def sha256(self, path: Path) -> str:
        """Hex sha256 of ``path`` (cached by name, size and mtime)."""
        st = path.stat()
        key = (path.name, st.st_size, st.st_mtime_ns)
        if key not in self._hashes:
            digest = hashlib.sha256()
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            self._hashes[key] = digest.hexdigest()
        return self._hashes[key]

    def metadata(self, path: Path) -> bytes | None:
        """The ``METADATA`` file inside wheel ``path`` (PEP 658), or None."""
        st = path.stat()
        key = (path.name, st.st_size, st.st_mtime_ns)
        if key not in self._metadata:
            found = None
            if path.name.endswith(".whl"):
                with contextlib.suppress(OSError, zipfile.BadZipFile), zipfile.ZipFile(path) as z:
                    names = [
                        n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)
                    ]
                    found = z.read(names[0]) if len(names) == 1 else None
            self._metadata[key] = found
        return self._metadata[key]

    def _links(self, files: Sequence[Path]) -> str:
        rows = []
        for p in files:
            extra = ""
            meta = self.metadata(p)
            if meta is not None:  # PEP 658/714: installers then fetch the metadata alone
                digest = hashlib.sha256(meta).hexdigest()
                extra = f' data-dist-info-metadata="sha256={digest}"'
                extra += f' data-core-metadata="sha256={digest}"'
            rows.append(
                f'<a href="/files/{urllib.parse.quote(p.name)}#sha256={self.sha256(p)}"{extra}>'
                f"{html.escape(p.name)}</a><br/>"
            )
        return _page(rows)

    def _respond(self, path: str) -> tuple[int, str, bytes | Path, str | None]:
        """(status, content type, body or file, redirect location) for ``path``."""
        path = urllib.parse.urlsplit(path).path
        parts = [urllib.parse.unquote(p) for p in path.split("/") if p]
        if parts == ["flat"]:
            return 200, "text/html", self._links(self.files()).encode(), None
        if parts == ["simple"]:
            names = sorted({n for p in self.files() if (n := _project_of(p.name))})
            rows = [f'<a href="/simple/{n}/">{n}</a><br/>' for n in names]
            return 200, "text/html", _page(rows).encode(), None
        if len(parts) == 2 and parts[0] == "simple":
            wanted = _normalize(parts[1])
            if wanted != parts[1] or not path.endswith("/"):
                return 301, "text/plain", b"", f"/simple/{wanted}/"
            files = [p for p in self.files() if _project_of(p.name) == wanted]
            if files:
                return 200, "text/html", self._links(files).encode(), None
        if len(parts) == 2 and parts[0] == "files" and "/" not in parts[1]:
            file = self.directory / parts[1]
            if file.is_file() and _project_of(file.name):
                return 200, "application/octet-stream", file, None
            wheel = self.directory / parts[1].removesuffix(".metadata")
            if parts[1].endswith(".whl.metadata") and wheel.is_file():
                meta = self.metadata(wheel)
                if meta is not None:
                    return 200, "application/octet-stream", meta, None
        return 404, "text/plain", b"not found\n", None

    def start(self) -> Self:
        """Start serving in a daemon thread."""
        if self._server is not None:
            return self
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self, body_wanted: bool) -> None:
                index.request_log.append((self.command, self.path))
                index.requests.append(self.path)
                status, ctype, body, location = index._respond(self.path)
                size = body.stat().st_size if isinstance(body, Path) else len(body)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(size))
                if location is not None:
                    self.send_header("Location", location)
                self.end_headers()
                if not body_wanted:
                    return
                if isinstance(body, Path):
                    with body.open("rb") as fh:
                        shutil.copyfileobj(fh, self.wfile, 1 << 20)
                else:
                    self.wfile.write(body)

            def do_GET(self) -> None:
                self._serve(True)

            def do_HEAD(self) -> None:
                self._serve(False)

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer((self.host, self._port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            args=(0.05,),
            name=f"package-index-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and join the thread. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> Self:
        """Start serving."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop serving."""
        self.close()


def _page(rows: Sequence[str]) -> str:
    body = "\n".join(rows)
    return f"<!DOCTYPE html>\n<html><body>\n{body}\n</body></html>\n"


# --------------------------------------------------------------------------- wheels


def client_uv_version() -> str:
    """The uv version installed beside the client (what skyward installs on hosts)."""
    return importlib.metadata.version("uv")


def _platforms(platform_tag: str, glibc: str | None) -> list[str]:
    platforms = [platform_tag]
    match = re.fullmatch(r"manylinux(?:1|2010|2014|_\d+_\d+)_(\w+)", platform_tag)
    if match and glibc:
        major, minor = (int(x) for x in glibc.split(".")[:2])
        if major == 2:
            platforms += [f"manylinux_2_{m}_{match[1]}" for m in range(17, minor + 1)]
    return list(dict.fromkeys(platforms))


def download_wheels(
    dest: Path | str | None,
    requirements: Sequence[str],
    python_version: str = "3.11",
    platform_tag: str = "manylinux2014_x86_64",
    *,
    glibc: str | None = None,
    timeout: float = 900.0,
) -> Path:
    """Wheels of ``requirements`` and their dependencies for another Python and platform.

    Runs ``pip download --only-binary=:all:`` for CPython ``python_version`` on
    ``platform_tag`` and every ``manylinux_2_X`` up to ``glibc`` (default: that of the
    suite shipping that Python: 3.11 bookworm 2.36, 3.13 trixie 2.41) once, cached in
    :func:`wheels_dir` under a hash of the arguments (built beside it, renamed when
    complete, under a file lock). Hard-links (or copies) the wheels into
    ``dest`` and returns it; with ``dest=None`` returns the read-only cache dir itself.
    """
    version = python_version.replace(".", "")
    platforms = _platforms(platform_tag, glibc or _SUITE_GLIBC.get(python_version, "2.28"))
    key = _short_hash({"requirements": sorted(requirements), "python": python_version,
                       "platforms": platforms})  # fmt: skip
    parent = wheels_dir()
    cache = parent / f"py{version}-{key}"
    if not cache.is_dir():
        with _locked(parent / f".{cache.name}.lock"):
            if not cache.is_dir():
                for stale in parent.glob(f".{cache.name}.building-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                building = Path(tempfile.mkdtemp(prefix=f".{cache.name}.building-", dir=parent))
                try:
                    argv = [
                        sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
                        "--no-input", "--only-binary=:all:", "--implementation", "cp",
                        "--python-version", python_version, "--abi", f"cp{version}",
                        "--abi", "abi3", "--abi", "none",
                    ]  # fmt: skip
                    for platform in platforms:
                        argv += ["--platform", platform]
                    argv += ["-d", str(building), *requirements]
                    env = {k: v for k, v in os.environ.items()
                           if k not in ("PIP_FIND_LINKS", "PIP_NO_INDEX")}  # fmt: skip
                    sshd._run(argv, env=env, timeout=timeout)
                    building.chmod(0o755)
                    for wheel in building.iterdir():
                        wheel.chmod(0o644)
                    building.rename(cache)
                except BaseException:
                    shutil.rmtree(building, ignore_errors=True)
                    raise
    if dest is None:
        return cache
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for wheel in cache.iterdir():
        target = dest / wheel.name
        if target.exists():
            continue
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy2(wheel, target)
    return dest


# -- cloud machines ---------------------------------------------------------------------------
# What the AWS and GCP simulators share: their instances are bookworm hosts booted by the
# provider's real first-boot script.

MACHINE_SUITE = "bookworm"
"""The cloud machines' image: a stock Debian 12 (python3 3.11, no venv, no pip)."""
FAKE_POWEROFF = "/usr/local/sbin/poweroff"
"""The fake ``poweroff`` on every machine, first on its PATH (a minimal Debian has none)."""
POWEROFF_MARKER = "/var/lib/skyward-test/powered-off"
"""What the fake ``poweroff`` writes, inside the machine, each time it is called."""


def machine_requirements() -> list[str]:
    """What the machines' environments need from the served index: the agent's requirements
    (cloudpickle pinned to this client's, as skyward asks), and JAX's CPU wheels at this
    interpreter's versions for the JAX tests."""
    jax = importlib.metadata.version("jax")
    return [
        f"cloudpickle=={importlib.metadata.version('cloudpickle')}",
        "packaging",
        f"jax=={jax}",
        f"jaxlib=={jax}",
    ]


def install_fake_poweroff(host: BareHost) -> Path:
    """Put the fake ``poweroff`` on `host`; return the marker it writes, as seen from here."""
    fake = host.root / FAKE_POWEROFF.lstrip("/")
    fake.parent.mkdir(parents=True, exist_ok=True)
    marker = Path(POWEROFF_MARKER)
    fake.write_text(f"#!/bin/sh\nmkdir -p {marker.parent}\ndate >> {marker}\n")
    fake.chmod(0o755)
    return host.root / POWEROFF_MARKER.lstrip("/")


def first_boot(
    host: BareHost, script: str, where: str, *, install_host_key: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a cloud provider's first-boot `script` on `host` as its image would, then start the
    host's sshd again (the caller stopped it, and authorized the login key). The script runs as
    root from `where`, inside the machine; the image's sysv script for sshd (the script's
    ``service ssh restart`` where there is no systemd) leaves sshd to the harness, which
    supervises it. With ``install_host_key=False`` the machine's sshd serves its own host key
    rather than the one the script made (and published). Returns the script's process, for its
    output and status."""
    (host.root / "etc/ssh/sshd_not_to_be_run").write_text("sshd runs under the harness\n")
    path = host.root / where.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    proc = host.run("bash", where, check=False)
    if not install_host_key:
        key = host.root / "etc/ssh/ssh_host_ed25519_key"
        shutil.copyfile(host.host_key.private_path, key)
        key.chmod(0o600)
        key.with_suffix(".pub").write_text(host.host_key.public_line + "\n")
    host.start()
    return proc
