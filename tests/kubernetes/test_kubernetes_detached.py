"""Detached runs on pods of the stand-in cluster (`tests.support.fakek8s`): the run outlives its
client, node 0's leader reaches pod 1 at the door the run opened on the pod network (no sshd,
no credentials in the pods), and the client reaches the pods later through the API server's
exec stream alone: `logs -f`, `status`, `fetch` and `stop` from this process, once the
``skyward run --detach`` that started the run has exited. Once a command has seen the end and
kept the logs and outputs here, the pods and the Service are gone.

The door itself (its exchange, a wrong secret refused, a follower stopped when the connection
ends) is tested here too, without a cluster: `skyward.worker.supervisor`'s door and dial.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.cachedir import write_private
from skyward.cli.main import main
from skyward.detached import record
from skyward.worker import supervisor
from tests.kubernetes.conftest import SECOND_SUBNET, cluster_for, dump, ours
from tests.support import bareroots, cmdlines
from tests.support.fakek8s import V4, FakeCluster

# Each rank writes early.txt, prints STEPS lines half a second apart and writes done.txt; with
# $FAIL set, rank 1 then exits with it while rank 0 would go on ten times as long. A rank
# stopped with SIGTERM says so.
JOB = """\
import os, signal, sys, time
rank = int(os.environ["JAX_PROCESS_ID"])
out = os.environ["SKYWARD_OUTPUT_DIR"]

def stopped(*_):
    print(f"rank {rank} stopped", flush=True)
    sys.exit(143)

signal.signal(signal.SIGTERM, stopped)
open(os.path.join(out, "early.txt"), "w").write(f"rank {rank}")
fail = os.environ.get("FAIL")
steps = int(sys.argv[1]) * (10 if rank == 0 and fail else 1)
for step in range(steps):
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.5)
if rank == 1 and fail:
    sys.exit(int(fail))
open(os.path.join(out, "done.txt"), "w").write(f"rank {rank}")
print(f"rank {rank} done", flush=True)
"""

SERVICES = "app.kubernetes.io/managed-by=skyward"


def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture
def project(kubeconfig: Path, pod_index: bareroots.PackageIndex, tmp_path: Path) -> Iterator[Path]:
    """The working directory: the job, and a profile for two pods building from the index the
    stand-in serves (the pods reach nothing else)."""
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "skyward.toml").write_text(
        textwrap.dedent(
            f"""
            [profile.default]
            provider = "kubernetes"
            nodes = 2
            build_env = {{ UV_INDEX = "{pod_index.simple_url}", UV_HTTP_RETRIES = "0" }}
            """
        )
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)


@pytest.fixture
def leftovers(cluster: FakeCluster) -> Iterator[None]:
    """Whatever a failed test leaves in the namespace is deleted after it (a passing one
    leaves nothing: each checks it)."""
    yield
    for pod in ours(cluster):
        cluster.request("DELETE", f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}")
    for service in cluster.services(selector=SERVICES):
        name = service["metadata"]["name"]
        cluster.request("DELETE", f"/api/v1/namespaces/default/services/{name}")


def _detach(project: Path, kubeconfig: Path, name: str, *args: str) -> str:
    """``skyward run --detach --provider kubernetes --nodes 2`` as a process of its own, which
    has exited once this returns (the laptop is closed); what it printed."""
    command = ["run", "--detach", "--provider", "kubernetes", "--nodes", "2", "--name", name]
    started = subprocess.run(
        [sys.executable, "-m", "skyward.cli", *command, *args],
        cwd=project,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    assert f"run {name} started on 2 node(s)" in started.stdout, started.stdout
    return started.stdout


def _status_line(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(name + " ")]
    assert lines, out
    return lines[0]


def _pods_of(cluster: FakeCluster, name: str) -> list[dict[str, object]]:
    """The run's pods (its record names them)."""
    pods = set(record.load(name).reach["data"]["pods"])
    return [p for p in ours(cluster) if p["metadata"]["name"] in pods]  # type: ignore[index]


def _gone(cluster: FakeCluster, name: str) -> bool:
    return not _pods_of(cluster, name) and not cluster.services(selector=SERVICES)


def _rank_lines(out: str, rank: int) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"(node {rank}) ")]


@pytest.mark.slow
def test_a_detached_run_on_two_pods_outlives_its_client_and_its_pods_go_after(
    cluster: FakeCluster,
    kubeconfig: Path,
    project: Path,
    leftovers: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "pods-outlive"
    _detach(project, kubeconfig, name, "--output-dir", "out", "--keep-for", "60", "job.py", "12")
    # The record keeps where the pods are, and no secret of the run.
    kept = record.load(name)
    assert kept.kind == "tcp" and kept.reach["data"]["namespace"] == "default"
    assert kept.reach["data"]["files"] == [str(kubeconfig.resolve())]
    assert len(kept.reach["data"]["pods"]) == 2
    assert "secret" not in json.dumps(kept.reach)
    pods = _pods_of(cluster, name)
    assert [p["status"]["phase"] for p in pods] == ["Running", "Running"], dump(pods)  # type: ignore[index]
    assert "running" in _status_line(name, capsys)
    # Mid-run: what each rank wrote so far comes back, and both ranks' first lines are there.
    assert main(["fetch", name, "--to", str(project / "mid")]) == 0
    assert [(project / "mid" / f"node-{i}" / "early.txt").read_text() for i in (0, 1)] == [
        "rank 0",
        "rank 1",
    ]
    capsys.readouterr()
    assert main(["logs", name]) == 0
    mid = capsys.readouterr().out
    assert "(node 0) rank 0 step 0" in mid and "(node 1) rank 1 step 0" in mid, mid
    # To the end: every line of both ranks, in order; then the outputs are here.
    assert main(["logs", "-f", name]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        expected = [f"(node {rank}) rank {rank} step {s}" for s in range(12)]
        assert _rank_lines(out, rank) == [*expected, f"(node {rank}) rank {rank} done"], out
    assert [(project / "out" / f"node-{i}" / "done.txt").read_text() for i in (0, 1)] == [
        "rank 0",
        "rank 1",
    ]
    assert "succeeded" in _status_line(name, capsys)
    # The logs and outputs are kept here: the pods and the Service go at once, not after the
    # 60 s --keep-for would have held them.
    assert wait_until(lambda: _gone(cluster, name), 20), dump(ours(cluster))
    assert main(["logs", name]) == 0
    assert "(node 1) rank 1 done" in capsys.readouterr().out
    assert main(["fetch", name, "--to", str(project / "after")]) == 0
    assert (project / "after" / "node-1" / "done.txt").read_text() == "rank 1"


@pytest.mark.slow
def test_a_failing_rank_on_one_pod_stops_the_other_and_fails_the_run(
    cluster: FakeCluster,
    kubeconfig: Path,
    project: Path,
    leftovers: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "pods-fail"
    # The run's env reaches its ranks through owner-only spec files, never a command line (the
    # pods' processes are this machine's): not the door's, the dial's or a rank's.
    secret = cmdlines.canary()
    markers = [f"{supervisor.MODULE} door ", f"{supervisor.MODULE} dial "]
    profile = project / "skyward.toml"  # (not --env: the client's own command line)
    profile.write_text(
        profile.read_text() + f'env = {{ FAIL = "3", SKYWARD_CANARY = "{secret}" }}\n'
    )
    with cmdlines.Watch(secret, markers) as watch:
        _detach(project, kubeconfig, name, "job.py", "4")
        begun = time.monotonic()
        assert main(["logs", "-f", name]) == 3
        assert time.monotonic() - begun < 20  # four half-second steps, then seconds at most
    assert watch.leaks == [], watch.leaks[:3]
    assert watch.seen == set(markers), watch.seen
    captured = capsys.readouterr()
    assert "rank 1 exited with status 3" in captured.err
    assert "(node 1) rank 1 step 3" in captured.out
    # Rank 0 would have gone on for 40 steps: node 0's leader stopped it (SIGTERM).
    assert _rank_lines(captured.out, 0)[-1] == "(node 0) rank 0 stopped", captured.out
    assert "failed: rank 1 exited with status 3" in _status_line(name, capsys)
    assert wait_until(lambda: _gone(cluster, name), 20), dump(ours(cluster))


@pytest.mark.slow
def test_stop_ends_a_detached_run_on_every_pod(
    cluster: FakeCluster,
    kubeconfig: Path,
    project: Path,
    leftovers: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "pods-stop"
    _detach(project, kubeconfig, name, "job.py", "600")
    assert wait_until(lambda: "step 1" in _logs(name, capsys), 20)
    begun = time.monotonic()
    assert main(["stop", name]) == 0
    assert time.monotonic() - begun < 20
    assert "stopped" in capsys.readouterr().out
    assert "stopped" in _status_line(name, capsys)
    assert main(["logs", "-f", name]) == 143
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert _rank_lines(out, rank)[-1] == f"(node {rank}) rank {rank} stopped", out
    assert wait_until(lambda: _gone(cluster, name), 20), dump(ours(cluster))


def _has_all(text: str, lines: tuple[str, ...]) -> bool:
    return all(line in text for line in lines)


def _logs(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["logs", name]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_pods_whose_client_never_comes_back_end_themselves_after_the_run(
    cluster: FakeCluster,
    kubeconfig: Path,
    project: Path,
    leftovers: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No command looks at the run: each pod's keeper ends its container `idle_timeout` after
    the run's last process there (its --keep-for linger included), so the pods hold nothing
    past the run. What then looks at the run says which pod ended; `skyward down` removes the
    pods' objects."""
    name = "pods-unseen"
    profile = project / "skyward.toml"
    profile.write_text(profile.read_text() + "idle_timeout = 2\n")
    _detach(project, kubeconfig, name, "--keep-for", "3", "job.py", "2")
    pool = record.load(name).reach["cloud"]["pool_id"]

    def ended() -> bool:
        phases = [p["status"]["phase"] for p in _pods_of(cluster, name)]  # type: ignore[index]
        return phases == ["Succeeded", "Succeeded"]

    # The run takes a second, the linger 3 s, the keeper 2 s more: within 30 s at the most.
    assert wait_until(ended, 30), dump(_pods_of(cluster, name))
    line = _status_line(name, capsys)
    assert "lost" in line, line
    assert main(["status"]) == 0
    said = capsys.readouterr().out
    assert "node 0 will not be reached again: pod" in said and "has ended (Succeeded)" in said
    assert f"`skyward down {pool}` removes the rest" in said, said
    assert main(["down", pool, "--provider", "kubernetes"]) == 0
    assert wait_until(lambda: _gone(cluster, name), 20), dump(ours(cluster))


RESTARTING = """\
import os, sys, time
rank, attempt = int(os.environ["JAX_PROCESS_ID"]), int(os.environ["SKYWARD_RESTART"])
print(f"rank {rank} attempt {attempt}", flush=True)
if rank == 1 and attempt == 0:
    sys.exit(3)
time.sleep(1)
"""


@pytest.mark.slow
def test_a_restart_dials_pod_1_again_and_its_door_lets_the_leader_in(
    cluster: FakeCluster,
    kubeconfig: Path,
    project: Path,
    leftovers: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Pod 1's first attempt ran under the follower its agent started; the restart's comes
    through a second connection to the same door, whose attach is the follower itself."""
    name = "pods-again"
    (project / "restarting.py").write_text(RESTARTING)
    _detach(project, kubeconfig, name, "--restarts", "1", "restarting.py")
    assert main(["logs", "-f", name]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        lines = _rank_lines(out, rank)
        assert lines == [f"(node {rank}) rank {rank} attempt {a}" for a in (0, 1)], out
    assert wait_until(lambda: _gone(cluster, name), 20), dump(ours(cluster))


@pytest.mark.slow
def test_a_pod_deleted_mid_run_is_a_lost_node_and_the_rest_goes(
    cluster: FakeCluster,
    kubeconfig: Path,
    project: Path,
    leftovers: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Someone deletes pod 1 mid-run: node 0's leader loses its connection to pod 1's door,
    stops rank 0 and fails the run; what pod 1 held went with it, the rest is kept here and
    pod 0 and the Service go (waiting for pod 1 would keep them for ever)."""
    name = "pods-lost"
    _detach(project, kubeconfig, name, "job.py", "600")
    # Both ranks are past their first step (rank 0's step 1 is what is kept here after).
    both = ("(node 0) rank 0 step 1", "(node 1) rank 1 step 1")
    assert wait_until(lambda: _has_all(_logs(name, capsys), both), 20)
    pod = record.load(name).reach["data"]["pods"][1]
    status, _ = cluster.request("DELETE", f"/api/v1/namespaces/default/pods/{pod}")
    assert status == 200
    begun = time.monotonic()
    assert main(["logs", "-f", name]) == 1
    assert time.monotonic() - begun < 30
    captured = capsys.readouterr()
    assert "node 1 was lost" in captured.err, captured.err
    assert _rank_lines(captured.out, 0)[-1] == "(node 0) rank 0 stopped", captured.out
    line = _status_line(name, capsys)
    assert "failed: node 1 was lost" in line, line
    assert wait_until(lambda: _gone(cluster, name), 20), dump(ours(cluster))
    assert main(["logs", name]) == 0  # node 0's, from the copy kept here
    assert "(node 0) rank 0 step 1" in capsys.readouterr().out


@pytest.mark.slow
def test_sky_submit_on_an_api_server_that_speaks_only_v4(
    instance_root: Path,
    pod_index: bareroots.PackageIndex,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older API server (exec protocol v4, which cannot close a command's stdin): every
    command the client runs in the pods later still ends, the outputs' tar stream too."""
    older = cluster_for(tmp_path / "v4", instance_root, SECOND_SUBNET, protocols=(V4,))
    try:
        monkeypatch.setenv("KUBECONFIG", str(older.kubeconfig))
        (tmp_path / "job.py").write_text(JOB)
        with bareroots.PackageIndex(Path(pod_index.directory), host=older.bridge) as index:
            provider = sky.Kubernetes(build_env={"UV_INDEX": index.simple_url})
            run = sky.submit(
                str(tmp_path / "job.py"),
                "3",
                provider=provider,
                nodes=2,
                name="pods-v4",
                output_dir=tmp_path / "out",
                keep_for=30,
            )
            assert run.wait(timeout=120) == 0
        lines: list[str] = []
        run.logs(out=lines.append)
        assert "(node 1) rank 1 done" in lines and "(node 0) rank 0 step 2" in lines, lines
        assert (tmp_path / "out" / "node-1" / "done.txt").read_text() == "rank 1"
        assert wait_until(lambda: not older.pods(selector=SERVICES), 20), dump(older.pods())
    finally:
        older.stop()


# -- the door, without a cluster ---------------------------------------------------------------

RANK = "import time; print('hello', flush=True); time.sleep({seconds}); print('bye')"


def _node(tmp_path: Path, secret: str, seconds: float) -> Path:
    """Node 1's run directory as its agent leaves it: a spec, its door open, its rank running
    under its early follower."""
    directory = tmp_path / "node-1"
    directory.mkdir(mode=0o700)
    spec = {
        "name": "door",
        "rank": 1,
        "argv": [sys.executable, "-c", RANK.format(seconds=seconds)],
        "cwd": str(tmp_path),
        "env": {},
        "grace": 3,
        "restarts": 0,
        "key_tag": None,
        "attach_within": 30,
        "door_secret": secret,
    }
    write_private(directory / supervisor.SPEC, json.dumps(spec))
    port = supervisor.open_door(directory)
    (directory / "port").write_text(str(port))
    supervisor.start_early(directory, 10)
    return directory


def _dial(tmp_path: Path, directory: Path, secret: str) -> subprocess.Popen[bytes]:
    key = tmp_path / f"key-{secret[:4]}"
    write_private(key, secret)
    port = (directory / "port").read_text()
    argv = [*supervisor.interpreter(), "-m", supervisor.MODULE, "dial", "localhost", port]
    return subprocess.Popen(
        [*argv, str(key)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_the_door_admits_the_secret_alone_and_relays_the_follower(tmp_path: Path) -> None:
    secret = "ab" * 32
    directory = _node(tmp_path, secret, 1.0)
    wrong = _dial(tmp_path, directory, "cd" * 32)
    _, complaint = wrong.communicate(timeout=30)
    assert wrong.returncode == 255
    assert b"refused the run's secret" in complaint
    assert "did not prove it holds the run's secret" in (directory / "door.log").read_text()
    right = _dial(tmp_path, directory, secret)
    assert right.stdout is not None and right.stdin is not None
    assert right.stdout.readline() == b"started\n"
    assert right.stdout.readline() == b"exit 0\n"
    right.stdin.close()  # the leader has heard how the rank ended: the run is over here
    assert right.wait(30) == 0
    assert (directory / "rank.log").read_text() == "hello\nbye\n"
    # The run has ended on the node: its spec (the secret) is gone, and the door with it.
    assert wait_until(lambda: not _processes_with(str(directory)), 10)
    assert not (directory / supervisor.SPEC).exists()


def test_the_dials_end_stops_the_rank_behind_the_door(tmp_path: Path) -> None:
    secret = "ef" * 32
    directory = _node(tmp_path, secret, 600)
    dial = _dial(tmp_path, directory, secret)
    assert dial.stdout is not None and dial.stdin is not None
    assert dial.stdout.readline() == b"started\n"
    rank = json.loads((directory / supervisor.NODE_STATE).read_text())["pid"]
    dial.stdin.close()  # the leader stops the run
    assert dial.stdout.readline() == b"exit -15\n"
    assert dial.wait(30) == 0
    assert not supervisor.alive(rank)
    assert wait_until(lambda: not _processes_with(str(directory)), 10)
    assert not (directory / supervisor.SPEC).exists()


def test_a_door_no_leader_comes_to_closes_with_its_follower(tmp_path: Path) -> None:
    """The leader died before it dialled: the early follower stops its rank after the time it
    waits for one, and the door closes with it (nothing of the run is left)."""
    directory = tmp_path / "node-1"
    directory.mkdir(mode=0o700)
    spec = {
        "name": "door",
        "rank": 1,
        "argv": [sys.executable, "-c", RANK.format(seconds=600)],
        "cwd": str(tmp_path),
        "env": {},
        "grace": 3,
        "restarts": 0,
        "key_tag": None,
        "attach_within": 1,
        "door_secret": "12" * 32,
    }
    write_private(directory / supervisor.SPEC, json.dumps(spec))
    supervisor.open_door(directory)
    supervisor.start_early(directory, 10)
    assert len(_processes_with(str(directory))) >= 2  # the door and the early follower
    assert wait_until(lambda: not _processes_with(str(directory)), 45)
    assert not (directory / supervisor.SPEC).exists()
