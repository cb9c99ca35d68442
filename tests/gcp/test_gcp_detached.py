"""A detached run on Compute Engine (the GCP fake, with bare Debian machines booted from the
startup script): the run keeps its VMs up past the pool's end and the idle timeout, their
watchdog powers them off once it ends, and the next command that sees the end keeps the logs
and removes the VMs and firewall rules.

What only the real cloud can show: that a VM powered off stops billing for its machine type
(GCE stops it; its disk is billed until the VM is deleted, which the command that sees the
run's end does, as `skyward down` would)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import google.auth
import pytest
from google.auth.credentials import AnonymousCredentials

import skyward as sky
from skyward.detached import record
from tests.gcp.conftest import PROJECT, GceHosts, gce_for
from tests.ssh.conftest import wait_until
from tests.support import bareroots

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

JOB = """\
import os, time
rank = os.environ["RANK"]
for step in range(10):
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.5)
"""


def test_a_detached_run_holds_its_vms_and_they_go_when_it_ends(
    gce_hosts: Callable[..., GceHosts], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = gce_hosts()
    assert sim.fake is not None
    # The command that removes the pool later builds its provider from the record, with the
    # standard credentials: here, the fake's.
    monkeypatch.setattr(google.auth, "default", lambda **_: (AnonymousCredentials(), PROJECT))
    job = tmp_path / "job.py"
    job.write_text(JOB)
    run = sky.submit(str(job), provider=gce_for(sim, idle_timeout=2), nodes=2, name="on-gce")
    addresses = [e["host"] for e in record.load("on-gce").reach["endpoints"]]
    markers = [sim.host(a).root / bareroots.POWEROFF_MARKER.lstrip("/") for a in addresses]
    assert not wait_until(lambda: any(m.exists() for m in markers), 3)
    assert wait_until(lambda: all(m.exists() for m in markers), 20)
    assert sim.fake.labelled() != []  # the VMs and rules wait for a command
    assert run.wait(timeout=30) == 0
    assert sim.fake.labelled() == []
    lines: list[str] = []
    sky.Run("on-gce").logs(out=lines.append)
    for rank in (0, 1):
        assert [line for line in lines if line.startswith(f"(node {rank})")] == [
            f"(node {rank}) rank {rank} step {step}" for step in range(10)
        ]
