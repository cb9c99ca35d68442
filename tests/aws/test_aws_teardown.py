"""The teardown loop against the moto server and namespace "instances": one failing EC2 call,
once or for good, never leaks the pool.

Failures are injected with a ``before-call`` hook on the provider's own EC2 client, registered
first so it runs before the stubs and before botocore sends anything: botocore's own retries do
not see them, so what recovers here is the teardown loop itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from botocore.exceptions import ClientError
from botocore.parsers import ResponseParserError

import skyward as sky
from skyward.cli import main as cli
from skyward.errors import ProvisionError
from skyward.providers.aws.provider import AWSCluster
from skyward.providers.aws.resources import POOL_TAG
from tests.aws.conftest import Ec2Hosts, Stubs, aws_for, leftovers, new_session

pytestmark = [pytest.mark.ssh]

# What moto's server answered in issue 14, and what EC2 answers when it throttles.
PARSER_ERROR = "Unable to parse response (syntax error), invalid XML received: b'<html>'"


def _error(kind: str, operation: str) -> Exception:
    if kind == "parser":
        return ResponseParserError(PARSER_ERROR)
    code = {"throttled": "RequestLimitExceeded", "500": "InternalError"}[kind]
    return ClientError({"Error": {"Code": code, "Message": f"injected {code}"}}, operation)


def inject(
    aws: sky.AWS, operation: str, kind: str, times: int | None = 1,
    when: Callable[[dict[str, Any]], bool] = lambda body: True,
) -> list[str]:  # fmt: skip
    """Make `operation` of `aws`'s EC2 client fail `times` times (None: always) from now on;
    the returned list grows by one entry per injected failure."""
    failed: list[str] = []

    def hook(params: dict[str, Any], **_: Any) -> None:
        if (times is None or len(failed) < times) and when(params.get("body", {})):
            failed.append(operation)
            raise _error(kind, operation)

    aws.client("ec2").meta.events.register_first(f"before-call.ec2.{operation}", hook)
    return failed


def _tagged(body: dict[str, Any]) -> bool:
    """A listing by the pool's tag: the teardown's, never the launch's wait (which asks by id)."""
    return any(value == f"tag:{POOL_TAG}" for value in body.values())


@pytest.mark.parametrize(
    ("operation", "kind"),
    [
        ("DescribeInstances", "parser"),
        ("TerminateInstances", "throttled"),
        ("DescribeSecurityGroups", "parser"),
        ("DeleteSecurityGroup", "500"),
        ("DescribeKeyPairs", "throttled"),
        ("DeleteKeyPair", "parser"),
        ("DescribePlacementGroups", "500"),
        ("DeletePlacementGroup", "throttled"),
    ],
)
def test_a_call_that_fails_once_leaves_nothing(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, operation: str, kind: str
) -> None:
    sim = ec2_hosts()
    aws = aws_for(sim, stubs, placement_group=True, teardown_timeout=30.0)
    with sky.ComputePool(provider=aws, nodes=2, stream_output=False) as pool:
        assert len(pool.nodes) == 2
        failed = inject(aws, operation, kind)
    assert failed == [operation], "the teardown made the call and it failed once"
    ec2 = new_session(stubs).client("ec2")
    assert leftovers(ec2, pool.pool_id) == []
    assert stubs.placement_groups == {}


def test_a_call_that_fails_for_good_is_named_and_skyward_down_removes_the_rest(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sim = ec2_hosts()
    aws = aws_for(sim, stubs, teardown_timeout=1.5)
    with pytest.raises(ProvisionError) as caught:
        with sky.ComputePool(provider=aws, nodes=2, stream_output=False) as pool:
            failed = inject(aws, "DeleteKeyPair", "500", times=None)
    message = str(caught.value)
    name = f"skyward-{pool.pool_id}"
    remaining = [line.strip() for line in message.splitlines() if line.startswith("  ")]
    assert remaining[0] == f"key pair {name}", message
    assert remaining[1].startswith("DeleteKeyPair failed: InternalError"), message
    assert len(remaining) == 2, message  # the key pair, and the one call that failed
    assert message.endswith(f"skyward down {pool.pool_id} --provider aws"), message
    assert len(failed) >= 2, "the loop tried again before it gave up"
    ec2 = new_session(stubs).client("ec2")
    assert leftovers(ec2, pool.pool_id) == [f"key pair {name}"]  # instances and group are gone

    from skyward.providers.aws.provider import AWS

    session = new_session(stubs)
    monkeypatch.setattr(AWS, "session", lambda self: session)
    assert cli.main(["down", pool.pool_id, "--provider", "aws"]) == 0
    assert f"removed {pool.pool_id}: key pair {name}" in capsys.readouterr().out
    assert leftovers(ec2) == []


def test_an_unreachable_instance_and_a_failing_describe_leave_nothing(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs
) -> None:
    """Issue 14: one instance never boots, and the teardown's first listing fails as it did
    against moto's server. The pool fails for its own reason, and nothing remains."""
    sim = ec2_hosts(boot_at_most=1)
    aws = aws_for(sim, stubs, boot_timeout=3.0, teardown_timeout=30.0)
    failed = inject(aws, "DescribeInstances", "parser", when=_tagged)
    with pytest.raises(ProvisionError, match="did not publish its SSH host key") as caught:
        with sky.ComputePool(provider=aws, nodes=2, stream_output=False):
            pytest.fail("the pool must not start")
    assert failed == ["DescribeInstances"]
    assert not getattr(caught.value, "__notes__", None), "the teardown must have succeeded"
    assert leftovers(new_session(stubs).client("ec2")) == []


def test_a_listing_that_fails_for_good_still_removes_what_the_client_made(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs
) -> None:
    """DescribeInstances never answers: the instances the client launched are terminated all
    the same, the group and key pair deleted; the error names only what it cannot confirm."""
    sim = ec2_hosts()
    aws = aws_for(sim, stubs, teardown_timeout=1.5)
    with pytest.raises(ProvisionError) as caught:
        with sky.ComputePool(provider=aws, nodes=2, stream_output=False) as pool:
            ids = [aws_pool_instance(pool, i) for i in range(2)]
            inject(aws, "DescribeInstances", "parser", times=None)
    message = str(caught.value)
    remaining = [line.strip() for line in message.splitlines() if line.startswith("  ")]
    assert remaining[:2] == [f"instance {i}" for i in sorted(ids)], message
    assert remaining[2].startswith("DescribeInstances failed: Unable to parse"), message
    assert message.endswith(f"skyward down {pool.pool_id} --provider aws"), message
    ec2 = new_session(stubs).client("ec2")
    assert leftovers(ec2, pool.pool_id) == []
    states = ec2.describe_instances(InstanceIds=ids)["Reservations"][0]["Instances"]
    assert {i["State"]["Name"] for i in states} == {"terminated"}


def test_a_kind_the_pool_never_made_does_not_hold_its_teardown(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, capfd: pytest.CaptureFixture[str]
) -> None:
    """DescribePlacementGroups by tag answers a 500 for good (moto's server did, for real): the
    pool made no placement group, so after two failed listings the teardown says so on the
    console and ends, instead of retrying for the whole teardown_timeout."""
    sim = ec2_hosts()
    aws = aws_for(sim, stubs)  # teardown_timeout: the default, 600 s
    with sky.ComputePool(provider=aws, nodes=1) as pool:
        inject(aws, "DescribePlacementGroups", "500", times=None, when=_tagged)
        began = time.monotonic()
    took = time.monotonic() - began
    assert took < 30, f"the teardown took {took:.0f} s"
    err = capfd.readouterr().err
    assert "DescribePlacementGroups failed: InternalError" in err, err
    assert "trying again in" in err  # the retry is on the console, with its reason
    assert "the pool made no placement group, so none is left" in err, err
    assert leftovers(new_session(stubs).client("ec2"), pool.pool_id) == []


def aws_pool_instance(pool: sky.ComputePool, index: int) -> str:
    cluster = pool.cluster
    assert isinstance(cluster, AWSCluster)
    return cluster.node_instances[index]
