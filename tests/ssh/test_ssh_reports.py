"""`sky.report` over SSH: reports travel on the agent's channel while the call runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import skyward as sky
from tests.ssh.conftest import Server

pytestmark = pytest.mark.ssh


@sky.compute
def report_then_wait(path: str, count: int) -> int:
    node = sky.instance_info().node
    sky.report({"node": node, "phase": "started"}, checkpoint=f"/ckpt/{node}")
    deadline = time.monotonic() + 30
    while not os.path.exists(path):  # the client creates it once both nodes' reports came
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.005)
    for step in range(count):
        sky.report({"node": node, "step": step})
    return count


def test_reports_arrive_over_ssh_while_the_call_runs(local_sshd: Server, tmp_path: Path) -> None:
    go_on = tmp_path / "go-on"
    started: set[int] = set()

    def on_report(report: sky.Report) -> None:
        if report.metrics.get("phase") == "started":
            started.add(report.node)
            if len(started) == 2:
                go_on.touch()

    provider = local_sshd.provider(count=2)
    with sky.ComputePool(provider, stream_output=False, on_report=on_report) as pool:
        assert report_then_wait(str(go_on), 1000) @ pool == [1000, 1000]
        got = list(pool.reports)
    for node in (0, 1):
        mine = [r for r in got if r.node == node]
        assert mine[0].metrics == {"node": node, "phase": "started"}
        assert mine[0].checkpoint == f"/ckpt/{node}"
        assert [r.metrics["step"] for r in mine[1:]] == list(range(1000))
