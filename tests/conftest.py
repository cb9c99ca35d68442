"""Shared test helpers: process liveness checks and a quiet pool factory."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import pytest


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def worker_children() -> list[int]:
    """Pids of skyward agents whose parent is this test process."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"skyward.worker" in cmdline:
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True, scope="module")
def no_leftover_agents() -> Iterable[None]:
    """Every test module must leave no agent of this process running."""
    yield
    left = wait_gone(worker_children(), timeout=10)
    assert not left, f"agent processes left behind: {left}"
