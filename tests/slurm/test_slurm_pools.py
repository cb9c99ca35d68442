"""Pools on a real Slurm cluster (Debian's slurm-wlm): one allocation, one agent step per node.

The cluster is `tests.support.slurmcluster.SlurmCluster`: slurmctld and three slurmd in network
namespaces on this machine. The client is the login node (`sky.Slurm()` with no `login`): the
Slurm commands find the cluster through ``SLURM_CONF``, as on a login node. The compute nodes
share this machine's filesystem (a shared home), so one environment build serves them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from tests.slurm.conftest import client_running, queue, wait_for_empty_queue
from tests.support import sshd, wheels
from tests.support.slurmcluster import SlurmCluster


def jobs_of(pool: sky.ComputePool, cluster: SlurmCluster) -> list[str]:
    """The pool's jobs in the queue (another test's may still be completing)."""
    return [line for line in queue(cluster) if pool.pool_id in line]


@sky.compute
def whereabouts() -> tuple[str, str, int, str, list[str]]:
    info = sky.instance_info()
    step_world = sorted(name for name in os.environ if name.startswith(("SLURM_", "SLURMD_")))
    return (
        socket.gethostname(),
        os.environ["SKYWARD_SLURM_JOB_ID"],
        info.node,
        info.head_addr,
        step_world,
    )


def test_a_pool_is_one_allocation_with_an_agent_on_each_node(login: SlurmCluster) -> None:
    with sky.ComputePool(provider=sky.Slurm(), nodes=3) as pool:
        found = whereabouts() @ pool
        assert len(jobs_of(pool, login)) == 1  # one job: the allocation
    names = [name for name, *_ in found]
    assert sorted(names) == ["node0", "node1", "node2"]
    assert len({job for _, job, *_ in found}) == 1  # every node in one job
    assert [node for _, _, node, *_ in found] == [0, 1, 2]
    assert {head for *_, head, _ in found} == {login.node(names[0]).address}
    # the step's SLURM_* world is gone; where the cluster's configuration is, is kept
    assert all(world == ["SLURM_CONF"] for *_, world in found), found
    assert wait_for_empty_queue(login, 5) == []


def test_a_partition_that_does_not_exist_is_a_config_error_with_nothing_queued(
    login: SlurmCluster,
) -> None:
    began = time.monotonic()
    with pytest.raises(sky.ConfigError, match=r"(?i)invalid partition.*nosuch"):
        with sky.ComputePool(provider=sky.Slurm(partition="nosuch"), nodes=2):
            pass
    assert time.monotonic() - began < 15
    assert queue(login) == []


def test_an_account_the_partition_refuses_is_a_config_error(login: SlurmCluster) -> None:
    began = time.monotonic()
    with pytest.raises(sky.ConfigError, match=r"(?i)account.*other"):
        with sky.ComputePool(provider=sky.Slurm(partition="restricted", account="other"), nodes=1):
            pass
    assert time.monotonic() - began < 15
    assert queue(login) == []


def test_a_pending_allocation_shows_slurms_reason_and_gives_up_when_asked(
    login: SlurmCluster, capfd: pytest.CaptureFixture[str]
) -> None:
    blocker = login.submit(["--exclusive", "-N3", "-J", "blocker", "--wrap", "sleep 300"])
    try:
        with pytest.raises(sky.ProvisionError, match="still pending after 4 s"):
            with sky.ComputePool(provider=sky.Slurm(pending_timeout=4), nodes=3):
                pass
        assert "pending: Resources" in capfd.readouterr().err
        assert [line.split()[1] for line in queue(login)] == ["blocker"]
    finally:
        login.run(["scancel", str(blocker)], check=True)
    assert wait_for_empty_queue(login, 10) == []


@sky.compute
def nap(seconds: float) -> int:
    time.sleep(seconds)
    return sky.instance_info().node


def test_a_pool_that_waits_in_the_queue_pays_only_from_its_allocation(
    login: SlurmCluster, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every node held by another job for ~25 s: at $1 a second a node, $20 would be spent
    three times over while the job pends; billed from the allocation, it runs its call."""
    # The nodes' environment first: built on the allocation, it is billed too, and on a machine
    # whose caches are empty (a fresh clone, where this pool may be the cluster's first) its
    # build alone took the measured pool past $20 at this price.
    with sky.ComputePool(provider=sky.Slurm(), nodes=3, stream_output=False) as warm:
        assert nap(0) @ warm == [0, 1, 2]
    assert wait_for_empty_queue(login, 10) == []
    blocker = login.submit(["--exclusive", "-N3", "-J", "blocker", "--wrap", "sleep 25"])
    try:
        began = time.monotonic()
        provider = sky.Slurm(price_per_hour=3600)
        with sky.ComputePool(provider=provider, nodes=3, max_cost=20) as pool:
            assert time.monotonic() - began > 15, "the pool did not wait: nothing was tested"
            assert nap(1) @ pool == [0, 1, 2]
        assert "pending: Resources" in capfd.readouterr().err
        spent = pool.cost.spent
        assert spent is not None and 3 < spent < 20, spent  # 3 nodes, the 1 s call at least
    finally:
        login.run(["scancel", str(blocker)], check=True)
    assert wait_for_empty_queue(login, 10) == []


@sky.compute
def my_job() -> dict[str, str]:
    """The fields of the node's job as ``scontrol`` shows them (SLURM_CONF is kept for this)."""
    import subprocess

    job = os.environ["SKYWARD_SLURM_JOB_ID"]
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, check=True
    ).stdout
    return dict(word.split("=", 1) for word in out.split() if "=" in word)


def test_the_allocation_is_what_the_provider_was_given(login: SlurmCluster) -> None:
    provider = sky.Slurm(partition="debug", account="lab", time_limit=600, options=["--exclusive"])
    with sky.ComputePool(provider=provider, nodes=2) as pool:
        jobs = my_job() @ pool
        assert len(jobs_of(pool, login)) == 1
    job = jobs[0]
    assert jobs[1]["JobId"] == job["JobId"]
    assert (job["Partition"], job["Account"], job["TimeLimit"]) == ("debug", "lab", "00:10:00")
    assert job["OverSubscribe"] == "NO"  # --exclusive, passed on as given
    assert job["JobName"] == f"skyward-{pool.pool_id}"
    assert wait_for_empty_queue(login, 5) == []


def test_gres_no_node_has_is_a_config_error_with_nothing_queued(login: SlurmCluster) -> None:
    began = time.monotonic()
    with pytest.raises(sky.ConfigError, match=r"(?i)gres=.gpu:a100:9"):
        with sky.ComputePool(provider=sky.Slurm(gres="gpu:a100:9"), nodes=1):
            pass
    assert time.monotonic() - began < 15
    assert queue(login) == []


@sky.compute
def sleep_on(node: int, seconds: float) -> str:
    if sky.instance_info().node == node:
        print("sleeping", flush=True)
        time.sleep(seconds)
    return socket.gethostname()


def test_a_client_killed_with_sigkill_leaves_no_job(
    login: SlurmCluster, running_pool: tuple[str, subprocess.Popen[str]]
) -> None:
    _, client = running_pool
    time.sleep(1)
    assert len(queue(login)) == 1
    client.send_signal(signal.SIGKILL)
    client.wait(10)
    assert wait_for_empty_queue(login, 60) == []


@contextlib.contextmanager
def ssh_login_node(
    cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    """A login node reached over SSH (an sshd whose sessions know `cluster` by SLURM_CONF)
    while this process does not know the cluster: `sky.Slurm`'s login arguments for it.

    No cache of this machine's is shared with the nodes then, so where their python3 lacks the
    agent's requirements they build an environment themselves, and they reach no index (nor
    does anything promise a uv cache that holds them): uv installs offline from a wheelhouse of
    this interpreter's cloudpickle and packaging, into a uv cache of the test's own."""
    for name in list(os.environ):
        if name.startswith("SLURM"):
            monkeypatch.delenv(name)
    key = sshd.KeyPair.generate(tmp_path)
    server = sshd.SshdServer(
        authorized_keys=[key], extra_config=[f"SetEnv SLURM_CONF={cluster.conf_path}"]
    )
    house = wheels.wheelhouse(tmp_path / "wheelhouse", wheels.AGENT_PACKAGES)
    build_env = {**wheels.offline_build_env(house), "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    with server:
        yield {
            "login": f"root@127.0.0.1:{server.port}",
            "key": str(key.private_path),
            "known_hosts": str(server.write_known_hosts(tmp_path / "known_hosts")),
            "build_env": build_env,
        }


def test_a_pool_through_a_login_node_reached_over_ssh(
    provider_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`login="root@host:port"`: every Slurm command and every agent's step goes over one
    verified SSH connection to the login node, whose sessions know the cluster (SLURM_CONF),
    while this process does not."""
    with ssh_login_node(provider_cluster, tmp_path, monkeypatch) as login:
        provider = sky.Slurm(**login)
        data = tmp_path / "data"
        data.mkdir()
        (data / "a.txt").write_text("alpha")
        runs = tmp_path / "runs"
        with sky.ComputePool(provider=provider, nodes=2, output_dir=runs) as pool:
            found = whereabouts() @ pool
            assert len(queue(provider_cluster)) == 1
            # streamed through the login's connection into a step (the nodes share a cache)
            assert read_data(sky.Data(data)) @ pool == ["alpha", "alpha"]
            write_output() @ pool
    assert sorted(name for name, *_ in found) == ["node0", "node1"]
    assert len({job for _, job, *_ in found}) == 1
    for node in (0, 1):  # pulled through the login's connection from a step on each node
        assert (runs / f"node-{node}" / "out.txt").read_text() == f"from node {node}"
    assert wait_for_empty_queue(provider_cluster, 5) == []


def test_a_client_gone_silent_behind_an_ssh_login_lets_the_allocation_go(
    provider_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client stopped (SIGSTOP: a laptop asleep) keeps its SSH connection open, so the login
    node sees no end; the allocation's holder, missing four keepalive lines, ends it."""
    with (
        ssh_login_node(provider_cluster, tmp_path, monkeypatch) as login,
        client_running(tmp_path, f"sky.Slurm(**{login!r}, keepalive=1)", nodes=1) as (_, client),
    ):
        assert len(queue(provider_cluster)) == 1
        client.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert wait_for_empty_queue(provider_cluster, 30) == []
        assert time.monotonic() - stopped >= 3  # not before four lines were missed


@sky.compute
def read_data(data: str) -> str:  # a sky.Data arrives on the node as its path
    return (Path(data) / "a.txt").read_text()


@sky.compute
def write_output() -> None:
    node = sky.instance_info().node
    (Path(sky.output_dir()) / "out.txt").write_text(f"from node {node}")


def test_a_preempted_allocation_is_a_preempted_worker_error(login: SlurmCluster) -> None:
    """A job of a higher priority tier takes the nodes (PreemptMode=CANCEL): the call fails
    with a WorkerError that says the pool was preempted, not that a node crashed."""
    try:
        with sky.ComputePool(provider=sky.Slurm(), nodes=3, broadcast_grace=1) as pool:
            whereabouts() @ pool
            future = pool.submit(sleep_on(0, 120), node=0)
            time.sleep(1)
            login.submit(
                ["-p", "urgent", "-N3", "--exclusive", "-J", "urgent", "--wrap", "sleep 60"]
            )
            with pytest.raises(sky.WorkerError) as caught:
                future.result(timeout=60)
        assert caught.value.preempted, str(caught.value)
        assert "preempted" in str(caught.value)
    finally:
        login.run(["scancel", "--name", "urgent"], check=True)
    assert wait_for_empty_queue(login, 10) == []


def test_a_node_lost_mid_call_is_named_and_replaced_from_a_new_allocation(
    login: SlurmCluster,
) -> None:
    """A node killed mid-call (its slurmd and everything on it): a WorkerError naming it and
    Slurm's account of the node; the job survives (--no-kill), and replace() brings the node
    back from a one-node allocation on another machine while node 0 keeps its job."""
    try:
        with sky.ComputePool(provider=sky.Slurm(), nodes=2, broadcast_grace=1) as pool:
            before = whereabouts() @ pool
            lost = before[1][0]
            future = pool.submit(sleep_on(1, 120), node=1)
            time.sleep(1)
            login.kill_node(lost)
            with pytest.raises(sky.WorkerError) as caught:
                future.result(timeout=60)
            assert caught.value.node == 1, str(caught.value)
            assert f"Slurm node {lost} is DOWN" in str(caught.value), str(caught.value)
            pool.replace(1)
            after = whereabouts() @ pool
            assert len(jobs_of(pool, login)) == 2  # the pool's job, and the replacement's
        names = [name for name, *_ in after]
        assert names[0] == before[0][0] and names[1] not in (lost, names[0]), names
        assert after[0][1] == before[0][1] != after[1][1]  # node 1 runs in a job of its own
    finally:
        login.start_node(lost)
    assert wait_for_empty_queue(login, 10) == []


@sky.compute
def exit_on(node: int) -> str:
    if sky.instance_info().node == node:
        os._exit(9)
    return socket.gethostname()


def test_an_agent_that_died_on_a_healthy_node_is_replaced_in_the_same_job(
    login: SlurmCluster,
) -> None:
    """The agent died, not the machine: replace() starts a new step on the same node, in the
    pool's own job, with nothing more asked of Slurm."""
    with sky.ComputePool(provider=sky.Slurm(), nodes=2, broadcast_grace=1) as pool:
        before = whereabouts() @ pool
        with pytest.raises(sky.WorkerError) as caught:
            exit_on(1) @ pool
        assert caught.value.node == 1, str(caught.value)
        pool.replace(1)
        after = whereabouts() @ pool
        assert len(jobs_of(pool, login)) == 1  # no second allocation
    assert [row[:2] for row in after] == [row[:2] for row in before]  # same nodes, same job
    assert wait_for_empty_queue(login, 5) == []


def test_a_node_an_admin_sets_down_mid_call_is_a_worker_error_with_slurms_reason(
    login: SlurmCluster,
) -> None:
    """``scontrol update state=down``: Slurm kills the node's steps; the call fails naming the
    node, its state and the admin's reason, and the rest of the job goes on (--no-kill)."""
    with sky.ComputePool(provider=sky.Slurm(), nodes=2, broadcast_grace=1) as pool:
        name = (whereabouts() @ pool)[1][0]
        future = pool.submit(sleep_on(1, 60), node=1)
        time.sleep(1)
        try:
            login.run(["scontrol", "update", f"nodename={name}", "state=down", "reason=maint"])
            with pytest.raises(sky.WorkerError) as caught:
                future.result(timeout=30)
            assert caught.value.node == 1, str(caught.value)
            assert f"Slurm node {name} is DOWN: maint" in str(caught.value), str(caught.value)
            assert len(jobs_of(pool, login)) == 1
        finally:
            login.run(["scontrol", "update", f"nodename={name}", "state=resume"])
    assert wait_for_empty_queue(login, 5) == []
    login.wait_ready()


def test_a_drained_node_finishes_the_call_it_runs(login: SlurmCluster) -> None:
    """``state=drain`` gives a node no new jobs; what runs there, the pool's call, goes on."""
    with sky.ComputePool(provider=sky.Slurm(), nodes=2) as pool:
        name = (whereabouts() @ pool)[1][0]
        future = pool.submit(sleep_on(1, 3), node=1)
        time.sleep(1)
        try:
            login.run(["scontrol", "update", f"nodename={name}", "state=drain", "reason=maint"])
            assert future.result(timeout=30) == name
        finally:
            login.run(["scontrol", "update", f"nodename={name}", "state=resume"])
    assert wait_for_empty_queue(login, 5) == []
    login.wait_ready()


def test_stacks_reach_the_agents_through_srun(login: SlurmCluster) -> None:
    """srun forwards the SIGUSR2 `pool.stacks()` sends to the agent of its step."""
    from tests.test_stacks import assert_stuck_on, stuck_in_a_wait

    with sky.ComputePool(provider=sky.Slurm(), nodes=2, stream_output=False) as pool:
        pool.submit(stuck_in_a_wait(1, 30), node=1)
        time.sleep(0.5)
        assert_stuck_on(pool.stacks(timeout=10), node=1, nodes=2)


def test_restarts_start_the_lost_agent_again_and_resume_from_the_checkpoint(
    login: SlurmCluster, tmp_path: Path
) -> None:
    """restarts=1 on Slurm: node 1's agent dies (its machine does not), so the restart starts
    it again on that machine in the pool's own job, and both nodes resume from node 0's
    checkpoint. (A lost machine is replaced from a new allocation: the test above.)"""
    from tests.test_restarts import checkpoint_then_lose_node_1

    with sky.ComputePool(
        provider=sky.Slurm(), nodes=2, restarts=1, output_dir=tmp_path / "runs"
    ) as pool:
        before = [name for name, *_ in whereabouts() @ pool]
        after = checkpoint_then_lose_node_1() @ pool
        assert len(jobs_of(pool, login)) == 1  # nothing more asked of Slurm
    assert [state for state, _ in after] == ["step 5", "step 5"]
    assert [name for _, name in after] == before
    assert wait_for_empty_queue(login, 10) == []


def test_slurms_signal_is_a_preemption_notice_on_the_node(login: SlurmCluster) -> None:
    """What Slurm sends ahead of a preemption or the time limit (``--signal=USR1@<s>``), here
    with ``scancel --signal=USR1``: sky.preempting() on every node sees it."""
    from tests.test_preemption import work_until_preempted

    with sky.ComputePool(provider=sky.Slurm(), nodes=2, stream_output=False) as pool:
        futures = [pool.submit(work_until_preempted(False), node=i) for i in (0, 1)]
        time.sleep(1)
        job = queue(login)[0].split()[0]
        login.run(["scancel", "--signal=USR1", job], check=True)
        assert [f.result(timeout=30)[0] for f in futures] == ["SIGUSR1", "SIGUSR1"]


@sky.compute
def nap_on(host: str, seconds: float) -> tuple[str, str]:
    """Sleep on machine `host` only (not on the machine that replaces it)."""
    if socket.gethostname() == host:
        time.sleep(seconds)
    return socket.gethostname(), os.environ["SKYWARD_SLURM_JOB_ID"]


def test_a_notice_starts_the_replacement_allocation_before_the_node_is_lost(
    login: SlurmCluster,
) -> None:
    """restarts=1: SIGUSR1 on node 1's agent step (what Slurm sends ahead of a preemption)
    makes the pool ask for node 1's replacement at once, a one-node allocation on the third
    machine; when node 1's machine is then lost, the restart takes it and asks Slurm for
    nothing more."""
    from concurrent.futures import ThreadPoolExecutor

    lost = ""
    try:
        with sky.ComputePool(
            provider=sky.Slurm(), nodes=2, restarts=1, broadcast_grace=1, stream_output=False
        ) as pool:
            before = whereabouts() @ pool
            lost, job = before[1][0], before[1][1]
            # SIGUSR1 to node 1's agent step, which srun forwards as it does Slurm's own
            # `--signal=USR1@<s>` (`scancel --signal` signals every step of the job).
            pool._sessions[1].stream.signal(signal.SIGUSR1)  # type: ignore[attr-defined]
            deadline = time.monotonic() + 60
            while len(jobs_of(pool, login)) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            ahead = jobs_of(pool, login)
            assert len(ahead) == 2, ahead  # the pool's, and the one started ahead
            spare_job = next(line.split()[0] for line in ahead if line.split()[0] != job)
            with ThreadPoolExecutor(1) as running:
                call = running.submit(lambda: nap_on(lost, 300) @ pool)
                time.sleep(2)
                login.kill_node(lost)
                after = call.result(timeout=180)
            assert len(jobs_of(pool, login)) == 2  # nothing more asked at the loss
        assert after[0] == before[0][:2]
        assert after[1][0] not in (lost, before[0][0]) and after[1][1] == spare_job, after
    finally:
        if lost:
            login.start_node(lost)
    assert wait_for_empty_queue(login, 10) == []
