"""The Slurm provider beside raw Slurm, in the same run, on a real one-machine Slurm cluster.

Run as root: ``python benchmarks/bench_slurm.py [--runs N] [--calls N]``. The cluster is
tests/support/slurmcluster.py (Debian's slurm-wlm, three slurmd in network namespaces on
10.213.34.0/24, apt-installed when missing); the nodes share this machine's filesystem and
Python (``sky.Slurm(python=sys.executable)``), as a cluster with a shared home does.

- start: from entering ``sky.ComputePool(provider=sky.Slurm(...), nodes=3)`` to the first
  result of a broadcast that returns each node's hostname (the allocation, the host check on
  every node, the agents' steps, the handshake), beside ``srun -N3 python -c "print(hostname)"``
  (the allocation, three steps started, three interpreters, the output back), and beside two
  such ``srun -N3`` in a row: the least a pool that checks its hosts before it runs on them
  costs (a check step, then the run). Nothing is built here (the interpreter satisfies the
  image). Target: within 1.5x of the two-step floor (the floor plus the check).
- rtt: the median of ``noop() >> pool`` on one node, beside the median round trip of a line
  echoed by a python3 step started with ``srun --overlap --unbuffered`` in an allocation (its
  stdin and stdout are srun's, as the agent's are). Target: within 1.5x.

A report: no targets enforced, it exits 0 (non-zero only when it cannot run: not root, no
namespaces, no Slurm).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ["SKYWARD_QUIET"] = "1"  # no status lines between the table's

import skyward as sky
from skyward.console.progress import Progress
from skyward.hardware import Hardware
from skyward.image import Image
from skyward.providers.base import Cluster
from tests.support import slurmcluster, sshd
from tests.support.slurmcluster import SlurmCluster

SUBNET = "10.213.34.0/24"  # shared with tests/slurm/test_slurm_gpus.py: clusters take turns
ECHO = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()\n"


@sky.compute
def hostname() -> str:
    import socket

    return socket.gethostname()


@sky.compute
def noop() -> None:
    return None


class TimedSlurm(sky.Slurm):
    """`sky.Slurm` that keeps how long its environment check took (`survey`: the host check
    on every node, which also reads whether they share this machine's cache)."""

    checked = 0.0

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        began = time.perf_counter()
        try:
            return await super().survey(cluster, image, progress)
        finally:
            self.checked = time.perf_counter() - began


def skyward_start() -> tuple[float, float, float, list[float]]:
    """Seconds to the first result, in the environment check, in the pool's end, and `calls`
    round trips."""
    began = time.perf_counter()
    provider = TimedSlurm(python=sys.executable)
    with sky.ComputePool(provider=provider, nodes=3) as pool:
        names = hostname() @ pool
        first = time.perf_counter() - began
        assert sorted(names) == ["node0", "node1", "node2"], names
        for _ in range(50):
            noop() >> pool
        trips = []
        for _ in range(CALLS):
            t = time.perf_counter()
            noop() >> pool
            trips.append(time.perf_counter() - t)
        ending = time.perf_counter()
    return first, provider.checked, time.perf_counter() - ending, trips


def srun_start(cluster: SlurmCluster, steps: int = 1) -> float:
    """Seconds for `steps` ``srun -N3 python`` in a row."""
    began = time.perf_counter()
    for _ in range(steps):
        out = cluster.run(
            ["srun", "-N3", sys.executable, "-c", "import socket; print(socket.gethostname())"],
            check=True,
        ).stdout
        assert sorted(out.split()) == ["node0", "node1", "node2"], out
    return time.perf_counter() - began


def srun_echo(cluster: SlurmCluster) -> list[float]:
    """Round trips of a line through a step's stdio, in an allocation of its own."""
    job = cluster.allocate(["-N1"])
    step = cluster.popen(
        [
            "srun",
            f"--jobid={job}",
            "--overlap",
            "-N1",
            "-n1",
            "--unbuffered",
            "--quiet",
            sys.executable,
            "-u",
            "-c",
            ECHO,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert step.stdin is not None and step.stdout is not None
    try:
        trips = []
        for index in range(50 + CALLS):
            t = time.perf_counter()
            step.stdin.write(b"ping\n")
            step.stdin.flush()
            assert step.stdout.readline() == b"ping\n"
            if index >= 50:
                trips.append(time.perf_counter() - t)
        return trips
    finally:
        step.stdin.close()
        step.wait(30)
        cluster.run(["scancel", str(job)], check=True)


def main() -> None:
    global CALLS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="pool starts of each side")
    parser.add_argument("--calls", type=int, default=1000, help="round trips per side")
    args = parser.parse_args()
    CALLS = args.calls
    reason = sshd.netns_unavailable_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    slurmcluster.ensure_slurm()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)", flush=True)
    with SlurmCluster(3, subnet=SUBNET) as cluster:
        os.environ.update(cluster.env())
        ours: list[float] = []
        floor: list[float] = []
        floor2: list[float] = []
        ends: list[float] = []
        checks: list[float] = []
        trips: list[float] = []
        for run in range(args.runs):  # the sides alternate, each going first in turn
            sides = ["skyward", "srun"] if run % 2 == 0 else ["srun", "skyward"]
            for side in sides:
                if side == "srun":
                    floor.append(srun_start(cluster))
                    floor2.append(srun_start(cluster, steps=2))
                    continue
                first, check, end, calls = skyward_start()
                ours.append(first)
                checks.append(check)
                ends.append(end)
                trips += calls
            print(
                f"run {run + 1}/{args.runs}: skyward {ours[-1]:.2f} s, srun {floor[-1]:.2f} s",
                flush=True,
            )
        echo = srun_echo(cluster)
    start_ratio = statistics.median(ours) / statistics.median(floor2)
    rtt, raw = statistics.median(trips) * 1e6, statistics.median(echo) * 1e6
    print()
    print(f"{'figure':<44} {'skyward':>10} {'floor':>10} {'ratio':>7}  target")
    print(
        f"{'start to first result, 3 nodes (median)':<44} {statistics.median(ours):9.2f}s "
        f"{statistics.median(floor2):9.2f}s {start_ratio:6.2f}x  <= 1.5x of 2 srun -N3"
    )
    one, check = statistics.median(floor), statistics.median(checks)
    print(
        f"{'  the same beside one srun -N3 + its check':<44} {statistics.median(ours):9.2f}s "
        f"{1.5 * one + check:9.2f}s {statistics.median(ours) / (one + check):6.2f}x  "
        f"<= 1.5 x {one:.2f}s + {check:.2f}s (1.5x plus the environment check)"
    )
    print(
        f"{'>> round trip, 1 node (median)':<44} {rtt:8.0f}us {raw:8.0f}us {rtt / raw:6.2f}x"
        "  <= 1.5x"
    )
    print(f"{'pool end (scancel, holder released)':<44} {statistics.median(ends):9.2f}s")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


CALLS = 1000

if __name__ == "__main__":
    main()
