"""A slow link between the client and a node: bytes arriving are word, only silence is silence.

A frame that takes longer than ``heartbeat_timeout`` to cross the link (a large argument or
result over a slow network) must not read as silence on either side: the agent counts every
chunk of its input as word from the client, the client every chunk from the node. The hosts
are network namespaces whose link `sshd.throttle` slows with a ``tbf`` qdisc.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import threading
import time

import pytest

import skyward as sky
from tests.ssh.conftest import Hosts, wait_until
from tests.support import sshd

pytestmark = pytest.mark.ssh


@sky.compute
def digest(data: bytes) -> tuple[int, str]:
    """The argument's length and hash, as the node got it."""
    return len(data), hashlib.sha256(data).hexdigest()


@sky.compute
def random_bytes(n: int) -> tuple[str, bytes]:
    """`n` bytes that do not compress (SSH may compress), with their hash as the node made
    them."""
    data = random.Random(n).randbytes(n)
    return hashlib.sha256(data).hexdigest(), data


@sky.compute
def node_pid() -> int:
    return os.getpid()


@sky.compute
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _pool(hosts: Hosts, heartbeat_timeout: float) -> sky.ComputePool:
    return sky.ComputePool(
        provider=hosts.provider(1),
        nodes=1,
        heartbeat_timeout=heartbeat_timeout,
        stream_output=False,
    )


def test_an_argument_slower_than_the_heartbeat_timeout_arrives_whole(netns_hosts: Hosts) -> None:
    """10 MB at 8 Mbit/s takes about 10 s, past a heartbeat_timeout of 3 s: the agent, which
    reads the frame all that time, hears the client in its bytes and does not stop."""
    data = os.urandom(10_000_000)
    with _pool(netns_hosts, heartbeat_timeout=3.0) as pool:
        digest(b"warm") >> pool  # the function reaches the node before the link slows
        with sshd.throttle(netns_hosts.net[0], 8, from_host=False):
            started = time.monotonic()
            got = digest(data) >> pool
            took = time.monotonic() - started
    print(f"10 MB at 8 Mbit/s to the node: {took:.1f} s")
    assert got == (len(data), hashlib.sha256(data).hexdigest())
    assert took > 3 * 3.0 * 0.7  # the link was slow: the test tests something


def test_a_result_slower_than_the_heartbeat_timeout_comes_back_whole(netns_hosts: Hosts) -> None:
    """10 MB at 8 Mbit/s back from the node, past a heartbeat_timeout of 3 s: the client hears
    the node in the result's bytes, and the agent, whose write takes that long, still hears
    the client's pings."""
    with _pool(netns_hosts, heartbeat_timeout=3.0) as pool:
        random_bytes(10) >> pool
        with sshd.throttle(netns_hosts.net[0], 8, to_host=False):
            started = time.monotonic()
            made, data = random_bytes(10_000_000) >> pool
            took = time.monotonic() - started
        assert random_bytes(10) >> pool  # and the node still serves
    print(f"10 MB at 8 Mbit/s from the node: {took:.1f} s")
    assert (len(data), hashlib.sha256(data).hexdigest()) == (10_000_000, made)
    assert took > 3 * 3.0 * 0.7


def test_an_argument_read_ahead_while_a_call_runs_leaves_the_node_heard(
    netns_hosts: Hosts,
) -> None:
    """While a call runs, the agent's watcher takes what the client sends meanwhile, to hear
    its pings: here the next call's 10 MB at 8 Mbit/s, about 10 s. It keeps sending
    heartbeats as it reads, so the client (heartbeat_timeout 3 s) still hears the node."""
    data = os.urandom(10_000_000)
    with _pool(netns_hosts, heartbeat_timeout=3.0) as pool:
        digest(b"warm") >> pool
        nap(0) >> pool
        with sshd.throttle(netns_hosts.net[0], 8, from_host=False):
            first = pool.submit(nap(14))
            time.sleep(1)  # the call runs: the watcher reads what comes next
            second = pool.submit(digest(data))
            assert first.result() == 14
            assert second.result() == (len(data), hashlib.sha256(data).hexdigest())


def test_an_agent_cut_off_while_it_sends_a_large_result_stops_by_itself(
    netns_hosts: Hosts,
) -> None:
    """The link goes down while the agent writes 50 MB back at 8 Mbit/s: its write blocks for
    good, and no ping reaches it. The client declares the node dead, and the agent, whose
    watcher does not wait behind that write to send a heartbeat, hears the silence and stops
    by itself."""
    host = netns_hosts.net[0]
    timeout = 3.0
    link = ["ip", "link", "set", host.veth]
    try:
        with _pool(netns_hosts, heartbeat_timeout=timeout) as pool:
            pid = node_pid() >> pool
            random_bytes(10) >> pool
            with sshd.throttle(host, 8, to_host=False):
                threading.Timer(2.0, subprocess.run, ([*link, "down"],), {"check": True}).start()
                started = time.monotonic()
                with pytest.raises(sky.WorkerError, match="heartbeat_timeout"):
                    random_bytes(50_000_000) >> pool
                assert wait_until(lambda: not sshd.pid_alive(pid), timeout + 15), "agent runs"
                gone = time.monotonic() - started - 2
                print(f"cut off 2 s into a result: agent gone {gone:.1f} s later")
            subprocess.run([*link, "up"], check=True)  # so the pool's close is quick
    finally:
        subprocess.run([*link, "up"], check=False)


@pytest.mark.slow
def test_a_400_mb_argument_over_a_slow_link_arrives_whole_with_the_default_heartbeat(
    netns_hosts: Hosts,
) -> None:
    """400 MB at 72 Mbit/s takes about 45 s, half as long again as the default
    heartbeat_timeout (30 s), as a large object does over a slow link: it arrives whole."""
    data = os.urandom(400_000_000)
    with _pool(netns_hosts, heartbeat_timeout=30.0) as pool:
        digest(b"warm") >> pool
        with sshd.throttle(netns_hosts.net[0], 72):
            started = time.monotonic()
            got = digest(data) >> pool
            took = time.monotonic() - started
    print(f"400 MB at 72 Mbit/s to the node: {took:.1f} s")
    assert got == (len(data), hashlib.sha256(data).hexdigest())
    assert took > 35  # (what this test is about: longer than the heartbeat_timeout)
