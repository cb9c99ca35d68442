"""Fixtures for the GCP provider: the fake Compute API (tests/support/fakegcp.py) driven by the
real google-cloud-compute client, and "VMs" that are fresh Debian roots behind sshd in network
namespaces (`tests.support.bareroots`), reaching only a package index the test serves.

Safety: the fake listens on 127.0.0.1 only; every address it hands out is a namespace host on
10.213.20.0/24 (TPU hosts: 10.213.22.0/24), inside the /16 that `tests.support.sshd.NetnsHosts`
routes as unreachable, and the provider runs with ``use_private_ips=True``: no test can reach a
real machine or Google.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials

import skyward as sky
from tests.support import bareroots
from tests.support.fakegcp import FakeGCP

PROJECT = "skyward-test"
ZONE = "us-central1-a"
SUBNET = "10.213.20.0/24"  # the hosts of `gce_hosts`
TPU_SUBNET = "10.213.22.0/24"  # those of `tpu_hosts` (4: one v5litepod-16 slice)
API_ADDRESSES = [f"10.213.20.{200 + i}" for i in range(20)]  # no host: unreachable


@pytest.fixture(autouse=True)
def gcp_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No gcloud config, no real credentials or endpoint from this machine."""
    for name in list(os.environ):
        if name.startswith(("CLOUDSDK_", "GOOGLE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/skyward-test")


@pytest.fixture
def api_fake() -> Iterator[FakeGCP]:
    """The fake API alone, its addresses unreachable: for tests that never connect."""
    with FakeGCP(PROJECT, API_ADDRESSES, boot_delay=0.05, delete_delay=0.05) as fake:
        yield fake
        assert fake.errors == []


# -- VMs that are fresh Debian machines --------------------------------------------------------

FAKE_CURL = "/usr/local/sbin/curl"
"""The machine's metadata server, as its startup script reaches it: a ``curl`` first on PATH
during the boot only. The machines cannot reach the fake API (as a VM cannot write to the
Compute API), so what the script PUTs to its guest attributes is kept inside the machine
(`GUEST_ATTRIBUTES`) and handed to the fake once the boot ends. What this proves: the script
PUTs the key the machine made, and the client trusts only what the fake's getGuestAttributes
then answers. What only GCE shows: that the metadata server accepts the PUT (with
``enable-guest-attributes=TRUE``) and getGuestAttributes returns it, as Google documents."""
GUEST_ATTRIBUTES = "/var/lib/skyward-test/guest-attributes"
FAKE_CURL_SCRIPT = f"""#!/bin/bash
# The metadata server's guest attributes: keep what a PUT with Metadata-Flavor sends.
data= url= put= flavor=
while [ $# -gt 0 ]; do
    case "$1" in
        --data) data="$2"; shift ;;
        -X) [ "$2" = PUT ] && put=1; shift ;;
        -H) [ "$2" = "Metadata-Flavor: Google" ] && flavor=1; shift ;;
        --retry) shift ;;
        http://*) url="$1" ;;
    esac
    shift
done
prefix=http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/
if [ -z "$put" ] || [ -z "$flavor" ] || [ "${{url#"$prefix"}}" = "$url" ]; then
    echo "fake curl: not a guest attribute PUT with Metadata-Flavor: $*" >&2
    exit 22
fi
path="${{url#"$prefix"}}"
mkdir -p "$(dirname "{GUEST_ATTRIBUTES}/$path")"
printf %s "$data" > "{GUEST_ATTRIBUTES}/$path"
"""

STARTUP_SCRIPT = "/tmp/metadata-scripts/startup-script"
"""Where the simulated guest agent writes the ``startup-script`` metadata before running it."""


# What the guest agent does for a non-root ``USER:KEY`` line of ``ssh-keys``: create the user if
# missing with its default ``useradd_cmd`` (a home, bash, and the password "*": no password
# login, yet not a locked account, which sshd would refuse), then write its authorized_keys
# (stdin), owned by it. (It also adds the user to groups such as google-sudoers, which a
# minimal Debian does not have.)
_GUEST_AGENT_USER = """\
set -e
user=$1
id -u "$user" >/dev/null 2>&1 || useradd -m -s /bin/bash -p '*' "$user"
home=$(getent passwd "$user" | cut -d: -f6)
install -d -m 700 -o "$user" -g "$user" "$home/.ssh"
cat > "$home/.ssh/authorized_keys"
chown "$user:$user" "$home/.ssh/authorized_keys"
chmod 600 "$home/.ssh/authorized_keys"
"""


def authorize(host: bareroots.BareHost, ssh_keys: str) -> None:
    """Authorize the ``ssh-keys`` metadata's ``USER:KEY`` lines on `host`, as the guest agent
    does: root's keys in /root, any other user created first (``useradd``, inside the host)."""
    keys: dict[str, list[str]] = {}
    for line in ssh_keys.splitlines():
        if ":" in line:
            user, key = line.split(":", 1)
            keys.setdefault(user.strip(), []).append(key.strip())
    for user, lines in keys.items():
        if user == "root":
            host.set_authorized_keys(lines)
        else:
            text = "".join(f"{line}\n" for line in lines)
            host.run("sh", "-c", _GUEST_AGENT_USER, "sh", user, input=text)


@dataclass
class GceHosts:
    """Plays GCE's boot for the fake's VMs: each address the fake hands out is a fresh Debian
    machine (`tests.support.bareroots.BareHosts`) reaching nothing but `index`.

    An address with no VM is a machine that is off: no process at all. When the fake reports a
    VM RUNNING, its machine boots as a GCE image would: the guest agent authorizes the
    ``ssh-keys`` metadata (creating a user other than root with ``useradd``), then runs the
    VM's real ``startup-script`` as root inside the machine (a fake ``poweroff`` first on PATH);
    the machine's sshd (which the harness supervises, as init would) is down meanwhile and then
    starts, serving the host key the script made in /etc/ssh, whose public half the script
    PUT to its guest attributes (`FAKE_CURL`). A VM that goes (deleted,
    preempted) loses every process of its machine (a power cut; the disk stays for the next VM
    at that address). Each machine boots and goes in its own thread, in the order the fake
    reports, so a slow boot never holds the fake's clock. With `boot_at_most`, VMs past that
    many never boot: nothing answers at their address. With ``install_host_key=False`` the
    machine's sshd serves a host key of its own, not the one it made and published.
    """

    net: bareroots.BareHosts
    index: bareroots.PackageIndex
    fake: FakeGCP | None = None
    boot_at_most: int | None = None
    install_host_key: bool = True
    booted: dict[str, str] = field(default_factory=dict)  # VM name -> address
    boot_logs: dict[str, str] = field(default_factory=dict)  # VM name -> startup-script output
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _machines: dict[str, ThreadPoolExecutor] = field(default_factory=dict)

    def host(self, address: str) -> bareroots.BareHost:
        for host in self.net.hosts:
            if host.address == address:
                return host
        raise AssertionError(f"the fake handed out {address}, which is not one of the hosts")

    def _later(self, address: str, what: Callable[[], None]) -> None:
        """Run `what` on the thread of the machine at `address`, after what it was given."""
        with self.lock:
            machine = self._machines.get(address)
            if machine is None:
                machine = ThreadPoolExecutor(1, thread_name_prefix=f"gce-{address}")
                self._machines[address] = machine

        def run() -> None:
            try:
                what()
            except Exception as exc:
                self.errors.append(f"{address}: {exc!r}")

        machine.submit(run)

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until every machine has done what it was given."""
        with self.lock:
            machines = list(self._machines.values())
        for machine in machines:
            machine.submit(lambda: None).result(timeout)

    def close(self) -> None:
        with self.lock:
            machines, self._machines = list(self._machines.values()), {}
        for machine in machines:
            machine.shutdown(wait=True)

    def on_running(self, instance: dict[str, Any]) -> None:
        name = instance["name"]
        address = instance["networkInterfaces"][0]["networkIP"]
        self.host(address)  # an address of ours, or fail the fake's hook now
        with self.lock:
            late = self.boot_at_most is not None and len(self.booted) >= self.boot_at_most
            self.booted[name] = address
        if not late:
            self._later(address, lambda: self._boot(instance))

    def _boot(self, instance: dict[str, Any]) -> None:
        name = instance["name"]
        host = self.host(instance["networkInterfaces"][0]["networkIP"])
        items = {i["key"]: i["value"] for i in instance["metadata"]["items"]}
        host.stop()  # not running: a new VM's machine was off
        authorize(host, items["ssh-keys"])
        bareroots.install_fake_poweroff(host)
        curl = host.root / FAKE_CURL.lstrip("/")
        curl.write_text(FAKE_CURL_SCRIPT)
        curl.chmod(0o755)
        proc = bareroots.first_boot(
            host, items["startup-script"], STARTUP_SCRIPT, install_host_key=self.install_host_key
        )
        curl.unlink()  # the nodes' own steps may need the real one
        self._publish(host, name)
        self.boot_logs[name] = proc.stdout + proc.stderr
        if proc.returncode != 0:
            self.errors.append(
                f"startup-script of {name} on {host.name} exited {proc.returncode}:\n"
                f"{proc.stdout}\n{proc.stderr}"
            )

    def _publish(self, host: bareroots.BareHost, name: str) -> None:
        """Hand the fake what the machine PUT to its metadata server's guest attributes (the fake
        ``curl`` kept each PUT's value under `GUEST_ATTRIBUTES`)."""
        assert self.fake is not None
        kept = host.root / GUEST_ATTRIBUTES.lstrip("/")
        for path in sorted(kept.rglob("*")) if kept.is_dir() else []:
            if path.is_file():
                self.fake.put_guest_attribute(name, str(path.relative_to(kept)), path.read_text())
                path.unlink()

    def on_gone(self, instance: dict[str, Any]) -> None:
        address = instance["networkInterfaces"][0]["networkIP"]
        with self.lock:
            if self.booted.get(instance["name"]) != address:
                return  # already gone (a preempted VM is deleted afterwards)
            del self.booted[instance["name"]]
        self._later(address, self.host(address).kill_all)

    def processes(self) -> dict[str, list[int]]:
        """Every machine's processes, by host name (empty where no VM runs)."""
        return {h.name: pids for h in self.net.hosts if (pids := h.pids())}


@pytest.fixture
def gce_hosts(
    tmp_path: Path, instance_root: Path, instance_wheels: Path
) -> Iterator[Callable[..., GceHosts]]:
    """Three fresh Debian "VMs" behind a fake Compute API and a package index they reach; call
    with boot_at_most=..., install_host_key=..."""
    yield from _simulated(tmp_path, 3, SUBNET, instance_root, instance_wheels)


@pytest.fixture
def tpu_hosts(
    tmp_path: Path, instance_root: Path, instance_wheels: Path
) -> Iterator[Callable[..., GceHosts]]:
    """Four fresh Debian hosts behind the fake (TPU and Compute) API: the hosts of one simulated
    v5litepod-16 slice, or of smaller ones; called as `gce_hosts`."""
    yield from _simulated(tmp_path, 4, TPU_SUBNET, instance_root, instance_wheels)


def _simulated(
    tmp_path: Path, count: int, subnet: str, root: Path, instance_wheels: Path
) -> Iterator[Callable[..., GceHosts]]:
    made: list[GceHosts] = []
    # The index's own directory (links to `instance_wheels`): a test may add wheels to it.
    wheels = tmp_path / "index"
    wheels.mkdir()
    for wheel in instance_wheels.iterdir():
        try:
            os.link(wheel, wheels / wheel.name)
        except OSError:  # another filesystem
            shutil.copy2(wheel, wheels / wheel.name)
    with contextlib.ExitStack() as stack:
        # Each host has its own hostname, mapped to its own address in its /etc/hosts, as on
        # separate machines: gloo (JAX's CPU collectives) binds to that address.
        net = bareroots.BareHosts(
            count, suite=bareroots.MACHINE_SUITE, subnet=subnet, root=root
        ).build()
        stack.callback(net.close)
        for host in net.hosts:
            host.stop()  # no VM there yet: the machine is off
        index = stack.enter_context(bareroots.PackageIndex(wheels, host=net.bridge_address))

        def make(boot_at_most: int | None = None, install_host_key: bool = True) -> GceHosts:
            sim = GceHosts(net, index, boot_at_most=boot_at_most, install_host_key=install_host_key)
            stack.callback(sim.close)  # after the fake stopped calling it
            sim.fake = stack.enter_context(
                FakeGCP(PROJECT, net.addresses, on_running=sim.on_running, on_gone=sim.on_gone)
            )
            made.append(sim)
            return sim

        yield make
        for sim in made:
            assert sim.fake is not None
            sim.settle()
            assert sim.fake.errors == []
            assert sim.errors == []
        # Closing the hosts also ends the watchdogs the startup scripts started inside them.


def gcp_for(fake: FakeGCP, **kwargs: Any) -> sky.GCP:
    """The provider as the tests use it: the fake's endpoint, private addresses, root login."""
    options: dict[str, Any] = {
        "project": PROJECT,
        "zone": ZONE,
        "use_private_ips": True,
        "ssh_cidr": SUBNET,
        "user": "root",
        "poll_interval": 0.1,
        "boot_timeout": 30.0,
        "connect_timeout": 3.0,
        "teardown_timeout": 20.0,
        "credentials": AnonymousCredentials(),
        "api_endpoint": fake.url,
    }
    options.update(kwargs)
    return sky.GCP(**options)


def gce_for(sim: GceHosts, **kwargs: Any) -> sky.GCP:
    """`gcp_for` the fake of `sim`, its VMs' own python3 building from the index the test
    serves (``UV_INDEX``; give ``build_env`` to replace it)."""
    assert sim.fake is not None
    options: dict[str, Any] = {"build_env": {"UV_INDEX": sim.index.simple_url}}
    options.update(kwargs)
    return gcp_for(sim.fake, **options)
