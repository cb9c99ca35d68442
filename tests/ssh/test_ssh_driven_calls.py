"""SSH calls whose callers run the pool's event loop themselves while they wait
(`loop.LoopThread.drive`): many callers at once, output, futures, and signals mid-call."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

import skyward as sky
from tests.conftest import reported_pids, sigint_default
from tests.ssh.conftest import Server, wait_until
from tests.support import sshd

pytestmark = pytest.mark.ssh


@sky.compute
def echo(value: int) -> int:
    return value


@sky.compute
def chatty(value: int) -> int:
    print(f"line {value}", flush=True)
    return value


def test_many_callers_futures_and_broadcasts_at_once(local_sshd: Server) -> None:
    with sky.ComputePool(
        provider=local_sshd.provider(count=2), nodes=2, stream_output=False
    ) as pool:
        errors: list[BaseException] = []

        def caller(base: int) -> None:
            try:
                for i in range(40):
                    assert echo(base + i) >> pool == base + i
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(1000 * k,)) for k in range(6)]
        for thread in threads:
            thread.start()
        futures: list[Future[int]] = [pool.submit(echo(i)) for i in range(20)]
        for i in range(10):
            assert echo(i) @ pool == [i, i]
            assert sky.gather(echo(i), echo(i + 1), echo(i + 2)) >> pool == (i, i + 1, i + 2)
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads)
        assert not errors
        assert [f.result(10) for f in futures] == list(range(20))
        # a future nobody waits on in `drive` still resolves once the callers are gone
        late = pool.submit(echo(7))
        assert late.result(10) == 7
        assert chatty(3) >> pool == 3
        assert any(line.endswith("line 3") for line in pool.logs())
    assert not [t.name for t in threading.enumerate() if t.name.startswith("skyward-pool")]


CLIENT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    import skyward as sky

    config = json.loads(sys.argv[1])

    @sky.compute
    def hang():
        child = subprocess.Popen(["sleep", "300"])
        print("PIDS", os.getpid(), child.pid, flush=True)
        while True:  # output keeps the caller's run of the loop busy in asyncssh's code
            print("x" * 200, flush=True)
            time.sleep(0.001)

    provider = sky.SSH([config["host"]] * 2, key=config["key"], known_hosts=config["known"],
                       python=sys.executable)
    with sky.ComputePool(provider=provider, nodes=2) as pool:
        if config["how"] == "one":
            hang() >> pool
        else:
            hang() @ pool
    """
)


@pytest.mark.parametrize(
    ("how", "sig"),
    [("one", signal.SIGINT), ("all", signal.SIGINT), ("one", signal.SIGTERM)],
)
def test_a_signal_mid_call_unwinds_the_pool_and_leaves_nothing(
    local_sshd: Server, how: str, sig: signal.Signals
) -> None:
    config = json.dumps(
        {
            "host": local_sshd.host(),
            "key": str(local_sshd.key.private_path),
            "known": str(local_sshd.known_hosts),
            "how": how,
        }
    )
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, config],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).parents[2],
        preexec_fn=sigint_default,
    )
    assert client.stdout is not None
    expected = 2 if how == "one" else 4
    pids: list[int] = []
    try:
        pids = reported_pids(client.stdout, expected)
        assert len(pids) == expected, f"the nodes never reported their pids: {pids}"
        time.sleep(0.3)  # the output flows: the caller is deep in the loop's callbacks
        client.send_signal(sig)
        out, _ = client.communicate(timeout=30)
    finally:
        client.kill()
    assert client.returncode != 0
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in out
    # the pool removed its nodes itself, over its connection (not left to the agents)
    assert re.search(r"closed \d+ connection", out), out[-2000:]
    assert wait_until(lambda: not any(sshd.pid_alive(p) for p in pids), 10), "left running"
