"""One bootstrap step on a host reached over SSH, and the steps every remote provider shares.

A step is a shell command run through the host's connection with the pool's build environment
(`Bootstrap`); its name and output lines go to the node's log as it runs, and a failure becomes
a `BootstrapError` naming the host, with the command's last lines and, when the host's cache is
nearly full, a word on that (the tools that fail do not always say ENOSPC). `CACHE` is where
everything skyward keeps on a host lives.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import importlib.metadata as metadata
import json
import shlex
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import asyncssh

from skyward import checks
from skyward.errors import BootstrapError
from skyward.image import Index
from skyward.providers.base import Log
from skyward.providers.environment import packaged_uv
from skyward.providers.remote.host import Host
from skyward.providers.source import source_hash
from skyward.transport.sshhost import Completed
from skyward.transport.stdinenv import READ_ENV, env_line
from skyward.worker import hostcheck, uvinstall
from skyward.worker.redact import redact_urls


class NodeOnHost(Protocol):
    """What a step needs of a node (`bootstrap.RemoteNode` is one): its index,
    for errors, and the connection to its host."""

    @property
    def index(self) -> int: ...
    @property
    def host(self) -> Host: ...


# skyward's cache directory on a host as its shell spells it, by the rule of
# `skyward.cachedir.cache_root` (which the agent follows there): $SKYWARD_CACHE_DIR in the host's
# environment, else $XDG_CACHE_HOME/skyward, else ~/.cache/skyward. Valid inside double quotes.
CACHE = "${SKYWARD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/skyward}"


@dataclass(frozen=True)
class Bootstrap:
    """How hosts are prepared: their interpreter, the uv to install, the build steps' env."""

    python: str | None = None  # default python3
    uv_version: str = field(default_factory=lambda: metadata.version("uv"))
    build_env: Mapping[str, str] = field(default_factory=dict)
    # Whether hosts start without skyward's cache (a pod's filesystem is its image's): then
    # skyward's source goes to a host beside its first check rather than after it found none.
    fresh_hosts: bool = False

    def __post_init__(self) -> None:
        checks.optional_text(self.python, "python")
        checks.text(self.uv_version, "uv_version")
        checks.environment(self.build_env, "build_env")


async def install_uv(
    node: NodeOnHost,
    bootstrap: Bootstrap,
    report: hostcheck.HostReport,
    indexes: Sequence[Index],
    log: Log,
) -> str:
    """A uv on the host to build with: the one the check found (skyward's copy, or one on PATH
    of the same minor version), else the client's own uv binary sent over the connection when
    the host's OS, architecture and C library are the client's, else the uv wheel fetched on
    the host from `indexes` (then the default index) with the standard library. No pip, no
    venv module: the host needs only a shell and python3."""
    if report.uv:
        return report.uv
    version = bootstrap.uv_version
    dest = f'"{CACHE}"/' + shlex.quote(f"bootstrap/uv-{version}/bin/uv")
    command = (
        f"{pythonpath()} exec {shlex.quote(report.python)} -m skyward.worker.uvinstall {dest} "
        f"{shlex.quote(version)}"
    )
    sendable = client_uv(version)
    if sendable is not None and sendable[0] == (report.system, report.machine, report.libc):
        binary = await asyncio.to_thread(compressed_uv, sendable[1])
        what = f"sending this client's uv {version} to the host ({len(binary) >> 20} MiB)"
        done = await json_step(node, bootstrap, f"{command} --receive", what, log, binary)
    else:
        # Scoped indexes serve uv only when they name it; unscoped ones serve everything.
        serving = [
            [i.url, i.flat, i.default] for i in indexes if not i.packages or "uv" in i.packages
        ]
        what = f"fetching uv {version} for {report.system} {report.machine} from the indexes"
        # On stdin: an index URL may hold a password, and a command line is public.
        listed = json.dumps(serving).encode()
        done = await json_step(node, bootstrap, f"{command} --fetch", what, log, listed)
    return str(json.loads(done)["uv"])


def client_uv(version: str) -> tuple[tuple[str, str, str], str] | None:
    """This client's uv binary when it is `version`: ((system, machine, libc), path)."""
    path = packaged_uv()
    if path is None or metadata.version("uv") != version:
        return None
    return uvinstall.platform_key(), path


_compressing = threading.Lock()  # the hosts of a cold pool ask at once: compress once


def compressed_uv(path: str) -> bytes:
    """The uv binary at `path`, gzip-compressed once per process (about half its size)."""
    with _compressing:
        return _compressed(path)


@functools.cache
def _compressed(path: str) -> bytes:
    return gzip.compress(Path(path).read_bytes(), compresslevel=1)


def pythonpath() -> str:
    """``PYTHONPATH=`` skyward's shipped source on a host, as a shell word."""
    return f'PYTHONPATH="{CACHE}/src/{source_hash()}"'


async def apt_install(
    node: NodeOnHost, bootstrap: Bootstrap, packages: Sequence[str], uid: int, log: Log
) -> None:
    sudo = "" if uid == 0 else "sudo -n "
    names = " ".join(shlex.quote(p) for p in packages)
    await run_step(
        node,
        bootstrap,
        # The system's usual umask, not the cache's 077 that every step runs with: what apt
        # writes (its lists, dpkg's status, what packages' scripts make) is for every user.
        f"umask 022; export DEBIAN_FRONTEND=noninteractive; {sudo}apt-get update -q 2>&1 && "
        # `--`: a package name that starts with "-" is a name, never an option.
        f"{sudo}apt-get install -y -q --no-install-recommends -- {names} 2>&1",
        f"installing apt packages {', '.join(packages)}",
        log,
        merge=True,
    )


async def send_step(
    node: NodeOnHost, bootstrap: Bootstrap, command: str, what: str, log: Log, input: bytes
) -> Completed:
    log(what)  # the step's name, then its output lines: the node's detail as it builds
    # build_env's values reach the step on its stdin, ahead of its input (`stdinenv`).
    line = env_line(bootstrap.build_env)
    # Every step runs under umask 077 before it makes anything: what it writes to the cache
    # (its first folders, bootstrap/, skyward's source, uv's files) is the user's alone, and a
    # host's login shell has the host's umask (022 on most).
    command = f"umask 077; {command}"

    def echo(text: str) -> None:  # a tool's line may show an index URL with its password
        log(redact_urls(text))

    try:
        return await node.host.run(READ_ENV + command, line + input, echo)
    except (OSError, asyncssh.Error) as exc:
        raise BootstrapError(
            f"{what} on {node.host} failed: the connection broke ({exc})", node=node.index
        ) from None


async def run_step(
    node: NodeOnHost,
    bootstrap: Bootstrap,
    command: str,
    what: str,
    log: Log,
    input: bytes = b"",
    merge: bool = False,
) -> Completed:
    """Run one bootstrap command; a failure becomes a `BootstrapError` with its output."""
    command = f"exec 2>&1; {command}" if merge else command
    done = await send_step(node, bootstrap, command, what, log, input)
    if done.status != 0:
        output = done.tail or done.stdout.decode(errors="replace")[-4000:]
        if merge:  # merged commands print to stdout: show its tail
            output = "\n".join(done.stdout.decode(errors="replace").splitlines()[-40:])
        raise await _failed(node, what, f" (exit status {done.status})", output)
    return done


async def _failed(node: NodeOnHost, what: str, how: str, output: str) -> BootstrapError:
    """The error of a failed step: `how` it failed, a word on a nearly full cache, its last
    lines (the credentials of any URL in them hidden)."""
    how, output = redact_urls(how), redact_urls(output)
    return BootstrapError(
        f"{what} on {node.host} failed{how}{await _low_disk(node)}\n--- last lines ---\n{output}",
        node=node.index,
        output=output,
    )


# Below this much free space in the host's cache, a failed step says so: the tools that fail
# (tar, uv, the uv install) do not always print ENOSPC themselves.
LOW_DISK_BYTES = 512 << 20


async def _low_disk(node: NodeOnHost) -> str:
    """A sentence for a failed step when the host's cache is nearly full; "" otherwise."""
    probe = f'umask 077; C="{CACHE}"; mkdir -p "$C" 2>/dev/null; echo "$C"; df -Pk "$C" | tail -n 1'
    try:
        done = await asyncio.wait_for(node.host.run(probe), 10)
        where, line = done.stdout.decode(errors="replace").strip().splitlines()[-2:]
        free = int(line.split()[3]) * 1024
    except Exception:  # only a hint: no df, a broken connection, odd output
        return ""
    if free >= LOW_DISK_BYTES:
        return ""
    return (
        f"; the host's skyward cache {where} has only {free / 2**20:.1f} MiB free: the disk is "
        "probably full. Free space there, or point SKYWARD_CACHE_DIR at a larger disk in the "
        "host's environment (docs/ssh.md)"
    )


async def json_step(
    node: NodeOnHost, bootstrap: Bootstrap, command: str, what: str, log: Log, input: bytes = b""
) -> str:
    """Run a command that prints one JSON object (or ``{"error", "output"}``) last; its text."""
    done = await send_step(node, bootstrap, command, what, log, input)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    result: dict[str, Any] = {}
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = {}
    if done.status != 0 or "error" in result or not result:
        output = str(result.get("output") or done.tail)
        reason = result.get("error") or f"exit status {done.status}"
        raise await _failed(node, what, f": {reason}", output)
    return lines[-1]
