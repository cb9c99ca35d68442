"""The provider base class: a `ClusterSpec` made into a `Cluster` of nodes, prepared, removed.

A provider is one class over a handful of async verbs (a folder of plain functions behind it for
a cloud). Every capability the pool uses is a method here; the optional ones have defaults:

- `validate(spec)`         checks the request before anything is created or paid for: a
                           `ConfigError` for one it cannot serve; creates nothing;
- `launch(spec, progress)`  creates all `spec.nodes` nodes or raises, leaving nothing behind;
                           reports each node's `Phase.BOOTING` / `Phase.CONNECTING`; returns the
                           `Cluster`: the nodes and everything the provider keeps for this pool;
- `survey(cluster, image, progress)`  what the launched nodes have (`Hardware`: their GPUs,
                           the lowest CUDA their drivers support), with each node's `gpus` set,
                           before any environment is built: the pool fills in its spec with it
                           and runs the plugins' `transform` again if that changed it. `image`
                           is the plan made before launch, for a provider that checks its
                           machines here and reuses that check in `prepare` (default: the
                           nodes' `gpus`, CUDA unknown);
- `prepare(cluster, image, progress)`  builds the image's environment on every node, once per
                           image hash; reports `Phase.BUILDING` and the build's lines
                           (`progress.detail`);
- `terminate(cluster)`     removes every node and everything made for them; idempotent, safe on
                           a partial pool;
- `default_nodes()`        the pool size when the user gives none (default 1; SSH: one per
                           host);
- `nodes_for(acc, asked)`  the pool size (default `asked` or `default_nodes()`); one for an
                           accelerator that fixes it (a TPU slice is one node per host), or
                           `ConfigError` when the asked size disagrees;
- `implied_accelerator()`  what an explicit instance type carries, so plugins see it (AWS);
- `price(spec)`            one node's `Price` per hour, from the cloud's own price APIs
                           (default: free, for machines the user already has);
- `release(cluster)`       lets the client go but leaves the nodes running, for a detached run
                           that holds them (default: `terminate`, for nodes that are not made:
                           processes here, existing hosts, a Slurm allocation);
- `detached_kind()`        how a detached run reaches the nodes (``local``, ``ssh``, ``slurm``,
                           ``tcp``: docs/detach.md), or a `ConfigError` where it cannot hold one
                           (the default); with it, `detached_login(cluster)` (``ssh``: how a
                           later process logs into the hosts, `DetachedLogin`: the key, the
                           ssh_config, the timeout, a `KeptPool` to remove once the run ended),
                           `batch_command(cluster, spec, run, script, output)` (``slurm``: the
                           command that queues the run as one batch job) or
                           `detached_reach(cluster)` and the class's `detached_commands(data)`
                           (``tcp``: what the run's record keeps, `DetachedReach`, never a
                           secret, and the later process's `NodeCommands` on the nodes from it,
                           raising `NodeGone` for a node that will never answer again);
- `teardown_summary(cluster)`  what `terminate` did, for the last line ("removed 4 instances");
- `replace(cluster, index)`  a fresh node in `cluster.nodes[index]`, in place of a lost one
                           (default: not supported);
- `prestart(cluster, index)`  start that replacement ahead, on a preemption notice (default:
                           nothing to start ahead);
- `explain(cluster, node)` why a node went away (`NodeLoss`: a reclaimed spot instance), or
                           None;
- `stage_data(cluster, data, log)`  makes a `sky.Data` available on every node and says where
                           (default: the client's own path: the nodes share this machine);
- `node_output_dir(cluster, node)`  the node's directory for `sky.output_dir()` (default:
                           ``outputs/<pool>/node-<i>`` under the node's cache directory);
- `collect_outputs(cluster, nodes, log)`  brings nodes' output directories to the pool's
                           `output_dir` (a local directory or s3://); incremental.

What a provider can do beyond the abstract verbs it declares in `capabilities` (`Capability`:
replace, prestart, signals, price, list); the pool refuses a feature that needs one it lacks
(`require`: `restarts=` without `REPLACE`, `stall_timeout=` without `SIGNALS`), and a provider
that declares one writes the verbs it needs (`CAPABILITY_VERBS`; `missing_verbs` names those
left to this class's defaults). Outside a pool, the command line asks a provider built from its
flags (its registry entry, `skyward.providers.registry`):

- `find()`                 every pool skyward made that it can see, by pool id (`skyward ls`);
- `cleanup(pool)`          removes one pool's leftovers, or every pool's (`skyward down`);
- `live_pools()`           this user's pools that are alive (`skyward status`), or None when
                           it cannot tell.

`find` and `cleanup` need `Capability.LIST`; `live_pools` by default lists what `find` finds.

Per-pool state lives in the `Cluster` a provider returns from `launch` (subclass it), never on
the provider object: one provider object may serve several pools at once.

A `Node` knows its index, its addresses and how to start the agent on itself.

A worked minimal provider: every node a process of this machine's interpreter, which already
has what the nodes need (a sketch of `Local`, without its environments, GPUs or outputs). The
pool starts the agents (`Node.start_agent`), talks to them over their pipes and stops them;
`tests/test_provider_example.py` runs a pool on exactly this code::

    import os
    import sys

    from skyward.providers.base import Cluster, Node, Provider
    from skyward.transport.pipes import spawn

    class ProcessNode(Node):
        async def start_agent(self, env):
            argv = [sys.executable, "-m", "skyward.worker"]
            return await spawn(argv, {**os.environ, **env}, os.getcwd())

    class Processes(Provider):
        name = "processes"

        async def launch(self, spec, progress):
            nodes = [ProcessNode(i, "127.0.0.1", "127.0.0.1") for i in range(spec.nodes)]
            return Cluster(spec, nodes)

        async def prepare(self, cluster, image, progress):
            pass  # this interpreter is the nodes' environment

        async def terminate(self, cluster):
            pass  # the pool stops the agents; nothing else was made

Registered (`skyward.providers.registry`) it is ``provider = "processes"`` for profiles and
``skyward run``; declaring `capabilities` and their methods adds restarts, ``pool.stacks()``,
prices and ``skyward ls/down``.

`launch` and `prepare` report each node's phase to their `Progress` (`skyward.console.progress`):
booting, connecting, building environment (with the build's output lines as detail); the pool
sets the phases around them (requested, starting agent, ready, stopping). `Progress` is also a
plain `Log`: ``progress("message")`` is a status line.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from skyward import checks
from skyward.console.progress import Progress
from skyward.cost import Price
from skyward.data import Data, Placement
from skyward.errors import ConfigError, SkywardError
from skyward.hardware import Accelerator, ClusterSpec, Hardware
from skyward.image import Image
from skyward.transport.base import AgentStream
from skyward.worker.gpus import Gpu

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
        # The GPUs this node owns, once its provider knows them (Local at launch, a remote
        # host when it is surveyed); `instance_info()` reports them.
        self.gpus: tuple[Gpu, ...] = ()

    @abstractmethod
    async def start_agent(self, env: Mapping[str, str]) -> AgentStream:
        """Start ``python -m skyward.worker`` in the node's prepared environment."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.index} {self.public_addr}>"


@dataclass
class Cluster:
    """What a provider made for one pool: its nodes, in node order. Providers subclass it to
    keep their per-pool state (connections, instance ids, keys) beside the nodes."""

    spec: ClusterSpec
    nodes: list[Node]


class Capability(enum.Enum):
    """What a provider can do beyond launching, preparing and terminating nodes: it declares
    them in `Provider.capabilities`, and the pool asks before it relies on one."""

    REPLACE = "replace a lost node (restarts=, pool.replace)"
    PRESTART = "start a replacement ahead on a preemption notice"
    SIGNALS = "deliver signals to an agent (pool.stacks(), stall_timeout=)"
    PRICE = "price its nodes from a price service"
    LIST = "list and clean up what a pool left (skyward ls/down)"


class FoundPool(Protocol):
    """What `Provider.find` says of one pool: what ``skyward ls`` and ``status`` print."""

    @property
    def pool_id(self) -> str: ...
    @property
    def created_at(self) -> datetime | None: ...
    @property
    def created_by(self) -> str | None: ...

    def describe(self) -> list[str]:
        """What the pool holds, a line each (``instance i-0abc (running)``)."""
        ...


def created(pool: FoundPool) -> str:
    """When `pool` was made, as ``skyward ls`` and ``status`` print it (``?``: unknown)."""
    return pool.created_at.strftime("%Y-%m-%d %H:%M UTC") if pool.created_at else "?"


@dataclass(frozen=True)
class LivePool:
    """One of this user's live pools as ``skyward status`` prints it: a heading (where it is,
    which pool) and the lines under it."""

    heading: str
    lines: tuple[str, ...] = ()

    @classmethod
    def of(cls, where: str, pool: FoundPool, *more: str) -> LivePool:
        """A found pool under `where` (``aws us-east-1``), with `more` lines (its cost)."""
        return cls(f"{where}  {pool.pool_id}  created {created(pool)}", (*pool.describe(), *more))


@dataclass(frozen=True)
class KeptPool:
    """A pool whose machines a detached run holds (`Provider.release`), as a later process
    finds it again to remove it once the run has ended: the class (``module:qualname``: the
    provider's, or one of its folder's) that, made with `arguments`, has
    ``remove_pool(pool_id)``, the arguments that find the pool (its region; its project and
    zone; its kubeconfig, context and namespace) and the pool's id."""

    provider: str
    arguments: Mapping[str, Any]
    pool_id: str


@dataclass(frozen=True)
class DetachedLogin:
    """How a later process logs into a pool's hosts, for a detached run reached over SSH
    (`Provider.detached_login`): the login key file, the ssh_config files read (none: ``[]``),
    the seconds to connect. `pool_key`: the key is the pool's own and goes with it, so the run
    keeps a copy; `kept`: the run holds machines the pool made, removed once it has ended."""

    key: str | None
    config: Sequence[str]
    timeout: float
    pool_key: bool = False
    kept: KeptPool | None = None


@dataclass(frozen=True)
class DetachedReach:
    """How a later process reaches a detached run's nodes through their provider, for a run
    whose `detached_kind` is ``"tcp"`` (`Provider.detached_reach`): `data`, kept in the run's
    owner-only record, is what the provider class's `detached_commands` needs to run commands
    on the nodes again (where they are, as whom: never a secret of the run); `kept`: the run
    holds machines the pool made, removed once it has ended."""

    data: Mapping[str, Any]
    kept: KeptPool | None = None


# What a node's command hands its output to, a piece at a time (awaited before the next).
Sink = Callable[[bytes], Awaitable[None]]


class NodeGone(SkywardError, ConnectionError):
    """A detached run's node that will never answer again (`NodeCommands.run` raises it): its
    pod or machine is gone or has ended, and what the run left there went with it. Unlike a
    node out of reach now, nothing is gained by waiting for it."""


class NodeCommands(Protocol):
    """Shell commands on a detached run's nodes from a later process (`skyward logs`,
    `status`, `fetch`, `stop`), through the provider's own way in (a pod's exec stream): what
    `Provider.detached_commands` returns. Every method runs on the one event loop of its
    caller, which gives up on a node that sends nothing for a while (cancelling `run`)."""

    async def run(self, node: int, command: str, sink: Sink) -> int:
        """Run shell `command` on node `node` with an empty stdin, handing its stdout to `sink`
        as it comes and reading no more until `sink` returns (memory stays bounded however
        much it prints); its exit status. Raises (`OSError`, `SkywardError`) with the reason
        in words where the node cannot be reached, `NodeGone` where it never will be."""
        ...

    async def drop(self, node: int) -> None:
        """Forget node `node`'s connection, after a command on it failed: the next command
        connects afresh."""
        ...

    async def close(self) -> None:
        """Close every connection."""
        ...


class Provider(ABC):
    """What a `ComputePool` needs from a provider; subclass and implement the abstract verbs."""

    name: str = "provider"
    # What it can do beyond the abstract verbs (see `Capability`); none unless declared.
    capabilities: frozenset[Capability] = frozenset()

    def capabilities_for(self, spec: ClusterSpec) -> frozenset[Capability]:
        """What it can do for a pool of `spec`: `capabilities`, less what such a pool's
        machines rule out (GCP: a TPU slice's hosts cannot be replaced one by one)."""
        return self.capabilities

    def require(
        self, capability: Capability, feature: str, spec: ClusterSpec | None = None
    ) -> None:
        """Raise `ConfigError` when `feature` (e.g. ``restarts=2``) needs `capability`, which
        this provider does not declare (for a pool of `spec`, when given): a clear refusal
        rather than a silent no-op."""
        able = self.capabilities if spec is None else self.capabilities_for(spec)
        if capability not in able:
            which = "" if capability in self.capabilities else " for this pool"
            raise ConfigError(
                f"{feature} needs a provider that can {capability.value}; the {self.name} "
                f"provider cannot{which}: leave it out, or use a provider that can"
            )

    # -- what pools left behind, for the command line (Capability.LIST) ---------------------

    def find(self) -> Mapping[str, FoundPool]:
        """Every pool skyward made that this provider can see (in its region, project or
        queue), by pool id, whoever made it: what ``skyward ls`` prints."""
        self.require(Capability.LIST, "skyward ls")
        return {}

    def cleanup(self, pool: str | None = None) -> list[str]:
        """Remove what `pool` left (every pool's with None): the sweep for pools whose client
        died before its teardown (``skyward down``). Returns what was removed, a line each."""
        self.require(Capability.LIST, "skyward down")
        return []

    def live_pools(self) -> list[LivePool] | None:
        """This user's pools that are alive here, for ``skyward status`` (None: this provider
        cannot tell). By default every pool `find` lists."""
        if Capability.LIST not in self.capabilities:
            return None
        return [LivePool.of(self.name, pool) for _, pool in sorted(self.find().items())]

    def default_nodes(self) -> int:
        """How many nodes a pool has when the user does not say."""
        return 1

    def nodes_for(self, accelerator: Accelerator | None, requested: int | None) -> int:
        """The pool size: `requested` (the user's ``nodes=``), else `default_nodes()`. A provider
        whose accelerator fixes the size (GCP: a TPU slice is one node per host) returns that,
        and raises `ConfigError` when `requested` disagrees."""
        return self.default_nodes() if requested is None else requested

    def implied_accelerator(self) -> Accelerator | None:
        """The accelerator the provider's own settings carry (an explicit instance type)."""
        return None

    def validate(self, spec: ClusterSpec) -> None:
        """Raise `ConfigError` if the request cannot be served; creates nothing."""
        return None

    async def price(self, spec: ClusterSpec) -> Price:
        """One node's price per hour for `spec`, asked before launch; `Price.unknown` with the
        reason when the price service cannot say (the pool still starts). Never raises."""
        return Price.free(f"the {self.name} provider runs on machines you already have")

    @abstractmethod
    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        """Create all `spec.nodes` nodes, or raise and leave nothing behind; report each
        node's phases (booting, connecting) to `progress`."""

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        """What the nodes of `cluster` have, once launched and before any environment is built:
        the pool fills in its spec with it (the drivers' CUDA; the GPUs, when none was named)
        and runs the plugins' `transform` again if that changes it. Each node's `gpus` are set
        by the time it returns.

        `image` is the image as planned before launch. A provider that must ask its machines
        may check them for it in the same step and reuse that check in `prepare` when the
        image stays the same. The default reads the nodes' `gpus`, with the CUDA unknown.
        """
        return Hardware.of([node.gpus for node in cluster.nodes], [None] * len(cluster.nodes))

    @abstractmethod
    async def prepare(self, cluster: Cluster, image: Image, progress: Progress) -> None:
        """Build the image's environment on every node of `cluster` (once per image hash);
        report `Phase.BUILDING` and the build's output lines to `progress`."""

    @abstractmethod
    async def terminate(self, cluster: Cluster) -> None:
        """Remove the nodes and what was created for them; idempotent."""

    def detached_kind(self) -> str:
        """How a detached run (``skyward run --detach``, docs/detach.md) reaches this
        provider's nodes: ``"local"`` (processes of this machine, which the leader follows
        itself), ``"ssh"`` (hosts node 0's leader logs into), ``"slurm"`` (a batch job),
        ``"tcp"`` (nodes without sshd: node 0's leader connects to a door the run opens on
        each other node, over the nodes' own network, and a later process reaches them
        through the provider: `detached_reach`, `detached_commands`); a `ConfigError` saying
        why where it cannot hold one (the default)."""
        raise ConfigError(
            f"the {self.name} provider cannot run detached (docs/detach.md lists the providers "
            "that can); run it attached (without --detach)"
        )

    def detached_login(self, cluster: Cluster) -> DetachedLogin:
        """How a later process logs into `cluster`'s hosts, for a detached run its
        `detached_kind` says is reached over SSH: the record of the run keeps it."""
        raise NotImplementedError(
            f"the {self.name} provider's detached runs are reached over SSH (detached_kind), "
            "but it does not say how to log in: it must implement detached_login"
        )

    def batch_command(
        self, cluster: Cluster, spec: ClusterSpec, run: str, script: str, output: str
    ) -> list[str]:
        """The command that queues detached run `run` as one batch job asking what the pool of
        `spec` (made as `cluster`) has, running `script` with its output in `output`, for a
        run its `detached_kind` says is a batch job; a `ConfigError` saying why where this
        machine cannot submit it."""
        raise NotImplementedError(
            f"the {self.name} provider's detached runs are batch jobs (detached_kind), but it "
            "does not say how to queue one: it must implement batch_command"
        )

    def detached_reach(self, cluster: Cluster) -> DetachedReach:
        """What a detached run on `cluster` keeps in its record to reach the nodes later,
        for a run its `detached_kind` says is ``"tcp"`` (see `DetachedReach`)."""
        raise NotImplementedError(
            f"the {self.name} provider's detached runs are reached through the provider "
            "(detached_kind 'tcp'), but it does not say how: it must implement detached_reach"
        )

    @classmethod
    def detached_commands(cls, data: Mapping[str, Any]) -> NodeCommands:
        """Commands on a detached run's nodes from a later process, made from the `data` its
        record kept (`detached_reach`), for a run whose `detached_kind` is ``"tcp"``. A class
        method: the process that follows the run has no provider object, only the record."""
        raise NotImplementedError(
            f"the {cls.name} provider's detached runs are reached through the provider "
            "(detached_kind 'tcp'), but it does not say how: it must implement "
            "detached_commands"
        )

    async def release(self, cluster: Cluster) -> None:
        """Let the client go but leave the nodes running: a detached run holds them, and ends
        them itself (a cloud machine's watchdog). The default is `terminate`: processes of this
        machine, existing hosts and a Slurm allocation are not the run's to keep."""
        await self.terminate(cluster)

    def teardown_summary(self, cluster: Cluster) -> str:
        """What `terminate` did to `cluster`, in words for the pool's last line (the pool adds
        the time): ``removed 4 instances``."""
        return f"removed {count(len(cluster.nodes), 'node')}"

    async def replace(self, cluster: Cluster, index: int) -> Node:
        """Put a fresh node in ``cluster.nodes[index]`` (whose node was lost) and return it;
        the environment is then prepared by `prepare`."""
        raise ConfigError(f"the {self.name} provider cannot replace nodes")

    async def prestart(self, cluster: Cluster, index: int) -> bool:
        """Start making node `index`'s replacement now, ahead of its loss (a preemption notice
        came): the next `replace(cluster, index)` takes it. False when there is nothing to
        start ahead (the default: a process or an existing host is there at once)."""
        return False

    async def explain(self, cluster: Cluster, node: Node) -> NodeLoss | None:
        """Why `node` went away (e.g. a spot preemption), or None when the provider cannot say."""
        return None

    async def stage_data(self, cluster: Cluster, data: Data, log: Log) -> Placement:
        """Make `data` available on every node of `cluster`; where the nodes find it. The
        default serves nodes that share this machine's files: the path itself, no copy."""
        if data.is_s3:
            return ("s3", data.source)
        return ("path", str(data.existing_path()))

    def node_output_dir(self, cluster: Cluster, node: Node) -> str:
        """Node `node`'s directory for `sky.output_dir()`; a relative path is under the node's
        skyward cache directory (``$SKYWARD_CACHE_DIR`` or ~/.cache/skyward)."""
        return output_path(cluster, node.index)

    async def collect_outputs(self, cluster: Cluster, nodes: Sequence[int], log: Log) -> None:
        """Bring the output directories of `nodes` to ``cluster.spec.outputs`` (node i's to
        ``<outputs>/node-<i>``, or uploaded under an s3:// prefix); only what changed."""
        return None


def given_rate(price_per_hour: float | None, owner: str) -> Price:
    """The price of a provider on machines the user already has: free, or the rate the user
    gave (`price_per_hour` of `owner`, e.g. ``sky.SSH``), to count spend and keep a budget."""
    if price_per_hour is None:
        return Price.free(f"{owner} runs on machines you already have")
    rate = checks.dollars(price_per_hour, f"{owner}(price_per_hour=)")
    return Price.given(rate, f"{owner}(price_per_hour=)")


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``1 instance``, ``4 instances``: a number and its noun."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def output_path(cluster: Cluster, index: int) -> str:
    """Node `index`'s output directory relative to its skyward cache directory (the default)."""
    return f"outputs/{cluster.spec.pool_id}/node-{index}"


def local_outputs(cluster: Cluster, index: int) -> Path:
    """Where node `index`'s outputs land on the client (the pool's `output_dir` is local)."""
    assert cluster.spec.outputs and not cluster.spec.outputs.startswith("s3://")
    return Path(cluster.spec.outputs) / f"node-{index}"


# The verbs a provider that declares a capability writes itself: the base class's are refusals
# or no-ops, so a provider declaring `LIST` without `find` would list nothing, silently.
# `SIGNALS` needs none: the agents' streams deliver them.
CAPABILITY_VERBS: Mapping[Capability, tuple[str, ...]] = {
    Capability.REPLACE: ("replace",),
    Capability.PRESTART: ("prestart",),
    Capability.SIGNALS: (),
    Capability.PRICE: ("price",),
    Capability.LIST: ("find", "cleanup"),
}


def missing_verbs(provider: type[Provider]) -> list[str]:
    """The verbs `provider`'s declared capabilities need that it leaves to `Provider`'s
    defaults, as ``CAPABILITY: verb``."""
    return [
        f"{capability.name}: {verb}"
        for capability in sorted(provider.capabilities, key=lambda c: c.name)
        for verb in CAPABILITY_VERBS[capability]
        if getattr(provider, verb) is getattr(Provider, verb)
    ]
