"""`InstanceInfo`: what a node knows about itself and its pool, and `instance_info()` to read it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from skyward.cachedir import cache_root
from skyward.errors import NotOnNodeError

ENV_VAR = "SKYWARD_INSTANCE_INFO"
OUTPUT_ENV_VAR = "SKYWARD_OUTPUT_DIR"

_current: InstanceInfo | None = None

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """The identity of one rank (one agent process) in a running pool, and of its node.

    `node` and `total_nodes` count machines; `rank` (global, node 0's ranks first),
    `local_rank` (its place on its node), `processes_per_node` and `world_size` (every rank of
    every node) count processes, as torchrun's ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
    and ``WORLD_SIZE`` do. With one rank per node (the default but for PyTorch on GPUs) the
    rank is the node.

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
    # The rank's directory for artifacts and checkpoints (see `output_dir()`); a relative path
    # is under the node's skyward cache directory.
    output_dir: str = ""
    # The rank among every rank of the pool, its place on its node, the ranks each node holds
    # and all of them; left out, one rank per node: the rank is the node.
    rank: int = -1
    local_rank: int = 0
    processes_per_node: int = 1
    world_size: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0:  # one rank per node
            object.__setattr__(self, "rank", self.node)
        if self.world_size <= 0:
            object.__setattr__(self, "world_size", self.total_nodes * self.processes_per_node)

    @property
    def is_head(self) -> bool:
        """True on rank 0 (node 0's first rank), the process that hosts the coordinators."""
        return self.rank == 0

    def to_json(self) -> str:
        """Serialize for the environment of processes started on the node."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> InstanceInfo:
        """Inverse of `to_json`."""
        return from_json(cls, text)


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


def output_dir() -> str:
    """This rank's directory for artifacts and checkpoints (also ``$SKYWARD_OUTPUT_DIR``).

    A pool with ``output_dir=`` brings every node's directory back (to ``<output_dir>/node-<i>``,
    each rank's in ``rank-<r>`` under it when a node holds several, or uploads it to
    ``s3://...``) when it ends and on `ComputePool.collect_outputs`; without
    one, what is written here is removed with the pool. Raises `NotOnNodeError` outside a node.
    """
    path = os.environ.get(OUTPUT_ENV_VAR)
    if path:
        return path
    instance_info()  # raises off a node
    raise NotOnNodeError("this node has no output directory (an agent from another version?)")


def set_current(info: InstanceInfo | None) -> None:
    """Install the node's identity in this process and its children (called by the agent), and
    create its output directory."""
    global _current
    _current = info
    if info is None:
        os.environ.pop(ENV_VAR, None)
        os.environ.pop(OUTPUT_ENV_VAR, None)
        return
    os.environ[ENV_VAR] = info.to_json()
    if info.output_dir:
        path = os.path.join(cache_root(), os.path.expanduser(info.output_dir))
        os.makedirs(path, exist_ok=True)
        os.environ[OUTPUT_ENV_VAR] = path


def from_json(make: Callable[..., T], text: str) -> T:
    """A dataclass (`make`) from the JSON of its `asdict`, as nodes pass them on: every JSON
    array is one of its tuples, nested ones too, so each becomes a tuple again; a field the
    JSON lacks (written by an older version) keeps its default."""
    return make(**{key: _tuples(value) for key, value in json.loads(text).items()})


def _tuples(value: object) -> object:
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value
