"""The cloud half of a GCP launch: the API calls that make a pool's VMs or its TPU slice, run in
a thread, each ending with the machines to connect to (`MachineAddress`). What they make is
recorded in the pool's `GCPCluster` as they go, so a teardown during or after a failed launch
finds it.

Failover: the pool's firewall rules are made once (they are global), then the zones given are
tried in order, each with one bulkInsert (or one TPU slice) for the whole pool, so that every
node lands in one zone; with ``spot="prefer"`` every zone is tried with spot VMs first, then
with on-demand ones. A zone without capacity is passed; a quota error blocks its region (GCE's
VM quotas are regional), whose other zones are not tried, and a region whose quotas, read
first (`quotas`), cannot fit the pool is skipped without an insert. What a failed attempt made
in its zone is removed before the next; each attempt is a console line (`failover.Attempts`)
and, when no zone is left, `sky.NoCapacity` lists them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from skyward.errors import ProvisionError
from skyward.providers.base import count
from skyward.providers.cloud import failover
from skyward.providers.cloud.bootscript import write_login_key
from skyward.providers.cloud.provider import CloudCluster
from skyward.providers.gcp import (
    api,
    instances,
    machine_types,
    prices,
    quotas,
    resources,
    startup,
    teardown,
    tpu_types,
    tpus,
)
from skyward.providers.gcp.instances import logger
from skyward.providers.gcp.settings import Access, Clients, MachineSettings, region_of

T = TypeVar("T")

_VM_HINT = (
    "Try more zones (zone=[...], in other regions too), spot='prefer' or spot=False, fewer "
    "nodes, another machine type, or ask for more quota"
)
_TPU_HINT = (
    "Try more zones (zone=[...]), spot='prefer' or spot=False, a smaller slice, or ask for "
    "TPU quota"
)


@dataclass
class GCPCluster(CloudCluster):
    """What one pool has made so far (the labels are the durable record)."""

    body: Any = None  # the bulkInsert request: a replacement asks for the same
    made: teardown.Made = field(default_factory=teardown.Made)
    tpu: tpu_types.TpuType | None = None  # the pool is this TPU slice
    # Where the pool is: the zone of its current attempt while it launches, the zone it landed
    # in after. Everything after the launch (replacements, explain, teardown) goes there.
    zone: str = ""
    spot: bool = False  # the market of that attempt, and so of what the pool runs on


@dataclass(frozen=True)
class MachineAddress:
    """One machine to connect to: a VM, or one host (worker) of a TPU slice."""

    name: str
    address: str  # how the client reaches it
    private: str  # how the other nodes reach it
    worker: int | None = None  # a TPU slice's host: its worker number


@dataclass(frozen=True)
class Calls:
    """What a launch's API calls need of the provider, resolved in the launch's thread."""

    clients: Clients
    access: Access
    machine_settings: MachineSettings
    poll: float
    timeout: float  # the provider's boot_timeout: each attempt has all of it
    deadline: float  # monotonic: `timeout` from the start of the launch or of the attempt

    @classmethod
    def start(
        cls,
        clients: Clients,
        access: Access,
        machine_settings: MachineSettings,
        poll: float,
        timeout: float,
    ) -> Calls:
        return cls(clients, access, machine_settings, poll, timeout, time.monotonic() + timeout)

    def attempt(self, zone: str, spot: bool | None = None) -> Calls:
        """These calls for one attempt: in `zone`, with spot VMs or not (`spot`; None: as
        the provider's settings say), with the whole boot_timeout from now."""
        machine_settings = self.machine_settings
        if spot is not None:
            machine_settings = dataclasses.replace(machine_settings, spot=spot)
        return dataclasses.replace(
            self,
            access=self.access.at(zone),
            machine_settings=machine_settings,
            deadline=time.monotonic() + self.timeout,
        )


def vms(
    calls: Calls, pool: GCPCluster, choice: machine_types.Choice, markets: Sequence[bool]
) -> list[MachineAddress]:
    """Firewall rules, then the pool's VMs in the first zone with room, one bulkInsert for all
    of them, until every one runs. `markets`: spot or not, in the order tried."""
    with _launching(pool):
        _firewalls(calls, pool)
        metadata = _metadata(calls, pool)
        attempts = failover.Attempts(f"{pool.spec.nodes} x {choice.machine_type}", pool.tell)
        read: dict[str, dict[str, quotas.Quota] | None] = {}  # region -> its quotas, once
        for spot in markets:
            if not spot and len(markets) > 1:
                pool.tell("no spot capacity in any zone: trying on-demand VMs")
            market = _market(spot)
            checked: set[str] = set()
            blocked: set[str] = set()
            for zone in calls.access.zones:
                region = region_of(zone)
                if region in blocked:
                    continue
                attempt = calls.attempt(zone, spot)
                if region not in checked:
                    checked.add(region)
                    short = _too_small(attempt, pool, choice, read)
                    if short is not None:
                        attempts.block_region(region, short)
                        blocked.add(region)
                        continue
                pool.check_cancel()
                try:
                    return _vms_in(attempt, pool, choice, metadata)
                except api.NoRoom as exc:
                    if exc.scope == api.REGION:
                        attempts.block_region(region, f"{exc.answer} ({market})")
                        blocked.add(region)
                    else:
                        attempts.failed(f"{zone} ({market})", exc.answer)
                    _clear(attempt, pool)
        raise attempts.exhausted(_VM_HINT)


def tpu_slice(
    calls: Calls,
    pool: GCPCluster,
    tpu: tpu_types.TpuType,
    runtime_version: str | None,
    markets: Sequence[bool],
) -> list[MachineAddress]:
    """Firewall rules, then the slice (a node, or a queued resource for spot on v5e+) in the
    first zone with room, until every host has an address and the slice is READY; its hosts
    in worker order. TPU quotas are not read first (the TPU API counts them per zone, and
    answers a slice over quota as it answers one without capacity: the next zone is tried)."""
    with _launching(pool):
        metadata = _metadata(calls, pool)
        _firewalls(calls, pool)
        attempts = failover.Attempts(
            f"TPU {tpu.accelerator_type} ({count(tpu.hosts, 'host')})", pool.tell
        )
        for spot in markets:
            if not spot and len(markets) > 1:
                pool.tell("no spot capacity in any zone: trying an on-demand slice")
            for zone in calls.access.zones:
                attempt = calls.attempt(zone, spot)
                pool.check_cancel()
                try:
                    return _slice_in(attempt, pool, tpu, runtime_version, metadata)
                except api.NoRoom as exc:
                    attempts.failed(f"{zone} ({_market(spot)})", exc.answer)
                    _clear(attempt, pool)
        raise attempts.exhausted(_TPU_HINT)


def retire(calls: Calls, lost: str, zone: str) -> None:
    """Delete the lost VM `lost` in `zone` (it may be hung rather than gone); a failure is
    only logged: the teardown deletes it in the end."""
    try:
        teardown.delete_vm(calls.clients, calls.access.project, zone, lost)
    except api.ApiError as exc:
        logger.info("deleting lost VM %s: %s", lost, api.describe(exc))


def one_more(calls: Calls, pool: GCPCluster) -> list[MachineAddress]:
    """One more VM, made as the pool's were (`pool.body`), once it runs: in the pool's zone,
    else in the next zone given of the same region (a zone of another region would put it on
    another subnet, away from the pool), passing zones without room as a launch does."""
    region = region_of(pool.zone)
    zones = [pool.zone] + [
        z for z in calls.access.zones if z != pool.zone and region_of(z) == region
    ]
    spot = str(pool.body.instance_properties.scheduling.provisioning_model) == "SPOT"
    market = _market(spot)
    machine = pool.body.instance_properties.machine_type
    attempts = failover.Attempts(f"a replacement VM ({machine})", pool.tell)
    known = set(pool.made.instances)
    for zone in zones:
        attempt = calls.attempt(zone)
        body = pool.body
        if zone != pool.zone:
            body = instances.named(body, resources.name_pattern(pool.pool_id, zone))
        try:
            instances.run(attempt.clients, attempt.access, body, 1, attempt.deadline)
        except api.NoRoom as exc:
            # One VM is all or nothing by itself: a refused one left nothing to remove.
            if exc.scope == api.REGION:
                attempts.block_region(region, f"{exc.answer} ({market})")
                break
            attempts.failed(f"{zone} ({market})", exc.answer)
            continue
        return _running(attempt, pool, 1, known)
    raise attempts.exhausted(
        f"Replacements stay in region {region}, the pool's network: give more of its zones "
        "(zone=[...]) to have more tried"
    )


def _firewalls(calls: Calls, pool: GCPCluster) -> None:
    """The pool's firewall rules (global: made once, before the first zone is tried)."""
    instances.create_firewalls(
        calls.clients,
        calls.access,
        calls.machine_settings,
        pool.pool_id,
        pool.made,
        calls.deadline,
        pool.check_cancel,
    )


def _vms_in(
    calls: Calls, pool: GCPCluster, choice: machine_types.Choice, metadata: dict[str, str]
) -> list[MachineAddress]:
    """All of the pool's VMs in `calls.access.zone`, running; `api.NoRoom` when GCE has no
    room for them there."""
    pool.zone, pool.spot = calls.access.zone, calls.machine_settings.spot
    pool.body = instances.bulk_body(
        calls.access, calls.machine_settings, pool.spec, choice, metadata
    )
    instances.run(calls.clients, calls.access, pool.body, pool.spec.nodes, calls.deadline)
    return _running(calls, pool, pool.spec.nodes, set())


def _slice_in(
    calls: Calls,
    pool: GCPCluster,
    tpu: tpu_types.TpuType,
    runtime_version: str | None,
    metadata: dict[str, str],
) -> list[MachineAddress]:
    """The pool's slice in `calls.access.zone`, READY; `api.NoRoom` when it has no room."""
    pool.zone, pool.spot = calls.access.zone, calls.machine_settings.spot
    body = tpus.node_body(
        calls.access, calls.machine_settings, pool.pool_id, tpu, metadata, runtime_version
    )
    operation = tpus.create(
        calls.clients,
        calls.access,
        pool.pool_id,
        body,
        tpu,
        calls.machine_settings.spot,
        pool.made.add,
    )
    node = _wait(calls, pool, tpus.wait_ready, tpu, operation)
    name = tpus.node_name(pool.pool_id)
    private = calls.machine_settings.use_private_ips
    return [
        MachineAddress(f"{name} worker {i}", tpus.address(e, private), str(e.ip_address), i)
        for i, e in enumerate(tpus.endpoints(node))
    ]


def _too_small(
    calls: Calls,
    pool: GCPCluster,
    choice: machine_types.Choice,
    read: dict[str, dict[str, quotas.Quota] | None],
) -> str | None:
    """Why the region of `calls.access.zone` cannot fit the pool by its quotas (read once per
    launch, into `read`), or None."""
    region = calls.access.region
    if region not in read:
        read[region] = quotas.read(calls.clients, calls.access.project, region)
    found = read[region]
    if found is None:
        logger.info("the quotas of %s could not be read: trying its zones", region)
        return None

    def vcpus() -> int | None:
        try:
            shape = prices.machine_shape(
                calls.clients.machine_types,
                calls.access.project,
                calls.access.zone,
                choice.machine_type,
            )
        except api.ApiError:
            return None
        return shape.cpus

    return quotas.shortfall(found, choice, pool.spec.nodes, calls.machine_settings.spot, vcpus)


def _clear(calls: Calls, pool: GCPCluster) -> None:
    """Remove what a failed attempt made in its zone (VMs a half-done bulkInsert left, the
    slice or queued resource), keeping the pool's firewall rules for the next zone."""
    made = teardown.Made(tpus=set(pool.made.tpus), queued=set(pool.made.queued))
    teardown.remove_pool(
        calls.clients,
        calls.access.project,
        pool.pool_id,
        made,
        timeout=max(1.0, calls.deadline - time.monotonic()),
        poll=calls.poll,
        log=logger.info,
        tpu_zone=calls.access.zone if pool.tpu is not None else None,
        firewalls=False,
    )
    pool.made.instances.clear()
    pool.made.tpus.clear()
    pool.made.queued.clear()


def _market(spot: bool) -> str:
    return "spot" if spot else "on-demand"


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
        calls.machine_settings.idle_timeout,
        calls.machine_settings.user,
        write_login_key(pool.key_path),
    )


def _running(calls: Calls, pool: GCPCluster, count: int, exclude: set[str]) -> list[MachineAddress]:
    """Wait until `count` of the pool's VMs not in `exclude` run; record them; their hosts."""
    found = _wait(calls, pool, instances.wait_running, count, exclude)
    for instance in found:
        pool.made.add(teardown.INSTANCE, str(instance.name), calls.access.zone)
    return [_vm_host(instance, calls.machine_settings.use_private_ips) for instance in found]


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


def _vm_host(instance: Any, private: bool) -> MachineAddress:
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
    return MachineAddress(str(instance.name), address, str(interface.network_i_p))
