"""A lost node's replacement, one path for every provider that makes its nodes one at a time
(the clouds make a machine, Slurm a one-node allocation), whatever carries the agents (an SSH
channel, an ``srun`` step).

`ReplacingProvider.replace`: where the provider says the lost node's own machine can serve
again (`reuse`: a Slurm node still in its job gets a new step), it does; otherwise the lost
node's connection closes, the replacement started ahead on a preemption notice (`prestart`) is
taken if there is one, the lost machine is let go before another is made (it may hold the
quota or the capacity its replacement needs), and the node made takes its place. A subclass
says how to make one node (`make_node`), how to let a lost one go (`retire_node`), and which
nodes cannot be replaced on their own (`check_replaceable`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from skyward.console.progress import Progress
from skyward.errors import ConfigError, ProvisionError
from skyward.providers.base import Cluster, Node, Provider
from skyward.providers.remote.bootstrap import RemoteNode


@dataclass(frozen=True)
class Made:
    """A node made for a pool, and the machine it is on as its provider names it (an instance's
    id, a VM's name; "" where the node has no machine of its own)."""

    node: Node
    machine: str = ""


@dataclass(kw_only=True)
class ReplacingCluster(Cluster):
    """A pool whose nodes its provider can make again: the replacements started ahead, and
    where the provider says what it does (the pool's console, once launched)."""

    # node index -> the replacement being made and reached, not yet in `nodes`
    spares: dict[int, asyncio.Future[Made]] = field(default_factory=dict)
    spares_closed: bool = False  # the teardown began: no replacement starts ahead any more
    tell: Progress = field(default_factory=Progress)


class ReplacingProvider(Provider):
    """`replace` and `prestart` for a provider that makes nodes one at a time (see the
    module's docstring); its pools are `ReplacingCluster`s."""

    def check_replaceable(self, pool: ReplacingCluster, index: int) -> None:
        """Raise `ConfigError` when node `index` cannot be replaced on its own."""
        return None

    async def reuse(self, pool: ReplacingCluster, index: int) -> Node | None:
        """Node `index` again on its own machine, where that machine can still serve (its
        agent died, not the machine); None: make another."""
        return None

    async def make_node(self, pool: ReplacingCluster, index: int) -> Made:
        """Make one node as the pool's were, for node `index`, and reach it."""
        raise ConfigError(f"the {self.name} provider cannot replace nodes")

    async def retire_node(self, pool: ReplacingCluster, index: int) -> None:
        """Let node `index`'s lost machine go (it may be hung rather than gone); a failure is
        only logged: the teardown removes it in the end."""
        return None

    def place(self, pool: ReplacingCluster, index: int, made: Made) -> None:
        """Put `made` in node `index`'s place."""
        pool.nodes[index] = made.node

    async def replace(self, cluster: Cluster, index: int) -> Node:
        pool = self.replacing(cluster)
        self.check_replaceable(pool, index)
        again = await self.reuse(pool, index)
        if again is not None:
            pool.nodes[index] = again
            return again
        lost = pool.nodes[index]
        if isinstance(lost, RemoteNode):
            await lost.host.close()
        spare = pool.spares.pop(index, None)
        retiring = asyncio.ensure_future(self.retire_node(pool, index))
        made: Made | None = None
        if spare is not None:
            try:
                made = await spare
            except ProvisionError as exc:  # made now instead, as if none had been started
                pool.tell(f"node {index}'s replacement started ahead failed ({exc}); again")
        # Shielded: a cancelled replace still lets the lost machine go.
        await asyncio.shield(retiring)
        if made is None:
            made = await self.make_node(pool, index)
        self.place(pool, index, made)
        return made.node

    async def prestart(self, cluster: Cluster, index: int) -> bool:
        pool = self.replacing(cluster)
        if index in pool.spares or pool.spares_closed:
            return False
        try:
            self.check_replaceable(pool, index)
        except ConfigError:
            return False
        pool.spares[index] = asyncio.ensure_future(self.make_node(pool, index))
        return True

    def replacing(self, cluster: Cluster) -> ReplacingCluster:
        if not isinstance(cluster, ReplacingCluster):
            raise TypeError(f"{cluster!r} is not a pool of the {self.name} provider")
        return cluster


async def drop_spares(pool: ReplacingCluster) -> None:
    """The teardown's part: replacements started ahead and never used stop being made, and
    what connected is closed (what they hold at their provider is the pool's: its teardown
    removes it with the rest); none starts after this."""
    pool.spares_closed = True
    spares, pool.spares = list(pool.spares.values()), {}
    for spare in spares:
        spare.cancel()
    for outcome in await asyncio.gather(*spares, return_exceptions=True):
        if isinstance(outcome, Made) and isinstance(outcome.node, RemoteNode):
            await outcome.node.host.close()
