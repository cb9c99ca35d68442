"""A pool's EC2 instances as plain functions: set up, run, wait, describe, replace, remove.

Each function is one step of a launch or a teardown, blocking (the provider runs them in a
thread) and working from the pool's tags (`resources`), so every step can be tested alone:

- `set_up` checks the instance type, resolves the AMI and subnet, then creates the pool's key
  pair, security group (22 from the client's CIDR only, all traffic inside the group) and
  optional placement group, and returns the `run_instances` parameters of the pool;
- `run` starts N instances with those parameters in ONE call (MinCount=MaxCount=N);
- `wait_running` waits until all of them run, failing the pool if one stops;
- `replace` terminates a lost instance and starts one more with the pool's parameters;
- `loss_of` / `describe_loss` say why an instance went away.

Each step records what it makes in the pool's `teardown.Made` before or as EC2 makes it, so the
teardown (`teardown.remove_pool`) removes it even when a listing by tags fails.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh
from botocore.exceptions import ClientError

from skyward.errors import ConfigError, ProvisionError
from skyward.hardware import ClusterSpec
from skyward.providers.aws import instance_types, resources, teardown, userdata
from skyward.providers.base import NodeLoss
from skyward.providers.cloud import failover
from skyward.providers.cloud.bootscript import printed_key
from skyward.providers.cloud.provider import public_cidr

GPU_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/{arch}/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)
CPU_AMI_PARAMETER = (
    "/aws/service/canonical/ubuntu/server/24.04/stable/current/{arch}/hvm/ebs-gp3/ami-id"
)
_GONE_STATES = ("shutting-down", "terminated", "stopping", "stopped")
_SPOT_CODES = ("Server.SpotInstanceTermination", "Server.SpotInstanceShutdown")
# EC2's answers that a zone cannot take the instances now: the next zone may.
ZONE_CODES = (
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "SpotMaxPriceTooLow",
    "Unsupported",
)
# Its answers that a quota (per region) is too low: no zone of the region will do.
REGION_CODES = ("InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded")
_CAPACITY_CODES = ZONE_CODES + REGION_CODES

CheckCancel = Callable[[], None]
logger = logging.getLogger("skyward.aws")


@dataclass(frozen=True)
class MachineSettings:
    """Where and how a pool's instances run: the `sky.AWS` settings the EC2 calls need."""

    ami: str | None = None
    spot: bool = False
    subnet_id: str | None = None
    use_private_ips: bool = False
    ssh_cidr: str | None = None
    idle_timeout: float = 300.0
    placement_group: bool = False
    iam_instance_profile: str | None = None  # a name or an ARN


def set_up(
    ec2: Any,
    ssm: Any,
    settings: MachineSettings,
    spec: ClusterSpec,
    choice: instance_types.Choice,
    details: Mapping[str, Any],
    subnet: Mapping[str, Any],
    key_path: Path,
    made: teardown.Made,
    check_cancel: CheckCancel,
) -> dict[str, Any]:
    """Create the pool's key pair, security group (in `subnet`'s VPC) and placement group;
    return the `run_instances` parameters of its instances in `subnet` (`in_subnet` moves
    them to another zone's). `details`: the type's `describe` (`type_details`). Everything
    that can be wrong with the request is found out before anything exists."""
    arch = instance_types.architecture(details)
    ami = settings.ami or _resolve_ami(ssm, choice.is_gpu, arch)
    cidr = settings.ssh_cidr or _client_cidr(ec2, subnet["VpcId"], settings.use_private_ips)
    check_cancel()

    tags = resources.pool_tags(spec.pool_id)
    name = f"skyward-{spec.pool_id}"
    _import_key_pair(ec2, name, tags, key_path, made)
    group = _security_group(ec2, name, tags, spec.pool_id, subnet["VpcId"], cidr, made)
    where: dict[str, str] = {"AvailabilityZone": subnet["AvailabilityZone"]}
    if settings.placement_group:
        where["GroupName"] = _placement_group(ec2, name, tags, made)
    check_cancel()
    return dict(
        ImageId=ami,
        InstanceType=choice.instance_type,
        KeyName=name,
        UserData=userdata.render(spec.pool_id, settings.idle_timeout),
        InstanceInitiatedShutdownBehavior="terminate",  # the watchdog's poweroff ends it
        NetworkInterfaces=[
            {
                "DeviceIndex": 0,
                "SubnetId": subnet["SubnetId"],
                "Groups": [group],
                "AssociatePublicIpAddress": not settings.use_private_ips,
                "DeleteOnTermination": True,
            }
        ],
        Placement=where,
        MetadataOptions={"HttpTokens": "required"},
        TagSpecifications=[
            resources.tag_spec("instance", tags),
            resources.tag_spec("volume", tags),
        ],
        **_instance_options(settings),
    )


def _import_key_pair(
    ec2: Any, name: str, tags: list[dict[str, str]], key_path: Path, made: teardown.Made
) -> None:
    """The pool's SSH key, made here and imported as the key pair `name`."""
    write_key_pair(key_path)
    made.add(teardown.KEY_PAIR, name)
    ec2.import_key_pair(
        KeyName=name,
        PublicKeyMaterial=key_path.with_suffix(".pub").read_bytes(),
        TagSpecifications=[resources.tag_spec("key-pair", tags)],
    )


def _security_group(
    ec2: Any,
    name: str,
    tags: list[dict[str, str]],
    pool_id: str,
    vpc: str,
    cidr: str,
    made: teardown.Made,
) -> str:
    """The pool's security group in `vpc`: SSH from `cidr` (the client), all traffic within the
    group; its id."""
    group: str = ec2.create_security_group(
        GroupName=name,
        Description=f"skyward pool {pool_id}: SSH from the client, all within the pool",
        VpcId=vpc,
        TagSpecifications=[resources.tag_spec("security-group", tags)],
    )["GroupId"]
    made.add(teardown.SECURITY_GROUP, group)
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
    return group


def _placement_group(ec2: Any, name: str, tags: list[dict[str, str]], made: teardown.Made) -> str:
    """A cluster placement group for the pool's instances; its name."""
    made.add(teardown.PLACEMENT_GROUP, name)
    ec2.create_placement_group(
        GroupName=name,
        Strategy="cluster",
        TagSpecifications=[resources.tag_spec("placement-group", tags)],
    )
    return name


def _instance_options(settings: MachineSettings) -> dict[str, Any]:
    """The `run_instances` parameters that only some pools have: an instance profile, spot."""
    options: dict[str, Any] = {}
    profile = settings.iam_instance_profile
    if profile:
        # The nodes' own credentials (sky.Data("s3://..."), s3:// output_dir): a role the user
        # owns; the pool only names it, so the teardown has nothing to remove.
        key = "Arn" if profile.startswith("arn:") else "Name"
        options["IamInstanceProfile"] = {key: profile}
    if settings.spot:
        options["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
            },
        }
    return options


def type_details(ec2: Any, choice: instance_types.Choice) -> dict[str, Any]:
    """EC2's description of the chosen type in this region (vCPUs, GPUs, architecture), checked
    against what the pool asked for."""
    try:
        info = ec2.describe_instance_types(InstanceTypes=[choice.instance_type])
    except ClientError as exc:
        if "InvalidInstanceType" in str(exc):
            raise ConfigError(
                f"instance type {choice.instance_type!r} does not exist in this region: {exc}"
            ) from None
        raise
    details = dict(info["InstanceTypes"][0])
    instance_types.check(choice, details)
    return details


def in_subnet(params: Mapping[str, Any], subnet: Mapping[str, Any]) -> dict[str, Any]:
    """`params` for instances in `subnet` (and so its zone) instead."""
    moved = dict(params)
    moved["NetworkInterfaces"] = [
        {**params["NetworkInterfaces"][0], "SubnetId": subnet["SubnetId"]}
    ]
    moved["Placement"] = {**params["Placement"], "AvailabilityZone": subnet["AvailabilityZone"]}
    return moved


def run_in_first_zone_with_room(
    ec2: Any,
    params: Mapping[str, Any],
    subnets: Sequence[Mapping[str, Any]],
    count: int,
    pool_id: str,
    attempts: failover.Attempts,
    market: str = "",
    check_cancel: CheckCancel = lambda: None,
) -> tuple[list[str], dict[str, Any]] | None:
    """`count` instances with `params` in the first of `subnets` whose zone has room: their ids
    and the parameters they ran with; None when no zone had. A zone without capacity is told to
    `attempts` and passed; a quota error blocks the region (`ec2`'s) and ends the search."""
    said = f" ({market})" if market else ""
    for subnet in subnets:
        check_cancel()
        moved = in_subnet(params, subnet)
        try:
            return run(ec2, moved, count, pool_id), moved
        except ClientError as exc:
            code, words = error_words(exc)
            if code in ZONE_CODES:
                attempts.failed(f"{subnet['AvailabilityZone']}{said}", words)
                continue
            if code in REGION_CODES:
                attempts.block_region(str(ec2.meta.region_name), f"{words}{said}")
                break
            raise
    return None


def run(ec2: Any, params: Mapping[str, Any], count: int, pool_id: str) -> list[str]:
    """Start `count` instances with `params` in one call, all or none; their ids."""
    logger.info(
        "starting %d x %s (%s) for %s", count, params["InstanceType"], params["ImageId"], pool_id
    )
    reply = ec2.run_instances(
        **params,
        MinCount=count,  # all-or-nothing: EC2 starts N or none
        MaxCount=count,
        # Makes the call idempotent: botocore's own retries can never start a second pool.
        ClientToken=f"{pool_id}-{uuid.uuid4().hex[:12]}",
    )
    return [str(i["InstanceId"]) for i in reply["Instances"]]


def retire(ec2: Any, lost: str) -> None:
    """Terminate `lost`, a lost instance (it may be hung rather than gone); a failure is only
    logged: the teardown removes it in the end."""
    try:
        ec2.terminate_instances(InstanceIds=[lost])
    except ClientError as exc:
        logger.info("terminating lost instance %s: %s", lost, exc)


def wait_running(
    ec2: Any, ids: list[str], *, timeout: float, poll: float, check_cancel: CheckCancel
) -> list[dict[str, Any]]:
    """Wait until every instance of `ids` runs; in launch order. One stopping fails them all."""
    deadline = time.monotonic() + timeout
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
                f"boot_timeout={timeout:g} s; all were terminated"
            )
        check_cancel()
        time.sleep(poll)


def published_key(ec2: Any, instance_id: str) -> str | None:
    """The public host key instance `instance_id` printed on its console output at boot (the
    user data's `bootscript.print_key`), or None while it has printed none. Only the instance
    writes its console and only ``ec2:GetConsoleOutput`` reads it: user data, which anyone with
    ``ec2:DescribeInstanceAttribute`` reads, carries no key."""
    try:
        # Latest: the live buffer, not the snapshot EC2 takes some minutes after boot.
        reply = ec2.get_console_output(InstanceId=instance_id, Latest=True)
    except ClientError as exc:
        if error_words(exc)[0] != "UnsupportedOperation":  # Latest needs a Nitro instance
            raise
        reply = ec2.get_console_output(InstanceId=instance_id)
    return printed_key(str(reply.get("Output") or ""))  # botocore decoded its base64


def loss_of(ec2: Any, instance_id: str) -> NodeLoss | None:
    """Why `instance_id` went away (e.g. spot preemption), or None if it runs or is unknown."""
    try:
        found = resources.instance_states(ec2, [instance_id])
    except ClientError:
        return None
    instance = found.get(instance_id)
    return describe_loss(instance) if instance is not None else None


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


def error_words(exc: ClientError) -> tuple[str, str]:
    """A failed EC2 call's code, and the code with its message."""
    error = exc.response.get("Error", {})
    code = str(error.get("Code", "?"))
    return code, f"{code}: {error.get('Message', str(exc))}"


def launch_error(exc: ClientError, spec: ClusterSpec, choice: instance_types.Choice) -> str:
    """A failed EC2 call of a launch, in words, with what to try."""
    error = exc.response.get("Error", {})
    code, message = error.get("Code", "?"), error.get("Message", str(exc))
    what = f"{spec.nodes} x {choice.instance_type}"
    if code in _CAPACITY_CODES:
        return (
            f"EC2 could not start {what} ({code}: {message}). Nothing was left running. Try "
            "another region or AZ (subnet_id=), fewer nodes, spot=False, or ask AWS for a quota "
            "increase"
        )
    if code in ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId"):
        return f"AWS refused the request ({code}: {message}); check the credentials' permissions"
    return f"EC2 call failed while launching {what} ({code}: {message}); nothing was left running"


def write_key_pair(path: Path) -> None:
    """A fresh ed25519 login key for one pool: private key 0600, public key beside it."""
    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"skyward-{path.parent.name}")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(key.export_private_key())
    path.chmod(0o600)
    path.with_suffix(".pub").write_bytes(key.export_public_key())


def _loss_words(instance: Mapping[str, Any]) -> str:
    loss = describe_loss(instance)
    return loss.reason if loss else str(instance["State"]["Name"])


def _resolve_ami(ssm: Any, gpu: bool, arch: str) -> str:
    template = GPU_AMI_PARAMETER if gpu else CPU_AMI_PARAMETER
    name = template.format(arch=arch if gpu else ("arm64" if arch == "arm64" else "amd64"))
    try:
        return str(ssm.get_parameter(Name=name)["Parameter"]["Value"])
    except ClientError as exc:
        raise ProvisionError(
            f"the AMI could not be looked up from the public SSM parameter {name}: {exc}; "
            "pass sky.AWS(ami=...)"
        ) from None


def subnets(ec2: Any, subnet_ids: Sequence[str], instance_type: str) -> list[dict[str, Any]]:
    """Where the pool may start, in the order tried: the subnets `subnet_ids` when given, else
    the region's default subnet of each zone that offers the type, by zone name."""
    if subnet_ids:
        found = {
            s["SubnetId"]: s for s in ec2.describe_subnets(SubnetIds=list(subnet_ids))["Subnets"]
        }
        return [dict(found[i]) for i in subnet_ids]
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
    return [dict(s) for s in candidates]


def _client_cidr(ec2: Any, vpc_id: str, use_private_ips: bool) -> str:
    if use_private_ips:
        return str(ec2.describe_vpcs(VpcIds=[vpc_id])["Vpcs"][0]["CidrBlock"])
    return public_cidr("AWS")
