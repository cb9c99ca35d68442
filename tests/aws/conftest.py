"""Fixtures for the AWS provider: moto (in process, or as a real server on 127.0.0.1), narrow
stubs for the calls moto does not implement, and an "EC2" whose instances are fresh Debian roots
behind sshd in network namespaces (`tests.support.bareroots`), reaching only a package index the
test serves.

Safety: moto only listens on 127.0.0.1; every subnet the tests give EC2 lies in 10.213.0.0/16,
which `tests.support.sshd.NetnsHosts` routes as ``unreachable`` except for the namespace hosts it
builds, and the provider always runs with ``use_private_ips=True``: no test can open a connection
to an address moto made up.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.awsrequest import AWSResponse

import skyward as sky
from skyward.providers.aws import resources
from tests.support import bareroots, motos3, sshd
from tests.support.awspricing import PriceListServer

REGION = "us-east-1"
MOTO_AMI = "ami-1e749f67"  # one of moto's built-in public images (an Ubuntu)
API_SUBNET = "10.213.9.0/24"  # no hosts: everything here is unreachable
E2E_SUBNET = "10.213.8.0/24"  # the namespace hosts of `ec2_hosts`


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_aws_env(monkeypatch)


def fake_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials, a fixed region, and no way to reach a real AWS endpoint or IMDS (also
    for tests elsewhere that use moto)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/skyward-test")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/skyward-test")


# -- stubs for what moto lacks -----------------------------------------------------------------


@dataclass
class Stubs:
    """Narrow before-call stubs: only the named operations are answered here, all else is moto.

    moto implements no placement groups (create/describe/delete raise NotImplementedError) and
    has none of the public SSM AMI parameters under /aws/service/ (and refuses to create them).
    """

    placement_groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    ssm_names: list[str] = field(default_factory=list)
    fail: dict[str, tuple[str, str]] = field(default_factory=dict)  # operation -> (code, msg)
    # availability zone -> the (code, msg) RunInstances answers there: no capacity in a zone
    fail_in_zone: dict[str, tuple[str, str]] = field(default_factory=dict)
    # (region, quota code) -> vCPUs: Service Quotas' EC2 quotas, which moto does not hold (any
    # other answers NoSuchResourceException, as for a quota the account cannot read)
    quotas: dict[tuple[str, str], float] = field(default_factory=dict)
    launches: list[tuple[str, str]] = field(default_factory=list)  # RunInstances: (region, AZ)

    def install(self, session: boto3.session.Session) -> boto3.session.Session:
        events = session.events
        events.register("before-call.ec2.CreatePlacementGroup", self._create_pg)
        events.register("before-call.ec2.DescribePlacementGroups", self._describe_pg)
        events.register("before-call.ec2.DeletePlacementGroup", self._delete_pg)
        events.register("before-call.ssm.GetParameter", self._get_parameter)
        events.register("before-call.service-quotas.GetServiceQuota", self._get_quota)
        events.register("before-call.ec2.RunInstances", self._run_instances)
        events.register("before-call.ec2", self._failures)
        return session

    @staticmethod
    def _ok(parsed: dict[str, Any], status: int = 200) -> tuple[AWSResponse, dict[str, Any]]:
        parsed.setdefault("ResponseMetadata", {"HTTPStatusCode": status})
        return AWSResponse("https://stub.invalid/", status, {}, None), parsed

    # before-call sees the serialized request: EC2's query-string fields, SSM's JSON body.
    def _create_pg(self, params: dict[str, Any], **_: Any) -> Any:
        body = params["body"]
        tags = [
            {"Key": body[k], "Value": body[k[:-3] + "Value"]}
            for k in sorted(body)
            if k.startswith("TagSpecification.") and k.endswith(".Key")
        ]
        name = body["GroupName"]
        self.placement_groups[name] = {
            "GroupName": name,
            "Strategy": params.get("Strategy"),
            "State": "available",
            "Tags": tags,
        }
        return self._ok({"PlacementGroup": self.placement_groups[name]})

    def _describe_pg(self, params: dict[str, Any], **_: Any) -> Any:
        body = params["body"]
        filters = [
            {
                "Name": body[k],
                "Values": [v for kk, v in body.items() if kk.startswith(k[:-4] + "Value.")],
            }
            for k in body
            if k.startswith("Filter.") and k.endswith(".Name")
        ]
        groups = list(self.placement_groups.values())
        for flt in filters:
            if flt["Name"] == "tag-key":
                groups = [g for g in groups if any(t["Key"] in flt["Values"] for t in g["Tags"])]
            elif flt["Name"].startswith("tag:"):
                key = flt["Name"][4:]
                groups = [
                    g
                    for g in groups
                    if any(t["Key"] == key and t["Value"] in flt["Values"] for t in g["Tags"])
                ]
        return self._ok({"PlacementGroups": groups})

    def _delete_pg(self, params: dict[str, Any], **_: Any) -> Any:
        self.placement_groups.pop(params["body"]["GroupName"], None)
        return self._ok({})

    def _get_parameter(self, params: dict[str, Any], **_: Any) -> Any:
        name = json.loads(params["body"])["Name"]
        if not name.startswith("/aws/service/"):
            return None  # moto answers
        self.ssm_names.append(name)
        return self._ok({"Parameter": {"Name": name, "Type": "String", "Value": MOTO_AMI}})

    def _get_quota(self, params: dict[str, Any], request_signer: Any, **_: Any) -> Any:
        code = json.loads(params["body"])["QuotaCode"]
        value = self.quotas.get((request_signer.region_name, code))
        if value is None:
            error = {"Code": "NoSuchResourceException", "Message": f"no quota {code} here"}
            return self._ok({"Error": error}, status=400)
        name = f"quota {code}"
        return self._ok({"Quota": {"QuotaCode": code, "QuotaName": name, "Value": value}})

    def _run_instances(self, params: dict[str, Any], request_signer: Any, **_: Any) -> Any:
        body = params["body"]
        zone = body.get("Placement.AvailabilityZone", "?")
        self.launches.append((request_signer.region_name, zone))
        market = body.get("InstanceMarketOptions.MarketType", "on-demand")
        failure = self.fail_in_zone.get(f"{zone} {market}") or self.fail_in_zone.get(zone)
        if failure is None:
            return None  # moto launches
        code, message = failure
        return self._ok({"Error": {"Code": code, "Message": message}}, status=500)

    def _failures(self, model: Any, **_: Any) -> Any:
        failure = self.fail.get(model.name)
        if failure is None:
            return None
        code, message = failure
        return self._ok({"Error": {"Code": code, "Message": message}}, status=500)


@pytest.fixture
def price_list(monkeypatch: pytest.MonkeyPatch) -> Iterator[PriceListServer]:
    """The Price List Query API stand-in, where boto3's pricing client goes."""
    with PriceListServer() as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", server.url)
        yield server
        assert server.errors == []


@pytest.fixture
def stubs() -> Stubs:
    return Stubs()


def new_session(stubs: Stubs) -> boto3.session.Session:
    return stubs.install(boto3.session.Session(region_name=REGION))


# -- the unreachable test network --------------------------------------------------------------


@pytest.fixture(scope="session")
def guard_network() -> Iterator[sshd.NetnsHosts]:
    """The unreachable route over 10.213.0.0/16 (and one host-less namespace) for API tests."""
    if not sshd.is_root():
        pytest.skip("AWS provider tests route the test subnet as unreachable; that needs root")
    reason = sshd.netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with sshd.NetnsHosts(1, subnet=API_SUBNET, start_sshd=False) as net:
        yield net


SUBNET_ZONE = "us-east-1a"


def make_vpc(ec2: Any, cidr: str) -> str:
    """A VPC on 10.213.0.0/16 with one subnet `cidr` in us-east-1a; returns the subnet id.

    The zone is named because moto picks one at random otherwise, and its spot price history
    has no m6i.large price in us-east-1e: a test that reads the spot quote failed one run in six.
    """
    vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr, AvailabilityZone=SUBNET_ZONE)
    return str(subnet["Subnet"]["SubnetId"])


def leftovers(ec2: Any, pool_id: str | None = None) -> list[str]:
    """Everything tagged by skyward (or by `pool_id`) that still exists."""
    return [line for pool in resources.find(ec2, pool_id).values() for line in pool.describe()]


def join_skyward_threads(timeout: float = 60) -> None:
    """Wait for teardown threads that outlive a cancelled pool."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name.startswith("skyward-aws-"):
            thread.join(max(0.0, deadline - time.monotonic()))


# -- moto as a real server ---------------------------------------------------------------------


@dataclass
class MotoServer:
    url: str
    process: subprocess.Popen[bytes]

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """``python -m moto.server`` on 127.0.0.1, a separate process, for the whole session."""
    port = sshd.free_port()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        server = MotoServer(f"http://127.0.0.1:{port}", process)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    server.reset()
                    break
                except OSError as exc:
                    if process.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(
                            f"moto server did not start: {log.read()[-2000:]!r}"
                        ) from exc
                    time.sleep(0.1)
            yield server
        finally:
            motos3.stop(process)


# -- EC2 instances that are fresh Debian machines ---------------------------------------------

INSTANCE_HOST_OFFSET = 4  # moto hands out a fresh subnet's addresses from .4 up (EC2 reserves


# .0-.3), so the hosts sit exactly where moto's instances claim to be.
@dataclass
class Ec2Hosts:
    """Plays the part of EC2's boot for instances moto reports on the hosts' subnet.

    The hosts are fresh Debian roots (`tests.support.bareroots.BareHosts`), one per address
    moto hands out, reaching nothing but `index`. For each new instance it does what the
    machine would: cloud-init authorizes the pool's key pair for root, then runs the provider's
    real user-data script inside the host (with a fake ``poweroff`` first on PATH); the host's
    sshd (which the harness supervises, as init would) is down meanwhile and then starts again,
    serving the host key the script made in /etc/ssh. The script's output is the instance's
    console output (`attach`), where the client reads that key. A terminated instance loses every
    process (a power cut; its disk stays for the next instance at that address) before the
    provider's TerminateInstances returns (`watch_terminations`): moto gives the address to the
    next instance at once, and EC2 frees it only once its instance is gone, so the old sshd must
    not answer there. With `boot_at_most`, instances past that many never boot: their host's sshd is
    stopped, as on an instance that hangs in boot. With ``install_host_key=False`` the host's
    sshd serves the key it had, not the one the script made and printed: a machine that
    presents a key other than the one it published.
    """

    net: bareroots.BareHosts
    index: bareroots.PackageIndex
    ec2: Any
    subnet_id: str
    install_host_key: bool = True
    boot_at_most: int | None = None
    booted: dict[str, str] = field(default_factory=dict)  # instance id -> address
    boot_logs: dict[str, str] = field(default_factory=dict)  # instance id -> user data output
    errors: list[str] = field(default_factory=list)
    # What happened to the machines, in order: ("boot" | "power off", instance id).
    events: list[tuple[str, str]] = field(default_factory=list)
    # Instances the provider terminated: never booted after (a poll that listed one as running
    # just before may come after its pool's key pair is gone).
    terminated: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one power change at a time
    _thread: threading.Thread | None = None

    def host(self, address: str) -> bareroots.BareHost:
        for host in self.net.hosts:
            if host.address == address:
                return host
        raise AssertionError(f"moto reported {address}, which is not one of the hosts")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ec2-sim", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def attach(self, session: boto3.session.Session) -> boto3.session.Session:
        """Power off what `session`'s TerminateInstances ends, before the call returns, and
        answer its GetConsoleOutput with what the booted machine printed."""
        session.events.register("after-call.ec2.TerminateInstances", self._terminated)
        session.events.register("before-call.ec2.GetConsoleOutput", self._console_output)
        return session

    def _console_output(self, params: dict[str, Any], **_: Any) -> Any:
        """EC2's console output of an instance, as the machine made it: the output of the user
        data the simulated boot really ran (moto's own is a fixed text). What this proves: the
        client reads the key the machine made and printed, and trusts nothing else. What only
        EC2 shows: that cloud-init's final stage sends the user data's output to the serial
        console, and that GetConsoleOutput(Latest=True) returns it (AWS documents both)."""
        iid = params["body"]["InstanceId"]
        reply: dict[str, Any] = {"InstanceId": iid}
        log = self.boot_logs.get(iid)
        if log is not None:  # none before the instance booted, as on EC2
            reply["Output"] = base64.b64encode(log.encode()).decode()
        reply["ResponseMetadata"] = {"HTTPStatusCode": 200}
        return AWSResponse("https://stub.invalid/", 200, {}, None), reply

    def _terminated(self, parsed: dict[str, Any], **_: Any) -> None:
        with self._lock:
            for change in parsed.get("TerminatingInstances", []):
                self.terminated.add(change["InstanceId"])
                self._power_off(change["InstanceId"])

    def _power_off(self, iid: str) -> None:
        if iid in self.booted:
            self.events.append(("power off", iid))
            self.host(self.booted.pop(iid)).kill_all()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self._step()
            except Exception as exc:
                self.errors.append(repr(exc))

    def _step(self) -> None:
        reply = self.ec2.describe_instances(
            Filters=[{"Name": "subnet-id", "Values": [self.subnet_id]}]
        )
        instances = [i for r in reply["Reservations"] for i in r["Instances"]]
        with self._lock:
            self._boot_and_power_off(instances)

    def _boot_and_power_off(self, instances: list[dict[str, Any]]) -> None:
        # Terminations first (those made by another client than the provider's): moto may
        # already have given a terminated instance's address to a new one, which must not be
        # powered off with it.
        for instance in instances:
            if instance["State"]["Name"] == "terminated":
                self._power_off(instance["InstanceId"])
        for instance in instances:
            iid, address = instance["InstanceId"], instance.get("PrivateIpAddress")
            if iid in self.terminated:
                continue
            if instance["State"]["Name"] == "running" and iid not in self.booted and address:
                if self.boot_at_most is not None and len(self.booted) >= self.boot_at_most:
                    self.host(address).stop()
                else:
                    self._boot(instance)
                self.booted[iid] = address

    def _boot(self, instance: dict[str, Any]) -> None:
        host = self.host(instance["PrivateIpAddress"])
        iid = instance["InstanceId"]
        self.events.append(("boot", iid))
        data = self.ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
        script = base64.b64decode(data["UserData"]["Value"]).decode()
        pair = self.ec2.describe_key_pairs(KeyNames=[instance["KeyName"]], IncludePublicKey=True)
        # No sshd while the instance boots: the one running reads its host key from the file
        # the script replaces, and a client could log in through it before the restart ends
        # its session.
        host.stop()
        # cloud-init: the key pair for the image's user before the user data runs.
        host.set_authorized_keys([pair["KeyPairs"][0]["PublicKey"].strip()])
        bareroots.install_fake_poweroff(host)
        where = f"/var/lib/cloud/instances/{iid}/user-data.txt"  # where cloud-init keeps it
        proc = bareroots.first_boot(host, script, where, install_host_key=self.install_host_key)
        self.boot_logs[iid] = proc.stdout + proc.stderr
        if proc.returncode != 0:
            self.errors.append(
                f"user data of {iid} on {host.name} exited {proc.returncode}:\n"
                f"{proc.stdout}\n{proc.stderr}"
            )


@pytest.fixture
def ec2_hosts(
    moto_server: MotoServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    instance_root: Path,
    instance_wheels: Path,
) -> Iterator[Callable[..., Ec2Hosts]]:
    """Three fresh Debian "instances" behind the moto server and a package index they reach;
    call with install_host_key=..., boot_at_most=..."""
    moto_server.reset()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.url)
    made: list[Ec2Hosts] = []
    # A pool asks its price before launch. moto has no Price List API: its 500s would have
    # boto3 retry for seconds at every start. The stand-in, with no product, answers at once
    # ("price unknown"); a test that wants prices gives its own (`price_list`).
    pricing = PriceListServer().__enter__()
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", pricing.url)
    # The index's own directory (links to `instance_wheels`): a test may add wheels to it.
    wheels = tmp_path / "index"
    wheels.mkdir()
    for wheel in instance_wheels.iterdir():
        try:
            os.link(wheel, wheels / wheel.name)
        except OSError:  # another filesystem
            shutil.copy2(wheel, wheels / wheel.name)
    with contextlib.ExitStack() as cleanup:
        # Each host has its own hostname, mapped to its own address in its /etc/hosts, as on
        # separate machines: gloo binds to that address.
        net = bareroots.BareHosts(
            3,
            suite=bareroots.MACHINE_SUITE,
            subnet=E2E_SUBNET,
            root=instance_root,
            host_offset=INSTANCE_HOST_OFFSET,
        ).build()
        cleanup.callback(net.close)
        index = cleanup.enter_context(bareroots.PackageIndex(wheels, host=net.bridge_address))

        def make(install_host_key: bool = True, boot_at_most: int | None = None) -> Ec2Hosts:
            ec2 = boto3.client("ec2", region_name=REGION)
            subnet = make_vpc(ec2, E2E_SUBNET)
            sim = Ec2Hosts(net, index, ec2, subnet, install_host_key, boot_at_most)
            sim.start()
            made.append(sim)
            return sim

        cleanup.callback(pricing.__exit__)
        try:
            yield make
        finally:
            for sim in made:
                sim.stop()
                assert not sim.errors, sim.errors
        # Closing the hosts also ends the watchdogs the user data started inside them.


def aws_for(sim: Ec2Hosts, stubs: Stubs, **kwargs: Any) -> sky.AWS:
    """The provider as the E2E tests use it: private addresses on the hosts' subnet, the nodes'
    own python3, and builds from the index the test serves (``UV_INDEX``; give ``build_env``
    to replace it)."""
    options: dict[str, Any] = {
        "subnet_id": sim.subnet_id,
        "use_private_ips": True,
        "ami": MOTO_AMI,
        "user": "root",
        "build_env": {"UV_INDEX": sim.index.simple_url},
        "poll_interval": 0.1,
        "boot_timeout": 30.0,
        "connect_timeout": 3.0,
        "session": sim.attach(new_session(stubs)),
    }
    options.update(kwargs)
    return sky.AWS(**options)
