"""A real Slurm cluster on this one machine, for testing skyward's Slurm provider.

Plain Python (no pytest), root only, Debian-like machines. Built on
:mod:`tests.support.sshd` (its network namespaces, process helpers and apt locking):

* :func:`ensure_slurm` installs Debian's ``slurm-wlm`` and ``munge`` with apt when missing,
  without leaving a system slurmctld, slurmd or munged running.
* :class:`SlurmCluster` starts a private ``munged`` (own key and socket), a ``slurmctld`` and
  N ``slurmd`` compute nodes, each node in its own network namespace on a private bridge
  (``10.213.30.0/24`` by default) with its own hostname and ``/etc/hosts``. Every file the
  cluster needs (``slurm.conf``, ``gres.conf``, munge key, state, spool dirs, logs, pid files)
  lives in one temp dir; clients reach the cluster through :meth:`SlurmCluster.env`
  (``SLURM_CONF``), so nothing under ``/etc`` is read or written.
* :func:`remove_stale_slurm_resources` removes what a crashed run left behind.

What this stand-in hides compared with a real cluster:

* The compute nodes share this machine's filesystem, users and Python (like a cluster with a
  shared home and a common node image): a path or a package the client has, every node has,
  except the ``private_dirs`` a cluster is given (a tmpfs of each node's own there).
* Every job runs as root (``SlurmUser=root``) and there is no accounting database (no
  slurmdbd, no associations): any ``--account`` string is accepted, except on a partition
  with ``AllowAccounts``, which then refuses every job at submission ("Invalid account or
  account/partition combination specified"), the listed accounts too, because slurmctld
  finds no association to check. Such a partition is good only for testing refusals.
* No cgroups: ``proctrack/linuxproc`` and ``task/none``, so memory and CPU limits are not
  enforced and nodes may claim more CPUs than the machine has (``config_overrides``).
* GRES are bookkeeping only: ``gpu:a100:4`` makes Slurm count, allocate and refuse four GPUs
  per node, but there is no device behind them. By default empty files stand in for the
  device files: slurmd 22.05 logs that they are "not a valid character or block device",
  keeps no device for them, and its steps get ``SLURM_GPUS_ON_NODE`` but no
  ``CUDA_VISIBLE_DEVICES``. With ``gpu_devices=True`` they are character device nodes
  (``mknod``, major 195 as NVIDIA's ``/dev/nvidia<i>``, nothing behind them): slurmd takes
  them for GPUs and sets ``CUDA_VISIBLE_DEVICES`` to the indexes of the GPUs it granted a
  step, as on a real GPU node without ``ConstrainDevices`` (another job's GPUs are 0 and 1,
  this one's 2 and 3). No process can open them (ENXIO): what a GPU step's program sees of
  its GPUs must come from elsewhere (the fake nvidia-smi of :mod:`tests.support.gpus`).
* The controller runs in this machine's own network namespace (in a UTS namespace of its own
  for its hostname): the client and the controller are on one host, as on a login node that
  also runs slurmctld.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_IFCHR
from types import TracebackType
from typing import Any, Self

from tests.support import sshd

__all__ = [
    "CONTROLLER_NAME",
    "DEFAULT_SLURM_SUBNET",
    "SLURM_APT_PACKAGES",
    "SLURM_WORKDIR_PREFIX",
    "Gres",
    "Partition",
    "SlurmCluster",
    "SlurmNode",
    "ensure_slurm",
    "remove_stale_slurm_resources",
]

SLURM_APT_PACKAGES = ("slurm-wlm", "munge")
"""Debian packages :func:`ensure_slurm` installs (slurmctld, slurmd, clients; munged)."""

DEFAULT_SLURM_SUBNET = "10.213.30.0/24"
"""The nodes' subnet: inside the guarded 10.213.0.0/16 of :mod:`tests.support.sshd`, apart
from every other test network (sshd 0-4, AWS 8-9, bare hosts 12-14, GCP 20-22; the cluster's
self-tests use 31 and 32). Clusters on one subnet take turns: see ``subnet_wait``."""

SLURM_WORKDIR_PREFIX = "skyward-slurm-"
"""Prefix of every cluster's temp dir (under the system temp dir)."""

CONTROLLER_NAME = "slurmctl"
"""Hostname of the controller (its own UTS namespace); ``SlurmctldHost`` names it."""

SLURMCTLD = Path("/usr/sbin/slurmctld")
SLURMD = Path("/usr/sbin/slurmd")
MUNGED = Path("/usr/sbin/munged")
_CLIENTS = ("srun", "sbatch", "salloc", "sinfo", "squeue", "scontrol", "scancel")
# The packaged daemons are symlinks (update-alternatives) to these: /proc/<pid>/exe shows them.
_DAEMON_EXES = {
    "/usr/sbin/slurmctld-wlm",
    "/usr/sbin/slurmd-wlm",
    "/usr/sbin/slurmstepd-wlm",
    str(MUNGED),
}
_SERVICES = ("munge", "slurmctld", "slurmd")
_POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
_DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_apt_updated = False

# Run inside fresh UTS and mount namespaces (unshare): give the process its own /etc/hosts
# (a bind mount that vanishes with the namespace, never touching this machine's file) and
# hostname, then become the daemon. Slurm compares gethostname() with the names in slurm.conf.
# Each directory of the colon-separated third argument gets a tmpfs of the process's own: a
# node's private disk where the cluster's nodes should not share a path (its cache, its home).
_LAUNCH = """\
set -e
name=$1
hosts=$2
private=$3
shift 3
mount --bind "$hosts" /etc/hosts
hostname "$name"
IFS=:
for dir in $private; do
    mkdir -p "$dir"
    mount -t tmpfs -o mode=0755 "private-$name" "$dir"
done
unset IFS
exec "$@"
"""


# --------------------------------------------------------------------------- install


def _installed() -> bool:
    return (
        SLURMCTLD.exists()
        and SLURMD.exists()
        and MUNGED.exists()
        and all(shutil.which(c) for c in _CLIENTS)
        and shutil.which("nsenter") is not None
        and shutil.which("unshare") is not None
    )


def _daemon_pids() -> dict[int, str]:
    """{pid: cmdline} of every live munged, slurmctld, slurmd and slurmstepd on the machine."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            exe = os.readlink(entry / "exe").removesuffix(" (deleted)")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if exe in _DAEMON_EXES and sshd.pid_alive(int(entry.name)):
            found[int(entry.name)] = cmdline.strip()
    return found


def _stop_system_services(before: set[int]) -> None:
    """Stop any munged/slurmctld/slurmd that the install started (the system services).

    Ours always carry their temp dir on the command line; anything else that appeared during
    the install is a service the package started despite policy-rc.d.
    """
    strays: dict[int, int] = {}
    for pid, cmdline in _daemon_pids().items():
        if pid in before or SLURM_WORKDIR_PREFIX in cmdline:
            continue
        stat = sshd._proc_stat(pid)
        if stat is not None:
            strays[pid] = stat[1]
    sshd._terminate(strays)
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        sshd._run(["systemctl", "disable", "--now", *_SERVICES], check=False)


def ensure_slurm() -> None:
    """Make sure Slurm's daemons and clients and munged exist, installing them if needed.

    Installs :data:`SLURM_APT_PACKAGES` with ``apt-get install --no-install-recommends`` as
    root (``apt-get update`` only when that first try fails: stale package lists), with a
    temporary ``policy-rc.d`` that forbids starting services; any daemon the install still
    started is stopped. Raises ``RuntimeError`` when they are missing and cannot be installed.
    """
    global _apt_updated
    if _installed():
        return
    if not sshd.is_root():
        raise RuntimeError(
            "Slurm is not installed and we are not root: install it with "
            f"`apt-get install -y --no-install-recommends {' '.join(SLURM_APT_PACKAGES)}`"
        )
    if shutil.which("apt-get") is None:
        raise RuntimeError("Slurm is not installed and there is no apt-get to install it with")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_MODE": "l"}
    install = [
        "apt-get", "install", "-y", "--no-install-recommends",
        "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
        *SLURM_APT_PACKAGES, "util-linux",
    ]  # fmt: skip
    with sshd._file_lock("apt"):
        if _installed():
            return
        before = set(_daemon_pids())
        made_policy = False
        if not _POLICY_RC_D.exists():
            _POLICY_RC_D.write_text("#!/bin/sh\n# skyward tests: never start services\nexit 101\n")
            _POLICY_RC_D.chmod(0o755)
            made_policy = True
        try:
            proc = sshd._run(install, check=False, env=env, timeout=900)
            if proc.returncode != 0 and not _apt_updated:
                sshd._run(["apt-get", "update"], env=env, timeout=600)
                _apt_updated = True
                sshd._run(install, env=env, timeout=900)
            elif proc.returncode != 0:
                raise RuntimeError(f"apt-get install failed: {proc.stderr.strip()[-2000:]}")
        finally:
            if made_policy:
                _POLICY_RC_D.unlink(missing_ok=True)
            _stop_system_services(before)
    if not _installed():
        raise RuntimeError(f"installed {' '.join(SLURM_APT_PACKAGES)} but Slurm is still missing")


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Gres:
    """A generic resource every node has, e.g. ``Gres.parse("gpu:a100:4")``."""

    name: str
    type: str | None
    count: int

    @classmethod
    def parse(cls, spec: str) -> Gres:
        """Parse ``name[:type]:count`` (``gpu:a100:4``, ``gpu:2``)."""
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[-1].isdigit() or int(parts[-1]) < 1:
            raise ValueError(f"GRES must look like gpu:a100:4 or gpu:2, not {spec!r}")
        return cls(parts[0], parts[1] if len(parts) == 3 else None, int(parts[-1]))

    def __str__(self) -> str:
        """The ``Gres=`` value of slurm.conf (``gpu:a100:4``)."""
        middle = f":{self.type}" if self.type else ""
        return f"{self.name}{middle}:{self.count}"


@dataclass(frozen=True)
class Partition:
    """One ``PartitionName=`` line of slurm.conf."""

    name: str
    nodes: tuple[str, ...] = ()
    """Node names in it; empty: every node of the cluster."""
    default: bool = False
    allow_accounts: tuple[str, ...] = ()
    """``AllowAccounts``; empty: ``ALL``. Without an accounting database a non-empty list
    refuses every job, the listed accounts too (see the module's note)."""
    max_time: str = "INFINITE"
    """Slurm time (``INFINITE``, minutes, ``1:00:00``)."""
    options: tuple[str, ...] = ()
    """More ``Key=Value`` words for the line (``PriorityTier=10``, ``PreemptMode=CANCEL``)."""

    def line(self, all_nodes: Sequence[str]) -> str:
        """The slurm.conf line."""
        nodes = ",".join(self.nodes or all_nodes)
        accounts = ",".join(self.allow_accounts) or "ALL"
        default = "YES" if self.default else "NO"
        return (
            f"PartitionName={self.name} Nodes={nodes} Default={default}"
            f" MaxTime={self.max_time} AllowAccounts={accounts} State=UP"
            + "".join(f" {option}" for option in self.options)
        )


@dataclass
class SlurmNode:
    """One compute node: a network namespace (and its own UTS and mount namespaces) running
    ``slurmd -D -N <name>``. Processes of its jobs (slurmstepd, tasks) live in the same
    network namespace, which is how they are found."""

    name: str
    netns: str
    address: str
    workdir: Path
    """Its spool dir, slurmd log, pid file, console log and /etc/hosts live here."""
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def log_path(self) -> Path:
        """slurmd's log (``SlurmdLogFile``)."""
        return self.workdir / "slurmd.log"

    @property
    def console_path(self) -> Path:
        """slurmd's stdout and stderr (what it says before its log is open)."""
        return self.workdir / "console.log"

    @property
    def pid(self) -> int | None:
        """PID of this node's slurmd, or None when it is not running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while this node's slurmd is alive."""
        return self._proc is not None and self._proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process of this node (slurmd, slurmstepd, job tasks)."""
        out = sshd._run([sshd._ip(), "netns", "pids", self.netns], check=False).stdout
        return [int(tok) for tok in out.split() if tok.isdigit() and sshd.pid_alive(int(tok))]

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of slurmd's log (and of its console where that says more)."""
        return _console_tail(self.console_path, self.log_path, lines)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"<no {path.name}>"
    return "\n".join(text.splitlines()[-lines:])


def _console_tail(console: Path, log: Path, lines: int) -> str:
    """The daemon's log tail, after what its console says that the log does not (errors of
    the launcher, or of the daemon before it opened its log: it echoes the rest there)."""
    try:
        said = console.read_text(errors="replace").splitlines()
    except OSError:
        said = []
    own = [line for line in said if not re.match(r"(slurmctld|slurmd|munged): ", line)]
    if not log.exists():
        own = said
    head = "\n".join(own[-lines:])
    return f"{head}\n{_tail(log, lines)}" if head else _tail(log, lines)


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


# --------------------------------------------------------------------------- the cluster


class SlurmCluster:
    """A Slurm cluster on this machine: munged, slurmctld and ``nodes`` slurmd.

    Layout for run id ``ID`` on 10.213.30.0/24: the bridge (see
    :class:`tests.support.sshd.NetnsHosts`) holds 10.213.30.1, where nodes and clients reach
    slurmctld (hostname :data:`CONTROLLER_NAME`; it listens on a free port of every address,
    having no bind option); node ``node<i>`` is namespace
    ``skyt-ID-<i>`` at 10.213.30.(11+i). slurm.conf names every node's address
    (``NodeAddr``), so clients here resolve nothing. The nodes reach only the bridge.

    Use as a context manager, or :meth:`start` and :meth:`close`. ``close`` kills every
    process the cluster started (its jobs' too), deletes the network and the temp dir; so does
    a :meth:`start` that fails halfway.
    """

    def __init__(
        self,
        nodes: int = 3,
        *,
        cpus_per_node: int = 2,
        gres: str | None = None,
        partitions: Sequence[Partition] | None = None,
        subnet: str = DEFAULT_SLURM_SUBNET,
        run_id: str | None = None,
        cluster_name: str = "skyward",
        extra_config: Sequence[str] = (),
        ready_timeout: float = 30.0,
        slurmd_timeout: int = 10,
        subnet_wait: float = 600.0,
        private_dirs: Sequence[str] = (),
        gpu_devices: bool = False,
    ) -> None:
        """Describe (not start) a cluster.

        ``gres`` (``gpu:a100:4``) gives every node that GRES (``GresTypes=gpu`` always).
        ``partitions`` default to one default partition ``debug`` with every node.
        ``extra_config`` lines are appended to slurm.conf (before nodes and partitions).
        ``slurmd_timeout`` (``SlurmdTimeout``, seconds): a node that stops answering is
        marked down within about twice that. ``start`` waits up to ``subnet_wait`` seconds
        while another cluster (or BareHosts), in any process, uses the same subnet.
        ``private_dirs`` (absolute paths) are each node's own: an empty tmpfs per node, mounted
        in its mount namespace, so a cache or home there is not shared (every other path is).
        ``gpu_devices``: the GRES's device files are character device nodes, so Slurm sets
        ``CUDA_VISIBLE_DEVICES`` in the steps given GPUs (see the module's note).
        """
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if cpus_per_node < 1:
            raise ValueError("cpus_per_node must be at least 1")
        self.net = sshd.NetnsHosts(
            nodes, subnet=subnet, run_id=run_id, start_sshd=False, subnet_wait=subnet_wait
        )
        self.run_id = self.net.run_id
        self.subnet = str(self.net.subnet)
        self.cpus_per_node = cpus_per_node
        self.gres = Gres.parse(gres) if gres else None
        self.gpu_devices = gpu_devices
        self.cluster_name = cluster_name
        self.extra_config = list(extra_config)
        self.ready_timeout = ready_timeout
        self.slurmd_timeout = slurmd_timeout
        self.subnet_wait = subnet_wait
        if any(":" in d or not os.path.isabs(d) for d in private_dirs):
            raise ValueError(f"private_dirs must be absolute paths without ':': {private_dirs}")
        self.private_dirs = tuple(private_dirs)
        self.nodes: list[SlurmNode] = []
        names = [f"node{i}" for i in range(nodes)]
        self.partitions = list(partitions or [Partition("debug", default=True)])
        for part in self.partitions:
            unknown = set(part.nodes) - set(names)
            if unknown:
                raise ValueError(f"partition {part.name} names unknown nodes {sorted(unknown)}")
        self._names = names
        self.workdir: Path | None = None
        self.controller_port = 0
        self._munged: subprocess.Popen[bytes] | None = None
        self._ctld: subprocess.Popen[bytes] | None = None
        self._ctld_uts: int | None = None
        self._net_inodes: set[int] = set()
        self._started_ticks = 0
        self._claim: contextlib.ExitStack | None = None

    # -- paths and addresses

    def _dir(self) -> Path:
        if self.workdir is None:
            raise RuntimeError("the cluster is not started")
        return self.workdir

    @property
    def conf_path(self) -> Path:
        """The cluster's slurm.conf (clients find it through ``SLURM_CONF``)."""
        return self._dir() / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        """The private munged's socket (``AuthInfo=socket=...``)."""
        return self._dir() / "munge" / "munge.socket"

    @property
    def controller_log(self) -> Path:
        """slurmctld's log."""
        return self._dir() / "ctld" / "slurmctld.log"

    @property
    def controller_address(self) -> str:
        """The address slurmctld is reached at (the bridge's)."""
        return self.net.bridge_address

    @property
    def node_names(self) -> list[str]:
        """Names of the compute nodes, in order (``node0``, ``node1``, ...)."""
        return list(self._names)

    def node(self, name: str) -> SlurmNode:
        """The node called ``name``."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} (nodes: {', '.join(self._names)})")

    # -- client side

    def env(self) -> dict[str, str]:
        """Variables a Slurm client command needs on top of its environment (``SLURM_CONF``).

        Slurm reads everything else (controller address and port, munge socket) from that
        slurm.conf. Drop any ``SLURM_*`` the caller inherited: :meth:`client_environ` does.
        """
        return {"SLURM_CONF": str(self.conf_path)}

    def client_environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment without inherited ``SLURM_*`` variables, plus
        :meth:`env` and ``extra``: what :meth:`run` and :meth:`popen` give commands."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**base, **self.env(), **(extra or {})}

    def run(
        self,
        args: Sequence[str],
        *,
        check: bool = False,
        timeout: float = 60.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``["srun", "-N3", "hostname"]``) against this cluster,
        capturing text output; ``check`` raises ``RuntimeError`` (with its output) on failure.
        It runs in the cluster's own directory, where a batch job's ``slurm-<id>.out`` lands."""
        proc = subprocess.run(
            list(args),
            cwd=self._dir(),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.client_environ(env),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} failed with exit code {proc.returncode}\n"
                f"stdout: {proc.stdout.strip()[-2000:]}\nstderr: {proc.stderr.strip()[-2000:]}"
            )
        return proc

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a Slurm client command (e.g. an ``srun`` step with piped stdin/stdout) with
        :meth:`client_environ`; ``kwargs`` go to ``subprocess.Popen`` (``env`` is merged)."""
        extra = kwargs.pop("env", None)
        kwargs.setdefault("cwd", self._dir())
        return subprocess.Popen(list(args), env=self.client_environ(extra), **kwargs)

    def submit(self, args: Sequence[str], timeout: float = 30.0) -> int:
        """Run ``sbatch --parsable ARGS`` and return the job id (raise when refused)."""
        out = self.run(["sbatch", "--parsable", *args], check=True, timeout=timeout).stdout
        return int(out.strip().split(";")[0])

    def allocate(self, args: Sequence[str] = (), timeout: float = 30.0) -> int:
        """Make an allocation with ``salloc --no-shell ARGS`` and return its job id."""
        proc = self.run(["salloc", "--no-shell", *args], check=True, timeout=timeout)
        found = re.search(r"Granted job allocation (\d+)", proc.stdout + proc.stderr)
        if found is None:
            raise RuntimeError(f"salloc printed no job id: {proc.stderr.strip()}")
        return int(found.group(1))

    def job_state(self, job_id: int) -> str:
        """The job's state (``RUNNING``, ``PENDING``, ``CANCELLED``...), "" when unknown."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        found = re.search(r"\bJobState=(\S+)", out)
        return found.group(1) if found else ""

    def node_states(self) -> dict[str, str]:
        """{node name: sinfo state} (``idle``, ``alloc``, ``mix``, ``down*``...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15).stdout
        states: dict[str, str] = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    # -- lifecycle

    def __enter__(self) -> Self:
        """Start the cluster (see :meth:`start`)."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the cluster; raise about leftovers only if the body did not fail."""
        self.close(raise_on_leftovers=exc_type is None)

    def start(self) -> Self:
        """Install Slurm if needed, build the network, start munged, slurmctld and every
        slurmd, and wait until every node is ``idle``. Undoes everything if a step fails."""
        if not sshd.is_root():
            raise RuntimeError("SlurmCluster needs root")
        if self._claim is not None:
            return self
        ensure_slurm()
        stack = contextlib.ExitStack()  # the subnet is claimed by net.build, below
        self._claim = stack
        stat = sshd._proc_stat(os.getpid())
        self._started_ticks = _boot_ticks_now()
        try:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{SLURM_WORKDIR_PREFIX}{self.run_id}-"))
            self.workdir.chmod(0o755)
            (self.workdir / "owner.json").write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "start": stat[1] if stat else 0,
                        "netns": self.net.netns_names,
                        "veths": [h.veth for h in self.net.hosts],
                        "bridge": self.net.bridge,
                        "unreachable": self.net.unreachable_address,
                    }
                )
            )
            self.net.build()
            self._net_inodes = {sshd._netns_inode(h.netns) for h in self.net.hosts}
            self.nodes = [
                SlurmNode(name, h.netns, h.address, self.workdir / "nodes" / name)
                for name, h in zip(self._names, self.net.hosts, strict=True)
            ]
            self._write_files()
            self._start_munged()
            self._start_controller()
            for node in self.nodes:
                self._launch_node(node)
            self.wait_ready()
        except BaseException:
            self.close(raise_on_leftovers=False)
            raise
        return self

    def _write_files(self) -> None:
        work = self._dir()
        for sub in ("etc", "ctld/state", "munge"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (node.workdir / "spool").mkdir(parents=True, exist_ok=True)
        # munged refuses a socket dir that others may write to; clients only need to traverse.
        (work / "munge").chmod(0o711)
        key = work / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        # slurmctld listens on every address (it has no bind option): a free port keeps two
        # clusters (or a system slurmctld) on this machine apart.
        self.controller_port = sshd.free_port("0.0.0.0")
        hosts = ["127.0.0.1\tlocalhost", f"{self.controller_address}\t{CONTROLLER_NAME}"]
        hosts += [f"{n.address}\t{n.name}" for n in self.nodes]
        (work / "etc" / "hosts").write_text("".join(f"{line}\n" for line in hosts))
        self.conf_path.write_text(self._slurm_conf())
        (work / "etc" / "gres.conf").write_text(self._gres_conf())
        # An empty plugstack.conf: SPANK plugins of this machine's /etc/slurm stay out.
        (work / "etc" / "plugstack.conf").write_text("")
        for path in (work / "etc").iterdir():
            path.chmod(0o644)

    def _slurm_conf(self) -> str:
        work = self._dir()
        node_dir = work / "nodes" / "%n"
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={CONTROLLER_NAME}({self.controller_address})",
            f"SlurmctldPort={self.controller_port}",
            "SlurmdPort=6818",  # every node has an address of its own
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            # No cgroups: the nodes share this machine's cgroup tree, so none can be enforced.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # Schedule at once: tests wait on every submission.
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            # Refuse at submission what a partition would never run (a disallowed account,
            # too long a time limit) instead of leaving it pending forever.
            "EnforcePartLimits=ALL",
            "GresTypes=gpu",
            f"PlugStackConfig={work / 'etc' / 'plugstack.conf'}",
            f"StateSaveLocation={work / 'ctld' / 'state'}",
            f"SlurmctldPidFile={work / 'ctld' / 'slurmctld.pid'}",
            f"SlurmctldLogFile={self.controller_log}",
            f"SlurmdSpoolDir={node_dir / 'spool'}",
            f"SlurmdPidFile={node_dir / 'slurmd.pid'}",
            f"SlurmdLogFile={node_dir / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # Nodes claim the CPUs slurm.conf gives them, not this machine's count.
            "SlurmdParameters=config_overrides",
            # A node that comes back (kill_node, then start_node) is usable again at once; one
            # an admin set down stays down until resumed (=2 would return it at its next
            # registration, which follows the kill of its jobs within moments).
            "ReturnToService=1",
            # Short timeouts: a lost node or an unanswered message shows within seconds.
            f"SlurmdTimeout={self.slurmd_timeout}",
            "MessageTimeout=5",
            "TCPTimeout=2",
            "KillWait=2",
            "InactiveLimit=0",
            "MinJobAge=60",
            *self.extra_config,
        ]
        gres = f" Gres={self.gres}" if self.gres else ""
        for node in self.nodes:
            lines.append(
                f"NodeName={node.name} NodeAddr={node.address} NodeHostname={node.name}"
                f" CPUs={self.cpus_per_node} RealMemory=1000{gres} State=UNKNOWN"
            )
        lines += [part.line(self._names) for part in self.partitions]
        return "".join(f"{line}\n" for line in lines)

    def _gres_conf(self) -> str:
        if self.gres is None:
            return ""
        # slurmd counts a GPU per device file; without File= it reports none and the node is
        # drained as INVAL. Empty regular files stand in for /dev/nvidia<i>, or, to have Slurm
        # set CUDA_VISIBLE_DEVICES, device nodes: slurmd keeps a device only for a file that
        # stat() calls a character or block device (195: NVIDIA's major number).
        devices = self._dir() / "dev"
        devices.mkdir(exist_ok=True)
        for i in range(self.gres.count):
            if self.gpu_devices:
                os.mknod(devices / f"{self.gres.name}{i}", 0o600 | S_IFCHR, os.makedev(195, i))
            else:
                (devices / f"{self.gres.name}{i}").touch()
        last = self.gres.count - 1
        files = f"{devices}/{self.gres.name}[0-{last}]" if last else f"{devices}/{self.gres.name}0"
        type_ = f" Type={self.gres.type}" if self.gres.type else ""
        return f"AutoDetect=off\nName={self.gres.name}{type_} File={files}\n"

    def _daemon_env(self) -> dict[str, str]:
        return {
            "PATH": _DAEMON_PATH,
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "SLURM_CONF": str(self.conf_path),
        }

    def _popen(self, argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            return subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self._daemon_env(),
                start_new_session=True,
                close_fds=True,
            )

    def _start_munged(self) -> None:
        work = self._dir() / "munge"
        argv = [
            str(MUNGED), "--foreground", f"--socket={self.munge_socket}",
            f"--key-file={work / 'munge.key'}", f"--pid-file={work / 'munged.pid'}",
            f"--log-file={work / 'munged.log'}", f"--seed-file={work / 'munged.seed'}",
            # --force: run although the temp dir's parents are world-writable (/tmp).
            "--force",
        ]  # fmt: skip
        self._munged = self._popen(argv, work / "console.log")
        deadline = time.monotonic() + 10
        while True:
            if self._munged.poll() is not None:
                raise RuntimeError(
                    f"munged exited with code {self._munged.returncode}:\n"
                    f"{_tail(work / 'console.log', 20)}\n{_tail(work / 'munged.log', 20)}"
                )
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(str(self.munge_socket))
                    return
                except OSError:
                    pass
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"munged did not open its socket:\n{_tail(work / 'munged.log', 20)}"
                )
            time.sleep(0.02)

    def _start_controller(self) -> None:
        work = self._dir()
        argv = [
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", _LAUNCH, "sh", CONTROLLER_NAME, str(work / "etc" / "hosts"), "",
            str(SLURMCTLD), "-D", "-i", "-f", str(self.conf_path),
        ]  # fmt: skip
        self._ctld = self._popen(argv, work / "ctld" / "console.log")
        self._ctld_uts = self._await_own_uts(self._ctld, "slurmctld", work / "ctld" / "console.log")

    def _await_own_uts(self, proc: subprocess.Popen[bytes], what: str, log: Path) -> int:
        """Return the UTS namespace inode of ``proc`` once it has left ours (after unshare):
        every process the controller starts stays in it, which is how they are found."""
        own = _ns_inode(os.getpid(), "uts")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            inode = _ns_inode(proc.pid, "uts")
            if inode is not None and inode != own:
                return inode
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        code = proc.poll()
        how = f"exited with code {code} on start-up" if code is not None else "did not start"
        raise RuntimeError(f"{what} {how}:\n{_tail(log, 20)}")

    def _launch_node(self, node: SlurmNode) -> None:
        # nsenter, not `ip netns exec`: that remounts /sys, which hides the cgroup
        # filesystem slurmd 22.05 checks for even with proctrack/linuxproc.
        argv = [
            "nsenter", f"--net=/run/netns/{node.netns}",
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", _LAUNCH, "sh", node.name, str(self._dir() / "etc" / "hosts"),
            ":".join(self.private_dirs),
            str(SLURMD), "-D", "-N", node.name, "-f", str(self.conf_path),
        ]  # fmt: skip
        node._proc = self._popen(argv, node.console_path)

    def start_node(self, name: str, wait: bool = True) -> None:
        """Start the node's slurmd again (after :meth:`kill_node`); wait until it is idle."""
        node = self.node(name)
        if node.running:
            return
        self._launch_node(node)
        if wait:
            self.wait_ready([name])

    def kill_node(self, name: str) -> None:
        """Power-cut the node: SIGKILL its slurmd and every process of its jobs. The
        controller marks it down within about twice ``slurmd_timeout``."""
        node = self.node(name)
        proc, node._proc = node._proc, None
        procs = {p: s for p in node.pids() if (s := _start_of(p)) is not None}
        if proc is not None and proc.poll() is None:
            proc.kill()
        for pid, start in procs.items():
            sshd._signal_if_same(pid, start, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=10)
        _wait_gone(procs, 5.0)

    def wait_ready(self, names: Sequence[str] | None = None, timeout: float | None = None) -> None:
        """Wait until the nodes (default: all) are ``idle`` in sinfo; raise ``RuntimeError``
        with the state seen and the daemons' log tails when they are not within ``timeout``
        (default ``ready_timeout``, 30 s) or a daemon exits."""
        wanted = list(names or self._names)
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        states: dict[str, str] = {}
        problem = ""
        while True:
            dead = self._dead_daemons()
            if dead:
                problem = f"{', '.join(dead)} exited"
                break
            try:
                states = self.node_states()
            except subprocess.TimeoutExpired:
                states = {}
            if all(states.get(name) == "idle" for name in wanted):
                return
            if time.monotonic() >= deadline:
                problem = "nodes not idle in time"
                break
            time.sleep(0.1)
        raise RuntimeError(
            f"Slurm cluster {self.run_id} not ready ({problem}); sinfo: {states or 'no answer'}\n"
            f"{self.log_tails()}"
        )

    def _dead_daemons(self) -> list[str]:
        dead = []
        if self._munged is None or self._munged.poll() is not None:
            dead.append("munged")
        if self._ctld is None or self._ctld.poll() is not None:
            dead.append("slurmctld")
        dead += [
            f"slurmd of {n.name}" for n in self.nodes if n._proc and n._proc.poll() is not None
        ]
        return dead

    def log_tails(self, lines: int = 20) -> str:
        """The last lines of slurmctld's, every slurmd's and munged's logs, labelled."""
        if self.workdir is None:
            return "<cluster not started>"
        work = self._dir()
        ctld = _console_tail(work / "ctld" / "console.log", self.controller_log, lines)
        munged = _console_tail(work / "munge" / "console.log", work / "munge" / "munged.log", lines)
        parts = [f"--- slurmctld:\n{ctld}"]
        parts += [f"--- slurmd {n.name}:\n{n.log_tail(lines)}" for n in self.nodes]
        parts.append(f"--- munged:\n{munged}")
        return "\n".join(parts)

    # -- processes and teardown

    def processes(self) -> dict[int, int]:
        """{pid: start time} of every live process of the cluster: munged, slurmctld (and
        whatever runs in its UTS namespace), and everything in the nodes' network namespaces
        (slurmd, slurmstepd, job tasks), plus any process naming the temp dir."""
        found: dict[int, int] = {}
        tracked = {p.pid for p in (self._munged, self._ctld) if p is not None}
        tracked |= {n.pid for n in self.nodes if n.pid is not None}
        uts = {self._ctld_uts} if self._ctld_uts is not None else set()
        workdir = str(self.workdir) if self.workdir is not None else None
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            stat = sshd._proc_stat(pid)
            if stat is None or not sshd.pid_alive(pid) or pid == os.getpid():
                continue
            ours = pid in tracked
            # Namespace inodes are reused once a namespace dies: only processes started after
            # this cluster can be its own.
            if not ours and stat[1] >= self._started_ticks:
                ours = _ns_inode(pid, "net") in self._net_inodes or _ns_inode(pid, "uts") in uts
            if not ours and workdir is not None:
                with contextlib.suppress(OSError):
                    ours = workdir.encode() in (entry / "cmdline").read_bytes()
            if ours:
                found[pid] = stat[1]
        return found

    def leftovers(self) -> list[str]:
        """Describe whatever of this cluster still exists (empty after :meth:`close`):
        processes, namespaces, links, routes, mounts and the temp dir."""
        found = [f"pid {pid} ({_cmdline(pid)})" for pid in self.processes()]
        guard = f"route unreachable {self.net.guard_network}"
        found += [item for item in self.net.leftovers() if item != guard]
        if self.workdir is not None:
            token = str(self.workdir)
            for entry in Path("/proc").iterdir():
                with contextlib.suppress(OSError):
                    if entry.name.isdigit() and token in (entry / "mountinfo").read_text():
                        found.append(f"mount of {token} in pid {entry.name}")
            if self.workdir.exists():
                found.append(f"dir {self.workdir}")
        return found

    def close(self, raise_on_leftovers: bool = True) -> None:
        """Kill every process of the cluster (jobs included), delete the network and the temp
        dir. Idempotent; raises ``RuntimeError`` naming leftovers unless told not to."""
        if self._claim is None:
            return
        try:
            procs = self.processes()
            # The nodes get a power cut (SIGKILL): their jobs need no grace, and slurmstepd
            # would otherwise wait out KillWait. The controller and munged get SIGTERM.
            on_nodes = {p: s for p, s in procs.items() if _ns_inode(p, "net") in self._net_inodes}
            for pid, start in on_nodes.items():
                sshd._signal_if_same(pid, start, signal.SIGKILL)
            sshd._terminate({p: s for p, s in procs.items() if p not in on_nodes}, grace=2.0)
            children = [n._proc for n in self.nodes] + [self._munged, self._ctld]
            for proc in children:  # reap them: no zombie of ours is left
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
            for node in self.nodes:
                node._proc = None
            self._munged = self._ctld = None
            _wait_gone(procs, 5.0)
            self.net.close(raise_on_leftovers=False)  # kills anything left in the namespaces
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
            left = self.leftovers()
        finally:
            self._claim.close()
            self._claim = None
        if left and raise_on_leftovers:
            raise RuntimeError(f"SlurmCluster {self.run_id} left behind: {', '.join(left)}")

    def __repr__(self) -> str:
        """Readable summary for test output."""
        state = "started" if self._claim is not None else "stopped"
        return f"SlurmCluster({self.run_id}, {len(self._names)} nodes on {self.subnet}, {state})"


def _boot_ticks_now() -> int:
    """Now, in clock ticks since boot (the unit of /proc/<pid>/stat's start time)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return int(uptime * os.sysconf("SC_CLK_TCK")) - 1


def _start_of(pid: int) -> int | None:
    stat = sshd._proc_stat(pid)
    return stat[1] if stat is not None else None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _wait_gone(procs: Mapping[int, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(sshd._alive_same(p, s) for p, s in procs.items()):
            return
        time.sleep(0.02)


def remove_stale_slurm_resources() -> list[str]:
    """Remove what crashed :class:`SlurmCluster` runs left (their owner process is gone):
    the processes naming their temp dir, their namespaces (and what runs there), links,
    routes and the temp dir. Safe beside live clusters. Returns what was removed."""
    removed: list[str] = []
    for folder in Path(tempfile.gettempdir()).glob(f"{SLURM_WORKDIR_PREFIX}*"):
        try:
            owner = json.loads((folder / "owner.json").read_text())
            pid, start = int(owner["pid"]), int(owner["start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        stat = sshd._proc_stat(pid)
        if stat is not None and stat[1] == start:
            continue  # its owner still runs
        token = str(folder).encode()
        procs: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and token in (entry / "cmdline").read_bytes():
                    start_ = _start_of(int(entry.name))
                    if start_ is not None:
                        procs[int(entry.name)] = start_
        sshd._terminate(procs)
        ip = sshd._ip()
        for netns in owner.get("netns", []):
            sshd._delete_netns(netns)
        for link in [*owner.get("veths", []), owner.get("bridge", "")]:
            if link and sshd._link_exists(link):
                sshd._run([ip, "link", "del", link], check=False)
        if owner.get("unreachable"):
            sshd._run([ip, "route", "del", "unreachable", f"{owner['unreachable']}/32"],
                      check=False)  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed
