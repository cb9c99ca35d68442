"""The teardown's reconciliation loop that AWS and GCP share: rounds of listing and removing a
pool's resources until one confirms nothing is left, or `timeout` runs out; then ONE
`ProvisionError` names what remains and the command that retries.

A cloud brings its round (its own listing and removal verbs); this module owns the rhythm:
`poll` apart while the cloud is merely slow, jittered exponential backoff while calls fail, and
straight on when a round only removed things (the next listing confirms it)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from skyward.errors import ProvisionError

Log = Callable[[str], None]
MAX_BACKOFF = 30.0


class Step(Enum):
    """What one round found."""

    DONE = "done"  # successful listings showed nothing of the pool
    WAIT = "wait"  # the cloud is still at work: look again `poll` later
    AGAIN = "again"  # the round only asked for removals: list again at once


@dataclass(frozen=True)
class Words:
    """How a cloud's teardown names itself in the final error."""

    service: str  # "EC2"
    removing: str  # what the service does to the rest: "removing"
    down: str  # the ``skyward down`` arguments after the pool id (" --provider gcp")


def reconcile(
    pool_id: str,
    run_round: Callable[[list[str]], Step],
    remaining: Callable[[], list[str]],
    words: Words,
    *,
    timeout: float,
    poll: float,
    log: Log,
) -> None:
    """Run `run_round` (which appends what failed to the list it is given) until it says `DONE`.
    Raises `ProvisionError` listing `remaining()` once `timeout` seconds were not enough."""
    deadline = time.monotonic() + timeout
    failing_rounds = 0
    while True:
        problems: list[str] = []
        step = run_round(problems)
        if step is Step.DONE:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProvisionError(_remains(pool_id, remaining(), problems, timeout, words))
        failing_rounds = failing_rounds + 1 if problems else 0
        pause = min(left, _delay(poll, failing_rounds) if step is Step.WAIT or problems else 0.0)
        for problem in problems:  # said where the user waits (the console, during a pool's end)
            log(
                f"teardown of {pool_id}: {problem}; trying again in {pause:.0f} s "
                f"(gives up {left:.0f} s from now: teardown_timeout)"
            )
        time.sleep(pause)


def _delay(poll: float, failing_rounds: int) -> float:
    """`poll` while the cloud is only slow; after failures, exponential backoff with full
    jitter."""
    if not failing_rounds:
        return poll
    return random.uniform(poll, max(poll, min(MAX_BACKOFF, poll * 2**failing_rounds)))


def _remains(
    pool_id: str, remaining: list[str], problems: list[str], timeout: float, words: Words
) -> str:
    lines = [f"  {line}" for line in remaining] or [
        f"  (nothing known, but {words.service} could not confirm the pool is gone)"
    ]
    why = [f"  {p}" for p in problems] or [f"  ({words.service} was still {words.removing} them)"]
    return "\n".join(
        [
            f"pool {pool_id} was not fully removed within teardown_timeout={timeout:g} s; "
            "still there (or not confirmed gone):",
            *lines,
            "the last round's failures:",
            *why,
            f"Remove the rest with: skyward down {pool_id}{words.down}",
        ]
    )
