"""API-level tests of the AWS provider against moto in process (`mock_aws`).

The SSH half of a launch cannot succeed here: the subnet is routed unreachable (see conftest), so
these tests see every EC2 resource a launch creates and prove that each exit path removes it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import boto3
import pytest
from moto import mock_aws

import skyward as sky
from skyward.console.progress import Progress
from skyward.errors import ConfigError, ProvisionError
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.aws import instance_types, instances, teardown, userdata
from skyward.providers.aws.instances import describe_loss
from skyward.providers.aws.resources import POOL_TAG, pool_tags
from skyward.providers.cloud.bootscript import printed_key
from tests.aws.conftest import (
    MOTO_AMI,
    REGION,
    Stubs,
    join_skyward_threads,
    leftovers,
    make_vpc,
    new_session,
)

KNOWN = ("T4", "A10G", "L4", "L40S", "A100", "A100-80GB", "H100", "H200")


@pytest.fixture
def ec2(stubs: Stubs) -> Iterator[Any]:
    with mock_aws():
        yield new_session(stubs).client("ec2")


@pytest.fixture
def subnet(ec2: Any, guard_network: object) -> str:
    return make_vpc(ec2, "10.213.9.0/24")


def provider(stubs: Stubs, subnet: str, **kwargs: Any) -> sky.AWS:
    options: dict[str, Any] = {
        "subnet_id": subnet,
        "use_private_ips": True,
        "ami": MOTO_AMI,
        "poll_interval": 0.01,
        "boot_timeout": 0.5,
        "connect_timeout": 0.5,
        "session": new_session(stubs),
    }
    options.update(kwargs)
    return sky.AWS(**options)


def spec(nodes: int, accelerator: str | None = None, pool_id: str = "t-0001") -> ClusterSpec:
    acc = Accelerator.parse(accelerator) if accelerator else None
    return ClusterSpec(nodes=nodes, pool_id=pool_id, accelerator=acc, provider="aws")


def snapshot_on(session: boto3.session.Session, ec2: Any, event: str) -> dict[str, Any]:
    """Record what exists right after `event` (another client, so the hook does not nest)."""
    seen: dict[str, Any] = {}

    def hook(**_: Any) -> None:
        reservations = ec2.describe_instances(
            Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
        )["Reservations"]
        seen["instances"] = [i for r in reservations for i in r["Instances"]]
        seen["groups"] = ec2.describe_security_groups(
            Filters=[{"Name": "tag-key", "Values": [POOL_TAG]}]
        )["SecurityGroups"]
        seen["keys"] = ec2.describe_key_pairs(Filters=[{"Name": "tag-key", "Values": [POOL_TAG]}])[
            "KeyPairs"
        ]
        first = seen["instances"][0]["InstanceId"]
        seen["user_data"] = base64.b64decode(
            ec2.describe_instance_attribute(InstanceId=first, Attribute="userData")["UserData"][
                "Value"
            ]
        ).decode()
        seen["shutdown"] = ec2.describe_instance_attribute(
            InstanceId=first, Attribute="instanceInitiatedShutdownBehavior"
        )["InstanceInitiatedShutdownBehavior"]["Value"]

    session.events.register(event, hook)
    return seen


def count_calls(session: boto3.session.Session) -> list[str]:
    calls: list[str] = []
    session.events.register("before-call.*.*", lambda model, **_: calls.append(model.name))
    return calls


# -- validation: nothing is created --------------------------------------------------------------


def test_unknown_accelerator_fails_before_any_call(ec2: Any, stubs: Stubs) -> None:
    session = new_session(stubs)
    calls = count_calls(session)
    with pytest.raises(ConfigError) as caught:
        sky.ComputePool(provider=sky.AWS(session=session), accelerator="B200", nodes=2)
    assert isinstance(caught.value, ValueError)
    for name in KNOWN:
        assert name in str(caught.value)
    with pytest.raises(ConfigError, match="no EC2 instance type has 16 A100"):
        sky.AWS(session=session).validate(spec(1, "A100:16"))
    assert calls == []
    assert leftovers(ec2) == []


def test_missing_credentials_fail_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match="no AWS credentials"):
        sky.AWS(region=REGION).validate(spec(1))


@pytest.mark.parametrize(
    ("accelerator", "expected"),
    [
        (None, "m6i.large"),
        ("T4", "g4dn.xlarge"),
        ("T4:4", "g4dn.12xlarge"),
        ("A10G", "g5.xlarge"),
        ("L4:8", "g6.48xlarge"),
        ("L40S", "g6e.xlarge"),
        ("A100", "p4d.24xlarge"),
        ("A100:8", "p4d.24xlarge"),
        ("A100-80GB", "p4de.24xlarge"),
        ("H100", "p5.4xlarge"),
        ("H100:8", "p5.48xlarge"),
        ("H200", "p5en.48xlarge"),
    ],
)
def test_accelerators_map_to_types_ec2_agrees_with(
    ec2: Any, accelerator: str | None, expected: str
) -> None:
    acc = Accelerator.parse(accelerator) if accelerator else None
    choice = instance_types.choose(acc, None)
    assert choice.instance_type == expected
    info = ec2.describe_instance_types(InstanceTypes=[expected])["InstanceTypes"][0]
    instance_types.check(choice, info)  # moto carries EC2's real GPU table


def test_instance_type_override_is_checked_against_ec2(ec2: Any) -> None:
    choice = instance_types.choose(Accelerator.parse("A100-80GB"), "p4d.24xlarge")
    info = ec2.describe_instance_types(InstanceTypes=["p4d.24xlarge"])["InstanceTypes"][0]
    with pytest.raises(ConfigError, match="8 x A100"):
        instance_types.check(choice, info)  # 40 GB A100s are not A100-80GB


def test_jax_plugin_picks_cuda_from_the_accelerator() -> None:
    plugin = sky.plugins.jax()
    assert plugin.flavour(spec(1, "A100")) == "cuda12"
    assert plugin.flavour(spec(1)) == "cpu"


# -- launch: the exact resources, and nothing left on any failure ---------------------------------


def test_launch_creates_exactly_this_and_a_failed_bootstrap_leaves_nothing(
    ec2: Any, subnet: str, stubs: Stubs
) -> None:
    aws = provider(stubs, subnet, spot=True, placement_group=True, idle_timeout=123)
    seen = snapshot_on(aws.session(), ec2, "after-call.ec2.RunInstances")
    calls = count_calls(aws.session())
    aws.validate(spec(4, "A100"))
    with pytest.raises(
        ProvisionError, match="did not publish its SSH host key in its console output"
    ):
        asyncio.run(aws.launch(spec(4, "A100"), Progress()))

    instances = seen["instances"]
    assert len(instances) == 4 and calls.count("RunInstances") == 1
    for instance in instances:
        assert instance["InstanceType"] == "p4d.24xlarge"
        assert instance["ImageId"] == MOTO_AMI
        assert instance["InstanceLifecycle"] == "spot"
        assert instance["SubnetId"] == subnet
        assert instance["KeyName"] == "skyward-t-0001"
        tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
        assert tags[POOL_TAG] == "t-0001" and "skyward:created-by" in tags
    assert len({i["Placement"]["AvailabilityZone"] for i in instances}) == 1
    assert seen["shutdown"] == "terminate"
    (group,) = seen["groups"]
    rules = group["IpPermissions"]
    ssh = next(r for r in rules if r["IpProtocol"] == "tcp")
    assert (ssh["FromPort"], ssh["ToPort"]) == (22, 22)
    assert [r["CidrIp"] for r in ssh["IpRanges"]] == ["10.213.0.0/16"]  # the VPC: private IPs
    inside = next(r for r in rules if r["IpProtocol"] == "-1")
    assert [p["GroupId"] for p in inside["UserIdGroupPairs"]] == [group["GroupId"]]
    assert len(rules) == 2
    (key,) = seen["keys"]
    assert key["KeyName"] == "skyward-t-0001" and key["KeyType"] == "ed25519"
    script = seen["user_data"]
    assert script.startswith("#!/bin/bash\n")
    assert "PRIVATE KEY" not in script and "ssh-keygen" in script  # the key is made there
    assert "skyward-watchdog 123 " in script
    pg = stubs.placement_groups  # the stub saw the cluster placement group created and deleted
    assert calls.count("CreatePlacementGroup") == 1 and calls.count("DeletePlacementGroup") == 1
    assert pg == {}

    assert leftovers(ec2) == []
    states = {
        i["State"]["Name"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
    }
    assert states == {"terminated"}


NO_CAPACITY = (
    "InsufficientInstanceCapacity",
    "We currently do not have sufficient p4d.24xlarge capacity in the AZ you requested",
)


class Told(Progress):
    """A `Progress` that keeps the status lines the provider tells the user."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, message: str) -> None:
        self.lines.append(message)


def subnets_in_zones(ec2: Any, zones: list[str]) -> list[str]:
    """One subnet per zone of `zones`, in one VPC on the unreachable 10.213.9.0/24."""
    vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
    size = 256 // len(zones)
    return [
        ec2.create_subnet(
            VpcId=vpc,
            CidrBlock=f"10.213.9.{i * size}/{32 - (size.bit_length() - 1)}",
            AvailabilityZone=zone,
        )["Subnet"]["SubnetId"]
        for i, zone in enumerate(zones)
    ]


def test_capacity_error_leaves_nothing_and_says_why(ec2: Any, subnet: str, stubs: Stubs) -> None:
    stubs.fail["RunInstances"] = NO_CAPACITY
    aws = provider(stubs, subnet)
    with pytest.raises(sky.NoCapacity) as caught:
        asyncio.run(aws.launch(spec(4, "A100"), Progress()))
    message = str(caught.value)
    assert "InsufficientInstanceCapacity" in message and "nothing was left running" in message
    assert len(caught.value.attempts) == 1
    assert leftovers(ec2) == []


def test_every_zone_is_tried_in_order_and_one_error_lists_each(
    ec2: Any, stubs: Stubs, guard_network: object
) -> None:
    zones = ["us-east-1a", "us-east-1b", "us-east-1c"]
    stubs.fail_in_zone = dict.fromkeys(zones, NO_CAPACITY)
    told = Told()
    aws = provider(stubs, subnets_in_zones(ec2, zones))
    with pytest.raises(sky.NoCapacity) as caught:
        asyncio.run(aws.launch(spec(4, "A100"), told))
    words = f"{NO_CAPACITY[0]}: {NO_CAPACITY[1]}"
    assert caught.value.attempts == [(f"{z} (on-demand)", words) for z in zones]
    assert stubs.launches == [("us-east-1", z) for z in zones]
    assert [line.split(":")[0] for line in told.lines] == [f"{z} (on-demand)" for z in zones]
    assert all(line.endswith("; trying the next location") for line in told.lines)
    assert "a multi-node" not in str(caught.value)  # (said in the docs, not every error)
    assert leftovers(ec2) == []  # the key pair and security group went with the attempts


def test_a_region_whose_quota_cannot_fit_the_pool_is_skipped_without_a_launch(
    stubs: Stubs, guard_network: object
) -> None:
    with mock_aws():
        east = new_session(stubs).client("ec2", region_name="us-east-1")
        (only,) = subnets_in_zones(east, ["us-east-1b"])
        stubs.quotas[("us-west-2", "L-417A185B")] = 96.0  # P on-demand: one p4d, not four
        stubs.quotas[("us-east-1", "L-417A185B")] = 1152.0
        stubs.fail_in_zone = {"us-east-1b": NO_CAPACITY}
        told = Told()
        aws = provider(
            stubs,
            "",
            region=["us-west-2", "us-east-1"],
            subnet_id={"us-east-1": only},
            ami=None,
        )
        with pytest.raises(sky.NoCapacity) as caught:
            asyncio.run(aws.launch(spec(4, "A100"), told))
        west = new_session(stubs).client("ec2", region_name="us-west-2")
        assert leftovers(west) == [] and leftovers(east) == []
    first, second = caught.value.attempts
    assert first == (
        "region us-west-2",
        "its quota L-417A185B quota is 96 vCPUs; 4 x p4d.24xlarge (on-demand) need 384",
    )
    assert second[0] == "us-east-1b (on-demand)"
    assert stubs.launches == [("us-east-1", "us-east-1b")]  # no launch call in us-west-2
    assert told.lines[0].startswith("region us-west-2: its quota")


def test_spot_prefer_tries_spot_everywhere_then_on_demand(
    ec2: Any, stubs: Stubs, guard_network: object
) -> None:
    zones = ["us-east-1a", "us-east-1b"]
    stubs.fail_in_zone = {f"{z} spot": NO_CAPACITY for z in zones}
    told = Told()
    aws = provider(stubs, subnets_in_zones(ec2, zones), spot="prefer")
    # On-demand launches in the first zone; its instances are unreachable (10.213.9.0/24), so
    # the launch then fails waiting for their host keys, and removes them.
    with pytest.raises(
        ProvisionError, match="did not publish its SSH host key in its console output"
    ):
        asyncio.run(aws.launch(spec(2), told))
    assert stubs.launches == [
        ("us-east-1", "us-east-1a"),
        ("us-east-1", "us-east-1b"),
        ("us-east-1", "us-east-1a"),
    ]
    assert [line.split(":")[0] for line in told.lines[:3]] == [
        "us-east-1a (spot)",
        "us-east-1b (spot)",
        "no spot capacity in any location",
    ]
    assert leftovers(ec2) == []


def test_instance_that_dies_at_boot_fails_the_whole_pool(
    ec2: Any, subnet: str, stubs: Stubs
) -> None:
    aws = provider(stubs, subnet)

    def kill_one(parsed: dict[str, Any], **_: Any) -> None:
        ec2.terminate_instances(InstanceIds=[parsed["Instances"][2]["InstanceId"]])

    aws.session().events.register("after-call.ec2.RunInstances", kill_one)
    with pytest.raises(ProvisionError, match="1 stopped at once") as caught:
        asyncio.run(aws.launch(spec(3), Progress()))
    assert "all were terminated" in str(caught.value)
    assert "cleaning up failed" not in str(caught.value)
    assert leftovers(ec2) == []


@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_during_provisioning_leaves_nothing(ec2: Any, subnet: str, stubs: Stubs) -> None:
    aws = provider(stubs, subnet, boot_timeout=20)
    # Ctrl-C lands while run_instances has just returned and the pool waits for the instances.
    aws.session().events.register(
        "after-call.ec2.RunInstances", lambda **_: os.kill(os.getpid(), signal.SIGINT)
    )
    with pytest.raises(KeyboardInterrupt):
        with sky.ComputePool(provider=aws, nodes=2, stream_output=False):
            pytest.fail("the pool must not start")
    join_skyward_threads()
    assert leftovers(ec2) == []
    assert ec2.describe_instances()["Reservations"], "run_instances did happen"


def test_amis_come_from_public_ssm_parameters(ec2: Any, subnet: str, stubs: Stubs) -> None:
    aws = provider(stubs, subnet, ami=None)
    for accelerator in ("L4", None):
        with pytest.raises(ProvisionError):
            asyncio.run(aws.launch(spec(1, accelerator, pool_id=f"t-{accelerator}"), Progress()))
    gpu, cpu = stubs.ssm_names
    assert gpu.startswith("/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-")
    assert cpu.startswith("/aws/service/canonical/ubuntu/server/") and "/amd64/" in cpu
    assert leftovers(ec2) == []


# -- orphans ---------------------------------------------------------------------------------------


def orphan(ec2: Any, pool_id: str, age_hours: float, subnet: str) -> None:
    """What a client that died hard leaves: a tagged group, key pair and running instance."""
    from datetime import UTC, datetime, timedelta

    tags = pool_tags(pool_id, datetime.now(UTC) - timedelta(hours=age_hours))
    ec2.import_key_pair(
        KeyName=f"skyward-{pool_id}",
        PublicKeyMaterial=asyncssh.generate_private_key("ssh-ed25519").export_public_key(),
        TagSpecifications=[{"ResourceType": "key-pair", "Tags": tags}],
    )
    vpc = ec2.describe_subnets(SubnetIds=[subnet])["Subnets"][0]["VpcId"]
    ec2.create_security_group(
        GroupName=f"skyward-{pool_id}",
        Description="orphan",
        VpcId=vpc,
        TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
    )
    ec2.run_instances(
        ImageId=MOTO_AMI,
        MinCount=1,
        MaxCount=1,
        SubnetId=subnet,
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )


def test_cleanup_removes_only_old_pools(ec2: Any, subnet: str, stubs: Stubs) -> None:
    orphan(ec2, "old-1", 5, subnet)
    orphan(ec2, "new-1", 0, subnet)
    aws = provider(stubs, subnet)
    removed = aws.cleanup(older_than=3600)
    assert removed and all(line.startswith("old-1: ") for line in removed)
    assert leftovers(ec2, "old-1") == []
    assert len(leftovers(ec2, "new-1")) == 3
    aws.cleanup(older_than=0)
    assert leftovers(ec2) == []


def test_cli_ls_and_down(
    ec2: Any,
    subnet: str,
    stubs: Stubs,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from skyward.cli import main as cli
    from skyward.providers.aws.provider import AWS

    session = new_session(stubs)
    monkeypatch.setattr(AWS, "session", lambda self: session)
    orphan(ec2, "pool-a", 2, subnet)
    orphan(ec2, "pool-b", 0, subnet)
    assert cli.main(["ls", "--provider", "aws"]) == 0
    out = capsys.readouterr().out
    assert "pool-a" in out and "pool-b" in out and "security group" in out
    assert cli.main(["down", "pool-a", "--provider", "aws"]) == 0
    assert "pool-a" in capsys.readouterr().out
    assert leftovers(ec2, "pool-a") == [] and leftovers(ec2, "pool-b")
    assert cli.main(["down"]) == 2  # neither a pool nor --all: refuse
    capsys.readouterr()
    assert cli.main(["down", "--all", "--provider", "aws"]) == 0
    assert leftovers(ec2) == []
    assert cli.main(["ls", "--provider", "aws"]) == 0
    assert "no skyward resources" in capsys.readouterr().out


def test_preemption_is_named() -> None:
    instance = {
        "InstanceId": "i-1",
        "InstanceLifecycle": "spot",
        "State": {"Name": "terminated"},
        "StateReason": {
            "Code": "Server.SpotInstanceTermination",
            "Message": "Server.SpotInstanceTermination: Spot instance termination",
        },
    }
    loss = describe_loss(instance)
    assert loss is not None and loss.preempted and "was preempted" in loss.reason
    user = {**instance, "StateReason": {"Code": "Client.UserInitiatedShutdown", "Message": "x"}}
    stopped = describe_loss(user)
    assert stopped is not None and not stopped.preempted and "preempted" not in stopped.reason
    assert describe_loss({**instance, "State": {"Name": "running"}}) is None


# -- the user-data script ------------------------------------------------------------------------


def test_user_data_makes_the_host_key_on_the_machine_and_prints_its_public_half(
    tmp_path: Any,
) -> None:
    script = userdata.render("t-1", idle_timeout=3600)
    assert "PRIVATE KEY" not in script  # nothing secret in what DescribeInstanceAttribute reads
    path = tmp_path / "ud.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    root = tmp_path / "root"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "poweroff").write_text(f"#!/bin/sh\ntouch {tmp_path}/off\n")
    (fake / "poweroff").chmod(0o755)
    env = {**os.environ, "SKYWARD_ROOT": str(root), "PATH": f"{fake}:{os.environ['PATH']}"}
    ran = subprocess.run(
        ["bash", str(path)], check=True, env=env, timeout=30, capture_output=True, text=True
    )
    private = root / "etc/ssh/ssh_host_ed25519_key"
    assert private.stat().st_mode & 0o777 == 0o600
    # What the console shows is the public half of the key the machine made.
    derived = subprocess.run(
        ["ssh-keygen", "-y", "-f", str(private)], capture_output=True, text=True, check=True
    ).stdout.split()[:2]
    assert printed_key(ran.stdout) == " ".join(derived)
    pid = int((root / "var/log/skyward-watchdog.pid").read_text())
    os.kill(pid, signal.SIGKILL)  # an hour-long watchdog: stop it, it was only started


def test_an_instance_type_override_tells_the_jax_plugin_its_gpus() -> None:
    with mock_aws():
        pool = sky.ComputePool(
            provider=sky.AWS(region="us-east-1", instance_type="p4d.24xlarge"),
            plugins=[sky.plugins.jax()],
            stream_output=False,
        )
        assert pool.spec.accelerator is not None and pool.spec.accelerator.name == "A100"
        assert sky.plugins.jax().transform(sky.Image(), pool.spec).pip == ("jax[cuda12]",)


def test_a_replacement_is_one_instance_launched_as_the_pools_were(
    ec2: Any, subnet: str, stubs: Stubs
) -> None:
    aws = provider(stubs, subnet, spot=True)
    pool = spec(2, "A100", pool_id="t-repl")
    key_path = Path(tempfile.mkdtemp()) / "id_ed25519"
    recorded = count_calls(aws.session())
    ec2_client = aws.client("ec2")

    def check_cancel() -> None:
        return None

    choice = instance_types.choose(pool.accelerator, None)
    (where,) = instances.subnets(ec2_client, [subnet], choice.instance_type)
    params = instances.set_up(
        ec2_client,
        aws.client("ssm"),
        aws.machine_settings,
        pool,
        choice,
        instances.type_details(ec2_client, choice),
        where,
        key_path,
        teardown.Made(),
        check_cancel,
    )
    ids = instances.run(ec2_client, params, 2, pool.pool_id)
    first = instances.wait_running(ec2_client, ids, timeout=5, poll=0.01, check_cancel=check_cancel)
    lost = first[1]["InstanceId"]
    before = len(recorded)

    instances.retire(ec2_client, lost)
    fresh_ids = instances.run(ec2_client, params, 1, pool.pool_id)
    (fresh,) = instances.wait_running(
        ec2_client, fresh_ids, timeout=5, poll=0.01, check_cancel=check_cancel
    )

    calls = recorded[before:]
    assert calls.count("RunInstances") == 1 and calls.count("TerminateInstances") == 1
    assert fresh["InstanceId"] not in {i["InstanceId"] for i in first}
    for key in ("InstanceType", "ImageId", "KeyName", "SubnetId", "InstanceLifecycle"):
        assert fresh.get(key) == first[0].get(key), key
    assert {t["Key"]: t["Value"] for t in fresh["Tags"]}[POOL_TAG] == "t-repl"
    states = {
        i["InstanceId"]: i["State"]["Name"]
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
    }
    assert states[lost] in ("shutting-down", "terminated")
    # the replacement is the pool's: teardown finds it by its tags too
    removed = teardown.remove_pool(ec2_client, pool.pool_id, poll=0.01)
    assert f"instance {fresh['InstanceId']}" in removed
    assert leftovers(ec2) == []


@pytest.mark.parametrize("by_arn", [False, True])
def test_an_instance_profile_gives_the_nodes_their_own_credentials(
    ec2: Any, subnet: str, stubs: Stubs, by_arn: bool
) -> None:
    iam = new_session(stubs).client("iam")
    made = iam.create_instance_profile(InstanceProfileName="skyward-data-reader")
    arn = made["InstanceProfile"]["Arn"]
    aws = provider(stubs, subnet, iam_instance_profile=arn if by_arn else "skyward-data-reader")
    pool = spec(1, pool_id="t-iam")
    choice = instance_types.choose(None, None)
    params = instances.set_up(
        aws.client("ec2"),
        aws.client("ssm"),
        aws.machine_settings,
        pool,
        choice,
        instances.type_details(aws.client("ec2"), choice),
        instances.subnets(aws.client("ec2"), [subnet], choice.instance_type)[0],
        Path(tempfile.mkdtemp()) / "id_ed25519",
        teardown.Made(),
        lambda: None,
    )
    expected = {"Arn": arn} if by_arn else {"Name": "skyward-data-reader"}
    assert params["IamInstanceProfile"] == expected
    (instance_id,) = instances.run(aws.client("ec2"), params, 1, pool.pool_id)
    found = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
    assert found["IamInstanceProfile"]["Arn"] == arn
    ec2.terminate_instances(InstanceIds=[instance_id])


def test_an_unreachable_endpoint_mid_launch_names_the_call_and_leaves_nothing(
    ec2: Any, subnet: str, stubs: Stubs
) -> None:
    from botocore.exceptions import EndpointConnectionError

    aws = provider(stubs, subnet)

    def cut_off(**_: Any) -> None:
        raise EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com/")

    aws.session().events.register("before-call.ec2.RunInstances", cut_off)
    with pytest.raises(ProvisionError) as caught:
        asyncio.run(aws.launch(spec(2), Progress()))
    message = str(caught.value)
    assert "RunInstances" in message and "Could not connect to the endpoint URL" in message
    assert leftovers(ec2) == []


def test_a_replacement_goes_to_the_next_zone_when_the_pools_has_no_room(
    ec2: Any, stubs: Stubs, guard_network: object
) -> None:
    from skyward.providers.aws.provider import AWSCluster

    first, second = subnets_in_zones(ec2, ["us-east-1a", "us-east-1b"])
    aws = provider(stubs, [first, second])
    told = Told()
    pool = AWSCluster(
        spec(2),
        [],
        key_dir=Path(tempfile.mkdtemp()),
        tell=told,
    )
    try:
        launched = aws._provision(pool, instance_types.choose(None, None), told)
        assert {i["Placement"]["AvailabilityZone"] for i in launched} == {"us-east-1a"}
        stubs.fail_in_zone = {"us-east-1a": NO_CAPACITY}
        (fresh,) = aws.make_one(pool)
        assert fresh["Placement"]["AvailabilityZone"] == "us-east-1b"
        assert fresh["SubnetId"] == second
        assert told.lines[-2].startswith("us-east-1a: InsufficientInstanceCapacity")
        assert told.lines[-1] == "the replacement runs in us-east-1b, not us-east-1a"
        stubs.fail_in_zone["us-east-1b"] = NO_CAPACITY
        with pytest.raises(sky.NoCapacity, match="cannot be replaced in its region now"):
            aws.make_one(pool)
    finally:
        aws.remove_resources(pool)
    assert leftovers(ec2) == []
