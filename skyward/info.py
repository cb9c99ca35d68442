"""`InstanceInfo`: what a node knows about itself and its pool, and `instance_info()` to read it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from skyward.errors import NotOnNodeError

ENV_VAR = "SKYWARD_INSTANCE_INFO"

_current: InstanceInfo | None = None


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """The identity of one node in a running pool.

    `head_addr:head_port` is a port that was free on the head node (node 0) at startup, for
    the user's own coordinator; `ports` holds one more free port on the head node for each name
    a plugin asked for (``ports["jax"]`` is where the JAX plugin's coordinator listens), so
    stacked plugins never share one. `peers` are every node's address as the other nodes reach
    it, in node order.
    """

    node: int
    total_nodes: int
    head_addr: str
    head_port: int
    peers: tuple[str, ...]
    pool_id: str
    accelerator: str | None = None
    accelerator_count: int = 0
    provider: str = "local"
    ports: dict[str, int] = field(default_factory=dict)
    devices: tuple[int, ...] = ()  # the GPUs this node owns, numbered as on its machine

    @property
    def is_head(self) -> bool:
        """True on node 0, the node that hosts the coordinator."""
        return self.node == 0

    def to_json(self) -> str:
        """Serialize for the environment of processes started on the node."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> InstanceInfo:
        """Inverse of `to_json`."""
        data = json.loads(text)
        data["peers"] = tuple(data["peers"])
        data["devices"] = tuple(data.get("devices", ()))
        return cls(**data)


def instance_info() -> InstanceInfo:
    """Return this node's `InstanceInfo`; raises `NotOnNodeError` outside a skyward worker.

    Works in the agent and in any process it starts (the info travels in the environment).
    """
    if _current is not None:
        return _current
    text = os.environ.get(ENV_VAR)
    if text:
        return InstanceInfo.from_json(text)
    raise NotOnNodeError(
        "instance_info() is only available on a node of a running ComputePool; "
        "call it inside a @sky.compute function that runs with `@ pool` or `>> pool`."
    )


def set_current(info: InstanceInfo | None) -> None:
    """Install the node's identity in this process and its children (called by the agent)."""
    global _current
    _current = info
    if info is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = info.to_json()
