"""examples/train_with_data.py on two network-namespace SSH hosts: the dataset is synced to the
hosts, the checkpoints are copied back to runs/ as node 0 reports them, a host's agent dies,
the node is replaced and training resumes from the copied checkpoint, synced to both hosts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import import_example
from tests.ssh.conftest import Hosts

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

pytest.importorskip("orbax.checkpoint")


def test_train_lose_a_host_and_resume_on_ssh(
    netns_hosts: Hosts, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    example = import_example("train_with_data.py")
    runs = tmp_path / "runs"
    final, _ = example.main(provider=netns_hosts.provider(2), runs=str(runs))
    captured = capfd.readouterr()
    out = captured.out
    assert final < 1e-6
    assert "restart 1 of 2 after WorkerError" in captured.err, captured.err
    assert "(node 0) resumed from step 30" in out and "(node 1) resumed from step 30" in out
    steps = [int(s) for s in re.findall(r"^  node 0: step (\d+) loss", out, re.M)]
    assert steps == [10, 20, 30, 40, 50, 60], out
    # node 0's checkpoints were brought back from its host (node 1 writes none: Orbax's
    # primary process writes a replicated checkpoint)
    saved = sorted(p.name for p in (runs / "node-0" / "checkpoints").iterdir())
    assert saved == [f"step-{s:05d}" for s in (10, 20, 30, 40, 50, 60)]
    assert (runs / "node-0" / "checkpoints" / "step-00060" / "_CHECKPOINT_METADATA").is_file()
