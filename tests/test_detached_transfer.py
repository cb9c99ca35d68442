"""A detached run's logs and outputs of any size come back in bounded memory, and `skyward
status` lists every run even when one of them cannot be read (Local runs, real processes).

The same over slow SSH links: tests/slowlinks/test_ssh_detached_transfer.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli.main import main
from skyward.detached import record
from tests.conftest import file_sha256

MIB = 1 << 20
SIZE = 128 * MIB  # of outputs, and of log lines, per rank

# Each rank writes SIZE bytes of outputs (1 MiB blocks, each numbered) and prints SIZE bytes of
# numbered lines: cheap to make, and any block or line out of place shows.
BIG = """\
import os, sys
rank, size = int(os.environ["JAX_PROCESS_ID"]), int(sys.argv[1])
out = os.path.join(os.environ["SKYWARD_OUTPUT_DIR"], "sub")
os.makedirs(out)
with open(os.path.join(out, "blocks.bin"), "wb") as f:
    for block in range(size >> 20):
        f.write((f"rank {rank} block {block:08d} ".encode() * 50000)[: 1 << 20])
first = 0
while first * 64 < size:
    lines = range(first, first + 16384)
    sys.stdout.write("".join(f"rank {rank} line {n:010d} {'.' * 40}\\n" for n in lines))
    first += 16384
sys.stdout.flush()
"""
LINES = -(-SIZE // 64 // 16384) * 16384  # each line is 64 bytes, printed 16384 at a time

# `skyward ARGS` in a process of its own, saying its peak memory (KiB) last on stderr: its own
# VmHWM, which starts afresh with the program (ru_maxrss keeps the peak of the process it was
# forked from: a test worker that held gigabytes before).
MEASURED = """\
import sys
from skyward.cli.main import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
print(peak, file=sys.stderr)
sys.exit(code)
"""


def _skyward(args: list[str], stdout: Path) -> int:
    """Run ``skyward ARGS`` with its output into `stdout`; its peak memory in MiB."""
    with open(stdout, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-c", MEASURED, *args],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    return int(done.stderr.split()[-1]) // 1024


@pytest.mark.slow
def test_logs_and_outputs_larger_than_a_look_come_back_whole_in_bounded_memory(
    tmp_path: Path,
) -> None:
    job = tmp_path / "big.py"
    job.write_text(BIG)
    run = sky.submit(str(job), [str(SIZE)], nodes=2, name="big")
    assert run.wait(timeout=240) == 0
    # Logs: every line of both ranks, in order, with a fraction of their size in memory.
    peak = _skyward(["logs", "big"], tmp_path / "logs.txt")
    seen = [0, 0]
    with open(tmp_path / "logs.txt") as lines:
        for text in lines:
            node = int(text[6])
            assert text == f"(node {node}) rank {node} line {seen[node]:010d} {'.' * 40}\n"
            seen[node] += 1
    assert seen == [LINES, LINES]
    assert peak < 100, f"skyward logs peaked at {peak} MiB for {SIZE // MIB} MiB a rank"
    # Outputs: every file of both nodes, byte for byte.
    peak = _skyward(["fetch", "big", "--to", str(tmp_path / "out")], tmp_path / "fetched.txt")
    for node, directory in enumerate(record.load("big").directories):
        source = Path(directory) / "outputs" / "sub" / "blocks.bin"
        fetched = tmp_path / "out" / f"node-{node}" / "sub" / "blocks.bin"
        assert fetched.stat().st_size == SIZE
        assert file_sha256(fetched) == file_sha256(source)
        fetched.unlink()  # the disk this test takes, given back at once
    assert peak < 100, f"skyward fetch peaked at {peak} MiB for {SIZE // MIB} MiB a node"


ESCAPING = """\
import os
os.symlink("/etc/passwd", os.path.join(os.environ["SKYWARD_OUTPUT_DIR"], "passwd"))
"""


def test_an_output_that_would_land_outside_the_target_is_refused_with_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "escaping.py"
    job.write_text(ESCAPING)
    out = tmp_path / "out"
    sky.submit(str(job), [], nodes=1, name="escaping", output_dir=out)
    capsys.readouterr()
    assert main(["logs", "-f", "escaping"]) == 1  # the end brings the outputs: they fail
    said = capsys.readouterr()
    assert "node 0" in said.err and "passwd" in said.err, said.err
    assert "`skyward fetch escaping` tries again" in said.err
    assert "outputs in" not in said.out
    assert main(["fetch", "escaping", "--to", str(tmp_path / "again")]) == 1
    assert "node 0" in capsys.readouterr().err
    assert not (out / "node-0" / "passwd").exists()
    assert not (tmp_path / "again" / "node-0" / "passwd").exists()


def test_status_lists_every_run_and_says_why_one_cannot_be_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Slurm run looked at from a shell without Slurm's commands (no `squeue` on its PATH,
    as on a login node before `module load slurm`): its row says so, the others are listed."""
    job = tmp_path / "quick.py"
    job.write_text("print('done')\n")
    assert sky.submit(str(job), [], nodes=1, name="fine").wait(timeout=60) == 0
    node = tmp_path / "slurm-node-0"
    node.mkdir()
    (node / "run.json").write_text(json.dumps({"state": "running", "started_at": time.time()}))
    record.save(
        record.RunRecord(
            name="on-slurm",
            provider="slurm",
            kind="slurm",
            nodes=1,
            script="job.py",
            args=[],
            created_at=time.time(),
            directories=[str(node)],
            reach={"job_id": "4242"},
        )
    )
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    capsys.readouterr()
    assert main(["status"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert "succeeded" in rows["fine"]
    assert "unreachable (FileNotFoundError" in rows["on-slurm"], rows
