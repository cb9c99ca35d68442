"""Removing a pool from Compute Engine: a reconciliation loop that ends with nothing left, or
says what is.

Each round lists the pool's VMs (one aggregated list over every zone, by label) and skyward's
firewall rules (by name), asks GCE to delete every one still there, and repeats until a
successful listing of both shows nothing of the pool. Deletions are not waited for one by one:
the next listing shows what is gone, so a round costs the same for 1 VM or 16 (plus one delete
call per VM, once: the Compute API has no multi-VM delete outside instance groups). A delete
still pending is asked again only after `REDELETE` seconds. Every step is idempotent ("not
found" is success) and one failing call never stops the others. What the client knows it made
(`Made`) is deleted even when a listing fails. Rounds repeat `poll` apart while GCE is only
slow, with jittered exponential backoff (up to 30 s) while calls fail, until `timeout`: then one
`ProvisionError` names what remains and ``skyward down <pool>``. That loop is
`skyward.providers.cloud.reconcile`'s; this module brings the GCE (and TPU) round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from skyward.providers.cloud.reconcile import Log, Step, Words, reconcile
from skyward.providers.gcp import api, resources, tpus

INSTANCE = "instance"
FIREWALL = "firewall rule"
TPU = tpus.TPU
QUEUED = tpus.QUEUED
KINDS = (INSTANCE, FIREWALL, TPU, QUEUED)
REDELETE = 60.0
_WORDS = Words("GCE", "deleting", " --provider gcp")


@dataclass
class Made:
    """What a launch made, or was about to make, by kind (instances: name -> zone)."""

    instances: dict[str, str] = field(default_factory=dict)
    firewalls: set[str] = field(default_factory=set)
    tpus: set[str] = field(default_factory=set)  # TPU node ids
    queued: set[str] = field(default_factory=set)  # queued resource ids

    def add(self, kind: str, name: str, zone: str = "") -> None:
        if kind == INSTANCE:
            self.instances[name] = zone
        elif kind == TPU:
            self.tpus.add(name)
        elif kind == QUEUED:
            self.queued.add(name)
        else:
            self.firewalls.add(name)


@dataclass
class _State:
    instances: dict[str, str]  # what may still exist: name -> zone
    firewalls: set[str]
    tpus: set[str]  # full resource names
    queued: set[str]
    asked: dict[str, float] = field(default_factory=dict)  # "kind name" -> when deleted
    seen: set[str] = field(default_factory=set)


def remove_pool(
    clients: Any,
    project: str,
    pool_id: str,
    made: Made | None = None,
    *,
    timeout: float = 600.0,
    poll: float = 3.0,
    log: Log = lambda line: None,
    tpu_zone: str | None = None,
    firewalls: bool = True,
) -> list[str]:
    """Remove everything of `pool_id` (and everything in `made`); what was found, by kind.
    With `tpu_zone`, the pool's TPU nodes and queued resources there too (when the pool made
    none, a TPU API that is off or forbidden means there are none). ``firewalls=False`` keeps
    the pool's firewall rules: a launch's failed attempt in one zone removes its machines
    only, and the next zone's use the same (global) rules.

    Returns once a successful listing shows nothing of the pool; raises `ProvisionError` naming
    what remains, and ``skyward down <pool_id>``, when `timeout` seconds were not enough.
    """
    made = made or Made()
    where = tpus.parent(project, tpu_zone) if tpu_zone else ""
    state = _State(
        dict(made.instances),
        set(made.firewalls),
        {f"{where}/nodes/{n}" for n in made.tpus},
        {f"{where}/queuedResources/{n}" for n in made.queued},
    )
    tpu = _TpuScope(tpu_zone, strict=bool(made.tpus or made.queued)) if tpu_zone else None

    def one_round(problems: list[str]) -> Step:
        clear = _round(clients, project, pool_id, state, problems, log, firewalls)
        clear = _tpu_round(clients, project, pool_id, tpu, state, problems, log) and clear
        return Step.DONE if clear else Step.WAIT

    reconcile(
        pool_id, one_round, partial(_remaining, state), _WORDS, timeout=timeout, poll=poll, log=log
    )
    return sorted(state.seen)


def _round(
    clients: Any,
    project: str,
    pool_id: str,
    state: _State,
    problems: list[str],
    log: Log,
    firewalls: bool,
) -> bool:
    """List, then delete what may still exist; True when both listings succeeded empty
    (without `firewalls`, the VMs' alone: the rules are neither listed nor deleted)."""
    listed_ok = True
    try:
        found = resources.list_instances(clients, project, pool_id)
        state.instances = resources.names(found)
    except api.ApiError as exc:
        problems.append(f"listing the pool's VMs failed: {api.describe(exc)}")
        listed_ok = False
    if not firewalls:
        state.firewalls = set()
    else:
        try:
            rules = resources.list_firewalls(clients, project, pool_id)
            state.firewalls = {str(rule.name) for rule in rules}
        except api.ApiError as exc:
            problems.append(f"listing firewall rules failed: {api.describe(exc)}")
            listed_ok = False
    state.seen |= {f"{INSTANCE} {name}" for name in state.instances}
    state.seen |= {f"{FIREWALL} {name}" for name in state.firewalls}
    if listed_ok and not state.instances and not state.firewalls:
        return True
    now = time.monotonic()
    for name, zone in sorted(state.instances.items()):
        call = partial(delete_vm, clients, project, zone, name)
        _ask(state, problems, now, f"{INSTANCE} {name}", f"deleting VM {name}", call)
    for name in sorted(state.firewalls):
        call = partial(delete_firewall, clients, project, name)
        _ask(state, problems, now, f"{FIREWALL} {name}", f"deleting firewall rule {name}", call)
    asked = [k for k in state.asked if state.asked[k] == now]
    if asked:
        log(f"teardown of {pool_id}: deleting {', '.join(sorted(asked))}")
    return False


@dataclass(frozen=True)
class _TpuScope:
    zone: str
    strict: bool  # the pool made TPUs: a failing listing is a problem, never "none"


def _tpu_round(
    clients: Any,
    project: str,
    pool_id: str,
    scope: _TpuScope | None,
    state: _State,
    problems: list[str],
    log: Log,
) -> bool:
    """`_round` for TPU nodes and queued resources; True when both listings are empty."""
    if scope is None:
        return True
    try:
        state.tpus = {str(n.name) for n in tpus.list_nodes(clients, project, scope.zone, pool_id)}
        state.queued = {
            str(q.name) for q in tpus.list_queued(clients, project, scope.zone, pool_id)
        }
    except api.ApiError as exc:
        if not scope.strict and isinstance(exc, (gexc.PermissionDenied, gexc.Forbidden)):
            # The TPU API off (or not ours to read) in a pool that made no TPU: none exist.
            log(f"teardown of {pool_id}: TPU API not usable ({api.describe(exc)}): no TPUs")
            return True
        problems.append(f"listing TPU nodes failed: {api.describe(exc)}")
        return False
    state.seen |= {f"TPU {n.rsplit('/', 1)[-1]}" for n in state.tpus}
    state.seen |= {f"queued resource {n.rsplit('/', 1)[-1]}" for n in state.queued}
    if not state.tpus and not state.queued:
        return True
    now = time.monotonic()
    for name in sorted(state.queued):  # force: deletes the node it holds too
        call = partial(tpus.delete_queued, clients, name)
        _ask(state, problems, now, f"{QUEUED} {name}", f"deleting queued resource {name}", call)
    for name in sorted(state.tpus):
        call = partial(tpus.delete_node, clients, name)
        _ask(state, problems, now, f"{TPU} {name}", f"deleting TPU {name}", call)
    return False


def _ask(
    state: _State, problems: list[str], now: float, key: str, what: str, call: Callable[[], None]
) -> None:
    """Ask for one deletion, unless it was asked for less than `REDELETE` seconds ago (a
    deletion still pending is not lost yet)."""
    if key in state.asked and now - state.asked[key] <= REDELETE:
        return
    try:
        call()
    except api.ApiError as exc:
        problems.append(f"{what} failed: {api.describe(exc)}")
        return
    state.asked[key] = now


def delete_vm(clients: Any, project: str, zone: str, name: str) -> None:
    """Ask GCE to delete one VM (not waited for); "not found" is done."""
    request = compute_v1.DeleteInstanceRequest(
        project=project, zone=zone, instance=name, request_id=api.request_id()
    )
    api.ask_delete(clients.instances.delete_unary, request)


def delete_firewall(clients: Any, project: str, name: str) -> None:
    """Ask GCE to delete one firewall rule (not waited for); "not found" is done."""
    request = compute_v1.DeleteFirewallRequest(
        project=project, firewall=name, request_id=api.request_id()
    )
    api.ask_delete(clients.firewalls.delete_unary, request)


def _remaining(state: _State) -> list[str]:
    lines = [f"{INSTANCE} {name} ({zone})" for name, zone in sorted(state.instances.items())]
    lines += [f"{FIREWALL} {name}" for name in sorted(state.firewalls)]
    lines += [f"TPU {name.rsplit('/', 1)[-1]}" for name in sorted(state.tpus)]
    lines += [f"queued resource {name.rsplit('/', 1)[-1]}" for name in sorted(state.queued)]
    return lines
