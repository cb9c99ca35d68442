"""Where a pool's nodes are: the `Phase` of each, as providers and the pool report it.

Providers get a `Progress` in `launch` and `prepare` and say what each node is doing
(``progress.phase(i, Phase.CONNECTING, "10.0.0.4")``) and what the current step prints
(``progress.detail(i, line)``: uv's lines while an environment builds). It is also a plain
``Log``: ``progress("message")`` is a status line, so a provider written against the older
``log(str)`` argument still works. A provider that makes or allocates machines says when each
node's is granted (``progress.granted(i, price)``: the instance runs, the allocation started):
the pool pays for it from then, at that price. The pool itself sets the phases around the
provider's: requested, starting agent, ready, stopping; running and lost are what the console
sees of a ready node (a call in flight, a dead agent), not reported events.

This base only logs, on the ``skyward`` logger (phases and messages at INFO, step output at
DEBUG); the pool's `skyward.console.console.Console` shows the same on the terminal.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable

from skyward.cost import Price

logger = logging.getLogger("skyward")


class Phase(enum.Enum):
    """A node's phase, in the order a node goes through them; the value is how it reads."""

    REQUESTED = "requested"
    BOOTING = "booting"
    CONNECTING = "connecting"
    BUILDING = "building environment"
    STARTING = "starting agent"
    READY = "ready"
    RUNNING = "running"
    LOST = "lost"
    STOPPING = "stopping"


class Progress:
    """What providers tell the user while they work; thread-safe (AWS reports from threads).

    `node` is a node index, or None for every node at once (Local builds one environment
    for all of them).
    """

    def __call__(self, message: str) -> None:
        """A status message (a hint, a step of the pool as a whole)."""
        logger.info("%s", message)

    def phase(self, node: int | None, phase: Phase, detail: str = "") -> None:
        """`node` entered `phase`; `detail` says more (an address, an instance id, a step)."""
        logger.info("%s %s%s", _who(node), phase.value, f" ({detail})" if detail else "")

    def detail(self, node: int | None, line: str) -> None:
        """A line of output of the step `node` is in (uv's lines): it replaces the last one."""
        logger.debug("%s: %s", _who(node), line)

    def granted(self, node: int, price: Price | None = None, at: float | None = None) -> None:
        """`node`'s machine is the pool's from `at` (``time.time()``, now by default): the
        cloud's instance runs, Slurm's allocation started. The pool pays for it from then, at
        `price`: what was launched (its market and zone), or the price quoted before launch
        with None. A node its provider never says this of is paid for from the end of its
        `launch` (or `replace`); a machine granted while the node still runs on another is
        its replacement, started ahead."""
        logger.info("%s granted%s", _who(node), f" at {price}" if price is not None else "")

    def log_for(self, node: int | None) -> Callable[[str], None]:
        """A ``Log`` that hands each line to `detail` for `node`: for a step's output."""
        return functools.partial(self.detail, node)


def _who(node: int | None) -> str:
    return "every node" if node is None else f"node {node}"


def clock(seconds: float) -> str:
    """Time in a phase as the region shows it: ``7s``, ``3m05s``, ``2h14m``."""
    whole = int(max(seconds, 0))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
