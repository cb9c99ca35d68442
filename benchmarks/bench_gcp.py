"""Compute API calls to launch and to tear down a GCP pool, for N = 1, 4 and 16 nodes.

Counted by the fake Compute API of the tests (tests/support/fakegcp.py, on 127.0.0.1) while the
real google-cloud-compute client talks to it. Only the API half of a launch runs (up to "all N
VMs running"); the SSH half makes no API calls. A launch costs the same for any N (one
bulkInsert); a teardown costs one delete per VM (the Compute API has no multi-VM delete outside
instance groups) plus a constant. Run: ``python benchmarks/bench_gcp.py``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from google.auth.credentials import AnonymousCredentials

from skyward.hardware import ClusterSpec
from skyward.providers.cloud.bootscript import HostKey
from skyward.providers.gcp import instances, machine_types, startup, teardown
from skyward.providers.gcp.settings import Access, Clients, Placement
from tests.support.fakegcp import FakeGCP

PROJECT, ZONE = "bench", "us-central1-a"


def measure(fake: FakeGCP, nodes: int) -> tuple[Counter[str], Counter[str]]:
    clients = Clients(AnonymousCredentials(), fake.url)
    access = Access(PROJECT, ZONE, AnonymousCredentials())
    spec = ClusterSpec(nodes, f"pool-bench{nodes:04d}")
    made = teardown.Made()
    metadata = startup.metadata(spec.pool_id, HostKey.generate("b"), 300, "skyward", "ssh-x b")
    deadline = time.monotonic() + 60
    start = Counter(fake.calls)
    body = instances.set_up(
        clients,
        access,
        Placement(use_private_ips=True),
        spec,
        machine_types.choose(None),
        metadata,
        made,
        deadline,
        lambda: None,
    )
    instances.run(clients, access, body, nodes, deadline)
    running = instances.wait_running(
        clients,
        access,
        spec.pool_id,
        nodes,
        set(),
        deadline=deadline,
        poll=0.5,
        check_cancel=lambda: None,
    )
    for vm in running:
        made.add(teardown.INSTANCE, str(vm.name), ZONE)
    launched = Counter(fake.calls)
    teardown.remove_pool(clients, PROJECT, spec.pool_id, made, timeout=60, poll=0.5)
    assert fake.labelled() == [] and fake.errors == [], (fake.labelled(), fake.errors)
    return launched - start, Counter(fake.calls) - launched


def main() -> None:
    addresses = [f"192.0.2.{i}" for i in range(1, 40)]  # TEST-NET-1: never connected to
    with FakeGCP(PROJECT, addresses, boot_delay=0.3, delete_delay=0.3) as fake:
        print(f"{'nodes':>5}  {'launch':>6}  {'teardown':>8}  details")
        for nodes in (1, 4, 16):
            up, down = measure(fake, nodes)
            details = ", ".join(f"{k} {v}" for k, v in sorted((up + down).items()))
            print(f"{nodes:>5}  {sum(up.values()):>6}  {sum(down.values()):>8}  {details}")


if __name__ == "__main__":
    main()
