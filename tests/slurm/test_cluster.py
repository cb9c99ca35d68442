"""Prove that tests/support/slurmcluster.py gives a real, working, self-cleaning Slurm cluster.

Most tests share the session's cluster (`slurm_cluster`, 10.213.31.0/24) and cancel every job
they start; the ones that kill nodes, break start-up or check teardown build their own small
cluster on 10.213.32.0/24.
"""

from __future__ import annotations

import functools
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.support import sshd
from tests.support.slurmcluster import SlurmCluster

pytestmark = pytest.mark.skipif(not sshd.is_root(), reason="a Slurm cluster needs root")

OWN_SUBNET = "10.213.32.0/24"
"""Clusters of single tests: apart from the session's (10.213.31.0/24) and from the default
10.213.30.0/24 that the Slurm provider's tests use."""

ECHO = """\
import socket, sys
for line in sys.stdin:
    print(socket.gethostname(), line.strip().upper(), flush=True)
"""

ON_USR1 = """\
import signal, time
got = []
signal.signal(signal.SIGUSR1, lambda sig, frame: got.append(sig))
print("ready", flush=True)
while not got:
    time.sleep(0.05)
print("got", got[0], flush=True)
"""

SLEEPER = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"


def _wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


class Lines:
    """The lines a process writes to a pipe, read by a thread so a test can wait with a
    timeout (a bare readline() would hang the test when the step never answers)."""

    def __init__(self, stream: IO[str]) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, timeout: float = 20.0) -> str | None:
        """The next line; None at end of stream. Raises ``queue.Empty`` on timeout."""
        return self._queue.get(timeout=timeout)


@pytest.fixture
def allocation(slurm_cluster: SlurmCluster) -> Iterator[Callable[..., int]]:
    """Make allocations with ``salloc --no-shell``; every one is cancelled afterwards."""
    jobs: list[int] = []

    def allocate(*args: str) -> int:
        job = slurm_cluster.allocate(args)
        jobs.append(job)
        return job

    yield allocate
    for job in jobs:
        slurm_cluster.run(["scancel", str(job)])
    for job in jobs:
        assert _wait_for(functools.partial(_ended, slurm_cluster, job), 20)


def _ended(cluster: SlurmCluster, job: int) -> bool:
    return cluster.job_state(job) in ("", "CANCELLED")


def _step(
    cluster: SlurmCluster, job: int, node: str, code: str
) -> tuple[subprocess.Popen[str], Lines]:
    """Start ``python -c code`` as a step of ``job`` on ``node``, its stdin and stdout piped."""
    proc = cluster.popen(
        ["srun", f"--jobid={job}", "--overlap", "-N1", "-n1", "-w", node,
         sys.executable, "-u", "-c", code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        bufsize=1,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, Lines(proc.stdout)


def _job_nodes(cluster: SlurmCluster, job: int) -> list[str]:
    nodelist = cluster.run(["squeue", "-h", "-j", str(job), "-o", "%N"], check=True).stdout
    out = cluster.run(["scontrol", "show", "hostnames", nodelist.strip()], check=True).stdout
    return out.split()


# --------------------------------------------------------------------------- jobs and steps


def test_srun_runs_on_three_distinct_nodes(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.run(["srun", "-N3", "hostname"], check=True)
    names = proc.stdout.split()
    assert sorted(names) == slurm_cluster.node_names == ["node0", "node1", "node2"]


def test_each_node_has_its_own_network(slurm_cluster: SlurmCluster) -> None:
    # Each task sees only its node's address and the bridge's: no route off the machine.
    code = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    proc = slurm_cluster.run(
        ["srun", "-N3", "--ntasks-per-node=1", "-l", sys.executable, "-c", code], check=True
    )
    addresses = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert sorted(addresses.values()) == sorted(n.address for n in slurm_cluster.nodes)
    routes = slurm_cluster.run(["srun", "-N1", "-w", "node0", "ip", "route"], check=True)
    assert "default" not in routes.stdout
    assert slurm_cluster.subnet in routes.stdout


def test_allocation_accepts_steps_with_working_pipes(
    slurm_cluster: SlurmCluster, allocation: Callable[..., int]
) -> None:
    job = allocation("-N2")
    nodes = _job_nodes(slurm_cluster, job)
    assert len(nodes) == 2
    for node in nodes:
        proc, lines = _step(slurm_cluster, job, node, ECHO)
        assert proc.stdin is not None
        try:
            # Two round trips: the step answers each line while its stdin is still open.
            proc.stdin.write("hello\n")
            proc.stdin.flush()
            assert lines.next() == f"{node} HELLO"
            proc.stdin.write("again\n")
            proc.stdin.flush()
            assert lines.next() == f"{node} AGAIN"
            proc.stdin.close()
            assert lines.next() is None
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert slurm_cluster.job_state(job) == "RUNNING"


def test_scancel_ends_the_steps_of_an_allocation(
    slurm_cluster: SlurmCluster, allocation: Callable[..., int]
) -> None:
    job = allocation("-N1")
    (node,) = _job_nodes(slurm_cluster, job)
    proc, lines = _step(slurm_cluster, job, node, SLEEPER)
    try:
        first = lines.next()
        assert first is not None
        pid = int(first)
        assert sshd.pid_alive(pid)
        assert pid in slurm_cluster.node(node).pids()  # the task runs in the node's namespace
        started = time.monotonic()
        slurm_cluster.run(["scancel", str(job)], check=True)
        assert proc.wait(timeout=30) != 0
        assert _wait_for(lambda: not sshd.pid_alive(pid), 10), f"task {pid} survived scancel"
        print(f"scancel ended the step in {time.monotonic() - started:.1f}s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _wait_for(lambda: slurm_cluster.job_state(job) == "CANCELLED", 10)
    # Only slurmd is left on the node once its slurmstepd is done.
    node_ = slurm_cluster.node(node)
    assert _wait_for(lambda: node_.pids() == [node_.pid], 15), node_.pids()


def test_scancel_signal_reaches_a_step(
    slurm_cluster: SlurmCluster, allocation: Callable[..., int]
) -> None:
    job = allocation("-N1")
    (node,) = _job_nodes(slurm_cluster, job)
    proc, lines = _step(slurm_cluster, job, node, ON_USR1)
    try:
        assert lines.next() == "ready"
        slurm_cluster.run(["scancel", "--signal=USR1", str(job)], check=True)
        assert lines.next() == "got 10"
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert slurm_cluster.job_state(job) == "RUNNING"  # a signal is not a cancellation


def test_scancel_signal_reaches_a_batch_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"  # the nodes share this machine's filesystem
    script = 'trap "echo got USR1; exit 0" USR1; echo ready; while :; do sleep 0.1; done'
    job = slurm_cluster.submit(["-N1", "-o", str(out), "--wrap", script])
    try:
        assert _wait_for(lambda: out.exists() and "ready" in out.read_text(), 20)
        slurm_cluster.run(["scancel", "--batch", "--signal=USR1", str(job)], check=True)
        assert _wait_for(lambda: "got USR1" in out.read_text(), 20), out.read_text()
        assert _wait_for(lambda: slurm_cluster.job_state(job) == "COMPLETED", 20)
    finally:
        slurm_cluster.run(["scancel", str(job)])


# --------------------------------------------------------------------------- refusals


def test_account_the_partition_refuses_is_rejected_at_submission(
    slurm_cluster: SlurmCluster,
) -> None:
    name = "refused-account"
    proc = slurm_cluster.run(
        ["sbatch", "-p", "restricted", "-A", "other", "-J", name, "--wrap", "true"], timeout=20
    )
    assert proc.returncode != 0
    assert "account" in proc.stderr.lower(), proc.stderr
    queued = slurm_cluster.run(["squeue", "-h", "-n", name], check=True).stdout
    assert queued.strip() == ""  # refused, not left pending
    # The same account runs on a partition that allows every account: the refusal was the
    # partition's. (Without an accounting database AllowAccounts refuses every account, the
    # allowed ones too: slurmctld finds no association; see slurmcluster's module note.)
    job = slurm_cluster.submit(["-p", "debug", "-A", "other", "--wrap", "true"])
    assert _wait_for(lambda: slurm_cluster.job_state(job) == "COMPLETED", 20)


def test_time_over_the_partition_limit_is_rejected_at_submission(
    slurm_cluster: SlurmCluster,
) -> None:
    proc = slurm_cluster.run(["sbatch", "-p", "short", "-t", "20", "--wrap", "true"], timeout=20)
    assert proc.returncode != 0
    assert "time limit" in proc.stderr.lower(), proc.stderr
    job = slurm_cluster.submit(["-p", "short", "-t", "5", "--wrap", "true"])
    assert _wait_for(lambda: slurm_cluster.job_state(job) == "COMPLETED", 20)


def test_gres_within_the_nodes_is_granted(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.run(
        ["srun", "-N1", "--gres=gpu:a100:2", "sh", "-c", "echo $SLURM_GPUS_ON_NODE"], check=True
    )
    assert proc.stdout.strip() == "2"
    whole = slurm_cluster.run(["srun", "-N3", "--gres=gpu:4", "hostname"], check=True)
    assert len(whole.stdout.split()) == 3


@pytest.mark.parametrize("gres", ["gpu:a100:5", "gpu:h100:1"])
def test_gres_beyond_the_nodes_is_refused(slurm_cluster: SlurmCluster, gres: str) -> None:
    for command in (["srun", "-N1", f"--gres={gres}", "true"], ["sbatch", f"--gres={gres}",
                                                                 "--wrap", "true"]):  # fmt: skip
        started = time.monotonic()
        proc = slurm_cluster.run(command, timeout=30)
        assert proc.returncode != 0
        assert "requested node configuration is not available" in proc.stderr.lower(), proc
        assert time.monotonic() - started < 10


# --------------------------------------------------------------------------- lifecycle


def test_close_leaves_nothing_behind(slurm_ready: None) -> None:
    started = time.monotonic()
    cluster = SlurmCluster(2, subnet=OWN_SUBNET, gres="gpu:1").start()
    print(f"2-node cluster ready in {time.monotonic() - started:.1f}s")
    procs: dict[int, int] = {}
    try:
        assert time.monotonic() - started < 15
        workdir = cluster.workdir
        assert workdir is not None and workdir.is_dir()
        job = cluster.submit(["-N2", "--wrap", "srun sleep 600"])
        assert _wait_for(lambda: cluster.job_state(job) == "RUNNING", 20)
        assert _wait_for(lambda: len(cluster.processes()) >= 9, 20)  # the steps are running
        procs = cluster.processes()
        lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in procs]
        assert any(b"slurmstepd" in line for line in lines)
        assert any(b"sleep" in line for line in lines)
    finally:
        started = time.monotonic()
        cluster.close()  # raises when anything is left
        print(f"closed in {time.monotonic() - started:.1f}s")
    assert cluster.leftovers() == []
    assert not any(sshd.pid_alive(pid) for pid in procs)
    assert not workdir.exists()
    assert not set(cluster.net.netns_names) & set(sshd._netns_names())


def test_failed_start_says_why_and_leaves_nothing(slurm_ready: None) -> None:
    cluster = SlurmCluster(1, subnet=OWN_SUBNET, extra_config=["NoSuchOption=1"])
    with pytest.raises(RuntimeError) as failure:
        cluster.start()
    message = str(failure.value)
    # Either start() saw slurmctld die at once, or wait_ready() saw it gone a moment later.
    assert re.search(r"slurmctld(, slurmd of node0)? exited", message), message
    assert "NoSuchOption" in message  # the controller's log tail says what is wrong
    assert cluster.leftovers() == []
