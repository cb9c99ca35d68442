"""Restarts: a broadcast that failed because a node died, was preempted or stalled (or raised
one of the exception types the user names) is run again, up to `restarts` times, with backoff.

The pool brings the restart itself (`ComputePool._restart`: the lost nodes replaced, every
agent started again with the newest reported checkpoint to resume from); this module owns the
rule for what is retried, the count, the pause, and the error once the budget is spent, which
lists every failure with its node and time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from skyward.errors import WorkerError

T = TypeVar("T")
MAX_BACKOFF = 30.0


@dataclass(frozen=True)
class Policy:
    """What `ComputePool(restarts=, restart_on=)` asked for."""

    restarts: int = 0
    restart_on: tuple[type[BaseException], ...] = ()

    def allows(self, error: BaseException) -> bool:
        """A node lost (died, preempted, stalled, stopped with the others), or an exception of
        a type the user named: not a user error, which a restart would only repeat."""
        return isinstance(error, (WorkerError, *self.restart_on))


@dataclass(frozen=True)
class Failure:
    """One failed attempt."""

    when: float
    error: BaseException

    def line(self) -> str:
        node = getattr(self.error, "node", None)
        where = f"node {node}" if node is not None else "the call"
        first = (str(self.error).splitlines() or [""])[0]
        at = datetime.fromtimestamp(self.when).strftime("%H:%M:%S")
        return f"{at} {where}: {type(self.error).__name__}: {first}"


def backoff(restart: int) -> float:
    """The pause before restart number `restart`: none before the first (a lost node is the
    common case, and its replacement's start is pause enough), then 1, 2, 4 s... up to 30."""
    if restart <= 1:
        return 0.0
    return float(min(MAX_BACKOFF, 2 ** (restart - 2)))


def with_restarts(
    attempt: Callable[[], T],
    policy: Policy,
    restart: Callable[[BaseException, int], None],
    pause: Callable[[int], float] = backoff,
) -> T:
    """`attempt()`; when it fails in a way `policy` allows and restarts are left, `restart(error,
    n)` and again. The last error carries a note listing every failure."""
    failures: list[Failure] = []
    while True:
        try:
            return attempt()
        except Exception as error:
            failures.append(Failure(time.time(), error))
            if not policy.allows(error) or len(failures) > policy.restarts:
                if len(failures) > 1:
                    error.add_note(
                        f"the call failed {len(failures)} times (restarts={policy.restarts}):\n"
                        + "\n".join(f"  {f.line()}" for f in failures)
                    )
                raise
            time.sleep(pause(len(failures)))
            restart(error, len(failures))
