"""The SSH provider: pools on machines that already exist, reached with asyncssh.

Per host, concurrently: one verified connection kept for the pool's life; then ONE remote check
command that reports what is already there (interpreter, skyward source, uv, environment, apt
packages, setup marker); only the missing pieces are then built:

- skyward itself: the client's package dir, tarred and content-hashed, unpacked once to
  ``~/.cache/skyward/src/<hash>/skyward`` (PYTHONPATH points there for envbuild and the agent);
- uv, only when an environment must be built: ``python3 -m venv`` +
  ``pip install uv==<client's uv>`` under ``~/.cache/skyward/bootstrap``;
- the image's environment with `skyward.worker.envbuild`, once per hash under
  ``~/.cache/skyward``; apt packages (``sudo -n`` when not root) and setup commands once.

When the interpreter (``python=`` or ``python3``) already satisfies the image and the agent's
pins, it is used directly, as `Local` does; otherwise a uv environment is built from it. A second
pool with the same image on the same hosts costs one check command and the agent start per host.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata as metadata
import io
import json
import os
import shlex
import tarfile
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import asyncssh

import skyward
from skyward.cluster import ClusterSpec
from skyward.errors import BootstrapError, ConfigError, ProvisionError
from skyward.image import Image
from skyward.providers.base import Log, Node
from skyward.providers.environment import env_spec
from skyward.transport.base import AgentStream
from skyward.transport.ssh import (
    Endpoint,
    KnownHosts,
    SSHConnectError,
    SSHHost,
    connect,
    load_known_hosts,
    shell_env,
)

CACHE = "$HOME/.cache/skyward"  # expanded by the remote shell

# Runs on the host with the base interpreter (stdlib, plus `packaging` when present); one JSON
# line out. argv[1] is a JSON object with the paths and requirements to look for.
_CHECK = r"""
import json, os, platform, sys
q = json.loads(sys.argv[1])
home = os.path.expanduser("~/.cache/skyward")
out = {"python": sys.executable, "version": platform.python_version(), "uid": os.getuid()}
out["src"] = os.path.isfile(os.path.join(home, "src", q["src"], "skyward", "__init__.py"))
uv = os.path.join(home, "bootstrap", "uv-" + q["uv"], "bin", "uv")
out["uv"] = uv if os.access(uv, os.X_OK) else None
env = os.path.join(home, "envs", q["env"])
out["env"] = os.path.join(env, "bin", "python") if os.path.exists(
    os.path.join(env, ".skyward-ready")) else None
out["setup"] = os.path.exists(os.path.join(home, "setup", q["env"] + ".done"))
missing = []
for pkg in q["apt"]:
    import subprocess
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    if "install ok installed" not in r.stdout:
        missing.append(pkg)
out["apt_missing"] = missing
# The requirement probe is skyward's own (skyward.worker.probe): None until skyward is there.
# A built environment wins, so a warm start skips the probe (the slowest part of this check).
out["satisfied"] = False
if out["env"] is None:
    sys.path.insert(0, os.path.join(home, "src", q["src"]))
    try:
        from skyward.worker.probe import satisfied
        out["satisfied"] = satisfied(q["requirements"])
    except ImportError:
        out["satisfied"] = None
print(json.dumps(out))
"""

_SETUP_ONLY = r"""
import json, os, sys
from pathlib import Path
from skyward.worker import envbuild
spec = envbuild.EnvSpec.from_json(sys.stdin.read())
try:
    envbuild.run_setup_once(spec, Path(os.path.expanduser("~/.cache/skyward")),
                            lambda line: print(line, file=sys.stderr, flush=True))
except envbuild.BuildFailed as exc:
    print(json.dumps({"error": str(exc), "output": exc.output}))
    sys.exit(1)
print(json.dumps({"ok": True}))
"""


class SSHNode(Node):
    """One host of an SSH pool: its connection and, once prepared, the interpreter to run."""

    def __init__(self, index: int, host: SSHHost) -> None:
        super().__init__(index, host.endpoint.host, host.endpoint.host)
        self.host = host
        self.python: str | None = None
        self.src_hash: str = ""

    async def start_agent(self, env: Mapping[str, str]) -> AgentStream:
        if self.python is None:
            raise BootstrapError(
                f"the environment of {self.host} was not prepared before the agent started",
                node=self.index,
            )
        full = {
            **env,
            "PYTHONPATH": f"{CACHE}/src/{self.src_hash}",
            "PYTHONUNBUFFERED": "1",
        }
        # The source path must expand on the host, so it is the one value left unquoted.
        words = shell_env({k: v for k, v in full.items() if k != "PYTHONPATH"})
        command = (
            f'cd "$HOME" && exec env PYTHONPATH="{full["PYTHONPATH"]}" {words} '
            f"{shlex.quote(self.python)} -m skyward.worker"
        )
        try:
            return await self.host.start(command)
        except (OSError, asyncssh.Error) as exc:
            raise BootstrapError(
                f"starting the agent on {self.host} failed: {exc}", node=self.index
            ) from None


class SSH:
    """Nodes on existing machines reached over SSH: one node per host, every host by default.

    Args:
        hosts: ``"host"``, ``"user@host"`` or ``"user@host:port"``; node i runs on hosts[i].
        user: login user for hosts that do not name one (default: ~/.ssh/config, then yours).
        port: sshd port for hosts that do not name one.
        key: private key file; default: the SSH agent and ~/.ssh/config / ~/.ssh/id_* keys.
        known_hosts: a known_hosts path, a list of ``"host keytype base64"`` lines or an
            asyncssh known-hosts object; default: ~/.ssh/known_hosts. Host keys are always
            verified.
        python: interpreter on the hosts (default ``python3``); used directly when it already
            satisfies the image, else the environment is built from it with uv.
        connect_timeout: seconds to reach and log into a host.
        keepalive: seconds between SSH keepalives (3 missed: the connection is dropped).
        config: ssh_config files to read; default ~/.ssh/config.
        uv_version: uv to install on hosts that lack it; default: the client's own uv.
        build_env: environment variables for the build steps on the hosts (pip, uv, apt,
            setup): proxies, ``UV_INDEX_URL``, ``SSL_CERT_FILE`` for a TLS-inspecting proxy...
    """

    name = "ssh"

    def __init__(
        self,
        hosts: Sequence[str],
        user: str | None = None,
        port: int = 22,
        key: str | os.PathLike[str] | None = None,
        known_hosts: KnownHosts = None,
        python: str | None = None,
        *,
        connect_timeout: float = 10.0,
        keepalive: float = 15.0,
        config: Sequence[str] | None = None,
        uv_version: str | None = None,
        build_env: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(hosts, str) or not hosts:
            raise ConfigError("hosts must be a non-empty list of 'host' / 'user@host:port' strings")
        self.endpoints = [Endpoint.parse(h, user, port) for h in hosts]
        self.key: str | None = None
        if key is not None:
            path = Path(key).expanduser()
            if not path.is_file():
                raise ConfigError(f"SSH key file {str(path)!r} does not exist")
            self.key = str(path)
        self.known_hosts = load_known_hosts(known_hosts)
        self.python = python
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.config: Sequence[str] | tuple[()] = tuple(config) if config is not None else ()
        self.uv_version = uv_version or metadata.version("uv")
        self.build_env = dict(build_env or {})
        self._build_prefix = f"export {shell_env(self.build_env)}; " if self.build_env else ""
        self._hosts: list[SSHHost] = []

    @property
    def default_nodes(self) -> int:
        """A pool on this provider has one node per host unless it asks for fewer."""
        return len(self.endpoints)

    @property
    def hosts(self) -> list[str]:
        return [str(e) for e in self.endpoints]

    def validate(self, spec: ClusterSpec) -> None:
        if spec.nodes > len(self.endpoints):
            raise ConfigError(
                f"nodes={spec.nodes} but sky.SSH was given {len(self.endpoints)} host(s); one "
                f"node runs per host: pass nodes={len(self.endpoints)} or add hosts"
            )

    async def launch(self, spec: ClusterSpec) -> list[Node]:
        endpoints = self.endpoints[: spec.nodes]
        results = await asyncio.gather(
            *(
                connect(
                    e,
                    known_hosts=self.known_hosts,
                    key=self.key,
                    config=self.config,
                    timeout=self.connect_timeout,
                    keepalive=self.keepalive,
                )
                for e in endpoints
            ),
            return_exceptions=True,
        )
        hosts = [r for r in results if isinstance(r, SSHHost)]
        self._hosts.extend(hosts)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
            for failure in failures:
                if not isinstance(failure, Exception):
                    raise failure  # cancellation, KeyboardInterrupt: not ours to reword
            first = failures[0]
            if len(failures) == 1 and isinstance(first, SSHConnectError):
                raise first
            raise ProvisionError(
                f"{len(failures)} of {len(endpoints)} SSH host(s) could not be reached:\n"
                + "\n".join(f"  {f}" for f in failures)
            ) from first
        return [SSHNode(i, h) for i, h in enumerate(hosts)]

    async def replace(self, node: Node) -> Node:
        """The same host again, on a new connection (it rebooted, or sshd was restarted)."""
        if isinstance(node, SSHNode):
            await node.host.close()
        host = await connect(
            self.endpoints[node.index],
            known_hosts=self.known_hosts,
            key=self.key,
            config=self.config,
            timeout=self.connect_timeout,
            keepalive=self.keepalive,
        )
        self._hosts.append(host)
        return SSHNode(node.index, host)

    async def prepare(self, nodes: list[Node], image: Image, log: Log) -> None:
        ssh_nodes = [n for n in nodes if isinstance(n, SSHNode)]
        await asyncio.gather(*(self._prepare_one(n, image, log) for n in ssh_nodes))

    async def terminate(self, nodes: list[Node]) -> None:
        hosts = {id(h): h for h in self._hosts}
        for node in nodes:
            if isinstance(node, SSHNode):
                hosts[id(node.host)] = node.host
        await asyncio.gather(*(h.close() for h in hosts.values()), return_exceptions=True)

    # -- bootstrap, per host ---------------------------------------------------------------

    async def _prepare_one(self, node: SSHNode, image: Image, log: Log) -> None:
        host = node.host
        spec = env_spec(image)
        src_hash, tarball = _source_tarball()
        node.src_hash = src_hash

        def host_log(line: str) -> None:
            log(f"[{host}] {line}")

        query = {
            "src": src_hash,
            "uv": self.uv_version,
            "env": spec.hash,
            "apt": list(image.apt),
            "requirements": list(spec.pip),
        }
        python = self.python or "python3"
        state = await self._json(
            node,
            f"P=$(command -v {shlex.quote(python)}) || "
            f"{{ echo 'python {python} was not found on this host' >&2; exit 127; }}; "
            f'exec "$P" -c {shlex.quote(_CHECK)} {shlex.quote(json.dumps(query))}',
            "checking the host",
            host_log,
        )
        base = str(state["python"])
        version_ok = not image.python or str(state["version"]).startswith(image.python)
        if not state["src"]:
            await self._step(
                node,
                _unpack_command(src_hash),
                "copying skyward to the host",
                host_log,
                tarball,
            )
        if state["apt_missing"]:
            await self._apt(node, list(state["apt_missing"]), int(state["uid"]), host_log)
        pythonpath = f'PYTHONPATH="{CACHE}/src/{src_hash}"'
        if state["satisfied"] is None:  # first contact: ask again, now that skyward is there
            probed = await self._json(
                node,
                f"cd && {pythonpath} exec {shlex.quote(base)} -m skyward.worker.probe "
                f"{shlex.quote(json.dumps(spec.pip))}",
                "checking the host's packages",
                host_log,
            )
            state["satisfied"] = probed["satisfied"]
        if state["satisfied"] and version_ok:
            if spec.setup and not state["setup"]:
                await self._json(
                    node,
                    f"cd && {pythonpath} exec {shlex.quote(base)} -c {shlex.quote(_SETUP_ONLY)}",
                    "running the image's setup commands",
                    host_log,
                    spec.to_json().encode(),
                )
            node.python = base
            return
        if state["env"]:
            node.python = str(state["env"])
            return
        uv = state["uv"] or await self._install_uv(node, base, host_log)
        built = await self._json(
            node,
            f"cd && {pythonpath} exec {shlex.quote(base)} -m skyward.worker.envbuild "
            f'"{CACHE}" {shlex.quote(str(uv))}',
            f"building the environment for image {image.content_hash}",
            host_log,
            spec.to_json().encode(),
        )
        node.python = str(built["python"])

    async def _install_uv(self, node: SSHNode, python: str, log: Log) -> str:
        version = self.uv_version
        root = f"{CACHE}/bootstrap"
        venv = f"{root}/uv-{version}"
        # flock: hosts sharing a home (NFS, or our test namespaces) install once.
        out = await self._step(
            node,
            f'set -e; mkdir -p "{root}"; exec 9>"{venv}.lock"; flock 9; '
            f'if [ ! -x "{venv}/bin/uv" ]; then rm -rf "{venv}"; '
            f'{shlex.quote(python)} -m venv "{venv}"; '
            f'"{venv}/bin/python" -m pip install --disable-pip-version-check -q '
            f'{shlex.quote(f"uv=={version}")} || {{ rm -rf "{venv}"; exit 1; }}; fi; '
            f'echo "{venv}/bin/uv"',
            f"installing uv=={version} (python -m venv + pip install)",
            log,
            merge=True,
        )
        return out.decode(errors="replace").strip().splitlines()[-1]

    async def _apt(self, node: SSHNode, packages: list[str], uid: int, log: Log) -> None:
        sudo = "" if uid == 0 else "sudo -n "
        names = " ".join(shlex.quote(p) for p in packages)
        await self._step(
            node,
            f"export DEBIAN_FRONTEND=noninteractive; {sudo}apt-get update -q 2>&1 && "
            f"{sudo}apt-get install -y -q --no-install-recommends {names} 2>&1",
            f"installing apt packages {', '.join(packages)}",
            log,
            merge=True,
        )

    async def _step(
        self,
        node: SSHNode,
        command: str,
        what: str,
        log: Log,
        input: bytes = b"",
        merge: bool = False,
    ) -> bytes:
        """Run one bootstrap command; a failure becomes a `BootstrapError` with its output."""
        try:
            command = f"exec 2>&1; {command}" if merge else command
            done = await node.host.run(self._build_prefix + command, input, log)
        except (OSError, asyncssh.Error) as exc:
            raise BootstrapError(
                f"{what} on {node.host} failed: the connection broke ({exc})", node=node.index
            ) from None
        if done.status != 0:
            output = done.tail or done.stdout.decode(errors="replace")[-4000:]
            # merged commands print to stdout; show its tail then
            if merge:
                output = "\n".join(done.stdout.decode(errors="replace").splitlines()[-40:])
            raise BootstrapError(
                f"{what} on {node.host} failed (exit status {done.status})\n"
                f"--- last lines ---\n{output}",
                node=node.index,
                output=output,
            )
        return done.stdout

    async def _json(
        self, node: SSHNode, command: str, what: str, log: Log, input: bytes = b""
    ) -> dict[str, Any]:
        """Run a command that prints one JSON object (or ``{"error", "output"}``) last."""
        try:
            done = await node.host.run(self._build_prefix + command, input, log)
        except (OSError, asyncssh.Error) as exc:
            raise BootstrapError(
                f"{what} on {node.host} failed: the connection broke ({exc})", node=node.index
            ) from None
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
            raise BootstrapError(
                f"{what} on {node.host} failed: {reason}\n--- last lines ---\n{output}",
                node=node.index,
                output=output,
            )
        return result


def _unpack_command(src_hash: str) -> str:
    # Unpack beside, then rename: a host sharing the home never sees half a tree. mv -T fails
    # when another bootstrap won the race, which is fine.
    root = f"{CACHE}/src"
    return (
        f'set -e; mkdir -p "{root}/{src_hash}"; T=$(mktemp -d "{root}/.tmp-XXXXXX"); '
        f'tar -xzf - -C "$T"; mv -T "$T/skyward" "{root}/{src_hash}/skyward" 2>/dev/null || true; '
        f'rm -rf "$T"; test -f "{root}/{src_hash}/skyward/__init__.py"'
    )


@cache
def _source_tarball() -> tuple[str, bytes]:
    """The client's skyward package as a .tar.gz, and its content hash (names and bytes)."""
    package = Path(skyward.__file__).resolve().parent
    files = sorted(
        p
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in {".pyc", ".pyo"}
    )
    digest = hashlib.sha256()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for path in files:
            rel = path.relative_to(package.parent).as_posix()
            data = path.read_bytes()
            digest.update(rel.encode() + b"\0" + data + b"\0")
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return digest.hexdigest()[:16], buffer.getvalue()
