"""How a detached run's leader reaches its followers, per kind of node (the provider says
which: `Provider.detached_kind`), and what the client records to reach the run later.

- ``local``: the nodes are processes on this machine (`sky.Local`): the leader follows every
  rank itself.
- ``slurm``: the run is a batch job (`skyward.detached.batch`): its leader starts each
  follower as an ``srun`` step.
- ``ssh``: the nodes are SSH hosts (`sky.SSH`, and the machines `sky.AWS` and `sky.GCP`
  make, which the run then keeps up: see `holds_nodes`). Node i's agent starts its follower
  (an early one: `skyward.worker.supervisor`); the leader on node 0 reaches it with ``ssh``
  and a key made for this run and node, which node i's authorized_keys lets run that node's
  ``attach`` and nothing else (``restrict,command=...``); node 0 trusts only the host keys the
  client verified. No port is opened: sshd is already there.
- ``tcp``: the nodes have no sshd (`sky.Kubernetes`' pods). Node i's agent starts its early
  follower behind a door, a TCP listener on the nodes' own network (none faces the client)
  that admits only who proves it holds a secret made here for this run and node (node i's spec
  and node 0's plan hold it, never the record); the leader's launcher for node i is ``dial``,
  which connects to node i's private address and relays as ``ssh`` would. The client reaches
  the nodes later through the provider (`Provider.detached_reach`, `detached_commands`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skyward.cachedir import write_private
from skyward.detached import record
from skyward.pool import ComputePool
from skyward.providers.base import KeptPool, Provider

if TYPE_CHECKING:  # asyncssh, which an SSH node needs, is an extra: loaded where one is used
    from skyward.providers.remote.bootstrap import RemoteNode


@dataclass
class LeaderKeys:
    """What node 0's leader proves itself to the other nodes' ranks with, one per rank (by
    global rank) off node 0, made here: an SSH key pair (``ssh``: the node's authorized_keys
    gets the public key, which runs that rank's attach), or a secret both ends hold (``tcp``:
    the rank's door admits who proves it); `private` goes to node 0."""

    kind: str = "local"
    public: dict[int, str] = field(default_factory=dict)
    private: dict[int, str] = field(default_factory=dict)
    per_node: int = 1

    def login_key(self, rank: int) -> str | None:
        """The public key rank `rank`'s node lets run that rank's attach (``ssh``)."""
        return self.public.get(rank) if self.kind == "ssh" else None

    def door_secret(self, rank: int) -> str | None:
        """The secret rank `rank`'s door admits the leader with (``tcp``)."""
        return self.public.get(rank) if self.kind == "tcp" else None

    def known_hosts(self, pool: ComputePool) -> str:
        """node 0's known_hosts: each other node's host key, as the client verified it, under
        the address and port node 0 reaches it at."""
        if not self.public or self.kind != "ssh":
            return ""
        lines = []
        for node, (endpoint, key) in enumerate(_host_keys(pool)):
            if node > 0:
                address = _nodes(pool)[node].private_addr
                lines.append(f"{_host_pattern(address, endpoint.port)} {key}")
        return "\n".join(lines) + "\n"


def leader_keys(kind: str, nodes: int, per_node: int = 1) -> LeaderKeys:
    """The keys for `nodes` nodes of `per_node` ranks each: one per rank off node 0."""
    keys = LeaderKeys(kind, per_node=per_node)
    away = range(per_node, nodes * per_node)
    if kind == "tcp":
        for rank in away:
            keys.public[rank] = keys.private[rank] = secrets.token_hex(32)
    if kind != "ssh":
        return keys
    import asyncssh

    for rank in away:
        key = asyncssh.generate_private_key("ssh-ed25519")
        keys.public[rank] = key.export_public_key("openssh").decode().strip()
        keys.private[rank] = key.export_private_key("openssh").decode()
    return keys


def launchers(kind: str, pool: ComputePool, setups: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The command line node 0's leader starts each rank's follower with (`setups`: each
    rank's, in rank order; node 0's ranks it follows itself). ``{key}`` and ``{known_hosts}``
    are filled in on node 0, where those files are written."""
    per_node = pool.spec.processes_per_node
    here = [list(setup["here"]) for setup in setups[:per_node]]
    if kind == "tcp":  # node 0's dial (its interpreter) to rank r's door, at its private address
        assert pool.cluster is not None, "the pool has started"
        nodes = pool.cluster.nodes
        dial = list(setups[0]["dial"])
        doors = [
            [*dial, nodes[r // per_node].private_addr, str(setups[r]["door"]), "{key}"]
            for r in range(per_node, len(setups))
        ]
        return [*here, *doors]
    if kind != "ssh":  # every node is this machine: the leader follows each rank itself
        return [list(setup["here"]) for setup in setups]
    from skyward.providers.remote.bootstrap import ssh_host

    found = here
    for rank in range(per_node, len(setups)):
        node = rank // per_node
        endpoint = ssh_host(_nodes(pool)[node]).endpoint
        found.append(
            [
                "ssh",
                "-T",
                "-i",
                "{key}",
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "IdentityAgent=none",
                "-o",
                "UserKnownHostsFile={known_hosts}",
                "-o",
                "GlobalKnownHostsFile=/dev/null",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=20",
                # A node that goes silent is lost within ~15 s: the run fails, never hangs.
                "-o",
                "ServerAliveInterval=5",
                "-o",
                "ServerAliveCountMax=3",
                "-F",
                "/dev/null",
                "-p",
                str(endpoint.port),
                "-l",
                str(setups[rank]["user"]),
                _nodes(pool)[node].private_addr,
            ]
        )
    return found


def holds_nodes(pool: ComputePool) -> bool:
    """Whether a run on `pool` keeps its nodes when the pool ends: machines made for the pool
    (a cloud's), whose provider lets them go (`Provider.release`) instead of removing them."""
    return type(pool.provider).release is not Provider.release


def record_data(kind: str, pool: ComputePool, name: str) -> dict[str, Any]:
    """What the client keeps to reach the run's nodes later (the login options, the host keys
    the pool verified: later connections trust those and no other), as the provider says
    (`Provider.detached_login`). A login key that goes with the pool (a cloud pool's) is
    copied beside the run's record, and the record says how to remove what the pool made once
    the run has ended. Where the provider reaches the nodes itself (``tcp``), it says what to
    keep (`Provider.detached_reach`), and the record names its class for a later process."""
    assert pool.cluster is not None, "the pool has started"
    if kind == "tcp":
        told = pool.provider.detached_reach(pool.cluster)
        cls = type(pool.provider)
        data = {"provider": f"{cls.__module__}:{cls.__qualname__}", "data": dict(told.data)}
        if told.kept is not None:
            data["cloud"] = _kept(told.kept)
        return data
    if kind != "ssh":
        return {}
    hosts = _host_keys(pool)
    found: dict[str, Any] = {
        "endpoints": [{"host": e.host, "port": e.port, "user": e.user} for e, _ in hosts],
        "known_hosts": [f"{_host_pattern(e.host, e.port)} {key}" for e, key in hosts],
    }
    login = pool.provider.detached_login(pool.cluster)
    key = login.key
    if login.pool_key and key is not None:
        copy = record.runs_dir() / f"{name}.key"
        write_private(copy, Path(key).read_text())
        key = str(copy)
    found.update(key=key, config=list(login.config), timeout=login.timeout)
    if login.kept is not None:
        found["cloud"] = _kept(login.kept)
    return found


def _kept(kept: KeptPool) -> dict[str, Any]:
    """A pool the run holds as its record keeps it (``cloud``): how to remove it later."""
    return {"provider": kept.provider, "arguments": dict(kept.arguments), "pool_id": kept.pool_id}


def _host_keys(pool: ComputePool) -> list[tuple[Any, str]]:
    """Each node's endpoint and the host key its connection verified (``type base64``)."""
    from skyward.providers.remote.bootstrap import ssh_host

    found = []
    for node in _nodes(pool):
        host = ssh_host(node)
        key = host.conn.get_server_host_key()
        assert key is not None  # a verified connection has one
        found.append((host.endpoint, key.export_public_key("openssh").decode().strip()))
    return found


def _nodes(pool: ComputePool) -> list[RemoteNode]:
    from skyward.providers.remote.bootstrap import remote_nodes

    assert pool.cluster is not None, "the pool has started"
    return remote_nodes(pool.cluster)


def _host_pattern(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"
