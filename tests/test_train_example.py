"""examples/train_with_data.py on the Local provider, as the README runs it: a dataset passed
with sky.Data, Orbax checkpoints reported and kept in runs/, a node lost, and the pool
(`restarts=2`, no try/except in the example) replacing it and resuming the training from the
last checkpoint, to the same parameters as a run without the failure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import import_example

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_with_data.py"

pytest.importorskip("orbax.checkpoint")


@pytest.mark.slow
def test_example_trains_loses_a_node_and_resumes(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), str(runs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    steps = [int(s) for s in re.findall(r"^  node 0: step (\d+) loss", out, re.M)]
    assert steps == [10, 20, 30, 40, 50, 60], out  # reports seen live, before and after
    assert "restart 1 of 2 after WorkerError" in out and "replacing node(s) [1]" in out, out
    assert "(node 0) resumed from step 30" in out and "(node 1) resumed from step 30" in out
    final = float(re.search(r"^final loss ([0-9.e+-]+);", out, re.M).group(1))  # type: ignore[union-attr]
    assert final < 1e-6
    saved = sorted(p.name for p in (runs / "node-0" / "checkpoints").iterdir())
    assert saved == [f"step-{s:05d}" for s in (10, 20, 30, 40, 50, 60)]
    # The same parameters as a run that lost nothing: the resumed run restores step 30's w
    # exactly (float32, through Orbax) and takes the same deterministic steps on the same data;
    # the tolerance only allows another summation order in XLA's reductions.
    w = [float(v) for v in re.search(r"; w \[([^\]]+)\];", out).group(1).split(",")]  # type: ignore[union-attr]
    _, unbroken = import_example("train_with_data.py").main(
        runs=str(tmp_path / "unbroken"), lose_node_at=None
    )
    assert max(abs(a - b) for a, b in zip(w, unbroken, strict=True)) < 1e-6, (w, unbroken)
