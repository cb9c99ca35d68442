"""A detached run's logs and outputs over slow links: each takes far longer to travel than a
node may stay silent (`reach.PROGRESS_TIMEOUT`, 20 s), and still comes back whole.

Two network-namespace SSH hosts whose links are throttled (`tbf`, tests/support/sshd.py's
`throttle`) once the run has started. The hosts share this machine's filesystem, so what the
nodes wrote is read here to compare; the client reads it over SSH."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from skyward.cli.main import main
from skyward.detached import reach, record
from tests.conftest import file_sha256
from tests.ssh.conftest import Hosts, detached_project
from tests.support import sshd

pytestmark = [pytest.mark.ssh]

MIB = 1 << 20
OUTPUTS = 80 * MIB  # per node
LOG = 64 * MIB  # of lines, per rank
MBIT = 20  # each host's link: 80 MiB take 34 s, 64 MiB 27 s (2.5 MB/s)
WIDTH = 200  # bytes a log line

# Each rank writes OUTPUTS bytes (1 MiB blocks, each numbered) and prints LOG bytes of numbered
# lines: cheap to make, and any block or line out of place shows.
JOB = f"""\
import os, sys
rank = int(os.environ["JAX_PROCESS_ID"])
with open(os.path.join(os.environ["SKYWARD_OUTPUT_DIR"], "blocks.bin"), "wb") as f:
    for block in range({OUTPUTS // MIB}):
        f.write((f"rank {{rank}} block {{block:08d}} ".encode() * 50000)[: 1 << 20])
pad = "." * ({WIDTH} - 24)
for first in range(0, {LOG // WIDTH}, 10000):
    lines = range(first, min(first + 10000, {LOG // WIDTH}))
    sys.stdout.write("".join(f"rank {{rank}} line {{n:010d}} {{pad}}\\n" for n in lines))
sys.stdout.flush()
"""


@pytest.fixture
def project(netns_hosts: Hosts, tmp_path: Path) -> Iterator[Path]:
    """A directory with the job and a profile for two of the hosts."""
    with detached_project(netns_hosts, tmp_path, JOB) as directory:
        yield directory


@pytest.mark.slow
def test_logs_and_outputs_longer_to_travel_than_the_silence_allowed_come_back_whole(
    netns_hosts: Hosts, project: Path
) -> None:
    name = "slow-link"
    assert main(["run", "--detach", "--name", name, "job.py"]) == 0
    with ExitStack() as slow:
        for host in netns_hosts.net.hosts[:2]:
            slow.enter_context(sshd.throttle(host, MBIT))
        begun = time.monotonic()
        with open(project / "logs.txt", "wb") as out:
            followed = subprocess.run(
                [sys.executable, "-m", "skyward.cli", "logs", "-f", name],
                stdout=out,
                stderr=subprocess.PIPE,
                text=True,
                timeout=300,
            )
        assert followed.returncode == 0, followed.stderr
        # (what this test is about: each transfer took longer than a node may stay silent)
        assert time.monotonic() - begun > reach.PROGRESS_TIMEOUT
        begun = time.monotonic()
        fetched = subprocess.run(
            [sys.executable, "-m", "skyward.cli", "fetch", name, "--to", "out"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert fetched.returncode == 0, fetched.stderr
        assert time.monotonic() - begun > reach.PROGRESS_TIMEOUT
    # `logs -f`: every line of both ranks, in order.
    seen = [0, 0]
    pad = "." * (WIDTH - 24)
    with open(project / "logs.txt") as lines:
        for text in lines:
            node = int(text[6])
            assert text == f"(node {node}) rank {node} line {seen[node]:010d} {pad}\n"
            seen[node] += 1
    assert seen == [LOG // WIDTH, LOG // WIDTH]
    # `fetch`: every node's file, byte for byte.
    for node, directory in enumerate(record.load(name).directories):
        source = Path(directory) / "outputs" / "blocks.bin"
        copy = project / "out" / f"node-{node}" / "blocks.bin"
        assert copy.stat().st_size == OUTPUTS
        assert file_sha256(copy) == file_sha256(source)
