"""A detached run on EC2 (moto, with bare Debian hosts booted from the user data): the run keeps
its instances up past the pool's end and the idle timeout, and their watchdog powers them off
once it ends; the next command that sees the end keeps the logs and removes what the pool made.

What only real EC2 can show: that powering off terminates the instance
(`InstanceInitiatedShutdownBehavior=terminate`); here the fake ``poweroff`` records the call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest

import skyward as sky
from skyward.detached import record
from tests.aws.conftest import Ec2Hosts, Stubs, aws_for, leftovers, new_session
from tests.ssh.conftest import wait_until
from tests.support import bareroots

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

JOB = """\
import os, time
rank = os.environ["JAX_PROCESS_ID"]
for step in range(10):
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.5)
open(os.path.join(os.environ["SKYWARD_OUTPUT_DIR"], "model.txt"), "w").write(rank)
"""


def test_a_detached_run_holds_its_instances_and_they_go_when_it_ends(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim = ec2_hosts()
    # The command that removes the pool later makes its own boto3 session (from the record):
    # it meets the same stand-in as the pool's (moto has no placement groups).
    made = boto3.session.Session.__init__

    def stubbed(self: boto3.session.Session, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        sim.attach(stubs.install(self))

    monkeypatch.setattr(boto3.session.Session, "__init__", stubbed)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    provider = aws_for(sim, stubs, idle_timeout=2)
    out = tmp_path / "out"
    # keep_for: the machines wait 3 s past the run's end for its outputs (a linger process
    # the watchdog counts as a run), then power off as before.
    run = sky.submit(
        str(job), provider=provider, nodes=2, name="on-ec2", output_dir=out, keep_for=3
    )
    addresses = [e["host"] for e in record.load("on-ec2").reach["endpoints"]]
    markers = [sim.host(a).root / bareroots.POWEROFF_MARKER.lstrip("/") for a in addresses]
    # No client is connected and idle_timeout (2 s) passes: the running run holds them.
    assert not wait_until(lambda: any(m.exists() for m in markers), 3)
    # The run ends (five seconds of steps): both power off on their own, with nobody asking.
    assert wait_until(lambda: all(m.exists() for m in markers), 20)
    ec2 = new_session(stubs).client("ec2")
    assert leftovers(ec2) != []  # the security group and key pair wait for a command
    assert run.wait(timeout=30) == 0  # sees the end: keeps the logs, removes the pool
    assert leftovers(ec2) == []
    lines: list[str] = []
    sky.Run("on-ec2").logs(out=lines.append)  # from the copies kept here: the nodes are gone
    for rank in (0, 1):
        assert [line for line in lines if line.startswith(f"(node {rank})")] == [
            f"(node {rank}) rank {rank} step {step}" for step in range(10)
        ]
    assert not Path(record.load("on-ec2").reach["key"]).exists()
    assert [(out / f"node-{i}" / "model.txt").read_text() for i in (0, 1)] == ["0", "1"]


def test_a_local_output_dir_on_a_cloud_needs_keep_for(
    ec2_hosts: Callable[..., Ec2Hosts], stubs: Stubs, tmp_path: Path
) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    provider = aws_for(ec2_hosts(), stubs)
    with pytest.raises(sky.ConfigError, match="give keep_for=SECONDS"):
        sky.submit(str(job), provider=provider, output_dir=tmp_path / "out")
