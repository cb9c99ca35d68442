"""How many of skyward's files one `fn(x) @ pool` passes through on a warm Local pool.

A reader follows one call through the code; each file on its way is one more to open. The
count is taken as a profiler sees it: every skyward file in which a Python function is entered
during the call, on the client (the caller's thread, which on Local also reads the replies)
and on the agent (its main thread, which reads, runs and answers the call), together.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

import skyward as sky

MAX_FILES = 9

# The agent's record of the files it entered, kept between calls (a module global of the
# functions' own module: they travel by value, and the agent keeps what they close over).
_entered: set[str] = set()


def _skyward_file(path: str) -> str | None:
    """``skyward/transport/frames.py`` for a file of skyward's (the client's tree, or the
    copy an agent runs from); None for any other."""
    parts = path.replace("\\", "/").split("/")
    if "skyward" not in parts:
        return None
    at = len(parts) - 1 - parts[::-1].index("skyward")
    return "/".join(parts[at:])


def _recorder(into: set[str]) -> Any:
    def record(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            name = _skyward_file(frame.f_code.co_filename)
            if name is not None:
                into.add(name)

    return record


@sky.compute
def recording(start: bool) -> list[str] | None:
    """Start recording what the agent's main thread enters (the thread that serves calls), or
    stop and return what it entered since. One function for both: the agent keeps one copy of
    it, and so one `_entered`."""
    if start:
        _entered.clear()
        # The agent's loop calls the function from within its one running frame, which the
        # profiler never sees entered: its file counts too.
        caller = _skyward_file(sys._getframe(1).f_code.co_filename)
        _entered.update([caller] if caller else [])
        sys.setprofile(_recorder(_entered))
        return None  # a small result, answered as `step`'s are
    sys.setprofile(None)
    return sorted(_entered)


@sky.compute
def step(x: int) -> int:
    return x + 1


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.ComputePool]:
    with sky.ComputePool(nodes=2, stream_output=False) as running:
        yield running


def _client_entered(pool: sky.ComputePool) -> tuple[list[str], list[int]]:
    """The skyward files the caller's thread entered for one `step(1) @ pool`."""
    client: set[str] = set()
    sys.setprofile(_recorder(client))
    try:
        results = step(1) @ pool
    finally:
        sys.setprofile(None)
    return sorted(client), results


def test_one_broadcast_passes_through_at_most_nine_files(pool: sky.ComputePool) -> None:
    # Warm: the functions' bytes, and the slow path they take, go first.
    assert step(0) @ pool == [1, 1]
    recording(False) @ pool
    recording(True) @ pool
    client, results = _client_entered(pool)
    agents = recording(False) @ pool
    assert results == [2, 2]
    agent = {name for files in agents if files is not None for name in files}
    assert "skyward/transport/agentwire.py" in agent  # the recorder saw the agent's loop
    assert {"skyward/calls.py", "skyward/pool.py"} <= set(client)
    files = sorted({*client, *agent})
    assert len(files) <= MAX_FILES, (
        f"one call passes through {len(files)} files: client {client}, agent {sorted(agent)}"
    )


def test_a_pool_without_restarts_leaves_the_recovery_layer_out(pool: sky.ComputePool) -> None:
    assert step(0) @ pool == [1, 1]
    client, _ = _client_entered(pool)
    assert "skyward/client/recovery.py" not in client


def test_a_pool_with_restarts_calls_through_the_recovery_layer() -> None:
    """Where the layer runs, the recorder sees it (so the test above can fail)."""
    with sky.ComputePool(nodes=1, restarts=1, stream_output=False) as restarting:
        assert step(0) @ restarting == [1]
        client, results = _client_entered(restarting)
    assert results == [2]
    assert "skyward/client/recovery.py" in client
