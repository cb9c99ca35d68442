"""`restarts=` over SSH: the checkpoint a restart resumes from is the newest one any node
reported, even when its report was still on the wire as the lost node's end arrived.

What the stand-in hides: the namespace hosts share this machine's filesystem and Python (see
tests/ssh/conftest.py), and the test uses that: node 1 learns from a marker file that node 0's
report was written. The same restart on bare hosts that share nothing is tested on AWS and GCP
(tests/aws/test_aws_e2e.py, tests/gcp/test_gcp_e2e.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import skyward as sky
from tests.ssh.conftest import Hosts

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

HOLD_SECONDS = 1.5


@sky.compute
def report_then_lose_node_1(marker: str) -> str | None:
    """Node 0 reports checkpoints 1 and 2 and then holds its sshd for HOLD_SECONDS, so the
    report of checkpoint 2 waits in the pipe between the agent and sshd (a slow link); node 1
    dies as soon as that report is written. After the restart: what every node resumes from."""
    resume = sky.resume_from()
    if resume is not None:
        return (Path(resume) / "state").read_text()
    sent = Path(marker + ".sent")
    if sky.instance_info().node == 0:
        for n in (1, 2):
            ckpt = Path(sky.output_dir()) / f"ckpt-{n}"
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / "state").write_text(f"checkpoint {n}")
            if n == 2:
                sshd = _sshd_above(os.getpid())
                # Resumed by a process of its own: this one is killed when node 1 dies.
                subprocess.Popen(
                    ["sh", "-c", f"sleep {HOLD_SECONDS}; kill -CONT {sshd}"],
                    start_new_session=True,
                )
                os.kill(sshd, signal.SIGSTOP)
            sky.report({"n": float(n)}, checkpoint=str(ckpt))
        sent.touch()
        time.sleep(120)  # stopped when node 1 dies
    else:
        deadline = time.monotonic() + 30
        while not sent.exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        os._exit(9)
    return None


def _sshd_above(pid: int) -> int:
    """The sshd process that carries this agent's channel (the nearest sshd ancestor)."""
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name == "sshd" or name.startswith("sshd-"):
            return pid
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    raise RuntimeError("no sshd above this agent")


def test_a_checkpoint_reported_just_before_the_loss_is_the_one_resumed_from(
    netns_hosts: Hosts, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    provider = netns_hosts.provider(2)
    with sky.ComputePool(
        provider, restarts=1, output_dir=tmp_path / "runs", stream_output=False
    ) as pool:
        results = report_then_lose_node_1(str(tmp_path / "m")) @ pool
    assert Path(str(tmp_path / "m") + ".sent").exists(), "node 0 never reported: nothing tested"
    err = capfd.readouterr().err
    assert "restart 1 of 1 after WorkerError" in err, err
    assert results == ["checkpoint 2", "checkpoint 2"], err
