"""`sky.AWS`: a pool's nodes as EC2 instances, reached over verified SSH.

launch, for the whole pool at once (the EC2 call count does not grow with N):

1. check the instance type against ``describe_instance_types`` and resolve the AMI (public SSM
   parameter) and the subnet, before anything is created;
2. import a fresh SSH key pair and create a security group (22 from the client's CIDR only, all
   traffic inside the group), both tagged ``skyward:pool=<id>``;
3. one ``run_instances`` for all N (MinCount=MaxCount=N), with user data that installs a host key
   made on the client and starts the idle watchdog; wait until all N run;
4. connect to every instance with the SSH layer, trusting only that host key; then `prepare` and
   the agents are the SSH provider's, composed rather than copied.

Teardown (end of the pool, or any failure or cancellation during launch) runs in a non-daemon
thread: a Ctrl-C that stops the pool's event loop cannot stop it half-way, and the interpreter
waits for it before exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import asyncssh
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

from skyward.cluster import Accelerator, ClusterSpec
from skyward.errors import ConfigError, ProvisionError
from skyward.image import Image
from skyward.providers.aws import instance_types, resources, userdata
from skyward.providers.base import Log, Node, NodeLoss
from skyward.providers.ssh import SSH, SSHNode
from skyward.transport.ssh import (
    Endpoint,
    SSHConnectError,
    SSHHost,
    connect,
    load_known_hosts,
)

T = TypeVar("T")
logger = logging.getLogger("skyward.aws")

GPU_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/{arch}/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)
CPU_AMI_PARAMETER = (
    "/aws/service/canonical/ubuntu/server/24.04/stable/current/{arch}/hvm/ebs-gp3/ami-id"
)
CHECK_IP_URL = "https://checkip.amazonaws.com"
_GONE_STATES = ("shutting-down", "terminated", "stopping", "stopped")
_SPOT_CODES = ("Server.SpotInstanceTermination", "Server.SpotInstanceShutdown")


class AWSNode(SSHNode):
    """One EC2 instance of a pool: its SSH connection plus the instance it runs on."""

    def __init__(
        self, index: int, host: SSHHost, instance: Mapping[str, Any], pool_id: str
    ) -> None:
        super().__init__(index, host)
        self.private_addr = str(instance.get("PrivateIpAddress") or host.endpoint.host)
        self.instance_id = str(instance["InstanceId"])
        self.instance_type = str(instance.get("InstanceType", ""))
        self.spot = instance.get("InstanceLifecycle") == "spot"
        self.pool_id = pool_id


@dataclass
class _PoolState:
    """What one pool of this provider has made so far (the tags are the durable record)."""

    pool_id: str
    key_dir: Path
    host_key: userdata.HostKey
    cancel: threading.Event = field(default_factory=threading.Event)
    provisioning: Future[list[dict[str, Any]]] | None = None
    run_params: dict[str, Any] = field(default_factory=dict)
    instance_ids: list[str] = field(default_factory=list)
    hosts: list[SSHHost] = field(default_factory=list)
    ssh: SSH | None = None
    removed: bool = False

    @property
    def key_path(self) -> Path:
        return self.key_dir / "id_ed25519"

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise ProvisionError(f"the launch of pool {self.pool_id} was cancelled")


class AWS:
    """Nodes as EC2 instances, one security group and key pair per pool, nothing left behind.

    Args:
        region: AWS region; default: the standard resolution (AWS_REGION / AWS_DEFAULT_REGION,
            the profile's region). Credentials come from the standard chain; AWS_ENDPOINT_URL
            and AWS_ENDPOINT_URL_EC2 are honoured as boto3 does.
        instance_type: EC2 instance type; default: from the pool's accelerator (checked against
            EC2's GPU info), or a small CPU type without one.
        ami: image id; default: the Deep Learning Base AMI (GPU types) or Ubuntu 24.04 (CPU),
            both from their public SSM parameters.
        spot: ask for spot instances (cheaper, may be preempted).
        subnet_id: subnet for all nodes (one subnet, one AZ); default: a default subnet in an
            AZ that offers the instance type.
        use_private_ips: connect to the instances' private addresses (client inside the VPC or
            on a VPN); then no public address is asked for.
        ssh_cidr: who may reach port 22; default: this client's public address (/32), or the
            VPC's CIDR with `use_private_ips`.
        idle_timeout: seconds without any SSH client after which an instance powers itself off
            (and so terminates): a dead client costs minutes, not days.
        user: login user of the AMI (``ubuntu`` for the Deep Learning AMIs and Ubuntu).
        python: interpreter on the instances (default ``python3``; see `sky.SSH`).
        placement_group: put the nodes in a new cluster placement group (low-latency network).
        boot_timeout: seconds for all instances to run and accept the verified SSH login.
        connect_timeout, keepalive, build_env: as for `sky.SSH`.
        poll_interval: seconds between EC2 state polls (boot, termination).
        profile, session: a named profile, or a ready `boto3.Session` (tests, custom chains).
    """

    name = "aws"

    def __init__(
        self,
        region: str | None = None,
        instance_type: str | None = None,
        ami: str | None = None,
        spot: bool = False,
        subnet_id: str | None = None,
        use_private_ips: bool = False,
        ssh_cidr: str | None = None,
        idle_timeout: float = 300.0,
        *,
        user: str = "ubuntu",
        python: str | None = None,
        placement_group: bool = False,
        boot_timeout: float = 900.0,
        connect_timeout: float = 10.0,
        keepalive: float = 15.0,
        build_env: Mapping[str, str] | None = None,
        poll_interval: float = 3.0,
        profile: str | None = None,
        session: boto3.session.Session | None = None,
    ) -> None:
        if idle_timeout <= 0:
            raise ConfigError(f"idle_timeout must be > 0 seconds, got {idle_timeout!r}")
        if ssh_cidr is not None:
            _check_cidr(ssh_cidr)
        self.region = region
        self.instance_type = instance_type
        self.ami = ami
        self.spot = spot
        self.subnet_id = subnet_id
        self.use_private_ips = use_private_ips
        self.ssh_cidr = ssh_cidr
        self.idle_timeout = idle_timeout
        self.user = user
        self.python = python
        self.placement_group = placement_group
        self.boot_timeout = boot_timeout
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.build_env = dict(build_env or {})
        self.poll_interval = poll_interval
        self._profile = profile
        self._session = session
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pools: dict[str, _PoolState] = {}

    # -- boto3 -----------------------------------------------------------------------------

    def session(self) -> boto3.session.Session:
        """The boto3 session (standard credential chain and region resolution)."""
        with self._lock:
            if self._session is None:
                self._session = boto3.session.Session(
                    region_name=self.region, profile_name=self._profile
                )
            return self._session

    def client(self, service: str) -> Any:
        """A cached client (botocore clients are thread-safe; sessions are not)."""
        session = self.session()
        with self._lock:
            if service not in self._clients:
                config = Config(retries={"mode": "standard", "max_attempts": 5})
                self._clients[service] = session.client(
                    service, region_name=self.region, config=config
                )
            return self._clients[service]

    # -- the provider protocol -------------------------------------------------------------

    def implied_accelerator(self) -> Accelerator | None:
        """The accelerator `instance_type=` carries, so plugins (JAX's wheel) can see it."""
        return instance_types.accelerator_of(self.instance_type) if self.instance_type else None

    def validate(self, spec: ClusterSpec) -> None:
        """Offline checks: the accelerator maps to a type, a region and credentials exist."""
        instance_types.choose(spec.accelerator, self.instance_type)
        session = self.session()
        if not (self.region or session.region_name):
            raise ConfigError(
                "no AWS region: pass sky.AWS(region=...), or set AWS_DEFAULT_REGION or a region "
                "in your AWS profile"
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

    async def launch(self, spec: ClusterSpec) -> list[Node]:
        choice = instance_types.choose(spec.accelerator, self.instance_type)
        state = _PoolState(
            spec.pool_id,
            Path(tempfile.mkdtemp(prefix=f"skyward-aws-{spec.pool_id}-")),
            userdata.HostKey.generate(f"skyward-{spec.pool_id}"),
        )
        self._pools[spec.pool_id] = state
        try:
            state.provisioning = _in_thread(
                lambda: self._provision(state, spec, choice), f"skyward-aws-launch-{spec.pool_id}"
            )
            instances = await asyncio.shield(asyncio.wrap_future(state.provisioning))
            return list(await self._connect(state, instances))
        except BaseException as exc:
            state.cancel.set()
            logger.info("launch of %s failed (%r): removing what it created", spec.pool_id, exc)
            try:
                await self._teardown(state)
            except ProvisionError as cleanup:
                if isinstance(exc, Exception):
                    raise ProvisionError(f"{exc}\nand then cleaning up failed: {cleanup}") from exc
            raise

    async def replace(self, node: Node) -> Node:
        """A new instance, launched as the pool's were, in place of a lost one."""
        if not isinstance(node, AWSNode):
            raise ConfigError(f"{node!r} is not a node of the AWS provider")
        state = self._pools[node.pool_id]
        launched = _in_thread(
            lambda: self._provision_replacement(state, node.instance_id),
            f"skyward-aws-replace-{state.pool_id}",
        )
        try:
            (instance,) = await asyncio.shield(asyncio.wrap_future(launched))
        except ClientError as exc:
            raise ProvisionError(f"launching a replacement for node {node.index}: {exc}") from None
        address = instance.get("PrivateIpAddress" if self.use_private_ips else "PublicIpAddress")
        if not address:
            raise ProvisionError(f"replacement instance {instance['InstanceId']} has no address")
        known = load_known_hosts([state.host_key.known_hosts_line(str(address))])
        deadline = asyncio.get_running_loop().time() + self.boot_timeout
        host = await self._connect_one(str(address), instance["InstanceId"], known, state, deadline)
        state.hosts.append(host)
        return AWSNode(node.index, host, instance, state.pool_id)

    async def prepare(self, nodes: list[Node], image: Image, log: Log) -> None:
        for pool_id in {n.pool_id for n in nodes if isinstance(n, AWSNode)}:
            state = self._pools[pool_id]
            assert state.ssh is not None
            await state.ssh.prepare(
                [n for n in nodes if isinstance(n, AWSNode) and n.pool_id == pool_id], image, log
            )

    async def terminate(self, nodes: list[Node]) -> None:
        for pool_id in {n.pool_id for n in nodes if isinstance(n, AWSNode)}:
            state = self._pools.get(pool_id)
            if state is not None:
                await self._teardown(state)

    async def explain(self, node: Node) -> NodeLoss | None:
        """Why `node`'s instance went away (e.g. spot preemption), or None if it still runs."""
        if not isinstance(node, AWSNode):
            return None
        ec2 = self.client("ec2")
        try:
            found = await asyncio.to_thread(resources.instance_states, ec2, [node.instance_id])
        except ClientError:
            return None
        instance = found.get(node.instance_id)
        return describe_loss(instance) if instance is not None else None

    # -- orphan sweep ----------------------------------------------------------------------

    def cleanup(
        self, older_than: timedelta | float = timedelta(hours=1), pool: str | None = None
    ) -> list[str]:
        """Remove skyward resources (all pools, or `pool`) created more than `older_than` ago.

        Pools whose clients died leave at most a security group and a key pair (the watchdog
        powers their instances off); this removes those and any instance still running.
        Returns what was removed; raises `ProvisionError` listing what could not be.
        """
        age = older_than if isinstance(older_than, timedelta) else timedelta(seconds=older_than)
        cutoff = datetime.now(UTC) - age
        ec2 = self.client("ec2")
        removed: list[str] = []
        problems: list[str] = []
        for found in resources.find(ec2, pool).values():
            # Resources without a readable created-at tag were still made by skyward: old.
            if found.created_at is not None and found.created_at > cutoff:
                continue
            problems += resources.remove(ec2, found, poll=self.poll_interval, log=logger.info)
            removed += [f"{found.pool_id}: {line}" for line in found.describe()]
        if problems:
            raise ProvisionError("could not remove:\n" + "\n".join(f"  {p}" for p in problems))
        return removed

    # -- launch, EC2 half (runs in a thread) ------------------------------------------------

    def _provision(
        self, state: _PoolState, spec: ClusterSpec, choice: instance_types.Choice
    ) -> list[dict[str, Any]]:
        try:
            return self._provision_calls(state, spec, choice)
        except ClientError as exc:
            raise ProvisionError(_client_error(exc, spec, choice)) from None
        except NoCredentialsError:
            raise ConfigError("no AWS credentials found (see `aws configure`)") from None
        except NoRegionError:
            raise ConfigError("no AWS region: pass sky.AWS(region=...)") from None

    def _provision_calls(
        self, state: _PoolState, spec: ClusterSpec, choice: instance_types.Choice
    ) -> list[dict[str, Any]]:
        ec2 = self.client("ec2")
        # Everything that can be wrong with the request is found out before anything exists.
        try:
            info = ec2.describe_instance_types(InstanceTypes=[choice.instance_type])
        except ClientError as exc:
            if "InvalidInstanceType" in str(exc):
                raise ConfigError(
                    f"instance type {choice.instance_type!r} does not exist in this region: {exc}"
                ) from None
            raise
        details = info["InstanceTypes"][0]
        instance_types.check(choice, details)
        arch = instance_types.architecture(details)
        ami = self.ami or self._resolve_ami(choice.is_gpu, arch)
        subnet = self._subnet(ec2, choice.instance_type)
        cidr = self.ssh_cidr or self._client_cidr(ec2, subnet["VpcId"])
        state.check_cancel()

        tags = resources.pool_tags(spec.pool_id)
        name = f"skyward-{spec.pool_id}"
        _write_key_pair(state.key_path)
        ec2.import_key_pair(
            KeyName=name,
            PublicKeyMaterial=state.key_path.with_suffix(".pub").read_bytes(),
            TagSpecifications=[resources.tag_spec("key-pair", tags)],
        )
        group = ec2.create_security_group(
            GroupName=name,
            Description=f"skyward pool {spec.pool_id}: SSH from the client, all within the pool",
            VpcId=subnet["VpcId"],
            TagSpecifications=[resources.tag_spec("security-group", tags)],
        )["GroupId"]
        ec2.authorize_security_group_ingress(
            GroupId=group,
            IpPermissions=[
                {
                    "IpProtocol": "tcp",
                    "FromPort": 22,
                    "ToPort": 22,
                    "IpRanges": [{"CidrIp": cidr, "Description": "skyward client"}],
                },
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]},
            ],
        )
        placement: dict[str, str] = {"AvailabilityZone": subnet["AvailabilityZone"]}
        if self.placement_group:
            ec2.create_placement_group(
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=[resources.tag_spec("placement-group", tags)],
            )
            placement["GroupName"] = name
        state.check_cancel()

        options: dict[str, Any] = {}
        if self.spot:
            options["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        logger.info("starting %d x %s (%s) for %s", spec.nodes, choice.instance_type, ami, name)
        # Kept for replace(): a replacement is the same request for one instance.
        state.run_params = dict(
            ImageId=ami,
            InstanceType=choice.instance_type,
            KeyName=name,
            UserData=userdata.render(spec.pool_id, state.host_key, self.idle_timeout),
            InstanceInitiatedShutdownBehavior="terminate",  # the watchdog's poweroff ends it
            NetworkInterfaces=[
                {
                    "DeviceIndex": 0,
                    "SubnetId": subnet["SubnetId"],
                    "Groups": [group],
                    "AssociatePublicIpAddress": not self.use_private_ips,
                    "DeleteOnTermination": True,
                }
            ],
            Placement=placement,
            MetadataOptions={"HttpTokens": "required"},
            TagSpecifications=[
                resources.tag_spec("instance", tags),
                resources.tag_spec("volume", tags),
            ],
            **options,
        )
        reply = ec2.run_instances(
            **state.run_params,
            MinCount=spec.nodes,  # all-or-nothing: EC2 starts N or none
            MaxCount=spec.nodes,
            # Makes the call idempotent: botocore's own retries can never start a second pool.
            ClientToken=f"{spec.pool_id}-{uuid.uuid4().hex[:12]}",
        )
        state.instance_ids = [i["InstanceId"] for i in reply["Instances"]]
        return self._wait_running(ec2, state, state.instance_ids)

    def _provision_replacement(self, state: _PoolState, lost: str) -> list[dict[str, Any]]:
        """One instance launched as the pool's were, in place of `lost` (terminated first)."""
        ec2 = self.client("ec2")
        try:
            ec2.terminate_instances(InstanceIds=[lost])  # it may be hung rather than gone
        except ClientError as exc:
            logger.info("terminating lost instance %s: %s", lost, exc)
        reply = ec2.run_instances(
            **state.run_params,
            MinCount=1,
            MaxCount=1,
            ClientToken=f"{state.pool_id}-{uuid.uuid4().hex[:12]}",
        )
        fresh = [i["InstanceId"] for i in reply["Instances"]]
        state.instance_ids += fresh
        return self._wait_running(ec2, state, fresh)

    def _wait_running(self, ec2: Any, state: _PoolState, ids: list[str]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.boot_timeout
        count = len(ids)
        while True:
            try:
                found = resources.instance_states(ec2, ids)
            except ClientError as exc:
                if "InvalidInstanceID.NotFound" not in str(exc):
                    raise
                found = {}  # EC2 is eventually consistent right after run_instances
            gone = [i for i in found.values() if i["State"]["Name"] in _GONE_STATES]
            if gone:
                reasons = "; ".join(f"{i['InstanceId']}: {_loss_words(i)}" for i in gone)
                raise ProvisionError(
                    f"EC2 started {count} instance(s) but {len(gone)} stopped at once ({reasons}); "
                    "a pool needs all of them, so all were terminated. Try again, another "
                    "subnet/AZ (subnet_id=), fewer nodes, or spot=False"
                )
            running = [i for i in found.values() if i["State"]["Name"] == "running"]
            if len(running) == count:
                return sorted(running, key=lambda i: (i.get("AmiLaunchIndex", 0), i["InstanceId"]))
            if time.monotonic() > deadline:
                raise ProvisionError(
                    f"only {len(running)} of {count} instance(s) were running after "
                    f"boot_timeout={self.boot_timeout:g} s; all were terminated"
                )
            state.check_cancel()
            time.sleep(self.poll_interval)

    def _resolve_ami(self, gpu: bool, arch: str) -> str:
        template = GPU_AMI_PARAMETER if gpu else CPU_AMI_PARAMETER
        name = template.format(arch=arch if gpu else ("arm64" if arch == "arm64" else "amd64"))
        try:
            return str(self.client("ssm").get_parameter(Name=name)["Parameter"]["Value"])
        except ClientError as exc:
            raise ProvisionError(
                f"the AMI could not be looked up from the public SSM parameter {name}: {exc}; "
                "pass sky.AWS(ami=...)"
            ) from None

    def _subnet(self, ec2: Any, instance_type: str) -> dict[str, Any]:
        if self.subnet_id:
            subnets = ec2.describe_subnets(SubnetIds=[self.subnet_id])["Subnets"]
            return dict(subnets[0])
        offerings = ec2.describe_instance_type_offerings(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": [instance_type]}],
        )["InstanceTypeOfferings"]
        zones = {o["Location"] for o in offerings}
        defaults = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])
        candidates = sorted(
            (s for s in defaults["Subnets"] if s["AvailabilityZone"] in zones),
            key=lambda s: str(s["AvailabilityZone"]),
        )
        if not candidates:
            raise ConfigError(
                f"no default subnet in an availability zone that offers {instance_type}: "
                "pass sky.AWS(subnet_id=...)"
            )
        return dict(candidates[0])

    def _client_cidr(self, ec2: Any, vpc_id: str) -> str:
        if self.use_private_ips:
            return str(ec2.describe_vpcs(VpcIds=[vpc_id])["Vpcs"][0]["CidrBlock"])
        try:
            with urllib.request.urlopen(CHECK_IP_URL, timeout=10) as answer:
                address = answer.read().decode().strip()
            return _check_cidr(f"{address}/32")
        except (OSError, ValueError, ConfigError) as exc:
            raise ConfigError(
                f"this client's public address could not be found ({CHECK_IP_URL}: {exc}); "
                "pass sky.AWS(ssh_cidr='x.x.x.x/32') to say who may reach port 22"
            ) from None

    # -- launch, SSH half ------------------------------------------------------------------

    async def _connect(self, state: _PoolState, instances: list[dict[str, Any]]) -> list[AWSNode]:
        addresses = []
        for instance in instances:
            key = "PrivateIpAddress" if self.use_private_ips else "PublicIpAddress"
            address = instance.get(key)
            if not address:
                raise ProvisionError(
                    f"instance {instance['InstanceId']} has no {key}: use a subnet that assigns "
                    "public addresses, or use_private_ips=True from inside the VPC"
                )
            addresses.append(str(address))
        lines = [state.host_key.known_hosts_line(a) for a in addresses]
        known = load_known_hosts(lines)
        deadline = asyncio.get_running_loop().time() + self.boot_timeout
        results = await asyncio.gather(
            *(
                self._connect_one(a, i["InstanceId"], known, state, deadline)
                for a, i in zip(addresses, instances, strict=True)
            ),
            return_exceptions=True,
        )
        state.hosts = [r for r in results if isinstance(r, SSHHost)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for failure in failures:
                if not isinstance(failure, Exception):
                    raise failure
            raise failures[0]
        state.ssh = SSH(
            addresses,
            user=self.user,
            key=state.key_path,
            known_hosts=lines,
            python=self.python,
            connect_timeout=self.connect_timeout,
            keepalive=self.keepalive,
            build_env=self.build_env,
        )
        return [
            AWSNode(i, host, instance, state.pool_id)
            for i, (host, instance) in enumerate(zip(state.hosts, instances, strict=True))
        ]

    async def _connect_one(
        self,
        address: str,
        instance_id: str,
        known: asyncssh.SSHKnownHosts | tuple[()],
        state: _PoolState,
        deadline: float,
    ) -> SSHHost:
        loop = asyncio.get_running_loop()
        endpoint = Endpoint(address, 22, self.user)
        while True:
            timeout = max(1.0, min(self.connect_timeout, deadline - loop.time()))
            try:
                # config=[]: no ~/.ssh/config rule (User, HostName...) may redirect this login.
                return await connect(
                    endpoint,
                    known_hosts=known,
                    key=str(state.key_path),
                    config=[],
                    timeout=timeout,
                    keepalive=self.keepalive,
                )
            except SSHConnectError as exc:
                # While the instance boots, sshd is down, still offers the image's own host key
                # (rejected: only ours is trusted) or has no authorized key yet. Wait, never trust.
                if loop.time() + self.poll_interval > deadline:
                    raise ProvisionError(
                        f"instance {instance_id} ({address}) did not accept the verified SSH "
                        f"login within boot_timeout={self.boot_timeout:g} s; last error: {exc}"
                    ) from None
                await asyncio.sleep(self.poll_interval)

    # -- teardown --------------------------------------------------------------------------

    async def _teardown(self, state: _PoolState) -> None:
        if state.removed:
            return
        hosts = list(state.hosts)
        await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
        done = _in_thread(lambda: self._remove(state), f"skyward-aws-teardown-{state.pool_id}")
        # Shielded: if the pool's loop is cancelled, the thread still finishes the job.
        await asyncio.shield(asyncio.wrap_future(done))

    def _remove(self, state: _PoolState) -> None:
        if state.provisioning is not None:
            # Let an in-flight run_instances return first, so its instances are found too.
            with contextlib.suppress(BaseException):
                state.provisioning.exception()
        ec2 = self.client("ec2")
        problems: list[str] = []
        try:
            found = resources.find(ec2, state.pool_id).get(
                state.pool_id, resources.PoolResources(state.pool_id)
            )
            problems = resources.remove(
                ec2,
                found,
                extra_instances=state.instance_ids,
                poll=self.poll_interval,
                log=logger.info,
            )
        except (ClientError, BotoCoreError) as exc:
            problems = [str(exc)]
        if problems:
            raise ProvisionError(
                f"pool {state.pool_id} could not be fully removed:\n"
                + "\n".join(f"  {p}" for p in problems)
                + f"\nRun `skyward down {state.pool_id}` to retry."
            )
        state.removed = True
        shutil.rmtree(state.key_dir, ignore_errors=True)


def describe_loss(instance: Mapping[str, Any]) -> NodeLoss | None:
    """Why an instance is gone, in words (preemption named as such); None while it runs."""
    status = instance.get("State", {}).get("Name", "")
    if status in ("pending", "running"):
        return None
    reason = instance.get("StateReason", {})
    code = str(reason.get("Code", ""))
    message = str(reason.get("Message", "") or instance.get("StateTransitionReason", ""))
    if code in _SPOT_CODES or (instance.get("InstanceLifecycle") == "spot" and "Spot" in code):
        return NodeLoss(
            f"instance {instance.get('InstanceId')} was preempted: EC2 reclaimed the spot "
            f"instance ({message or code})",
            preempted=True,
        )
    return NodeLoss(
        f"instance {instance.get('InstanceId')} is {status}: {message or code or 'no reason'}"
    )


def _loss_words(instance: Mapping[str, Any]) -> str:
    loss = describe_loss(instance)
    return loss.reason if loss else str(instance["State"]["Name"])


def _client_error(exc: ClientError, spec: ClusterSpec, choice: instance_types.Choice) -> str:
    error = exc.response.get("Error", {})
    code, message = error.get("Code", "?"), error.get("Message", str(exc))
    capacity = (
        "InsufficientInstanceCapacity",
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
        "MaxSpotInstanceCountExceeded",
        "SpotMaxPriceTooLow",
        "InsufficientCapacity",
        "Unsupported",
    )
    what = f"{spec.nodes} x {choice.instance_type}"
    if code in capacity:
        return (
            f"EC2 could not start {what} ({code}: {message}). Nothing was left running. Try "
            "another region or AZ (subnet_id=), fewer nodes, spot=False, or ask AWS for a quota "
            "increase"
        )
    if code in ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId"):
        return f"AWS refused the request ({code}: {message}); check the credentials' permissions"
    return f"EC2 call failed while launching {what} ({code}: {message}); nothing was left running"


def _check_cidr(cidr: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_network(cidr, strict=False))
    except ValueError:
        raise ConfigError(f"ssh_cidr {cidr!r} is not a CIDR such as '203.0.113.7/32'") from None


def _write_key_pair(path: Path) -> None:
    """A fresh ed25519 login key for one pool: private key 0600, public key beside it."""
    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"skyward-{path.parent.name}")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(key.export_private_key())
    path.chmod(0o600)
    path.with_suffix(".pub").write_bytes(key.export_public_key())


def _in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Run `fn` in a new non-daemon thread: the interpreter waits for it before exiting."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    # daemon=False explicitly: threads inherit daemon status from the (daemon) loop thread.
    threading.Thread(target=run, name=name, daemon=False).start()
    return future
