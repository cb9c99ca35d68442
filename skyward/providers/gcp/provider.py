"""`sky.GCP`: a pool's nodes as Compute Engine VMs, reached over verified SSH.

launch, for the whole pool at once (the API calls do not grow with N); the GCE steps are
`provision`'s (over the plain functions of `instances` and `tpus`), run in a thread, the SSH steps
those of `skyward.providers.remote.connect` and `skyward.providers.remote.bootstrap`:

1. resolve project, zones and credentials and pick the machine type (offline, in `validate`);
2. create the pool's firewall rules and a fresh login key; the VMs' metadata carries the key
   (``ssh-keys``) and a startup script that installs a host key made on the client and starts
   the idle watchdog;
3. in the first zone given with room (failover: the zones in order, a region whose quotas
   cannot fit the pool skipped, spot then on-demand with ``spot="prefer"``), one
   ``instances.bulkInsert`` for all N (``minCount = N``); wait until all N run;
4. connect to every VM, trusting only that host key, retrying while they boot; `survey` (the
   VMs' GPUs and drivers), `prepare` and the agents are the remote bootstrap's, as for
   `sky.SSH`.

What one pool made lives in its `GCPCluster` (and in the labels and names, the durable record),
with the zone it landed in, where its replacements, explanations and TPU teardown go.
Teardown (end of the pool, or any failure or cancellation during launch) is
`teardown.remove_pool`, which ``skyward down`` uses too; it runs in a non-daemon thread.

A TPU accelerator (``tpu-v5litepod-16``, ``v4-32``) makes the pool one TPU slice instead
(`tpus`): one node per host of the slice, in the API's worker order, the same firewall rules,
metadata and SSH steps; the slice is created, and removed, as a whole.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from skyward import checks
from skyward.console.progress import Phase, Progress
from skyward.cost import Price
from skyward.errors import ConfigError, ProvisionError
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.base import Capability, Cluster, LivePool, Node, NodeLoss, count
from skyward.providers.cloud.provider import (
    CloudCluster,
    CloudProvider,
    check_cidr,
    remove_pools,
)
from skyward.providers.gcp import (
    api,
    hostkeys,
    instances,
    machine_types,
    prices,
    provision,
    resources,
    teardown,
    tpu_types,
    tpus,
)
from skyward.providers.gcp.instances import logger
from skyward.providers.gcp.provision import GCPCluster
from skyward.providers.gcp.settings import (
    Access,
    Clients,
    MachineSettings,
    endpoint_of,
    region_of,
    resolve,
    zone_list,
)
from skyward.providers.remote.bootstrap import RemoteNode
from skyward.providers.remote.replacing import Made, ReplacingCluster
from skyward.worker.notices import NOTICES_ENV


class GCP(CloudProvider):
    """Nodes as Compute Engine VMs (GPU or CPU), firewall rules per pool, nothing left behind.

    Args:
        project: default: the standard sources (``CLOUDSDK_CORE_PROJECT``,
            ``GOOGLE_CLOUD_PROJECT``, the credentials' project, gcloud's config).
        zone: a zone, or a list of zones tried in order when one has no room for the pool
            (failover; zones of several regions make it regional failover too). Every node
            of a pool lands in one zone. A zone without capacity is passed; a quota error,
            or a region whose quotas (read first) cannot fit the pool, skips that region's
            zones. Default: ``CLOUDSDK_COMPUTE_ZONE``, gcloud's ``compute/zone``.
        spot: Spot VMs (cheaper, may be preempted); ``"prefer"``: spot VMs in every zone
            first, then on-demand ones when no zone had spot capacity.
        network, subnetwork: where the VMs go (default: the ``default`` network); a name or a
            resource path. A subnetwork named by name is that name in each zone's region; a
            path is one region's, so all zones must be in it.
        use_private_ips: connect to the VMs' internal addresses (client in the VPC or on a
            VPN); then no external address is asked for.
        ssh_cidr: who may reach port 22; default: this client's public address (/32), or the
            private ranges with `use_private_ips`.
        idle_timeout: seconds without any SSH client after which a VM powers itself off.
        service_account: the VMs' own service account (e.g. for data in Cloud Storage).
        machine_type: default: from the pool's accelerator (see `machine_types`); a TPU
            accelerator type (``v4-16``) makes the provider's pools that TPU slice.
        runtime_version: TPU VM software version (default: per generation, `tpu_types`).
        image: boot image (default: a Deep Learning VM image for GPUs, Ubuntu 24.04 for CPU).
        disk_size_gb: boot disk size.
        user: login user the guest agent creates from the pool's key.
        python, connect_timeout, keepalive, build_env: as for `sky.SSH`.
        boot_timeout: seconds for all VMs to run and accept the verified SSH login.
        poll_interval: seconds between state polls (boot, teardown).
        teardown_timeout: seconds the teardown keeps trying before it names what remains.
        credentials: google-auth credentials (default: Application Default Credentials).
        api_endpoint: the Compute API's ``scheme://host[:port]`` (default: Google's, or
            ``CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE``).
    """

    name = "gcp"

    def __init__(
        self,
        project: str | None = None,
        zone: str | Sequence[str] | None = None,
        spot: bool | Literal["prefer"] = False,
        network: str | None = None,
        subnetwork: str | None = None,
        use_private_ips: bool = False,
        ssh_cidr: str | None = None,
        idle_timeout: float = 300.0,
        service_account: str | None = None,
        *,
        machine_type: str | None = None,
        runtime_version: str | None = None,
        image: str | None = None,
        disk_size_gb: int = 100,
        user: str = "skyward",
        python: str | None = None,
        boot_timeout: float = 900.0,
        connect_timeout: float = 10.0,
        keepalive: float = 15.0,
        build_env: Mapping[str, str] | None = None,
        poll_interval: float = 3.0,
        teardown_timeout: float = 600.0,
        credentials: Any | None = None,
        api_endpoint: str | None = None,
    ) -> None:
        super().__init__(
            idle_timeout=idle_timeout,
            python=python,
            boot_timeout=boot_timeout,
            connect_timeout=connect_timeout,
            keepalive=keepalive,
            build_env=build_env,
            poll_interval=poll_interval,
            teardown_timeout=teardown_timeout,
        )
        ssh_cidr = _check_settings(spot, ssh_cidr, user, disk_size_gb, use_private_ips)
        checks.optional_texts("sky.GCP", project=project, network=network, subnetwork=subnetwork)
        checks.optional_texts("sky.GCP", machine_type=machine_type, image=image)
        checks.optional_texts("sky.GCP", runtime_version=runtime_version)
        checks.optional_texts("sky.GCP", service_account=service_account, api_endpoint=api_endpoint)
        self.zones = _checked_zones(zone, subnetwork)  # () : the standard resolution
        self.project, self.spot = project, spot
        self.machine_type, self.runtime_version = machine_type, runtime_version
        self.machine_settings = MachineSettings(
            image,
            bool(spot),  # "prefer": spot first (each market tried sets its own)
            network,
            subnetwork,
            use_private_ips,
            ssh_cidr,
            idle_timeout,
            service_account,
            disk_size_gb,
            user,
        )
        self._credentials, self._endpoint = credentials, api_endpoint
        self._access: Access | None = None
        self._clients: Clients | None = None

    # -- project, zone, clients ----------------------------------------------------------

    def access(self) -> Access:
        """Project, zones and credentials (resolved once; `ConfigError` when one is missing).
        Its `zone` is the first zone given."""
        with self._lock:
            if self._access is None:
                self._access = resolve(self.project, self.zones or None, self._credentials)
            return self._access

    def clients(self) -> Clients:
        access = self.access()
        with self._lock:
            if self._clients is None:
                self._clients = Clients(
                    access.credentials,
                    endpoint_of(self._endpoint),
                    endpoint_of(self._endpoint, "TPU"),
                )
            return self._clients

    # -- the Provider's verbs --------------------------------------------------------------

    def implied_accelerator(self) -> Accelerator | None:
        """The accelerator `machine_type=` carries, so plugins (JAX's wheel) can see it."""
        if self.machine_type and tpu_types.is_tpu_name(self.machine_type):
            return Accelerator.parse(tpu_types.parse(self.machine_type).accelerator_type)
        return machine_types.accelerator_of(self.machine_type) if self.machine_type else None

    def nodes_for(self, accelerator: Accelerator | None, requested: int | None) -> int:
        """A TPU slice is one node per host: its host count, or `ConfigError` when `requested`
        says otherwise."""
        if accelerator is None or not accelerator.is_tpu:
            return super().nodes_for(accelerator, requested)
        tpu = tpu_types.parse(accelerator)
        if requested is not None and requested != tpu.hosts:
            raise ConfigError(
                f"a TPU {tpu.accelerator_type} slice has {tpu.hosts} host(s) and each host is "
                f"one node, so nodes={requested} cannot be; leave nodes out or pass "
                f"nodes={tpu.hosts}"
            )
        return tpu.hosts

    def validate(self, spec: ClusterSpec) -> None:
        """Offline checks: the accelerator maps to a machine type or a TPU slice of
        `spec.nodes` hosts; project, zone, credentials."""
        if spec.accelerator is not None and spec.accelerator.is_tpu:
            self.nodes_for(spec.accelerator, spec.nodes)
        else:
            machine_types.choose(spec.accelerator, self.machine_type)
        self.access()

    async def price(self, spec: ClusterSpec) -> Price:
        """One node's price per hour from the Cloud Billing Catalog, quoted before launch: a VM
        of the machine type the pool would launch (its cores, memory and GPUs), or one host of
        its TPU slice, in the first zone; spot rates with ``spot=True`` (and ``"prefer"``: spot
        is tried first). What is launched is then billed at its own price (`made_price`).
        `Price.unknown` with the reason when the catalog cannot say."""
        try:
            tpu, machine_type = self._shape(spec)
            spot = self.machine_settings.spot
            return await asyncio.to_thread(self._catalog_price, tpu, machine_type, None, spot)
        except Exception as exc:  # a price is only information: the pool goes on without it
            return Price.unknown(f"the GCP price lookup failed: {exc}")

    def made_price(self, pool: CloudCluster, machine: Any) -> Price:
        """One VM's (or TPU host's) price as it runs: the spot or on-demand rates of the zone
        it landed in."""
        gcp = _gcp(pool)
        zone = gcp.made.instances.get(machine.name) or gcp.zone
        tpu, machine_type = self._shape(gcp.spec)
        price = self._catalog_price(tpu, machine_type, zone, gcp.spot)
        return price.launched("spot" if gcp.spot else "on-demand", zone)

    def capabilities_for(self, spec: ClusterSpec) -> frozenset[Capability]:
        """A TPU slice is made and removed whole: its hosts cannot be replaced one by one, nor
        a replacement started ahead of a notice."""
        if spec.accelerator is not None and spec.accelerator.is_tpu:
            return self.capabilities - {Capability.REPLACE, Capability.PRESTART}
        return self.capabilities

    def _shape(self, spec: ClusterSpec) -> tuple[tpu_types.TpuType | None, str]:
        """What a node of `spec` is: a host of a TPU slice, or a VM of a machine type."""
        if spec.accelerator is not None and spec.accelerator.is_tpu:
            return tpu_types.parse(spec.accelerator), ""
        return None, machine_types.choose(spec.accelerator, self.machine_type).machine_type

    def _catalog_price(
        self, tpu: tpu_types.TpuType | None, machine_type: str, zone: str | None, spot: bool
    ) -> Price:
        """One node's price in `zone` (None: the first zone given), from the catalog."""
        access = self.access()
        zone = zone or access.zone
        endpoint = endpoint_of(self._endpoint, "CLOUDBILLING")
        catalog = prices.catalog_client(access.credentials, endpoint)
        if tpu is not None:
            return prices.tpu_price(catalog, tpu, region_of(zone), spot)
        compute = prices.machine_types_client(access.credentials, endpoint_of(self._endpoint))
        return prices.vm_price(compute, catalog, access.project, zone, machine_type, spot)

    def running_cost(self, pool: resources.PoolResources) -> str:
        """What `pool`'s running VMs cost so far (`skyward status`), in words ("" for none)."""
        access = self.access()
        catalog = prices.catalog_client(
            access.credentials, endpoint_of(self._endpoint, "CLOUDBILLING")
        )
        compute = prices.machine_types_client(access.credentials, endpoint_of(self._endpoint))
        return prices.running_cost(compute, catalog, access.project, pool.instances)

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        tpu = None
        if spec.accelerator is not None and spec.accelerator.is_tpu:
            tpu = tpu_types.parse(spec.accelerator)
            what = f"TPU {tpu.accelerator_type} ({count(tpu.hosts, 'host')})"
        else:
            choice = machine_types.choose(spec.accelerator, self.machine_type)
            what = f"{spec.nodes} x {choice.machine_type}"
        cluster = GCPCluster(
            spec,
            [],
            key_dir=Path(tempfile.mkdtemp(prefix=f"skyward-gcp-{spec.pool_id}-")),
            tpu=tpu,
            tell=progress,
        )
        progress.phase(None, Phase.BOOTING, what)
        markets = (True, False) if self.spot == "prefer" else (bool(self.spot),)
        return await self.launched(
            cluster,
            lambda: (
                provision.vms(self._calls(), cluster, choice, markets)
                if tpu is None
                else provision.tpu_slice(self._calls(), cluster, tpu, self.runtime_version, markets)
            ),
            lambda found: self._connect(cluster, found, range(len(found)), progress),
        )

    def check_replaceable(self, pool: ReplacingCluster, index: int) -> None:
        if _gcp(pool).tpu is not None:
            raise ConfigError(
                f"node {index} is a host of TPU slice {tpus.node_name(pool.spec.pool_id)}: a "
                "slice's hosts cannot be replaced one by one; start a new pool"
            )

    def make_one(self, pool: CloudCluster) -> list[Any]:
        """One more VM, made as the pool's were, running: in the pool's zone, else in another
        zone given of its region."""
        return provision.one_more(self._calls(), _gcp(pool))

    def retire(self, pool: CloudCluster, lost: str) -> None:
        gcp = _gcp(pool)
        provision.retire(self._calls(), lost, gcp.made.instances.get(lost) or gcp.zone)

    async def reach(
        self, pool: CloudCluster, found: list[Any], indexes: Sequence[int]
    ) -> list[Made]:
        return await self._connect(_gcp(pool), found, indexes)

    def describe_failure(self, exc: BaseException) -> str:
        return api.describe(exc) if isinstance(exc, api.ApiError) else str(exc)

    def teardown_summary(self, cluster: Cluster) -> str:
        tpu = _gcp(cluster).tpu
        if tpu is not None:
            return f"removed TPU slice {tpu.accelerator_type} ({count(tpu.hosts, 'host')})"
        return f"removed {count(len(cluster.nodes), 'VM')}"

    async def explain(self, cluster: Cluster, node: Node) -> NodeLoss | None:
        """Why `node`'s VM went away (e.g. preempted), or None if it still runs."""
        pool = _gcp(cluster)
        name = pool.node_instances.get(node.index)
        if name is None:
            return None
        access = self.access()
        access = access.at(pool.zone or access.zone)  # where the pool landed
        if pool.tpu is not None:
            return await asyncio.to_thread(
                tpus.loss_of, self.clients(), access, pool.pool_id, node.index
            )
        zone = pool.made.instances.get(name) or access.zone
        return await asyncio.to_thread(instances.loss_of, self.clients(), access, zone, name)

    # -- orphan sweep ----------------------------------------------------------------------

    def locate(self, pool: CloudCluster) -> dict[str, Any]:
        assert isinstance(pool, GCPCluster)
        found: dict[str, Any] = {"project": self.access().project, "zone": pool.zone}
        if self._endpoint:  # a private endpoint the pool was made through
            found["api_endpoint"] = self._endpoint
        return found

    def remove_pool(self, pool_id: str) -> list[str]:
        return self.cleanup(pool=pool_id)

    def cleanup(self, pool: str | None = None) -> list[str]:
        """Remove skyward's resources in the project: one pool's, or every pool's. Returns what
        was removed; raises `ProvisionError` listing what could not be."""
        pools = [pool] if pool is not None else sorted(self.find())
        return remove_pools(
            pools, lambda pool_id: self._remove_pool(pool_id, tpu_zone=tpus.ALL_LOCATIONS)
        )

    def find(self, pool: str | None = None) -> dict[str, resources.PoolResources]:
        """Everything of skyward in the project, in every zone (VMs, firewall rules, TPU nodes
        and queued resources), by pool: what ``skyward ls`` prints."""
        clients, access = self.clients(), self.access()
        try:
            return resources.find(
                clients,
                access.project,
                pool,
                tpus.found(clients, access.project, tpus.ALL_LOCATIONS, pool),
            )
        except api.ApiError as exc:
            raise ProvisionError(f"listing skyward's resources failed: {exc}") from None

    def live_pools(self) -> list[LivePool]:
        """The pools this user@host made in the project that still hold something, each with
        what its running VMs cost so far (``skyward status``)."""
        found = self.find()
        me = resources.pool_labels("-")[resources.CREATED_BY_LABEL]
        where = f"{self.name:<6} {self.access().project}"
        live = []
        for _, pool in sorted(found.items()):
            if pool.created_by == me:
                cost = self.running_cost(pool)
                live.append(LivePool.of(where, pool, *([f"cost: {cost}"] if cost else [])))
        return live

    # -- launch: the API half runs in a thread (`provision`), then SSH ----------------------

    def _calls(self) -> provision.Calls:
        return provision.Calls.start(
            self.clients(),
            self.access(),
            self.machine_settings,
            self.poll_interval,
            self.boot_timeout,
        )

    async def _connect(
        self,
        pool: GCPCluster,
        found: list[provision.MachineAddress],
        indexes: Sequence[int],
        progress: Progress | None = None,
    ) -> list[Made]:
        """Connect to the VMs (or TPU hosts) `found` (as nodes `indexes`), each trusted with only
        the host key it published as a guest attribute."""
        addresses = [h.address for h in found]
        if progress is not None:
            for index, host in zip(indexes, found, strict=True):
                progress.phase(index, Phase.CONNECTING, f"{host.name} {host.address}")
        labels = [f"{'TPU' if pool.tpu else 'VM'} {h.name} ({h.address})" for h in found]
        clients, access = self.clients(), self.access()
        # Each VM in its own zone: a replacement may have gone to another of the region's.
        wheres = [access.at(pool.made.instances.get(h.name) or pool.zone) for h in found]
        connected = await self.connect_hosts(
            addresses,
            self.machine_settings.user,
            labels,
            pool,
            lambda: [
                hostkeys.published_key(clients, w, pool.pool_id, h)
                for w, h in zip(wheres, found, strict=True)
            ],
            "guest attributes",
            "tpu.nodes.getGuestAttributes" if pool.tpu else "compute.instances.getGuestAttributes",
        )
        reached: list[Made] = []
        for index, ssh, host in zip(indexes, connected, found, strict=True):
            node = RemoteNode(index, ssh, host.private or None)
            # The agent watches the preemption notice (sky.preempting()) itself.
            node.provider_env = {NOTICES_ENV: "skyward.worker.notices:watch_gcp"}
            reached.append(Made(node, host.name))
        return reached

    # -- teardown --------------------------------------------------------------------------

    def remove_resources(self, pool: CloudCluster) -> None:
        gcp = _gcp(pool)
        # A VM pool's own teardown looks for no TPU: its calls stay those of the Compute API.
        # A slice's is in the pool's zone (the one it landed in, or its last attempt's).
        zone = (gcp.zone or self.access().zone) if gcp.tpu is not None else None
        self._remove_pool(gcp.pool_id, gcp.made, tpu_zone=zone, log=pool.tell)

    def _remove_pool(
        self,
        pool_id: str,
        made: teardown.Made | None = None,
        tpu_zone: str | None = None,
        log: Callable[[str], None] = logger.info,
    ) -> list[str]:
        """Remove one pool; with `tpu_zone` (a zone, or `tpus.ALL_LOCATIONS`), its TPU nodes
        and queued resources there too."""
        return teardown.remove_pool(
            self.clients(),
            self.access().project,
            pool_id,
            made,
            timeout=self.teardown_timeout,
            poll=self.poll_interval,
            log=log,
            tpu_zone=tpu_zone,
        )


def _check_settings(
    spot: object, ssh_cidr: str | None, user: object, disk_size_gb: object, use_private_ips: object
) -> str | None:
    """`sky.GCP`'s choices checked, each a `ConfigError` naming the parameter; the SSH CIDR in
    its normal form."""
    checks.one_of(spot, "spot", (True, False, "prefer"))
    checks.text(user, "sky.GCP(user=)")
    checks.whole(disk_size_gb, "sky.GCP(disk_size_gb=)", minimum=10)
    checks.flag(use_private_ips, "sky.GCP(use_private_ips=)")
    return None if ssh_cidr is None else check_cidr(ssh_cidr)


def _checked_zones(zone: str | Sequence[str] | None, subnetwork: str | None) -> tuple[str, ...]:
    """The zones `zone=` names, in order, each checked (a subnetwork is one region's)."""
    if zone is not None:
        checks.texts([zone] if isinstance(zone, str) else zone, "sky.GCP(zone=)")
    zones = zone_list(zone)
    if zone is not None and not zones:
        raise ConfigError("zone=[] names no zone: give one or more, or leave it out")
    _check_subnetwork(subnetwork, zones)
    return zones


def _check_subnetwork(subnetwork: str | None, zones: Sequence[str]) -> None:
    """A subnetwork given as a path is one region's: every zone given must be in it."""
    if not subnetwork or "/regions/" not in subnetwork:
        return
    region = subnetwork.split("/regions/", 1)[1].split("/", 1)[0]
    elsewhere = [z for z in zones if region_of(z) != region]
    if elsewhere:
        raise ConfigError(
            f"subnetwork {subnetwork!r} is in region {region}, but zone(s) {', '.join(elsewhere)} "
            "are not: give the subnetwork by name (each region's subnetwork of that name), or "
            "zones of that region only"
        )


def _gcp(cluster: Cluster) -> GCPCluster:
    if not isinstance(cluster, GCPCluster):
        raise TypeError(f"{cluster!r} is not a pool of the GCP provider")
    return cluster
