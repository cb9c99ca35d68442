"""The SSH provider: pools on machines that already exist, reached with asyncssh.

Node i runs on hosts[i]. `launch` opens one verified connection per host, all at once, kept for
the pool's life; `survey` and `prepare` are the remote bootstrap (`remote.bootstrap`):
one check command per host (its GPUs too, before the plugins choose their packages), then only
what is missing (skyward's source, apt packages, uv, the image's environment). A host needs only
a shell and python3: uv arrives without pip (`hoststeps.install_uv`), and the environment runs
the client's Python minor (uv provides it where python3 is another). When the interpreter
(``python=`` or ``python3``) already satisfies the image and the agent's pins, it is used
directly, as `Local` does; otherwise a uv environment is built. A second pool with the same
image on the same hosts costs one check command and the agent start per host.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as metadata
import os
from collections.abc import Mapping, Sequence

from skyward import checks
from skyward.console.progress import Phase, Progress, clock
from skyward.cost import Price
from skyward.errors import ConfigError, SkywardError
from skyward.hardware import ClusterSpec, Hardware
from skyward.image import Image
from skyward.providers.base import (
    Capability,
    Cluster,
    DetachedLogin,
    LivePool,
    Node,
    Provider,
    count,
    given_rate,
)
from skyward.providers.remote import bootstrap, connect, hoststeps
from skyward.providers.remote.datasync import RemoteData, outputs_removal
from skyward.transport.sshhost import Endpoint, KnownHosts

# This login's agents on a host: pid, seconds since start, command line.
_AGENTS = 'ps -o pid=,etimes=,args= -u "$(id -u)" | grep "[s]kyward.worker$" || true'


class SSH(RemoteData, Provider):
    """Nodes on existing machines reached over SSH: one node per host, every host by default.

    Args:
        hosts: ``"host"``, ``"user@host"`` or ``"user@host:port"``; node i runs on hosts[i].
        user: login user for hosts that do not name one (default: ~/.ssh/config, then yours).
        port: sshd port for hosts that do not name one.
        key: private key file; default: the SSH agent and ~/.ssh/config / ~/.ssh/id_* keys.
        known_hosts: a known_hosts path, a list of ``"host keytype base64"`` lines or an
            asyncssh known-hosts object; default: ~/.ssh/known_hosts. Host keys are always
            verified.
        python: interpreter on the hosts (default ``python3``, any 3.8+); used directly when
            it already satisfies the image (the client's Python minor, every requirement),
            else the environment is built with uv, from it when it is the client's minor.
        connect_timeout: seconds to reach and log into a host.
        keepalive: seconds between SSH keepalives (3 missed: the connection is dropped).
        config: ssh_config files to read; default ~/.ssh/config.
        uv_version: uv to install on hosts that lack it; default: the client's own uv.
        build_env: environment variables for the build steps on the hosts (uv, apt, setup):
            proxies, ``UV_INDEX`` / ``UV_INDEX_URL`` for a mirror, ``UV_PYTHON_INSTALL_MIRROR``,
            ``SSL_CERT_FILE`` for a TLS-inspecting proxy...
        price_per_hour: what one host costs you per hour, in US dollars, if anything: the
            pool then counts its spend (`ComputePool.cost`) and can keep a `max_cost`.
    """

    name = "ssh"
    capabilities = frozenset({Capability.REPLACE, Capability.SIGNALS})

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
        price_per_hour: float | None = None,
    ) -> None:
        self._price = given_rate(price_per_hour, "sky.SSH")
        if isinstance(hosts, str) or not isinstance(hosts, Sequence) or not hosts:
            raise ConfigError("hosts must be a non-empty list of 'host' / 'user@host:port' strings")
        checks.optional_text(user, "user")
        if not 1 <= checks.whole(port, "port", minimum=1) <= 65535:
            raise ConfigError(f"port must be in 1..65535, got {port!r}")
        self.endpoints = [Endpoint.parse(h, user, port) for h in hosts]
        self.connect_options = connect.login_options(
            key, known_hosts, config, connect_timeout, keepalive
        )
        self.bootstrap = hoststeps.Bootstrap(
            python,
            metadata.version("uv") if uv_version is None else uv_version,
            checks.environment(build_env, "build_env"),
        )

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

    async def price(self, spec: ClusterSpec) -> Price:
        return self._price

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        endpoints = self.endpoints[: spec.nodes]
        for index, endpoint in enumerate(endpoints):
            progress.phase(index, Phase.CONNECTING, str(endpoint))
        hosts = await connect.connect_all(endpoints, self.connect_options)
        nodes: list[Node] = [bootstrap.RemoteNode(i, h) for i, h in enumerate(hosts)]
        return Cluster(spec, nodes)

    async def replace(self, cluster: Cluster, index: int) -> Node:
        """The same host again, on a new connection (it rebooted, or sshd was restarted)."""
        await bootstrap.remote_nodes(cluster)[index].host.close()
        host = await self.connect_options.connect(self.endpoints[index])
        cluster.nodes[index] = bootstrap.RemoteNode(index, host)
        return cluster.nodes[index]

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        return await bootstrap.survey_nodes(cluster, image, self.bootstrap, progress)

    async def prepare(self, cluster: Cluster, image: Image, progress: Progress) -> None:
        await bootstrap.prepare_nodes(cluster, image, self.bootstrap, progress)

    def live_pools(self) -> list[LivePool]:
        """This login's agents on each host (``skyward status``): a pool's agents live as long
        as its client, or `heartbeat_timeout` past a client cut off from them. A host that
        cannot be reached is listed as such."""

        async def ask(endpoint: Endpoint) -> str:
            try:
                host = await self.connect_options.connect(endpoint)
            except SkywardError as exc:
                return f"unreachable: {str(exc).splitlines()[0]}"
            try:
                done = await asyncio.wait_for(host.run(_AGENTS), 30)
                return done.stdout.decode(errors="replace")
            finally:
                await host.close()

        async def ask_all() -> list[str]:
            return list(await asyncio.gather(*(ask(e) for e in self.endpoints)))

        live = []
        for endpoint, answer in zip(self.endpoints, asyncio.run(ask_all()), strict=True):
            where = f"{self.name:<6} {endpoint}"
            if answer.startswith("unreachable"):
                live.append(LivePool(f"{where}: {answer}"))
                continue
            agents = [line.split(None, 2) for line in answer.splitlines() if line.strip()]
            if agents:
                pids = ", ".join(pid for pid, _, _ in agents)
                oldest = max(int(age) for _, age, _ in agents)
                live.append(
                    LivePool(f"{where}: {len(agents)} agent(s) [{pids}], up {clock(oldest)}")
                )
        return live

    def teardown_summary(self, cluster: Cluster) -> str:
        return f"closed {count(len(cluster.nodes), 'connection')}"

    def detached_kind(self) -> str:
        return "ssh"

    def detached_login(self, cluster: Cluster) -> DetachedLogin:
        """The pool's own login: the hosts stay, and so do the key and ssh_config it used."""
        options = self.connect_options
        return DetachedLogin(options.key, options.config, options.timeout)

    async def terminate(self, cluster: Cluster) -> None:
        # The hosts stay: what the pool wrote on them goes, in the command that kills the
        # pool's processes (one channel a host, not two in a row: 0.7 -> 0.4 s for a 2-host
        # pool's end, benchmarks/README.md).
        await bootstrap.close_hosts(cluster, last=outputs_removal(cluster))
