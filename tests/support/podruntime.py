"""Pods as processes, for the Kubernetes stand-in (`tests.support.fakek8s`): what containerd
and runc do on a node, with the parts this machine has. Plain Python, root only.

A pod's sandbox is a network namespace of the stand-in's `sshd.NetnsHosts` (its own address on
the private bridge, no default route) and a folder: the container's log, the overlay's upper and
work dirs, the disk ``emptyDir`` volumes, and the files the kubelet manages (``/etc/hosts``,
``/etc/hostname``, ``/etc/resolv.conf``), bind-mounted over the image's as the kubelet does and
rewritten in place (`write_in_place`).

`start` runs the container in the sandbox's network namespace: `unshare` gives it its own
mount, UTS, IPC and PID namespaces, and the launch script mounts an overlayfs of the image's root
(a cached Debian root, never written), its own /proc, a read-only /sys, a small /dev (null,
zero, full, random, urandom, tty, its own devpts, a 64 MiB /dev/shm unless a memory volume is
mounted there, as containerd's default), the volumes and the kubelet's files, sets the hostname,
pivots into the root and detaches the rest (as runc does: no mount of this machine, of another
pod or of another test is left in the pod's namespace to pin it), then execs the command as
PID 1 with the container's environment, stdout and stderr appended to the log, stdin from
/dev/null. What is mounted lives in the container's mount namespace and goes with its last
process; nothing is mounted in the test's own.

`exec_argv` is ``runc exec``: nsenter into every namespace of the container's PID 1, its root
and working directory. `find_executable` resolves a command inside a root as execve there would
(symlinks followed inside the root) and says what runc says when it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support import sshd

__all__ = [
    "KUBELET_FILES",
    "Container",
    "LaunchError",
    "Volume",
    "exec_argv",
    "exit_code",
    "find_executable",
    "prepare_folder",
    "start",
    "write_in_place",
]

KUBELET_FILES = ("hosts", "hostname", "resolv.conf")
"""The files under /etc the kubelet writes for a pod and mounts over the image's."""

_SHM_DEFAULT = 64 << 20  # containerd's /dev/shm for a container that mounts none of its own
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_SETUP_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_NSENTER = "/usr/bin/nsenter"

# Run by `sh` as PID 1 of the container's new namespaces (mount, UTS, IPC, PID), inside its
# network namespace. $1 root (the overlay's mount point), $2 the image's layers (top first,
# colon-separated), $3 upper, $4 work, $5 the kubelet's files folder, $6 hostname, $7 working
# directory, $8 the container's PATH, $9 the /dev/shm size in bytes ("" for no limit), then
# volume words up to "--", then the command. A volume is "tmpfs PATH SIZE" (SIZE "" for none)
# or "bind PATH SOURCE". Its stdin is the write end of the readiness pipe: moved to fd 3, it
# gets one byte once the root is pivoted.
_LAUNCH = """\
set -e
root=$1 lower=$2 upper=$3 work=$4 files=$5 name=$6 cwd=$7 cpath=$8 shm=$9
shift 9
PATH={setup_path}
exec 3>&0 </dev/null
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$root"
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
mount -t tmpfs -o nosuid,mode=755,size=65536k tmpfs "$root/dev"
for dev in {devices}; do
    : > "$root/dev/$dev"
    mount --bind "/dev/$dev" "$root/dev/$dev"
done
mkdir "$root/dev/pts" "$root/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts "$root/dev/pts"
ln -s pts/ptmx "$root/dev/ptmx"
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
shm_options=nosuid,nodev,noexec,mode=1777
[ -z "$shm" ] || shm_options="$shm_options,size=$shm"
mount -t tmpfs -o "$shm_options" shm "$root/dev/shm"
while [ "$1" != -- ]; do
    mkdir -p "$root$2"
    if [ "$1" = tmpfs ]; then
        options=nosuid,nodev,mode=1777
        [ -z "$3" ] || options="$options,size=$3"
        mount -t tmpfs -o "$options" tmpfs "$root$2"
    else
        mount --bind "$3" "$root$2"
    fi
    shift 3
done
shift
for file in {files}; do
    [ -e "$root/etc/$file" ] || : > "$root/etc/$file"
    mount --bind "$files/$file" "$root/etc/$file"
done
hostname "$name"
cd "$root"
pivot_root . .
umount -l .
mkdir -p "$cwd"
cd "$cwd"
unset OLDPWD PWD
printf x >&3
exec 3>&-
PATH=$cpath
exec "$@"
""".format(
    setup_path=_SETUP_PATH,
    devices=" ".join(_DEVICES),
    files=" ".join(KUBELET_FILES),
)


class LaunchError(Exception):
    """The container's namespaces or root could not be set up (the launch script's output)."""


@dataclass(frozen=True)
class Volume:
    """An ``emptyDir`` in the container: a tmpfs (``medium: Memory``), or `source` (a folder of
    the sandbox) bound there."""

    mount_path: str
    memory: bool
    size_bytes: int | None = None
    source: Path | None = None


@dataclass
class Container:
    """A running container: the `unshare` process that holds it (its exit status is the
    container's) and the container's PID 1 as this machine sees it."""

    process: asyncio.subprocess.Process
    pid: int
    env: dict[str, str]
    cwd: str
    log: Path

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the container's PID 1 (SIGKILL ends the whole PID namespace; any other
        signal reaches PID 1 only if it handles it, as in a real container)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def wait(self) -> int:
        """Wait for PID 1 to end; its exit code as the runtime reports it (128+N for signal N)."""
        return exit_code(await self.process.wait())


def exit_code(returncode: int) -> int:
    """A `subprocess` return code as a container's exit code (a signal N is 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def prepare_folder(folder: Path, files: Mapping[str, str]) -> None:
    """Make a pod's folder: the overlay's ``upper`` and ``work``, ``volumes``, and ``etc`` with
    the kubelet's `files` (name -> text)."""
    for sub in ("upper", "work", "merged", "volumes", "etc"):
        (folder / sub).mkdir(mode=0o755, parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / "etc" / name).write_text(text)


def write_in_place(path: Path, text: str) -> None:
    """Rewrite `path` keeping its inode (it is bind-mounted into a container): the new bytes
    first, then the length, so a reader never sees an empty file."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


async def start(
    *,
    netns: str,
    layers: Sequence[Path],
    folder: Path,
    hostname: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    volumes: Sequence[Volume],
    timeout: float = 30.0,
) -> Container:
    """Start the container of the sandbox `netns` whose folder is `folder` (`prepare_folder`)
    and return it once its command is about to run; `LaunchError` with the launch script's
    output when a step fails (the process is gone then)."""
    if not argv:
        raise LaunchError("no command to run")
    shm = ""
    words: list[str] = []
    for volume in volumes:
        size = "" if volume.size_bytes is None else str(volume.size_bytes)
        if volume.mount_path == "/dev/shm" and volume.memory:
            shm = size
        elif volume.memory:
            words += ["tmpfs", volume.mount_path, size]
        else:
            assert volume.source is not None
            words += ["bind", volume.mount_path, str(volume.source)]
    if not any(v.mount_path == "/dev/shm" and v.memory for v in volumes):
        shm = str(_SHM_DEFAULT)
    log = folder / "container.log"
    argv_all = [
        sshd._ip(), "netns", "exec", netns,
        "unshare", "--mount", "--uts", "--ipc", "--pid", "--fork", "--propagation", "private",
        "sh", "-c", _LAUNCH, "sh",
        str(folder / "merged"), ":".join(str(layer) for layer in layers),
        str(folder / "upper"), str(folder / "work"),
        str(folder / "etc"), hostname, cwd, env.get("PATH", _SETUP_PATH), shm,
        *words, "--", *argv,
    ]  # fmt: skip
    ready_r, ready_w = os.pipe()
    try:
        with log.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *argv_all,
                stdin=ready_w,
                stdout=out,
                stderr=out,
                env=dict(env),
                start_new_session=True,
            )
    finally:
        os.close(ready_w)
    loop = asyncio.get_running_loop()
    try:
        byte = await asyncio.wait_for(loop.run_in_executor(None, os.read, ready_r, 1), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise LaunchError(f"the container did not start within {timeout:.0f}s") from None
    finally:
        os.close(ready_r)
    if byte != b"x":
        await process.wait()
        tail = log.read_text(errors="replace")[-2000:]
        raise LaunchError(f"the container's launch failed ({process.returncode}): {tail}")
    try:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    except OSError:
        children = []
    if not children:
        # The command ended as soon as it began (a crash at start): the container has ended,
        # and `unshare` is about to exit with its status.
        await process.wait()
        return Container(process, -1, dict(env), cwd, log)
    return Container(process, int(children[0]), dict(env), cwd, log)


def exec_argv(container: Container, argv: Sequence[str]) -> list[str]:
    """The command line that runs `argv` in `container` as ``runc exec`` does: in all of its
    PID 1's namespaces, at its root and working directory (run it with `container.env`)."""
    return [_NSENTER, f"--target={container.pid}", "--all", "--root", "--wd", "--", *argv]


def find_executable(root: Path, command: str, path_var: str, cwd: str = "/") -> str:
    """Where execve would find `command` in the container whose root is `root` (a folder of
    this machine, ``/proc/PID/root`` for a running one), searching `path_var` for a bare name;
    `FileNotFoundError` or `PermissionError` with runc's words when it would fail."""
    if "/" in command:
        where = command if command.startswith("/") else f"{cwd.rstrip('/')}/{command}"
        found = _resolve(root, where)
        if found is None:
            raise FileNotFoundError(f'exec: "{command}": stat {command}: no such file or directory')
        if not _is_executable(found):
            raise PermissionError(f'exec: "{command}": permission denied')
        return where
    for folder in path_var.split(":"):
        where = f"{folder or '.'}/{command}"
        found = _resolve(root, where if where.startswith("/") else f"{cwd}/{where}")
        if found is not None and _is_executable(found):
            return where
    raise FileNotFoundError(f'exec: "{command}": executable file not found in $PATH')


def _is_executable(path: Path) -> bool:
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) and bool(mode & 0o111)


def _resolve(root: Path, path: str, hops: int = 40) -> Path | None:
    """`path` (absolute, inside the container) as a path under `root` with every symlink
    followed inside the root (an absolute link starts again at the root); None if missing."""
    todo = [p for p in path.split("/") if p]
    done: list[str] = []
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        try:
            mode = os.lstat(here).st_mode
        except OSError:
            return None
        if stat.S_ISLNK(mode):
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p] + todo
            continue
        done.append(part)
    return root.joinpath(*done)
