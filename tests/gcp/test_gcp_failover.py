"""Failover on GCP: the zones given tried in order, a region skipped by its quotas or blocked by
a quota error, spot then on-demand with ``spot="prefer"``, replacements in the pool's region.

The API tests run the provider's launch against the fake Compute API, whose addresses have no
machine: a launch that found a zone with room then fails at the SSH login (after a short
boot_timeout) and is removed, which is all they need. The end-to-end tests start pools on the
bare Debian hosts of `gce_hosts`: the fake gives a VM one of their addresses whichever zone it
is in, so a pool that lands in its second zone runs there for real.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials

import skyward as sky
from skyward.console.progress import Progress
from skyward.cost import Price
from skyward.errors import ConfigError, ProvisionError
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.gcp import machine_types, provision, resources, teardown
from skyward.providers.gcp.provision import GCPCluster
from skyward.providers.gcp.settings import resolve
from tests.gcp.conftest import PROJECT, GceHosts, gce_for, gcp_for
from tests.gcp.test_gcp_e2e import node_index, nothing_left, preempt_mid_call
from tests.ssh.conftest import wait_until
from tests.support.fakegcp import FakeGCP

A, B, EAST = "us-central1-a", "us-central1-b", "us-east1-c"
EXHAUSTED = "ZONE_RESOURCE_POOL_EXHAUSTED"
DETAILS = "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"


def exhausted(zone: str) -> str:
    """GCE's answer for a zone without capacity, as the attempts list it."""
    return (
        f"{EXHAUSTED}: The zone 'projects/{PROJECT}/zones/{zone}' does not have enough resources "
        "available to fulfill the request. Try a different zone, or try again later."
    )


class Told(Progress):
    """A `Progress` that keeps the status lines the provider tells the user."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.grants: list[tuple[int, Price | None]] = []  # the nodes granted, at their price

    def __call__(self, message: str) -> None:
        self.lines.append(message)

    def granted(self, node: int, price: Price | None = None, at: float | None = None) -> None:
        self.grants.append((node, price))

    def attempts(self) -> list[str]:
        """Where each attempt went, as the console said it, and any market change."""
        return [
            line.split(":")[0]
            for line in self.lines
            if line.endswith("; trying the next location") or line.startswith("no spot")
        ]


def launch(fake: FakeGCP, nodes: int, accelerator: str | None = None, **options: Any) -> Told:
    """Launch a pool through the provider; `ProvisionError` waiting for the host keys (the
    fake's addresses have no machine to publish one) once a zone had room. What the console
    said."""
    told = Told()
    parsed = Accelerator.parse(accelerator) if accelerator else None
    spec = ClusterSpec(nodes, "pool-fo123456", parsed)
    gcp = gcp_for(fake, boot_timeout=1.5, **options)
    with pytest.raises(ProvisionError, match="did not publish its SSH host key"):
        asyncio.run(gcp.launch(spec, told))
    assert fake.labelled() == []
    return told


# -- zones, then regions ---------------------------------------------------------------------


def test_every_zone_without_capacity_is_tried_in_order_and_one_error_lists_each(
    api_fake: FakeGCP,
) -> None:
    api_fake.no_capacity = {A: EXHAUSTED, B: DETAILS, EAST: EXHAUSTED}
    told = Told()
    gcp = gcp_for(api_fake, zone=[A, B, EAST])
    with pytest.raises(sky.NoCapacity) as caught:
        asyncio.run(gcp.launch(ClusterSpec(2, "pool-fo123456"), told))
    details = (
        f"{DETAILS}: The zone 'projects/{PROJECT}/zones/{B}' does not have enough resources "
        "available to fulfill the request. '(resource type:compute)'."
    )
    assert caught.value.attempts == [
        (f"{A} (on-demand)", exhausted(A)),
        (f"{B} (on-demand)", details),
        (f"{EAST} (on-demand)", exhausted(EAST)),
    ]
    assert api_fake.inserts == [(A, "STANDARD"), (B, "STANDARD"), (EAST, "STANDARD")]
    assert api_fake.calls["instances.bulkInsert"] == 3
    assert api_fake.calls["firewalls.insert"] == 2  # global: made once for every zone
    assert told.attempts() == [f"{A} (on-demand)", f"{B} (on-demand)", f"{EAST} (on-demand)"]
    message = str(caught.value)
    assert message.startswith("no location could start 2 x e2-standard-2; nothing was left")
    assert message.endswith("ask for more quota")
    assert api_fake.labelled() == []


@pytest.mark.parametrize(
    ("accelerator", "spot", "quotas", "words"),
    [
        (
            "L4",
            False,
            {"NVIDIA_L4_GPUS": (4.0, 3.0)},
            "its NVIDIA_L4_GPUS quota has 1 free (3 of 4 in use); 2 x g2-standard-4 "
            "(on-demand) need 2",
        ),
        (
            # A granted preemptible quota is the one spot VMs count against.
            "L4",
            True,
            {"PREEMPTIBLE_NVIDIA_L4_GPUS": (1.0, 0.0), "NVIDIA_L4_GPUS": (64.0, 0.0)},
            "its PREEMPTIBLE_NVIDIA_L4_GPUS quota has 1 free (0 of 1 in use); 2 x "
            "g2-standard-4 (spot) need 2",
        ),
        (
            None,
            False,
            {"CPUS": (24.0, 22.0)},
            "its CPUS quota has 2 free (22 of 24 in use); 2 x e2-standard-2 (on-demand) need 4",
        ),
        (
            None,
            False,
            {"INSTANCES": (10.0, 9.0)},
            "its INSTANCES quota has 1 free (9 of 10 in use); 2 x e2-standard-2 (on-demand) need 2",
        ),
    ],
)
def test_a_region_whose_quota_cannot_fit_the_pool_is_skipped_without_an_insert(
    api_fake: FakeGCP,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    accelerator: str | None,
    spot: bool,
    quotas: dict[str, tuple[float, float]],
    words: str,
) -> None:
    # The machine type's vCPUs are read (and kept) as for a price: from a cache of this test's.
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path / "cache"))
    api_fake.add_machine_type("e2-standard-2", 2, 8192)
    api_fake.quotas["us-central1"] = quotas
    told = launch(api_fake, 2, accelerator, zone=[A, B, EAST], spot=spot)
    model = "SPOT" if spot else "STANDARD"
    assert api_fake.inserts == [(EAST, model)]  # not one insert in us-central1
    assert told.lines[0] == f"region us-central1: {words}; trying the next location"
    assert told.attempts() == ["region us-central1"]
    assert api_fake.calls["regions.get"] == 2  # us-central1 once, then us-east1


def test_a_quota_that_cannot_be_read_is_no_reason_to_skip(api_fake: FakeGCP) -> None:
    api_fake.forbid.add("regions.get")
    told = launch(api_fake, 2, zone=[A, EAST])
    assert api_fake.inserts == [(A, "STANDARD")]
    assert told.attempts() == []


def test_a_quota_error_at_insert_blocks_the_rest_of_the_region(api_fake: FakeGCP) -> None:
    api_fake.no_capacity = {A: "QUOTA_EXCEEDED"}
    told = launch(api_fake, 2, zone=[A, B, EAST])
    assert api_fake.inserts == [(A, "STANDARD"), (EAST, "STANDARD")]  # B: same region
    assert told.lines[0] == (
        "region us-central1: QUOTA_EXCEEDED: Quota 'CPUS' exceeded.  Limit: 24.0 in region "
        "us-central1. (on-demand); trying the next location"
    )


def test_spot_prefer_tries_spot_in_every_zone_then_on_demand(api_fake: FakeGCP) -> None:
    api_fake.no_capacity = {f"{A} SPOT": EXHAUSTED, f"{B} SPOT": EXHAUSTED}
    told = launch(api_fake, 2, zone=[A, B], spot="prefer")
    assert api_fake.inserts == [(A, "SPOT"), (B, "SPOT"), (A, "STANDARD")]
    assert told.attempts() == [f"{A} (spot)", f"{B} (spot)", "no spot capacity in any zone"]
    # Both VMs are paid for at what they are: on-demand, in the zone they run in.
    assert [node for node, _ in told.grants] == [0, 1]
    assert all(p and p.source.startswith(f"on-demand in {A}; ") for _, p in told.grants), told


def test_a_spot_tpu_slice_goes_to_the_next_zone_and_its_failed_queue_is_removed(
    api_fake: FakeGCP,
) -> None:
    api_fake.no_capacity = {A: EXHAUSTED}
    told = launch(api_fake, 4, "v5litepod-16", zone=[A, B], spot=True)
    assert api_fake.slices == [A, B]
    assert api_fake.calls["tpu.queuedResources.create"] == 2
    assert api_fake.calls["tpu.queuedResources.delete"] >= 2  # A's failed one, then B's
    assert told.attempts() == [f"{A} (spot)"]
    assert told.lines[0].startswith(f"{A} (spot): RESOURCE_EXHAUSTED: There is no more capacity")


def bare_pool(tmp_path: Path, nodes: int) -> GCPCluster:
    """A pool's state as `launch` makes it, for the API half (`provision`) alone."""
    spec = ClusterSpec(nodes, "pool-fo654321")
    return GCPCluster(spec, [], key_dir=tmp_path, tell=Told())


def calls_of(gcp: sky.GCP) -> provision.Calls:
    return provision.Calls.start(gcp.clients(), gcp.access(), gcp.machine_settings, 0.05, 10.0)


def test_what_a_refused_zone_left_is_removed_before_the_next_and_the_rules_stay(
    api_fake: FakeGCP, tmp_path: Path
) -> None:
    api_fake.no_capacity = {A: EXHAUSTED}
    api_fake.refusal_leaves = 1  # one VM of A's bulkInsert outlives its refusal
    gcp = gcp_for(api_fake, zone=[A, B])
    pool = bare_pool(tmp_path, 2)
    try:
        hosts = provision.vms(calls_of(gcp), pool, machine_types.choose(None), (False,))
        assert [h.name for h in hosts] == ["skyward-pool-fo654321-001", "skyward-pool-fo654321-002"]
        assert {zone for zone, _ in api_fake.instances} == {B}  # A's leftover went first
        assert api_fake.calls["instances.delete"] == 1
        assert api_fake.calls["firewalls.delete"] == 0 and len(api_fake.firewalls) == 2
        assert pool.zone == B and set(pool.made.instances.values()) == {B}
    finally:
        teardown.remove_pool(gcp.clients(), PROJECT, pool.pool_id, pool.made, timeout=10, poll=0.05)
    assert api_fake.labelled() == []


def test_a_replacement_stays_in_the_pools_region(api_fake: FakeGCP, tmp_path: Path) -> None:
    """The pool's zone, then the other zones given of its region, never another region's."""
    gcp = gcp_for(api_fake, zone=[A, EAST, B])
    pool = bare_pool(tmp_path, 1)
    calls = functools.partial(calls_of, gcp)
    try:
        provision.vms(calls(), pool, machine_types.choose(None), (False,))
        assert pool.zone == A
        api_fake.no_capacity = {A: EXHAUSTED}
        (fresh,) = provision.one_more(calls(), pool)
        assert fresh.name == "skyward-pool-fo654321-b-001"  # B's letter: names are per zone
        assert pool.made.instances[fresh.name] == B
        api_fake.no_capacity = {A: EXHAUSTED, B: EXHAUSTED}
        with pytest.raises(sky.NoCapacity) as caught:
            provision.one_more(calls(), pool)
        assert caught.value.attempts == [
            (f"{A} (on-demand)", exhausted(A)),
            (f"{B} (on-demand)", exhausted(B)),
        ]
        # The launch (A), the first replacement (A refused, then B), the second (A, B refused).
        assert [zone for zone, _ in api_fake.inserts] == [A, A, B, A, B]
    finally:
        teardown.remove_pool(gcp.clients(), PROJECT, pool.pool_id, pool.made, timeout=10, poll=0.05)
    assert api_fake.labelled() == []


def test_zones_resolve_in_order_and_bad_settings_are_config_errors() -> None:
    access = resolve("p", [B, A, B, EAST], AnonymousCredentials())
    assert (access.zone, access.zones, access.region) == (B, (B, A, EAST), "us-central1")
    assert access.at(EAST).region == "us-east1" and access.at(EAST).zones == (B, A, EAST)
    assert resolve("p", A, AnonymousCredentials()).zones == (A,)
    with pytest.raises(ConfigError, match=r"zone=\[\] names no zone"):
        sky.GCP(zone=[])
    with pytest.raises(ConfigError, match="spot must be True, False or 'prefer'"):
        sky.GCP(zone=A, spot="sometimes")  # type: ignore[arg-type]
    path = "projects/p/regions/us-central1/subnetworks/mine"
    with pytest.raises(ConfigError, match=f"zone\\(s\\) {EAST} are not"):
        sky.GCP(zone=[A, EAST], subnetwork=path)
    sky.GCP(zone=[A, B], subnetwork=path)
    assert resources.name_pattern("pool-1") == "skyward-pool-1-###"


# -- end to end: pools on the bare hosts -----------------------------------------------------


def _zones_of(fake: FakeGCP) -> set[str]:
    return {zone for zone, _ in fake.instances}


@pytest.mark.ssh
@pytest.mark.slow
def test_a_pool_whose_first_zone_is_full_runs_in_the_second(
    gce_hosts: Callable[..., GceHosts], capfd: pytest.CaptureFixture[str]
) -> None:
    """Both VMs in B; a preempted one is explained and replaced there too (the pool's zone, not
    the first one given)."""
    sim = gce_hosts()
    fake = sim.fake
    assert fake is not None
    fake.no_capacity = {A: EXHAUSTED}
    with sky.ComputePool(provider=gce_for(sim, zone=[A, B]), nodes=2) as pool:
        assert node_index() @ pool == [0, 1]
        assert _zones_of(fake) == {B}
        cluster = pool.cluster
        assert isinstance(cluster, GCPCluster) and cluster.zone == B
        victim, lost = preempt_mid_call(sim, pool)
        pool.replace(lost.node)
        assert node_index() @ pool == [0, 1]
        # The lost VM was deleted where it was (B), and its replacement made there too.
        assert wait_until(lambda: victim not in {i["name"] for i in fake.instances.values()}, 10)
        assert _zones_of(fake) == {B}
    assert fake.inserts == [(A, "STANDARD"), (B, "STANDARD"), (B, "STANDARD")]
    err = capfd.readouterr().err
    assert f"{A} (on-demand): {exhausted(A)}; trying the next location" in err, err
    nothing_left(sim)


@pytest.mark.ssh
@pytest.mark.slow
def test_a_replacement_goes_to_the_next_zone_of_the_region_when_the_pools_is_full(
    gce_hosts: Callable[..., GceHosts], capfd: pytest.CaptureFixture[str]
) -> None:
    sim = gce_hosts()
    fake = sim.fake
    assert fake is not None
    provider = gce_for(sim, zone=[A, EAST, B], spot=True)
    with sky.ComputePool(provider=provider, nodes=2) as pool:
        assert node_index() @ pool == [0, 1]
        assert _zones_of(fake) == {A}
        fake.no_capacity = {A: EXHAUSTED}
        _, lost = preempt_mid_call(sim, pool)
        pool.replace(lost.node)
        assert node_index() @ pool == [0, 1]
        running = {
            (zone, i["name"]) for (zone, _), i in fake.instances.items() if i["status"] == "RUNNING"
        }
        slug = resources.slug(pool.pool_id)
        assert (B, f"skyward-{slug}-b-001") in running and len(running) == 2
    # A, then the replacement: A refused, B (the next zone of us-central1), never us-east1.
    assert fake.inserts == [(A, "SPOT"), (A, "SPOT"), (B, "SPOT")]
    err = capfd.readouterr().err
    assert f"{A} (spot): {exhausted(A)}; trying the next location" in err, err
    nothing_left(sim)


@pytest.mark.ssh
@pytest.mark.slow
def test_a_pool_fails_over_from_aws_without_capacity_to_gcp(
    gce_hosts: Callable[..., GceHosts],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """provider=[sky.AWS(...), sky.GCP(...)]: EC2 (moto, in process) has no capacity in its
    one zone, so the pool starts on GCP (the fake and its bare hosts) and runs there; what AWS
    made for the attempt (key pair, security group) is gone."""
    import boto3
    from botocore.exceptions import ClientError
    from moto import mock_aws

    # moto has no placement groups: the AWS tests' stubs answer them
    from tests.aws.conftest import Stubs, fake_aws_env

    fake_aws_env(monkeypatch)
    sim = gce_hosts()

    with mock_aws():
        session = Stubs().install(boto3.session.Session(region_name="us-east-1"))
        ec2 = session.client("ec2")
        vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
        # Unreachable (10.213.9.0/24 has no host): no instance is made there anyway.
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.213.9.0/24")["Subnet"]["SubnetId"]

        def full(**_: Any) -> None:
            error = {"Code": "InsufficientInstanceCapacity", "Message": "no m6i.large here"}
            raise ClientError({"Error": error}, "RunInstances")

        session.events.register("before-call.ec2.RunInstances", full)
        aws = sky.AWS(subnet_id=subnet, use_private_ips=True, ami="ami-1e749f67", session=session)
        with sky.ComputePool(provider=[aws, gce_for(sim)], nodes=2) as pool:
            assert node_index() @ pool == [0, 1]
            assert pool.provider.name == "gcp"
        groups = ec2.describe_security_groups()["SecurityGroups"]
        assert [g["GroupName"] for g in groups if g["GroupName"].startswith("skyward-")] == []
        assert ec2.describe_key_pairs()["KeyPairs"] == []
    err = capfd.readouterr().err
    assert "InsufficientInstanceCapacity: no m6i.large here; trying the next location" in err
    assert "aws had no room for the pool; trying the next" in err, err
    assert "launching 2 node(s) on gcp" in err
    nothing_left(sim)
