"""The cloud half of a GCP launch: the API calls that make a pool's VMs or its TPU slice, run in
a thread, each ending with the hosts to connect to (`Host`). What they make is recorded in the
pool's `GCPCluster` as they go, so a teardown during or after a failed launch finds it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from skyward.errors import ProvisionError
from skyward.providers.cloud.bootscript import write_login_key
from skyward.providers.cloud.provider import CloudCluster
from skyward.providers.gcp import api, instances, machine_types, startup, teardown, tpu_types, tpus
from skyward.providers.gcp.instances import logger
from skyward.providers.gcp.settings import Access, Clients, Placement

T = TypeVar("T")


@dataclass
class GCPCluster(CloudCluster):
    """What one pool has made so far (the labels are the durable record)."""

    body: Any = None  # the bulkInsert request: a replacement asks for the same
    made: teardown.Made = field(default_factory=teardown.Made)
    tpu: tpu_types.TpuType | None = None  # the pool is this TPU slice


@dataclass(frozen=True)
class Host:
    """One machine to connect to: a VM, or one host (worker) of a TPU slice."""

    name: str
    address: str  # how the client reaches it
    private: str  # how the other nodes reach it


@dataclass(frozen=True)
class Calls:
    """What a launch's API calls need of the provider, resolved in the launch's thread."""

    clients: Clients
    access: Access
    placement: Placement
    poll: float
    deadline: float  # monotonic: the provider's boot_timeout from the launch's start

    @classmethod
    def start(
        cls, clients: Clients, access: Access, placement: Placement, poll: float, timeout: float
    ) -> Calls:
        return cls(clients, access, placement, poll, time.monotonic() + timeout)


def vms(calls: Calls, pool: GCPCluster, choice: machine_types.Choice) -> list[Host]:
    """Firewall rules, then one bulkInsert for all of the pool's VMs, until every one runs."""
    with _launching(pool):
        pool.body = instances.set_up(
            calls.clients,
            calls.access,
            calls.placement,
            pool.spec,
            choice,
            _metadata(calls, pool),
            pool.made,
            calls.deadline,
            pool.check_cancel,
        )
        pool.check_cancel()
        instances.run(calls.clients, calls.access, pool.body, pool.spec.nodes, calls.deadline)
        return _running(calls, pool, pool.spec.nodes, set())


def tpu_slice(
    calls: Calls, pool: GCPCluster, tpu: tpu_types.TpuType, runtime_version: str | None
) -> list[Host]:
    """Firewall rules, then the slice (a node, or a queued resource for spot on v5e+), until
    every host has an address and the slice is READY; its hosts in worker order."""
    with _launching(pool):
        metadata = _metadata(calls, pool)
        instances.create_firewalls(
            calls.clients,
            calls.access,
            calls.placement,
            pool.pool_id,
            pool.made,
            calls.deadline,
            pool.check_cancel,
        )
        body = tpus.node_body(
            calls.access, calls.placement, pool.pool_id, tpu, metadata, runtime_version
        )
        operation = tpus.create(
            calls.clients,
            calls.access,
            pool.pool_id,
            body,
            tpu,
            calls.placement.spot,
            pool.made.add,
        )
        node = _wait(calls, pool, tpus.wait_ready, tpu, operation)
    name = tpus.node_name(pool.pool_id)
    private = calls.placement.use_private_ips
    return [
        Host(f"{name} worker {i}", tpus.address(e, private), str(e.ip_address))
        for i, e in enumerate(tpus.endpoints(node))
    ]


def retire(calls: Calls, lost: str) -> None:
    """Delete the lost VM `lost` (it may be hung rather than gone); a failure is only logged:
    the teardown deletes it in the end."""
    try:
        teardown.delete_vm(calls.clients, calls.access.project, calls.access.zone, lost)
    except api.ApiError as exc:
        logger.info("deleting lost VM %s: %s", lost, api.describe(exc))


def one_more(calls: Calls, pool: GCPCluster) -> list[Host]:
    """One more VM, made as the pool's were (`pool.body`), once it runs."""
    known = set(pool.made.instances)
    instances.run(calls.clients, calls.access, pool.body, 1, calls.deadline)
    return _running(calls, pool, 1, known)


@contextlib.contextmanager
def _launching(pool: GCPCluster) -> Iterator[None]:
    """An API failure or a timeout of the launch as the `ProvisionError` the user sees."""
    try:
        yield
    except (*api.ApiError, TimeoutError) as exc:
        raise ProvisionError(
            f"launching pool {pool.pool_id} failed: {api.describe(exc)}; nothing was left running"
        ) from None


def _metadata(calls: Calls, pool: GCPCluster) -> dict[str, str]:
    """The machines' metadata: the pool's fresh login key and the startup script."""
    return startup.metadata(
        pool.pool_id,
        pool.host_key,
        calls.placement.idle_timeout,
        calls.placement.user,
        write_login_key(pool.key_path),
    )


def _running(calls: Calls, pool: GCPCluster, count: int, exclude: set[str]) -> list[Host]:
    """Wait until `count` of the pool's VMs not in `exclude` run; record them; their hosts."""
    found = _wait(calls, pool, instances.wait_running, count, exclude)
    for instance in found:
        pool.made.add(teardown.INSTANCE, str(instance.name), calls.access.zone)
    return [_vm_host(instance, calls.placement.use_private_ips) for instance in found]


def _wait(calls: Calls, pool: GCPCluster, wait: Callable[..., T], *what: Any) -> T:
    """`wait` (`instances.wait_running`, `tpus.wait_ready`) for `what` of the pool, polling
    until the launch's deadline unless the launch is cancelled."""
    return wait(
        calls.clients,
        calls.access,
        pool.pool_id,
        *what,
        deadline=calls.deadline,
        poll=calls.poll,
        check_cancel=pool.check_cancel,
    )


def _vm_host(instance: Any, private: bool) -> Host:
    """A VM's name and the address to reach it at (private or external)."""
    interface = instance.network_interfaces[0]
    if private:
        address = str(interface.network_i_p)
    else:
        nat = [c.nat_i_p for c in interface.access_configs if c.nat_i_p]
        address = str(nat[0]) if nat else ""
    if not address:
        raise ProvisionError(
            f"VM {instance.name} has no external address: use_private_ips=True from "
            "inside the VPC, or a network that allows external addresses"
        )
    return Host(str(instance.name), address, str(interface.network_i_p))
