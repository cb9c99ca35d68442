"""What every provider that makes machines shares (AWS, GCP): `CloudCluster`, the per-pool
state it keeps, and `CloudProvider`, the base class with its settings, connection, bootstrap and
teardown."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import shutil
import threading
import time
import urllib.request
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyward import checks
from skyward.console.progress import Progress
from skyward.cost import Price
from skyward.errors import ConfigError, ProvisionError
from skyward.hardware import Hardware
from skyward.image import Image
from skyward.providers.base import Capability, Cluster, DetachedLogin, KeptPool
from skyward.providers.cloud.bootscript import known_hosts_line
from skyward.providers.cloud.threads import in_thread
from skyward.providers.remote.bootstrap import (
    close_hosts,
    prepare_nodes,
    survey_nodes,
)
from skyward.providers.remote.connect import BootWait, ConnectOptions, connect_all
from skyward.providers.remote.datasync import RemoteData
from skyward.providers.remote.hoststeps import Bootstrap
from skyward.providers.remote.replacing import (
    Made,
    ReplacingCluster,
    ReplacingProvider,
    drop_spares,
)
from skyward.transport.sshhost import Endpoint, SSHHost, load_known_hosts

# How long the price of what a launch made may hold up reaching it (it is usually cached: the
# quote asked the same); past it, the machines are counted at the quote.
GRANT_PRICE_SECONDS = 15.0


@dataclass
class CloudCluster(ReplacingCluster):
    """What one pool has made so far; the cloud's tags or labels are the durable record. Its
    `tell` is where the launch, the replacements and the teardown say what they do (the
    attempts, the grants, what a teardown retries and why): the pool's console, once launched
    (a user who waits on a teardown sees why), the log before."""

    key_dir: Path  # the pool's login key, removed with the pool
    cancel: threading.Event = field(default_factory=threading.Event)
    provisioning: Future[list[Any]] | None = None  # the launch's thread
    node_instances: dict[int, str] = field(default_factory=dict)  # node index -> machine
    removed: bool = False

    @property
    def pool_id(self) -> str:
        return self.spec.pool_id

    @property
    def key_path(self) -> Path:
        return self.key_dir / "id_ed25519"

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise ProvisionError(f"the launch of pool {self.pool_id} was cancelled")


class CloudProvider(RemoteData, ReplacingProvider):
    """What a provider that makes its machines shares (AWS, GCP): the settings every one of them
    takes, the verified SSH connection to a pool's machines, the remote bootstrap (`survey`,
    `prepare`) and a teardown that a cancelled event loop cannot stop half-way.

    A subclass makes the machines (`launch`; one more for a replacement: `make_one`, which
    `ReplacingProvider`'s path calls) and removes a pool's cloud resources (`remove_resources`,
    called in a non-daemon thread)."""

    # Machines it makes it can replace, start ahead, price and find again: every capability.
    capabilities = frozenset(Capability)

    def __init__(
        self,
        *,
        idle_timeout: float,
        python: str | None,
        boot_timeout: float,
        connect_timeout: float,
        keepalive: float,
        build_env: Mapping[str, str] | None,
        poll_interval: float,
        teardown_timeout: float,
    ) -> None:
        checks.seconds(idle_timeout, "idle_timeout")
        self.boot_timeout = checks.seconds(boot_timeout, "boot_timeout")
        self.connect_timeout = checks.seconds(connect_timeout, "connect_timeout")
        self.keepalive = checks.seconds(keepalive, "keepalive")
        self.bootstrap = Bootstrap(python, build_env=checks.environment(build_env, "build_env"))
        self.poll_interval = checks.seconds(poll_interval, "poll_interval")
        self.teardown_timeout = checks.seconds(teardown_timeout, "teardown_timeout")
        self._lock = threading.Lock()  # guards the subclass's lazily made API clients

    async def launched(
        self,
        cluster: CloudCluster,
        make: Callable[[], list[Any]],
        reach: Callable[[list[Any]], Awaitable[list[Made]]],
    ) -> Cluster:
        """`cluster` with its nodes: `make` (the cloud calls that make the machines) runs in a
        thread, then `reach` connects to what it made. On any failure or cancellation, what was
        made is removed; the launch's own error stays the error, the teardown's is a note."""
        try:
            cluster.provisioning = in_thread(make, f"skyward-{self.name}-launch-{cluster.pool_id}")
            found = await asyncio.shield(asyncio.wrap_future(cluster.provisioning))
            await self._grant(cluster, found, range(len(found)))
            reached = await reach(found)
            cluster.nodes = [made.node for made in reached]
            cluster.node_instances.update((made.node.index, made.machine) for made in reached)
            return cluster
        except BaseException as exc:
            cluster.cancel.set()
            logger = logging.getLogger(f"skyward.{self.name}")
            logger.info("launch of %s failed (%r): removing what it created", cluster.pool_id, exc)
            try:
                await self.terminate(cluster)
            except ProvisionError as cleanup:
                exc.add_note(str(cleanup))
            raise

    # -- one machine in place of another (`ReplacingProvider` holds the path) ----------------
    # A subclass says how to make one more machine as the pool's were (`make_one`, blocking),
    # how to reach it (`reach`), how to let a lost one go (`retire`, blocking), and whether
    # node `index` can be replaced at all (`check_replaceable`).

    def make_one(self, pool: CloudCluster) -> list[Any]:
        """Make one machine as the pool's were and wait until it runs (in a thread)."""
        raise ConfigError(f"the {self.name} provider cannot replace nodes")

    def retire(self, pool: CloudCluster, lost: str) -> None:
        """Remove the lost machine `lost` (it may be hung rather than gone; in a thread); a
        failure is only logged: the teardown removes it in the end."""
        return None

    async def reach(
        self, pool: CloudCluster, found: list[Any], indexes: Sequence[int]
    ) -> list[Made]:
        """Connect to the machines `found` (for nodes `indexes`)."""
        raise ConfigError(f"the {self.name} provider cannot replace nodes")

    def describe_failure(self, exc: BaseException) -> str:
        """A failed cloud call in words."""
        return str(exc)

    def made_price(self, pool: CloudCluster, machine: Any) -> Price | None:
        """One machine's price per hour as it was made (`machine`: one of what the launch's
        `make`, or `make_one`, returned): its market (spot or on-demand) and its zone, which
        failover chose; None: the price quoted before launch. Blocking (run in a thread); the
        machines of one launch share their market and zone, so the first one's is asked."""
        return None

    async def _grant(self, pool: CloudCluster, found: list[Any], indexes: Sequence[int]) -> None:
        """The machines `found` run (for nodes `indexes`): the pool pays for them from now, at
        the price of what was made."""
        if not found:
            return
        at = time.time()

        def price() -> Price | None:
            try:
                return self.made_price(pool, found[0])
            except Exception as exc:  # a price is only information: the meter says so
                return Price.unknown(f"the {self.name} price lookup failed: {exc}")

        try:
            made = await asyncio.wait_for(asyncio.to_thread(price), GRANT_PRICE_SECONDS)
        except TimeoutError:
            made = Price.unknown(
                f"the {self.name} price lookup took longer than {GRANT_PRICE_SECONDS:g} s"
            )
        for index in indexes:
            pool.tell.granted(index, made, at)

    async def retire_node(self, pool: ReplacingCluster, index: int) -> None:
        cloud = self._own(pool)
        lost = cloud.node_instances[index]
        retiring = in_thread(
            lambda: self.retire(cloud, lost), f"skyward-{self.name}-retire-{cloud.pool_id}"
        )
        await asyncio.shield(asyncio.wrap_future(retiring))

    async def make_node(self, pool: ReplacingCluster, index: int) -> Made:
        cloud = self._own(pool)
        made = in_thread(lambda: self.make_one(cloud), f"skyward-{self.name}-spare-{cloud.pool_id}")
        try:
            found = await asyncio.shield(asyncio.wrap_future(made))
        except (ConfigError, ProvisionError):  # already in words (NoCapacity: each zone's)
            raise
        except Exception as exc:
            raise ProvisionError(
                f"launching a replacement for node {index}: {self.describe_failure(exc)}"
            ) from None
        await self._grant(cloud, found, [index])
        (reached,) = await self.reach(cloud, found, [index])
        return reached

    def place(self, pool: ReplacingCluster, index: int, made: Made) -> None:
        super().place(pool, index, made)
        self._own(pool).node_instances[index] = made.machine

    def _own(self, cluster: Cluster) -> CloudCluster:
        if not isinstance(cluster, CloudCluster):
            raise TypeError(f"{cluster!r} is not a pool of the {self.name} provider")
        return cluster

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        return await survey_nodes(cluster, image, self.bootstrap, progress)

    async def prepare(self, cluster: Cluster, image: Image, progress: Progress) -> None:
        await prepare_nodes(cluster, image, self.bootstrap, progress)

    async def terminate(self, cluster: Cluster) -> None:
        cluster = self._own(cluster)
        if cluster.removed:
            return
        await close_hosts(cluster)
        await drop_spares(cluster)
        name = f"skyward-{self.name}-teardown-{cluster.pool_id}"
        done = in_thread(lambda: self._remove(cluster), name)
        # Shielded: if the pool's loop is cancelled, the thread still finishes the job.
        await asyncio.shield(asyncio.wrap_future(done))

    def detached_kind(self) -> str:
        return "ssh"  # the machines' sshd; the run keeps them up (`release`)

    def detached_login(self, cluster: Cluster) -> DetachedLogin:
        """The pool's key (removed with the pool, so the run keeps a copy), no ssh_config (as
        the pool logged in: no rule may redirect it), and how a later process removes the
        machines and what was made for them once the run has ended (`locate`, `remove_pool`)."""
        pool = self._own(cluster)
        cls = type(self)
        kept = KeptPool(f"{cls.__module__}:{cls.__qualname__}", self.locate(pool), pool.pool_id)
        return DetachedLogin(str(pool.key_path), [], self.connect_timeout, pool_key=True, kept=kept)

    async def release(self, cluster: Cluster) -> None:
        """The machines stay up for a detached run: only the connections go. Their watchdog
        powers them off once the run and every client are gone; `skyward down` (or the run's
        end, seen by a later command) removes the rules and keys."""
        cluster = self._own(cluster)
        await close_hosts(cluster)
        await drop_spares(cluster)
        shutil.rmtree(cluster.key_dir, ignore_errors=True)  # the run keeps its own copy

    def _remove(self, pool: CloudCluster) -> None:
        if pool.provisioning is not None:
            # Let an in-flight create call return first, so the machines it made are found too.
            with contextlib.suppress(BaseException):
                pool.provisioning.exception()
        self.remove_resources(pool)
        pool.removed = True
        shutil.rmtree(pool.key_dir, ignore_errors=True)

    @abstractmethod
    def locate(self, pool: CloudCluster) -> dict[str, Any]:
        """This provider's arguments that find `pool` again from a new process (its region,
        its project and zone): a detached run's record keeps them to remove the pool later."""

    @abstractmethod
    def remove_pool(self, pool_id: str) -> list[str]:
        """Remove everything pool `pool_id` has in the cloud, whatever its age (`skyward down
        POOL`); what was removed."""

    @abstractmethod
    def remove_resources(self, pool: CloudCluster) -> None:
        """Remove everything `pool` made in the cloud (its machines, rules, keys), or raise
        `ProvisionError` naming what remains once `teardown_timeout` has passed."""

    async def connect_hosts(
        self,
        addresses: Sequence[str],
        user: str,
        labels: Sequence[str],
        pool: CloudCluster,
        published: Callable[[], list[str | None]],
        channel: str,
        permission: str,
    ) -> list[SSHHost]:
        """Connect to the machines at `addresses` (named `labels` in errors) as `user`, logging
        in with the pool's key, retrying while they boot. Each machine is trusted with the host
        key it made and published (`published`: blocking, each machine's public key or None
        while it has none yet, read from `channel` with `permission`, both named in the error),
        for its own address only: no other key is accepted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.boot_timeout
        budget = f"boot_timeout={self.boot_timeout:g} s"
        while True:
            keys = await asyncio.to_thread(published)
            missing = [label for label, key in zip(labels, keys, strict=True) if key is None]
            if not missing:
                break
            if loop.time() + self.poll_interval > deadline:
                raise ProvisionError(
                    f"{', '.join(missing)} did not publish its SSH host key in its {channel} "
                    f"within {budget}: check that the image runs skyward's boot script at first "
                    f"boot and that these credentials have {permission}"
                )
            pool.check_cancel()
            await asyncio.sleep(self.poll_interval)
        lines = [known_hosts_line(a, k) for a, k in zip(addresses, keys, strict=True) if k]
        options = ConnectOptions(
            known_hosts=load_known_hosts(lines),
            key=str(pool.key_path),
            config=[],  # no ~/.ssh/config rule (User, HostName...) may redirect this login
            timeout=self.connect_timeout,
            keepalive=self.keepalive,
        )
        wait = BootWait(deadline, self.poll_interval, budget)
        return await connect_all([Endpoint(a, 22, user) for a in addresses], options, wait, labels)


def remove_pools(pool_ids: Sequence[str], remove: Callable[[str], list[str]]) -> list[str]:
    """`remove` each pool (what it found, as lines) and go on past a failure; what was removed,
    each line prefixed with its pool, or one `ProvisionError` naming every pool that remains."""
    removed: list[str] = []
    problems: list[str] = []
    for pool_id in pool_ids:
        try:
            removed += [f"{pool_id}: {line}" for line in remove(pool_id)]
        except ProvisionError as exc:
            problems.append(str(exc))
    if problems:
        raise ProvisionError("\n".join(problems))
    return removed


def check_cidr(cidr: str) -> str:
    """`cidr` normalised; `ConfigError` when it is not one."""
    try:
        return str(ipaddress.ip_network(cidr, strict=False))
    except ValueError:
        raise ConfigError(f"ssh_cidr {cidr!r} is not a CIDR such as '203.0.113.7/32'") from None


# Where a client asks for its public address, when no ssh_cidr says who may reach port 22.
CHECK_IP_URL = "https://checkip.amazonaws.com"


def public_cidr(provider: str) -> str:
    """This client's public address as a ``/32``, for the rule that lets it reach port 22;
    `ConfigError` naming `provider`'s ``ssh_cidr=`` when it cannot be found."""
    try:
        with urllib.request.urlopen(CHECK_IP_URL, timeout=10) as answer:
            address = answer.read().decode().strip()
        return check_cidr(f"{address}/32")
    except (OSError, ValueError, ConfigError) as exc:
        raise ConfigError(
            f"this client's public address could not be found ({CHECK_IP_URL}: {exc}); "
            f"pass sky.{provider}(ssh_cidr='x.x.x.x/32') to say who may reach port 22"
        ) from None
