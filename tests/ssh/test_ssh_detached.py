"""Detached runs on SSH hosts (network namespaces): the run outlives its client.

The client runs in a network namespace of its own; once ``skyward run --detach`` returns, that
namespace is deleted with every process in it (the laptop is gone). Then `skyward logs`,
`status` and `stop` from this machine's own namespace find the run on the hosts. The hosts
share this machine's filesystem (see tests/ssh/conftest.py), so the run's files are read
here to check what the nodes left; the client reads them over SSH, as from a real laptop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward.cli.main import main
from skyward.detached import record
from tests.ssh.conftest import Hosts, detached_project, processes_with, wait_until
from tests.support import cmdlines, sshd

pytestmark = [pytest.mark.ssh]

# Each rank prints STEPS lines half a second apart; with $FAIL set, rank 1 then exits with it
# while rank 0 would go on ten times as long.
JOB = """\
import os, sys, time
rank = int(os.environ["JAX_PROCESS_ID"])
steps = int(sys.argv[1]) * (10 if rank == 0 and os.environ.get("FAIL") else 1)
for step in range(steps):
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.5)
if rank == 1 and os.environ.get("FAIL"):
    sys.exit(int(os.environ["FAIL"]))
open(os.path.join(os.environ["SKYWARD_OUTPUT_DIR"], "done.txt"), "w").write(f"rank {rank}")
print(f"rank {rank} done", flush=True)
"""


@pytest.fixture
def project(netns_hosts: Hosts, tmp_path: Path) -> Iterator[Path]:
    """A directory with the job and a profile for two of the hosts."""
    with detached_project(netns_hosts, tmp_path, JOB) as directory:
        yield directory


def _run_files(name: str) -> list[Path]:
    return [Path(d) for d in record.load(name).directories]


def _authorized_lines(name: str) -> list[str]:
    path = Path("/root/.ssh/authorized_keys")
    text = path.read_text() if path.exists() else ""
    return [line for line in text.splitlines() if f"skyward-run:{name}:" in line]


def _status_line(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(name + " ")]
    assert lines, out
    return lines[0]


@pytest.mark.slow
def test_a_detached_run_outlives_its_client(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "outlives"
    with netns_hosts.net.client_namespace() as laptop:
        command = ["run", "--detach", "--name", name, "--output-dir", "out", "job.py", "16"]
        command.append(f"token-{name}")
        started = subprocess.run(
            ["ip", "netns", "exec", laptop.netns, sys.executable, "-m", "skyward.cli", *command],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert started.returncode == 0, started.stderr
        assert f"run {name} started on 2 node(s)" in started.stdout
        assert f"skyward logs -f {name}" in started.stdout
        netns_hosts.net.delete_namespace(laptop)  # the laptop is closed: nothing of it is left
    # From this machine's own namespace: the run goes on.
    assert "running" in _status_line(name, capsys)
    assert wait_until(lambda: len(processes_with(f"token-{name}")) >= 2, 10)
    time.sleep(1.5)
    assert main(["logs", name]) == 0
    mid = capsys.readouterr().out
    assert "(node 0) rank 0 step 0" in mid and "(node 1) rank 1 step 0" in mid, mid
    assert "done" not in mid
    assert main(["logs", "-f", name]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        lines = [line for line in out.splitlines() if line.startswith(f"(node {rank}) ")]
        expected = [f"(node {rank}) rank {rank} step {s}" for s in range(16)]
        assert lines == [*expected, f"(node {rank}) rank {rank} done"], out
    assert "succeeded" in _status_line(name, capsys)
    assert [(project / "out" / f"node-{i}" / "done.txt").read_text() for i in (0, 1)] == [
        "rank 0",
        "rank 1",
    ]
    # Nothing of the run is left on the hosts but its logs, state and outputs.
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
    assert not processes_with(f"token-{name}")
    assert _authorized_lines(name) == []
    for directory in _run_files(name):
        assert not (directory / "spec.json").exists()
        assert (directory / "rank.log").stat().st_mode & 0o077 == 0


@pytest.mark.slow
def test_a_failing_rank_stops_the_others_and_fails_the_run(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "fails"
    # A run's env reaches its ranks through owner-only spec files, never a command line: not
    # the leader's, a follower's (authorized_keys' command=) or a rank's (`cmdlines.Watch`).
    secret = cmdlines.canary()
    with cmdlines.Watch(secret) as watch:
        command = ["run", "--detach", "--name", name, "--env", "FAIL=3"]
        assert main([*command, "--env", f"SKYWARD_CANARY={secret}", "job.py", "4"]) == 0
        capsys.readouterr()
        begun = time.monotonic()
        assert main(["logs", "-f", name]) == 3
        assert time.monotonic() - begun < 10  # four half-second steps, then seconds at most
    assert watch.leaks == [], watch.leaks[:3]
    captured = capsys.readouterr()
    assert "rank 1 exited with status 3" in captured.err
    assert "(node 1) rank 1 step 3" in captured.out
    assert "failed: rank 1 exited with status 3" in _status_line(name, capsys)
    node0 = record.load(name).directories[0]
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
    # rank 0 was stopped (SIGTERM from its follower), not left to run on
    assert '"status": -15' in (Path(node0) / "node.json").read_text()


@pytest.mark.slow
def test_stop_ends_a_detached_run_on_every_node(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "stopped"
    assert main(["run", "--detach", "--name", name, "job.py", "600", f"token-{name}"]) == 0
    assert len(processes_with(f"token-{name}")) == 2
    begun = time.monotonic()
    assert main(["stop", name]) == 0
    assert time.monotonic() - begun < 20
    assert "stopped" in capsys.readouterr().out
    assert not processes_with(f"token-{name}")
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
    assert "stopped" in _status_line(name, capsys)
    assert _authorized_lines(name) == []
    assert main(["logs", "-f", name]) == 128 + signal.SIGTERM


@pytest.mark.slow
def test_a_node_lost_mid_run_fails_the_run_and_ends_it(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "lost"
    assert main(["run", "--detach", "--name", name, "job.py", "600", f"token-{name}"]) == 0
    node0 = Path(record.load(name).directories[0])
    # Mid-run: the leader has reached node 1 (it says `running` once every follower did).
    assert wait_until(lambda: "running" in (node0 / "run.json").read_text(), 15)
    # Node 1 dies: every process of its namespace but the sshd that the other tests share.
    host = netns_hosts.net.hosts[1]
    listener = host.server.pid if host.server is not None else None
    out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
    for pid in (int(p) for p in out.stdout.split()):
        if pid != listener:
            os.kill(pid, signal.SIGKILL)
    assert main(["logs", "-f", name]) == 1
    assert "node 1 was lost" in capsys.readouterr().err
    assert "failed: node 1 was lost" in _status_line(name, capsys)
    assert wait_until(lambda: not processes_with(f"token-{name}"), 15)
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
    assert sshd.pid_alive(listener or 0)


@pytest.mark.slow
def test_a_leader_that_dies_takes_the_run_down_and_says_lost(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 0's supervisor killed (its node failing) mid-run: node 1's rank stops too, and the
    run is `lost`, not `running` for ever. (One that dies before it reaches node 1: see
    tests/test_supervisor.py's early rank no leader attaches to.)"""
    name = "ssh-headless"
    assert main(["run", "--detach", "--name", name, "job.py", "600", f"token-{name}"]) == 0
    capsys.readouterr()
    node0 = Path(record.load(name).directories[0])
    # Mid-run: the leader has reached node 1 (it says `running` once every follower did).
    assert wait_until(lambda: "running" in (node0 / "run.json").read_text(), 15)
    # Node 0 fails: its leader, the leader's guard and its rank go at once.
    os.kill(json.loads((node0 / "run.json").read_text())["leader_pid"], signal.SIGKILL)
    for pid in processes_with(f"runs/{name}/node-0"):
        os.kill(pid, signal.SIGKILL)
    os.killpg(json.loads((node0 / "node.json").read_text())["pid"], signal.SIGKILL)  # its rank
    assert wait_until(lambda: not processes_with(f"token-{name}"), 15)
    assert "lost (the supervisor on node 0 is gone)" in _status_line(name, capsys)
    assert main(["stop", name]) == 0  # what is left of it (its files) is cleaned
    assert _authorized_lines(name) == []


@pytest.mark.slow
def test_a_run_that_cannot_start_on_one_node_leaves_nothing_running_on_the_others(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1 cannot make its run directory (a file is in the way); node 2's rank had already
    started under its early follower: the command fails, and node 2's rank is stopped at once
    (not after the 30 s an early follower waits for a leader) with its key line gone."""
    name = "halfway"
    hosts = netns_hosts.net.addresses
    profile = (project / "skyward.toml").read_text()
    profile = profile.replace(repr(hosts[:2]), repr(hosts)).replace("nodes = 2", "nodes = 3")
    (project / "skyward.toml").write_text(profile)
    # The hosts share this machine's disk: node 1's directory is blocked for node 1 only.
    runs = Path(os.environ["SKYWARD_TEST_HOST_CACHE"]) / "runs" / name  # (tests/conftest.py)
    runs.mkdir(parents=True, exist_ok=True)
    (runs / "node-1").write_text("in the way")
    try:
        assert main(["run", "--detach", "--name", name, "job.py", "600", f"token-{name}"]) == 1
        assert "node-1" in capsys.readouterr().err
        assert wait_until(lambda: not processes_with(f"token-{name}"), 10)
        assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
        assert _authorized_lines(name) == []
        assert not (runs / "node-2" / "spec.json").exists()
    finally:
        (runs / "node-1").unlink()


RESTARTING = """\
import os, sys, time
rank, attempt = int(os.environ["JAX_PROCESS_ID"]), int(os.environ["SKYWARD_RESTART"])
print(f"rank {rank} attempt {attempt}", flush=True)
if rank == 1 and attempt == 0:
    sys.exit(3)
time.sleep(1)
"""


@pytest.mark.slow
def test_restarts_start_every_rank_again_through_the_same_launchers(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1's first attempt ran under the follower its agent started; the restart's comes
    through the leader's ssh, whose `attach` finds no early follower and is the follower."""
    name = "ssh-again"
    (project / "restarting.py").write_text(RESTARTING)
    assert main(["run", "--detach", "--name", name, "--restarts", "1", "restarting.py"]) == 0
    capsys.readouterr()
    assert main(["logs", "-f", name]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        for attempt in (0, 1):
            assert f"(node {rank}) rank {rank} attempt {attempt}" in out, out
    assert "succeeded" in _status_line(name, capsys)
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
    assert _authorized_lines(name) == []


@pytest.mark.slow
def test_a_host_whose_sshd_ignores_authorized_keys_fails_the_start_and_says_why(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 0's leader reaches node 1 with a key the run adds to node 1's authorized_keys; an
    sshd that reads keys from elsewhere refuses it. The start must fail, saying so, rather
    than say every rank runs and lose node 1 a second later."""
    name = "keyless"
    server = netns_hosts.net.hosts[1].server
    assert server is not None
    server.user_keys = False
    server.restart()
    try:
        assert main(["run", "--detach", "--name", name, "job.py", "600", f"token-{name}"]) == 1
        out = capsys.readouterr()
        assert "every rank is running" not in out.out
        assert "node 1" in out.err and "AuthorizedKeysFile" in out.err, out.err
        assert wait_until(lambda: not processes_with(f"token-{name}"), 15)
        assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
        assert _authorized_lines(name) == []
    finally:
        server.user_keys = True
        server.restart()


@pytest.mark.slow
def test_a_run_that_succeeds_after_a_restart_leaves_no_secret_on_its_nodes(
    netns_hosts: Hosts, project: Path
) -> None:
    """The spec of every node holds the run's environment: it goes, and the leader's key lines
    with it, as soon as the run has ended on the nodes, before any client looks."""
    import secrets

    import skyward as sky
    from skyward.cachedir import cache_root

    name = "ssh-secretive"
    canary = f"canary-{secrets.token_hex(8)}"
    (project / "quick.py").write_text("print('done')\n")
    provider = netns_hosts.provider(2)
    sky.submit("quick.py", [], provider=provider, name=name, env={"K": canary}, restarts=1)
    node0 = Path(os.environ["SKYWARD_TEST_HOST_CACHE"]) / "runs" / name / "node-0"
    assert wait_until(lambda: '"succeeded"' in (node0 / "run.json").read_text(), 30)
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 15)
    holders = [
        str(path)
        for root in (os.environ["SKYWARD_TEST_HOST_CACHE"], cache_root())
        for path in Path(root).rglob("*")
        if path.is_file()
        and path.stat().st_size < 1 << 22  # (not an environment's libraries)
        and canary.encode() in path.read_bytes()
    ]
    assert holders == []
    assert _authorized_lines(name) == []
