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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skyward.detached import record
from skyward.pool import ComputePool
from skyward.providers.base import Provider
from skyward.worker import supervisor

if TYPE_CHECKING:  # asyncssh, which an SSH node needs, is an extra: loaded where one is used
    from skyward.providers.remote.bootstrap import RemoteNode


@dataclass
class LeaderKeys:
    """The keys node 0's leader logs into the other nodes with: one per node, made here."""

    public: dict[int, str] = field(default_factory=dict)
    private: dict[int, str] = field(default_factory=dict)

    def known_hosts(self, pool: ComputePool) -> str:
        """node 0's known_hosts: each other node's host key, as the client verified it, under
        the address and port node 0 reaches it at."""
        if not self.public:
            return ""
        lines = []
        for node, (endpoint, key) in enumerate(_host_keys(pool)):
            if node in self.public:
                address = _nodes(pool)[node].private_addr
                lines.append(f"{_host_pattern(address, endpoint.port)} {key}")
        return "\n".join(lines) + "\n"


def leader_keys(kind: str, nodes: int) -> LeaderKeys:
    keys = LeaderKeys()
    if kind != "ssh":
        return keys
    import asyncssh

    for node in range(1, nodes):
        key = asyncssh.generate_private_key("ssh-ed25519")
        keys.public[node] = key.export_public_key("openssh").decode().strip()
        keys.private[node] = key.export_private_key("openssh").decode()
    return keys


def launchers(kind: str, pool: ComputePool, setups: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The command line node 0's leader starts each rank's follower with. ``{key}`` and
    ``{known_hosts}`` are filled in on node 0, where those files are written."""
    if kind != "ssh":  # every node is this machine: the leader follows each rank itself
        return [list(setup["here"]) for setup in setups]
    from skyward.providers.remote.bootstrap import ssh_host

    found = [list(setups[0]["here"])]
    for node in range(1, len(setups)):
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
                str(setups[node]["user"]),
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
    the run has ended."""
    if kind != "ssh":
        return {}
    hosts = _host_keys(pool)
    found: dict[str, Any] = {
        "endpoints": [{"host": e.host, "port": e.port, "user": e.user} for e, _ in hosts],
        "known_hosts": [f"{_host_pattern(e.host, e.port)} {key}" for e, key in hosts],
    }
    assert pool.cluster is not None, "the pool has started"
    login = pool.provider.detached_login(pool.cluster)
    key = login.key
    if login.pool_key and key is not None:
        copy = record.runs_dir() / f"{name}.key"
        supervisor.write_private(copy, Path(key).read_text())
        key = str(copy)
    found.update(key=key, config=list(login.config), timeout=login.timeout)
    if login.kept is not None:
        found["cloud"] = {
            "provider": login.kept.provider,
            "arguments": dict(login.kept.arguments),
            "pool_id": login.kept.pool_id,
        }
    return found


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
