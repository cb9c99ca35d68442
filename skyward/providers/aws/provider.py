"""`sky.AWS`: a pool's nodes as EC2 instances, reached over verified SSH.

launch, for the whole pool at once (the EC2 call count does not grow with N); the EC2 steps are
the plain functions of `instances`, the SSH steps those of `skyward.providers.remote.connect` and
`skyward.providers.remote.bootstrap`:

1. check the instance type against ``describe_instance_types`` and resolve the AMI (public SSM
   parameter) and the subnet, before anything is created;
2. import a fresh SSH key pair and create a security group (22 from the client's CIDR only, all
   traffic inside the group), both tagged ``skyward:pool=<id>``;
3. one ``run_instances`` for all N (MinCount=MaxCount=N), with user data that installs a host key
   made on the client and starts the idle watchdog; wait until all N run;
4. connect to every instance, trusting only that host key, retrying while they boot; `survey`
   (the instances' GPUs and drivers), `prepare` and the agents are the remote bootstrap's, as
   for `sky.SSH`.

What one pool made lives in its `AWSCluster` (and in the tags, the durable record). Teardown
(end of the pool, or any failure or cancellation during launch) is `teardown.remove_pool`, the
reconciliation loop that `cleanup` and ``skyward down`` use too; it runs in a non-daemon thread:
a Ctrl-C that stops the pool's event loop cannot stop it half-way, and the interpreter waits for
it before exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError
from botocore.parsers import ResponseParserError

from skyward import checks
from skyward.console.progress import Phase, Progress
from skyward.cost import Price
from skyward.errors import ConfigError, ProvisionError
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.aws import (
    instance_types,
    instances,
    prices,
    quotas,
    resources,
    teardown,
)
from skyward.providers.aws.instances import logger
from skyward.providers.base import Cluster, LivePool, Node, NodeLoss, count
from skyward.providers.cloud import failover
from skyward.providers.cloud.provider import (
    CloudCluster,
    CloudProvider,
    check_cidr,
    remove_pools,
)
from skyward.providers.remote.bootstrap import (
    RemoteNode,
)
from skyward.providers.remote.replacing import Made
from skyward.worker.notices import NOTICES_ENV

T = TypeVar("T")


@dataclass
class AWSCluster(CloudCluster):
    """What one pool has made so far (the tags are the durable record)."""

    region: str | None = None  # where the pool landed (failover may try several)
    subnets: list[dict[str, Any]] = field(default_factory=list)  # its region's, in order
    run_params: dict[str, Any] = field(default_factory=dict)  # replace() asks for the same
    instance_ids: list[str] = field(default_factory=list)  # the pool's current instances
    made: teardown.Made = field(default_factory=teardown.Made)  # everything, for teardown


class AWS(CloudProvider):
    """Nodes as EC2 instances, one security group and key pair per pool, nothing left behind.

    Args:
        region: AWS region, or a list of regions tried in order when one has no room for the
            pool (failover: within a region every zone that offers the type is tried, a
            region whose vCPU quota cannot fit the pool is skipped without a launch); default:
            the standard resolution (AWS_REGION / AWS_DEFAULT_REGION, the profile's region).
            Credentials come from the standard chain; AWS_ENDPOINT_URL and
            AWS_ENDPOINT_URL_EC2 are honoured as boto3 does.
        instance_type: EC2 instance type; default: from the pool's accelerator (checked against
            EC2's GPU info), or a small CPU type without one.
        ami: image id; default: the Deep Learning Base AMI (GPU types) or Ubuntu 24.04 (CPU),
            both from their public SSM parameters.
        spot: ask for spot instances (cheaper, may be preempted); ``"prefer"``: spot in
            every location first, then on-demand when none had spot capacity.
        subnet_id: the subnet for all nodes (one subnet, one AZ), or a list of subnets of the
            region tried in order (zone failover), or with several regions a mapping from
            region to its subnet(s); default: the default subnet of each AZ that offers the
            instance type, tried in order.
        use_private_ips: connect to the instances' private addresses (client inside the VPC or
            on a VPN); then no public address is asked for.
        ssh_cidr: who may reach port 22; default: this client's public address (/32), or the
            VPC's CIDR with `use_private_ips`.
        idle_timeout: seconds without any SSH client after which an instance powers itself off
            (and so terminates): a dead client costs minutes, not days.
        user: login user of the AMI (``ubuntu`` for the Deep Learning AMIs and Ubuntu).
        python: interpreter on the instances (default ``python3``; see `sky.SSH`).
        placement_group: put the nodes in a new cluster placement group (low-latency network).
        iam_instance_profile: an instance profile (name or ARN) for the instances: the nodes'
            own AWS credentials, e.g. to read ``sky.Data("s3://...")`` or write an s3://
            ``output_dir``.
        boot_timeout: seconds for all instances to run and accept the verified SSH login.
        connect_timeout, keepalive, build_env: as for `sky.SSH`.
        poll_interval: seconds between EC2 state polls (boot, termination).
        teardown_timeout: seconds the teardown keeps trying to remove a pool (calls that fail
            are retried, with backoff, in rounds) before it names what remains in a
            `ProvisionError`.
        profile, session: a named profile, or a ready `boto3.Session` (tests, custom chains).
    """

    name = "aws"

    def __init__(
        self,
        region: str | Sequence[str] | None = None,
        instance_type: str | None = None,
        ami: str | None = None,
        spot: bool | Literal["prefer"] = False,
        subnet_id: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
        use_private_ips: bool = False,
        ssh_cidr: str | None = None,
        idle_timeout: float = 300.0,
        *,
        user: str = "ubuntu",
        python: str | None = None,
        placement_group: bool = False,
        iam_instance_profile: str | None = None,
        boot_timeout: float = 900.0,
        connect_timeout: float = 10.0,
        keepalive: float = 15.0,
        build_env: Mapping[str, str] | None = None,
        poll_interval: float = 3.0,
        teardown_timeout: float = 600.0,
        profile: str | None = None,
        session: boto3.session.Session | None = None,
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
        _check_settings(spot, ssh_cidr, user, use_private_ips, placement_group)
        _check_names(instance_type, ami, iam_instance_profile, profile)
        regions = _checked_regions(region, ami)
        self.subnets = _subnets_by_region(regions, subnet_id)
        self.regions: tuple[str | None, ...] = tuple(regions)
        self.region = regions[0]
        self.spot = spot
        self.instance_type = instance_type
        self.machine_settings = instances.MachineSettings(
            ami,
            bool(spot),  # "prefer": spot first (each market tried sets its own)
            next(iter(self.subnets.get(regions[0], ())), None),
            use_private_ips,
            ssh_cidr,
            idle_timeout,
            placement_group,
            iam_instance_profile,
        )
        self.user = user
        self._profile = profile
        self._session = session
        self._clients: dict[str, Any] = {}

    # -- boto3 -----------------------------------------------------------------------------

    def session(self) -> boto3.session.Session:
        """The boto3 session (standard credential chain and region resolution)."""
        with self._lock:
            if self._session is None:
                self._session = boto3.session.Session(
                    region_name=self.region, profile_name=self._profile
                )
            return self._session

    def client(self, service: str, region: str | None = None) -> Any:
        """A cached client for `region` (default: the first one given, or the standard
        resolution); botocore clients are thread-safe, sessions are not."""
        session = self.session()
        region = region or self.region or session.region_name
        with self._lock:
            key = f"{service} {region}"
            if key not in self._clients:
                # Adaptive: standard retries (throttling, 5xx, dropped connections) plus a
                # client-side rate limit when EC2 throttles, which a teardown of many pools hits.
                config = Config(retries={"mode": "adaptive", "max_attempts": 5})
                client = session.client(service, region_name=region, config=config)
                client.meta.events.register("before-parameter-build", _note_operation)
                self._clients[key] = client
            return self._clients[key]

    # -- the Provider's verbs --------------------------------------------------------------

    def implied_accelerator(self) -> Accelerator | None:
        """The accelerator `instance_type=` carries, so plugins (JAX's wheel) can see it."""
        return instance_types.accelerator_of(self.instance_type) if self.instance_type else None

    def validate(self, spec: ClusterSpec) -> None:
        """Offline checks: the accelerator maps to a type, a region and credentials exist."""
        instance_types.choose(spec.accelerator, self.instance_type)
        self.check_access()

    def check_access(self) -> None:
        """Raise `ConfigError` unless a region and credentials can be found (offline)."""
        session = self.session()
        if not (self.region or session.region_name):
            raise ConfigError(
                "no AWS region: pass sky.AWS(region=...) (--region to the skyward command), or "
                "set AWS_DEFAULT_REGION or a region in your AWS profile"
            )
        try:
            credentials = session.get_credentials()
        except BotoCoreError as exc:
            raise ConfigError(f"AWS credentials could not be loaded: {exc}") from None
        if credentials is None:
            raise ConfigError(
                "no AWS credentials found: configure them as for the AWS CLI (aws configure, "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, SSO or an instance role)"
            )

    async def price(self, spec: ClusterSpec) -> Price:
        """One instance's price per hour, quoted before launch: the on-demand list price of the
        type the pool would launch, or with ``spot=True`` (and ``"prefer"``: spot is tried
        first) the spot price in its first subnet's zone (the region's cheapest zone without
        ``subnet_id=``). What is launched is then billed at its own price (`made_price`).
        `Price.unknown` with the reason when AWS cannot say."""

        def look_up(kind: str) -> Price:
            session = self.session()
            region = self.region or session.region_name
            if not region:
                return Price.unknown("no AWS region: pass sky.AWS(region=...)")
            if not self.machine_settings.spot:
                with self._lock:  # a session makes one client at a time
                    pricing = prices.pricing_client(session)
                return prices.on_demand(pricing, kind, region)
            ec2 = self.client("ec2")
            subnet = self.machine_settings.subnet_id
            return prices.spot(ec2, kind, prices.zone_of_subnet(ec2, subnet) if subnet else None)

        try:
            kind = instance_types.choose(spec.accelerator, self.instance_type).instance_type
            return await asyncio.to_thread(look_up, kind)
        except Exception as exc:  # a price is only information: the pool goes on without it
            return Price.unknown(f"the AWS price lookup failed: {exc}")

    def made_price(self, pool: CloudCluster, machine: Any) -> Price:
        """One instance's price as it runs (`machine`, as EC2 describes it): the spot price of
        its zone, or the on-demand list price of its region."""
        region = str(_aws(pool).region)
        kind = str(machine["InstanceType"])
        zone = str(machine["Placement"]["AvailabilityZone"])
        if machine.get("InstanceLifecycle") == "spot":
            return prices.spot(self.client("ec2", region), kind, zone).launched("spot", zone)
        session = self.session()
        with self._lock:  # a session makes one client at a time
            pricing = prices.pricing_client(session)
        return prices.on_demand(pricing, kind, region).launched("on-demand", zone)

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        choice = instance_types.choose(spec.accelerator, self.instance_type)
        cluster = AWSCluster(
            spec,
            [],
            key_dir=Path(tempfile.mkdtemp(prefix=f"skyward-aws-{spec.pool_id}-")),
            tell=progress,
        )
        return await self.launched(
            cluster,
            lambda: self._provision(cluster, choice, progress),
            lambda found: self._connect(cluster, found, range(len(found)), progress),
        )

    def make_one(self, pool: CloudCluster) -> list[Any]:
        """One more instance, launched as the pool's were, running: in the pool's zone, else
        in the next of its region's that has room (failover, as at launch)."""
        aws = _aws(pool)
        ec2 = self.client("ec2", aws.region)
        zone = aws.run_params["Placement"]["AvailabilityZone"]
        here = [s for s in aws.subnets if s["AvailabilityZone"] == zone]
        others = [s for s in aws.subnets if s["AvailabilityZone"] != zone]
        attempts = failover.Attempts(f"a replacement {aws.run_params['InstanceType']}", pool.tell)
        found = instances.run_in_first_zone_with_room(
            ec2, aws.run_params, here + others, 1, aws.pool_id, attempts
        )
        if found is None:
            raise attempts.exhausted("The lost node cannot be replaced in its region now")
        fresh, params = found
        if (went := params["Placement"]["AvailabilityZone"]) != zone:
            pool.tell(f"the replacement runs in {went}, not {zone}")
        aws.instance_ids += fresh
        aws.made.add(teardown.INSTANCE, *fresh)
        return self._wait_running(ec2, aws, fresh)

    def retire(self, pool: CloudCluster, lost: str) -> None:
        instances.retire(self.client("ec2", _aws(pool).region), lost)

    async def reach(
        self, pool: CloudCluster, found: list[Any], indexes: Sequence[int]
    ) -> list[Made]:
        return await self._connect(_aws(pool), found, indexes)

    def teardown_summary(self, cluster: Cluster) -> str:
        return f"removed {count(len(cluster.nodes), 'instance')}"

    async def explain(self, cluster: Cluster, node: Node) -> NodeLoss | None:
        """Why `node`'s instance went away (e.g. spot preemption), or None if it still runs."""
        instance_id = _aws(cluster).node_instances.get(node.index)
        if instance_id is None:
            return None
        ec2 = self.client("ec2", _aws(cluster).region)
        return await asyncio.to_thread(instances.loss_of, ec2, instance_id)

    # -- orphan sweep ----------------------------------------------------------------------

    def locate(self, pool: CloudCluster) -> dict[str, Any]:
        assert isinstance(pool, AWSCluster)
        return {"region": pool.region}

    def remove_pool(self, pool_id: str) -> list[str]:
        return self.cleanup(pool_id)

    def find(self) -> dict[str, resources.PoolResources]:
        """Everything tagged ``skyward:pool`` in the region, by pool: what ``skyward ls``
        prints."""
        self.check_access()  # no region or no credentials: one clear line
        try:
            return resources.find(self.client("ec2"))
        except (ClientError, BotoCoreError, ResponseParserError) as exc:
            raise ProvisionError(f"listing skyward's resources failed: {exc}") from None

    def live_pools(self) -> list[LivePool]:
        """The pools this user@host made in the region that still hold something, each with
        what its running instances cost so far (``skyward status``)."""
        found = self.find()
        ec2 = self.client("ec2")
        pricing = prices.pricing_client(self.session())
        where = f"{self.name:<6} {ec2.meta.region_name}"
        mine = [
            pool for _, pool in sorted(found.items()) if pool.created_by == resources.created_by()
        ]
        live = []
        for pool in mine:
            cost = prices.running_cost(pricing, ec2, pool.instances)
            live.append(LivePool.of(where, pool, *([f"cost: {cost}"] if cost else [])))
        return live

    def cleanup(
        self, pool: str | None = None, older_than: timedelta | float = timedelta(0)
    ) -> list[str]:
        """Remove skyward resources (all pools, or `pool`) created more than `older_than` ago
        (default: whatever their age, as ``skyward down`` does).

        Pools whose clients died leave at most a security group and a key pair (the watchdog
        powers their instances off); this removes those and any instance still running, each
        pool with the teardown's loop. Returns what was removed; raises `ProvisionError`
        listing what could not be.
        """
        age = older_than if isinstance(older_than, timedelta) else timedelta(seconds=older_than)
        self.check_access()
        ec2 = self.client("ec2")
        if pool is not None and age <= timedelta(0):
            pools = [pool]  # no age to check: the loop's own listing (with its retries) will do
        else:
            cutoff = datetime.now(UTC) - age
            try:
                found = resources.find(ec2, pool).values()
            except (ClientError, BotoCoreError, ResponseParserError) as exc:
                raise ProvisionError(f"listing skyward's resources failed: {exc}") from None
            # Resources without a readable created-at tag were still made by skyward: old.
            pools = [p.pool_id for p in found if p.created_at is None or p.created_at <= cutoff]
        return remove_pools(pools, lambda pool_id: self._remove_pool(ec2, pool_id))

    # -- launch and replace: the EC2 half runs in a thread ---------------------------------

    def _provision(
        self, pool: AWSCluster, choice: instance_types.Choice, progress: Progress
    ) -> list[dict[str, Any]]:
        """The pool's instances in the first location with room: for each market asked (spot
        then on-demand with ``spot="prefer"``), each region in order, each zone that offers the
        type; all nodes in one zone."""
        attempts = failover.Attempts(f"{pool.spec.nodes} x {choice.instance_type}", progress)
        markets = [True, False] if self.spot == "prefer" else [bool(self.spot)]
        for spot in markets:
            if not spot and self.spot == "prefer":
                progress("no spot capacity in any location: trying on-demand instances")
            for region in self.regions:
                found = self._in_region(pool, choice, region, spot, attempts, progress)
                if found is not None:
                    return found
        raise attempts.exhausted(
            "Try more regions (region=[...]), spot='prefer' or spot=False, fewer nodes, another "
            "instance type, or ask AWS for a quota increase"
        )

    def _in_region(
        self,
        pool: AWSCluster,
        choice: instance_types.Choice,
        region: str | None,
        spot: bool,
        attempts: failover.Attempts,
        progress: Progress,
    ) -> list[dict[str, Any]] | None:
        """The pool's instances in `region` (one zone after another), or None when no zone
        had room; what was made there for the pool is removed before the next region."""
        ec2 = self.client("ec2", region)
        where = str(region or ec2.meta.region_name)
        pool.region = where
        market = "spot" if spot else "on-demand"
        with _launch_errors(pool, choice):
            details = instances.type_details(ec2, choice)
            if self._short_of_quota(region, where, pool, choice, details, spot, attempts):
                return None
            candidates = instances.subnets(ec2, self.subnets.get(region, ()), choice.instance_type)
            pool.subnets = candidates
            pool.run_params = instances.set_up(
                ec2,
                self.client("ssm", region) if self.machine_settings.ami is None else None,
                dataclasses.replace(self.machine_settings, spot=spot),
                pool.spec,
                choice,
                details,
                candidates[0],
                pool.key_path,
                pool.made,
                pool.check_cancel,
            )
            found = instances.run_in_first_zone_with_room(
                ec2,
                pool.run_params,
                candidates,
                pool.spec.nodes,
                pool.pool_id,
                attempts,
                market,
                pool.check_cancel,
            )
            if found is not None:
                ids, pool.run_params = found
                pool.instance_ids = ids
                pool.made.add(teardown.INSTANCE, *ids)
                for index, instance_id in enumerate(ids):
                    progress.phase(index, Phase.BOOTING, f"{instance_id} {choice.instance_type}")
                return self._wait_running(ec2, pool, ids)
        # Nothing started here: what the pool made in this region goes before the next one.
        self._remove_pool(ec2, pool.pool_id, pool.made, pool.tell)
        pool.made = teardown.Made()
        return None

    def _short_of_quota(
        self,
        region: str | None,
        where: str,
        pool: AWSCluster,
        choice: instance_types.Choice,
        details: Mapping[str, Any],
        spot: bool,
        attempts: failover.Attempts,
    ) -> bool:
        """Whether `region`'s vCPU quota is below what the pool needs (then the region is
        blocked in `attempts`, and nothing is made there)."""
        need = int(details["VCpuInfo"]["DefaultVCpus"]) * pool.spec.nodes
        quota = quotas.vcpu_quota(self.client("service-quotas", region), choice.instance_type, spot)
        if quota is None or quota.vcpus >= need:
            return False
        market = "spot" if spot else "on-demand"
        attempts.block_region(
            where,
            f"its {quota.name} quota is {quota.vcpus:g} vCPUs; {pool.spec.nodes} x "
            f"{choice.instance_type} ({market}) need {need}",
        )
        return True

    def _wait_running(self, ec2: Any, pool: AWSCluster, ids: list[str]) -> list[dict[str, Any]]:
        return instances.wait_running(
            ec2,
            ids,
            timeout=self.boot_timeout,
            poll=self.poll_interval,
            check_cancel=pool.check_cancel,
        )

    # -- launch and replace: the SSH half --------------------------------------------------

    async def _connect(
        self,
        pool: AWSCluster,
        found: list[dict[str, Any]],
        indexes: Sequence[int],
        progress: Progress | None = None,
    ) -> list[Made]:
        """Connect to the instances `found` (as nodes `indexes`), each trusted with only the host
        key it printed on its console output."""
        key = "PrivateIpAddress" if self.machine_settings.use_private_ips else "PublicIpAddress"
        addresses = []
        for instance in found:
            address = instance.get(key)
            if not address:
                raise ProvisionError(
                    f"instance {instance['InstanceId']} has no {key}: use a subnet that assigns "
                    "public addresses, or use_private_ips=True from inside the VPC"
                )
            addresses.append(str(address))
            if progress is not None:
                index = indexes[len(addresses) - 1]
                progress.phase(index, Phase.CONNECTING, f"{instance['InstanceId']} {address}")
        labels = [
            f"instance {i['InstanceId']} ({a})" for i, a in zip(found, addresses, strict=True)
        ]
        ec2 = self.client("ec2", pool.region)
        ids = [str(i["InstanceId"]) for i in found]
        hosts = await self.connect_hosts(
            addresses,
            self.user,
            labels,
            pool,
            lambda: [instances.published_key(ec2, i) for i in ids],
            "console output",
            "ec2:GetConsoleOutput",
        )
        reached: list[Made] = []
        for index, host, instance in zip(indexes, hosts, found, strict=True):
            node = RemoteNode(index, host, instance.get("PrivateIpAddress"))
            # The agent watches the spot interruption notice (sky.preempting()) itself.
            node.provider_env = {NOTICES_ENV: "skyward.worker.notices:watch_aws"}
            reached.append(Made(node, str(instance["InstanceId"])))
        return reached

    # -- teardown --------------------------------------------------------------------------

    def remove_resources(self, pool: CloudCluster) -> None:
        aws = _aws(pool)
        self._remove_pool(self.client("ec2", aws.region), pool.pool_id, aws.made, pool.tell)

    def _remove_pool(
        self,
        ec2: Any,
        pool_id: str,
        made: teardown.Made | None = None,
        log: Callable[[str], None] = logger.info,
    ) -> list[str]:
        return teardown.remove_pool(
            ec2, pool_id, made, timeout=self.teardown_timeout, poll=self.poll_interval, log=log
        )


def _subnets_by_region(
    regions: Sequence[str | None],
    subnet_id: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None,
) -> dict[str | None, tuple[str, ...]]:
    """`subnet_id=` as the subnets to try in each region (none: the default ones)."""

    def listed(value: object) -> tuple[str, ...]:
        found = checks.texts([value] if isinstance(value, str) else value, "sky.AWS(subnet_id=)")
        if not found:
            raise ConfigError("sky.AWS(subnet_id=) names no subnet: give one or more, or None")
        return found

    if subnet_id is None:
        return {}
    if isinstance(subnet_id, Mapping):
        unknown = sorted(set(subnet_id) - {r for r in regions if r})
        if unknown:
            raise ConfigError(f"subnet_id= names regions not in region=: {', '.join(unknown)}")
        return {region: listed(value) for region, value in subnet_id.items()}
    if len(regions) > 1:
        raise ConfigError(
            "subnets belong to one region: with several regions, give subnet_id= as a mapping "
            "{region: subnet(s)}, or leave it out (each region's default subnets)"
        )
    return {regions[0]: listed(subnet_id)}


def _aws(cluster: Cluster) -> AWSCluster:
    if not isinstance(cluster, AWSCluster):
        raise TypeError(f"{cluster!r} is not a pool of the AWS provider")
    return cluster


_operations = threading.local()


def _note_operation(model: Any, **_: Any) -> None:
    """botocore's before-parameter-build event (the first of a call): remember, per thread, which
    API call is under way."""
    _operations.name = getattr(model, "name", "?")


def last_operation() -> str:
    """The API call this thread made last (``RunInstances``), for an error to name."""
    return str(getattr(_operations, "name", "?"))


@contextlib.contextmanager
def _launch_errors(pool: AWSCluster, choice: instance_types.Choice) -> Iterator[None]:
    """A launch's AWS errors in words: what was asked that AWS refused, missing credentials or
    region, and what botocore's retries could not get past."""
    try:
        yield
    except ClientError as exc:
        raise ProvisionError(instances.launch_error(exc, pool.spec, choice)) from None
    except NoCredentialsError:
        raise ConfigError("no AWS credentials found (see `aws configure`)") from None
    except NoRegionError:
        raise ConfigError("no AWS region: pass sky.AWS(region=...)") from None
    except (BotoCoreError, ResponseParserError) as exc:
        # What botocore's retries could not get past (an endpoint that cannot be reached,
        # an answer that cannot be read): named here, once, with the call that failed.
        raise ProvisionError(
            f"launching pool {pool.pool_id}: the AWS call {last_operation()} failed after "
            f"botocore's retries: {exc}"
        ) from None


def _checked_regions(region: str | Sequence[str] | None, ami: str | None) -> list[str | None]:
    """The regions `region=` names, in order ([None]: the session's own), each checked; an
    `ami=` goes with one region only."""
    asked = [region] if region is None or isinstance(region, str) else region
    regions: list[str | None] = (
        [None] if region is None else list(checks.texts(asked, "sky.AWS(region=)"))
    )
    if not regions:
        raise ConfigError("region=[] names no region: give one or more, or leave it out")
    if len(regions) > 1 and ami:
        raise ConfigError(
            "ami= names one region's image: with several regions, leave it out (skyward "
            "finds the image in each)"
        )
    return regions


def _check_settings(
    spot: object,
    ssh_cidr: str | None,
    user: object,
    use_private_ips: object,
    placement_group: object,
) -> None:
    """`sky.AWS`'s choices checked, each a `ConfigError` naming the parameter."""
    if ssh_cidr is not None:
        check_cidr(ssh_cidr)
    checks.one_of(spot, "spot", (True, False, "prefer"))
    checks.text(user, "sky.AWS(user=)")
    checks.flag(use_private_ips, "sky.AWS(use_private_ips=)")
    checks.flag(placement_group, "sky.AWS(placement_group=)")


def _check_names(
    instance_type: object, ami: object, iam_instance_profile: object, profile: object
) -> None:
    """`sky.AWS`'s optional names checked: each None or a non-empty string."""
    checks.optional_texts(
        "sky.AWS",
        instance_type=instance_type,
        ami=ami,
        iam_instance_profile=iam_instance_profile,
        profile=profile,
    )
