"""EC2 API calls to launch and to tear down an AWS pool, for N = 1, 4 and 16 nodes.

Counted with a botocore ``before-call`` event hook against moto (in process, fake credentials,
no network). Only the EC2 half of a launch runs (up to "all N instances running"); the SSH half
makes no AWS calls. The counts must not grow with N: one ``run_instances`` for all nodes, and
batched describes. Run: ``python benchmarks/bench_aws.py``.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

for name, value in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ[name] = value
for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2"):
    os.environ.pop(name, None)

import boto3  # noqa: E402
from botocore.awsrequest import AWSResponse  # noqa: E402
from moto import mock_aws  # noqa: E402

from skyward.hardware import Accelerator, ClusterSpec  # noqa: E402
from skyward.providers.aws import AWS, instance_types, userdata  # noqa: E402
from skyward.providers.aws.provider import AWSCluster  # noqa: E402

MOTO_AMI = "ami-1e749f67"


def measure(nodes: int) -> tuple[Counter[str], Counter[str]]:
    with mock_aws():
        session = boto3.session.Session(region_name="us-east-1")
        ec2 = session.client("ec2")
        vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.213.8.0/24")["Subnet"]["SubnetId"]
        calls: list[str] = []
        session.events.register("before-call.ec2.*", lambda model, **_: calls.append(model.name))
        # moto implements no placement groups: answer the one describe of the teardown here.
        session.events.register(
            "before-call.ec2.DescribePlacementGroups",
            lambda **_: (
                AWSResponse("https://stub.invalid/", 200, {}, None),
                {"PlacementGroups": [], "ResponseMetadata": {}},
            ),
        )
        aws = AWS(
            subnet_id=subnet, use_private_ips=True, ami=MOTO_AMI, poll_interval=0.01,
            session=session,
        )  # fmt: skip
        spec = ClusterSpec(nodes, f"bench-{nodes}", Accelerator.parse("A100"), "aws")
        cluster = AWSCluster(
            spec,
            [],
            key_dir=Path(tempfile.mkdtemp(prefix="skyward-bench-")),
            host_key=userdata.HostKey.generate("bench"),
        )
        choice = instance_types.choose(spec.accelerator, None)
        instances = aws._provision(cluster, choice)
        assert len(instances) == nodes
        launch = Counter(calls)
        calls.clear()
        aws._remove(cluster)
        teardown = Counter(calls)
        return launch, teardown


def main() -> None:
    rows = {n: measure(n) for n in (1, 4, 16)}
    print(f"{'N':>3} {'launch calls':>13} {'teardown calls':>15}")
    for n, (launch, teardown) in rows.items():
        print(f"{n:>3} {sum(launch.values()):>13} {sum(teardown.values()):>15}")
    launch, teardown = rows[16]
    print("launch:  ", dict(launch))
    print("teardown:", dict(teardown))
    totals = {(sum(a.values()), sum(b.values())) for a, b in rows.values()}
    assert len(totals) == 1, f"call counts grow with N: {rows}"
    assert launch["RunInstances"] == 1


if __name__ == "__main__":
    main()
