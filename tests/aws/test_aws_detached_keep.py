"""A detached run on EC2 (moto, bare Debian hosts booted from the user data) whose node cannot
be read when its end is seen: its machines are not removed before its logs and outputs are
kept here, and a later look keeps them and removes the pool."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest

import skyward as sky
from skyward.detached import record
from tests.aws.conftest import Ec2Hosts, Stubs, aws_for, leftovers, new_session
from tests.ssh.conftest import wait_until
from tests.support import bareroots, sshd

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

JOB = """\
import os, time
rank = os.environ["JAX_PROCESS_ID"]
for step in range(6):
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.5)
open(os.path.join(os.environ["SKYWARD_OUTPUT_DIR"], "model.txt"), "w").write(rank)
"""


def _link(host: bareroots.BareHost, state: str) -> None:
    """Node `host`'s network cable, pulled out (``down``) or put back (``up``)."""
    subprocess.run(
        [sshd._ip(), "-n", host.netns, "link", "set", "eth0", state], check=True, timeout=30
    )


def test_a_cloud_run_keeps_its_machines_until_its_logs_and_outputs_are_kept_here(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim = ec2_hosts()
    made = boto3.session.Session.__init__

    def stubbed(self: boto3.session.Session, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        sim.attach(stubs.install(self))

    monkeypatch.setattr(boto3.session.Session, "__init__", stubbed)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "out"
    provider = aws_for(sim, stubs, idle_timeout=2)
    run = sky.submit(str(job), provider=provider, nodes=2, name="kept", output_dir=out, keep_for=3)
    rec = record.load("kept")
    hosts = [sim.host(e["host"]) for e in rec.reach["endpoints"]]
    markers = [host.root / bareroots.POWEROFF_MARKER.lstrip("/") for host in hosts]
    assert wait_until(lambda: all(m.exists() for m in markers), 30)  # the run has ended
    ec2 = new_session(stubs).client("ec2")
    _link(hosts[1], "down")
    try:
        # The end is seen on node 0; node 1's log and outputs cannot be read: nothing goes.
        assert run.wait(timeout=120) == 0
        assert leftovers(ec2) != []
        kept = record.load("kept")
        assert "saved" not in kept.reach and "node 1" in kept.reach["unsaved"]
        status = sky.Run("kept").status()
        assert status.state == "succeeded" and "not kept here yet" in status.note
        assert f"skyward down {kept.reach['cloud']['pool_id']}" in status.note
        assert leftovers(ec2) != []  # that look could not keep them either
    finally:
        _link(hosts[1], "up")
    # A later look reaches every node: it keeps the logs and outputs, then removes the pool.
    status = sky.Run("kept").status()
    assert (status.state, status.note) == ("succeeded", "")
    assert leftovers(ec2) == []
    lines: list[str] = []
    sky.Run("kept").logs(out=lines.append)  # from the copies kept here
    for rank in (0, 1):
        assert [line for line in lines if line.startswith(f"(node {rank})")] == [
            f"(node {rank}) rank {rank} step {step}" for step in range(6)
        ]
    assert [(out / f"node-{i}" / "model.txt").read_text() for i in (0, 1)] == ["0", "1"]
