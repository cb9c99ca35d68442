"""The provider protocol: turn a `ClusterSpec` into nodes, make them runnable, take them away.

A provider is a handful of async verbs, each safe to call again and safe on a partial pool:

- `validate(spec)`  checks the request before anything is created or paid for;
- `launch(spec)`    creates all N nodes or raises, leaving nothing behind;
- `prepare(nodes, image, log)`  builds the image's environment on every node;
- `terminate(nodes)`  removes every node and everything created for them.

A provider may also offer ``async explain(node) -> NodeLoss | None``: why a node whose agent
died went away (a reclaimed spot instance), which the pool then puts in the `WorkerError`; and
``async replace(node) -> Node``: a fresh node with the same index, for `ComputePool.replace`;
``default_nodes``: the pool size when the user gives none (SSH: one per host); and
``implied_accelerator() -> Accelerator | None``: what an explicit instance type carries, so
plugins see it (AWS).

A `Node` knows its index, its addresses and how to start the agent on itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from skyward.cluster import ClusterSpec
from skyward.image import Image
from skyward.transport.base import AgentStream

Log = Callable[[str], None]


@dataclass(frozen=True)
class NodeLoss:
    """What the provider knows of a lost node: the reason in words, and whether it was
    preempted (reclaimed by the cloud) rather than failed."""

    reason: str
    preempted: bool = False


class Node(ABC):
    """One machine (or process slot) of a pool."""

    def __init__(self, index: int, private_addr: str, public_addr: str) -> None:
        self.index = index
        self.private_addr = private_addr  # how the other nodes reach it
        self.public_addr = public_addr  # how the client reaches it

    @abstractmethod
    async def start_agent(self, env: Mapping[str, str]) -> AgentStream:
        """Start ``python -m skyward.worker`` in the node's prepared environment."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.index} {self.public_addr}>"


class Provider(Protocol):
    """What a `ComputePool` needs from a provider."""

    name: str

    def validate(self, spec: ClusterSpec) -> None:
        """Raise `ConfigError` if the request cannot be served; creates nothing."""
        ...

    async def launch(self, spec: ClusterSpec) -> list[Node]:
        """Create all `spec.nodes` nodes, or raise and leave nothing behind."""
        ...

    async def prepare(self, nodes: list[Node], image: Image, log: Log) -> None:
        """Build the image's environment on every node (once per image hash)."""
        ...

    async def terminate(self, nodes: list[Node]) -> None:
        """Remove the nodes and what was created for them; idempotent."""
        ...
