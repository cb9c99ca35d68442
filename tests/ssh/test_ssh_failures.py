"""Failures and bad input of the SSH provider, each against real sshd processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import asyncssh
import pytest

import skyward as sky
from skyward.transport.sshhost import HostKeyError, HostUnreachableError, SSHAuthError
from tests.conftest import reported_pids, sigint_default
from tests.contract import ends, zeros_with_marks
from tests.ssh.conftest import BUILD_ENV, Hosts, Server, processes_with, wait_until
from tests.support import sshd

pytestmark = pytest.mark.ssh


@sky.compute
def node_pid() -> int:
    return os.getpid()


@sky.compute
def nap(seconds: float) -> int:
    time.sleep(seconds)
    return sky.instance_info().node


def fingerprint(public_line: str) -> str:
    return str(asyncssh.import_public_key(public_line).get_fingerprint("sha256"))


def start(provider: sky.SSH, nodes: int = 1, **kwargs: object) -> sky.ComputePool:
    return sky.ComputePool(provider=provider, nodes=nodes, stream_output=False, **kwargs)  # type: ignore[arg-type]


def launch(provider: sky.SSH, nodes: int = 1, **kwargs: object) -> None:
    """Start a pool and leave at once (for tests where starting must fail)."""
    with start(provider, nodes, **kwargs):
        pass


# -- bad input: fails before connecting -----------------------------------------------------------


def test_more_nodes_than_hosts_is_a_config_error() -> None:
    with pytest.raises(sky.ConfigError, match=re.escape("nodes=3 but sky.SSH was given 2 host")):
        sky.ComputePool(provider=sky.SSH(["a", "b"]), nodes=3)


@pytest.mark.parametrize("host", ["user@@host", "host:99999", "host:", "us er@host", ""])
def test_malformed_host_is_a_config_error(host: str) -> None:
    with pytest.raises(sky.ConfigError):
        sky.SSH([host])


def test_missing_key_and_known_hosts_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(sky.ConfigError, match="key file"):
        sky.SSH(["h"], key=tmp_path / "nope")
    with pytest.raises(sky.ConfigError, match="known_hosts file"):
        sky.SSH(["h"], known_hosts=tmp_path / "nope")


def test_host_string_forms() -> None:
    provider = sky.SSH(["a", "bob@b:2222", "[::1]:23"], user="ann", port=2200)
    assert provider.hosts == ["ann@a:2200", "bob@b:2222", "ann@[::1]:23"]


# -- connecting -----------------------------------------------------------------------------------


def test_wrong_key_is_an_authentication_error(local_sshd: Server, tmp_path: Path) -> None:
    stranger = sshd.KeyPair.generate(tmp_path)
    with pytest.raises(SSHAuthError, match=re.escape("127.0.0.1")) as caught:
        launch(local_sshd.provider(key=str(stranger.private_path)))
    assert isinstance(caught.value, sky.ProvisionError)
    assert str(local_sshd.port) in caught.value.host


def test_wrong_user_is_an_authentication_error(local_sshd: Server) -> None:
    with pytest.raises(SSHAuthError, match=f"nosuchuser@127.0.0.1:{local_sshd.port}"):
        launch(local_sshd.provider(user="nosuchuser"))


def test_unknown_host_key_names_host_and_fingerprint(local_sshd: Server, tmp_path: Path) -> None:
    other = sshd.KeyPair.generate(tmp_path, "other")
    lines = [sshd.known_hosts_line("10.9.9.9", 22, other.public_line)]
    with pytest.raises(HostKeyError, match="unknown") as caught:
        launch(local_sshd.provider(known_hosts=lines))
    expected = fingerprint(local_sshd.sshd.host_public_key)
    assert caught.value.fingerprint == expected
    assert expected in str(caught.value) and f"127.0.0.1:{local_sshd.port}" in str(caught.value)


def test_changed_host_key_names_host_and_fingerprint(local_sshd: Server, tmp_path: Path) -> None:
    other = sshd.KeyPair.generate(tmp_path, "other")
    lines = [local_sshd.sshd.known_hosts_line(other.public_line)]
    with pytest.raises(HostKeyError, match="CHANGED") as caught:
        launch(local_sshd.provider(known_hosts=lines))
    assert fingerprint(local_sshd.sshd.host_public_key) in str(caught.value)


def test_refused_connection_fails_fast_naming_the_host() -> None:
    port = sshd.free_port()
    began = time.monotonic()
    with pytest.raises(HostUnreachableError, match=f"127.0.0.1:{port}"):
        launch(sky.SSH([f"127.0.0.1:{port}"], known_hosts=[], connect_timeout=5))
    assert time.monotonic() - began < 5


def test_silent_host_fails_within_the_connect_timeout() -> None:
    # Accepts TCP (kernel backlog) but never sends an SSH banner.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(HostUnreachableError, match=f"127.0.0.1:{port}.*1 s"):
            launch(sky.SSH([f"127.0.0.1:{port}"], known_hosts=[], connect_timeout=1))
        assert time.monotonic() - began < 5


def test_one_bad_host_fails_the_launch_and_names_it(local_sshd: Server) -> None:
    port = sshd.free_port()
    provider = sky.SSH(
        [local_sshd.host(), f"root@127.0.0.1:{port}"],
        key=str(local_sshd.key.private_path),
        known_hosts=str(local_sshd.known_hosts),
        python=sys.executable,
    )
    with pytest.raises(sky.ProvisionError, match=f"127.0.0.1:{port}"):
        launch(provider, nodes=2)


# -- bootstrap ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_failed_package_install_is_a_bootstrap_error_with_the_tail(local_sshd: Server) -> None:
    image = sky.Image(pip=[f"skyward-no-such-package-{uuid.uuid4().hex[:8]}"])
    with pytest.raises(sky.BootstrapError) as caught:
        launch(local_sshd.provider(user=sshd.TEST_USER), image=image)
    message = str(caught.value)
    assert f"skyward-test@127.0.0.1:{local_sshd.port}" in message
    assert "last lines" in message and "skyward-no-such-package" in caught.value.output


def test_a_uv_no_index_serves_is_a_bootstrap_error_naming_each_index(
    local_sshd: Server,
) -> None:
    """A uv version other than the client's cannot be sent: the host fetches its wheel from
    the image's indexes, then the default one; none serves it, and the error says what each
    answered."""
    folder = Path(tempfile.mkdtemp(prefix="skyward-empty-index-"))
    folder.chmod(0o755)  # the test user reads it
    image = sky.Image(
        pip=[f"skyward-no-such-package-{uuid.uuid4().hex[:8]}"],
        indexes=[sky.Index(folder.as_uri() + "/", flat=True)],  # an empty folder
    )
    provider = local_sshd.provider(
        user=sshd.TEST_USER,
        uv_version="0.0.0.dev424242",
        build_env={**BUILD_ENV, "UV_DEFAULT_INDEX": "http://127.0.0.1:9/simple/"},  # nothing
    )
    try:
        expected = re.escape("fetching uv 0.0.0.dev424242")
        with pytest.raises(sky.BootstrapError, match=expected) as caught:
            launch(provider, image=image)
    finally:
        folder.rmdir()
    message = str(caught.value)
    assert f"127.0.0.1:{local_sshd.port}" in message
    assert "no index served uv 0.0.0.dev424242" in message
    assert f"{folder.as_uri()}/: no uv 0.0.0.dev424242 wheel" in caught.value.output
    assert "http://127.0.0.1:9/simple/: " in caught.value.output


def test_apt_packages_already_there_cost_nothing_and_missing_ones_are_installed_or_named(
    local_sshd: Server,
) -> None:
    # installed already: the one check command sees it, nothing runs (not even sudo)
    with start(local_sshd.provider(user=sshd.TEST_USER), image=sky.Image(apt=["openssh-server"])):
        pass
    # missing, as a user without sudo: apt runs through `sudo -n`, which fails, and says why
    missing = f"skyward-no-such-deb-{uuid.uuid4().hex[:6]}"
    with pytest.raises(sky.BootstrapError, match=f"installing apt packages {missing}") as caught:
        launch(local_sshd.provider(user=sshd.TEST_USER), image=sky.Image(apt=[missing]))
    assert "sudo" in caught.value.output


@pytest.mark.slow
def test_apt_as_root_runs_apt_get_and_reports_its_output(local_sshd: Server) -> None:
    missing = f"skyward-no-such-deb-{uuid.uuid4().hex[:6]}"
    with pytest.raises(sky.BootstrapError, match=f"installing apt packages {missing}") as caught:
        launch(local_sshd.provider(), image=sky.Image(apt=[missing]))
    assert f"Unable to locate package {missing}" in caught.value.output


def test_missing_python_is_a_bootstrap_error(local_sshd: Server) -> None:
    with pytest.raises(sky.BootstrapError, match=re.escape("python3.99 was not found")):
        launch(local_sshd.provider(python="python3.99"))


# -- dying mid-call -------------------------------------------------------------------------------


def test_sshd_killed_mid_call_fails_the_call_stops_the_others_and_the_host_can_rejoin(
    local_sshd: Server, own_sshd: Server
) -> None:
    provider = sky.SSH(
        [local_sshd.host(), own_sshd.host()],
        key=str(local_sshd.key.private_path),
        known_hosts=[local_sshd.sshd.known_hosts_line(), own_sshd.sshd.known_hosts_line()],
        python=sys.executable,
    )
    with start(provider, nodes=2) as pool:
        pids = node_pid() @ pool
        threading.Timer(1.0, own_sshd.sshd.stop).start()
        began = time.monotonic()
        with pytest.raises(sky.WorkerError) as caught:
            nap(60) @ pool
        assert time.monotonic() - began < 30
        assert caught.value.node == 1 and "node 1" in str(caught.value)
        # the host comes back (sshd restarted): the pool can take it again
        own_sshd.sshd.start()
        pool.replace(1)
        assert len(set(node_pid() @ pool) - set(pids)) == 2
    assert wait_until(lambda: not any(sshd.pid_alive(p) for p in pids), 10)


def test_agent_killed_mid_call_is_a_worker_error(local_sshd: Server) -> None:
    provider = local_sshd.provider(count=2)
    # no nodes=: an SSH pool has one node per host
    with sky.ComputePool(provider=provider, stream_output=False) as pool:
        assert len(pool.nodes) == 2
        pids = node_pid() @ pool
        threading.Timer(1.0, os.kill, (pids[0], signal.SIGKILL)).start()
        with pytest.raises(sky.WorkerError) as caught:
            nap(60) @ pool
        assert caught.value.node == 0 and "node 0" in str(caught.value)
    assert wait_until(lambda: not any(sshd.pid_alive(p) for p in pids), 10)


def test_a_hung_agent_is_declared_dead_and_removed(local_sshd: Server) -> None:
    """An agent stopped with SIGSTOP (hung, not dead: its connection stays up) goes silent:
    the call fails naming its node once heartbeat_timeout passes, the other node's call is
    stopped, and both agents are gone after the pool (SIGKILL reaches a stopped process)."""
    provider = local_sshd.provider(count=2)
    # 5 s, not less: on a loaded 2-core machine a live node's own heartbeat has been 2 s late.
    with sky.ComputePool(provider=provider, heartbeat_timeout=5.0, stream_output=False) as pool:
        pids = node_pid() @ pool
        threading.Timer(0.5, os.kill, (pids[1], signal.SIGSTOP)).start()
        started = time.monotonic()
        with pytest.raises(sky.WorkerError, match="heartbeat_timeout") as caught:
            nap(60) @ pool
        assert caught.value.node == 1
        assert time.monotonic() - started < 20  # 5 s of silence, checked a few times a second
    assert wait_until(lambda: not any(sshd.pid_alive(p) for p in pids), 10)


def test_a_host_cut_off_mid_call_fails_the_call_and_its_agent_stops_by_itself(
    netns_hosts: Hosts,
) -> None:
    """A partition: the host's link goes down mid-call, so nothing closes and no signal can
    reach it. The client declares the node dead after heartbeat_timeout; the agent, hearing
    no ping for as long, stops by itself, before the link comes back; a new pool then works."""
    host = netns_hosts.net.hosts[-1]
    provider = netns_hosts.provider(len(netns_hosts.net.hosts))
    provider.endpoints = provider.endpoints[-1:]  # that one host
    timeout = 4.0
    link = ["ip", "link", "set", host.veth]
    try:
        with sky.ComputePool(
            provider=provider, nodes=1, heartbeat_timeout=timeout, stream_output=False
        ) as pool:
            pid = node_pid() >> pool
            threading.Timer(0.5, subprocess.run, ([*link, "down"],), {"check": True}).start()
            started = time.monotonic()
            with pytest.raises(sky.WorkerError, match="heartbeat_timeout") as caught:
                nap(60) >> pool
            noticed = time.monotonic() - started
            assert caught.value.node == 0
            # Still cut off: only the agent itself can end it.
            assert wait_until(lambda: not sshd.pid_alive(pid), timeout + 15), "agent still runs"
            stopped = time.monotonic() - started
            subprocess.run([*link, "up"], check=True)
        print(f"partition: client noticed in {noticed:.1f} s, agent gone in {stopped:.1f} s")
        assert noticed < timeout + 10
    finally:
        subprocess.run([*link, "up"], check=False)
    with sky.ComputePool(provider=provider, nodes=1, stream_output=False) as pool:
        assert node_pid() >> pool != pid


# -- Ctrl-C ---------------------------------------------------------------------------------------


def test_ctrl_c_during_bootstrap_leaves_no_remote_process(local_sshd: Server) -> None:
    token = f"skyward-ctrl-c-{uuid.uuid4().hex[:8]}"
    script = textwrap.dedent(f"""
        import sys
        import skyward as sky
        provider = sky.SSH([{local_sshd.host()!r}] * 2, key={str(local_sshd.key.private_path)!r},
                           known_hosts={str(local_sshd.known_hosts)!r}, python=sys.executable)
        image = sky.Image(setup=["sleep 300 # {token}"])
        with sky.ComputePool(provider=provider, nodes=2, image=image):
            pass
    """)
    client = subprocess.Popen(
        [sys.executable, "-c", script], cwd=Path(__file__).parents[2], preexec_fn=sigint_default
    )
    try:
        assert wait_until(lambda: len(processes_with(f"sleep 300 # {token}")) >= 1, 60), (
            "the setup command never started"
        )
        client.send_signal(signal.SIGINT)
        assert client.wait(30) != 0
    finally:
        client.kill()
    assert wait_until(lambda: not processes_with(token), 10), processes_with(token)
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert token not in out


@pytest.mark.slow
def test_a_value_over_2_gib_travels_both_ways_over_ssh(local_sshd: Server) -> None:
    """Past every 32-bit length, through an SSH channel's flow control: a 2 GiB result comes
    back whole and goes out again whole."""
    n = (2 << 30) + 12_345
    with sky.ComputePool(provider=local_sshd.provider(), nodes=1, stream_output=False) as pool:
        started = time.monotonic()
        data = zeros_with_marks(n) >> pool
        back = time.monotonic() - started
        assert (len(data), data[0], data[-1]) == (n, 1, 2)
        started = time.monotonic()
        assert ends(data) >> pool == (n, 1, 2)
        print(f"2 GiB over SSH: {back:.1f} s back, {time.monotonic() - started:.1f} s out")


SSH_CLIENT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    import skyward as sky

    config = json.loads(sys.argv[1])

    @sky.compute
    def hang():
        child = subprocess.Popen(["sleep", "300"])
        print("PIDS", os.getpid(), child.pid, flush=True)
        time.sleep(300)

    provider = sky.SSH([config["host"]] * 2, key=config["key"], known_hosts=config["known"],
                       python=sys.executable)
    with sky.ComputePool(provider=provider, nodes=2) as pool:
        hang() @ pool
    """
)


def test_the_client_killed_mid_call_leaves_nothing_on_the_host(local_sshd: Server) -> None:
    """SIGKILL: the client unwinds nothing. Its TCP connection closes with it, sshd ends the
    sessions, and each agent, finding its stream gone, takes down what it started."""
    config = json.dumps(
        {
            "host": local_sshd.host(),
            "key": str(local_sshd.key.private_path),
            "known": str(local_sshd.known_hosts),
        }
    )
    client = subprocess.Popen(
        [sys.executable, "-c", SSH_CLIENT, config],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).parents[2],
        preexec_fn=sigint_default,
    )
    assert client.stdout is not None
    pids: list[int] = []
    try:
        pids = reported_pids(client.stdout, 4)
        assert len(pids) == 4, f"the nodes never reported their pids: {pids}"
    finally:
        client.kill()
        client.wait(10)
    killed = time.monotonic()
    assert wait_until(lambda: not any(sshd.pid_alive(p) for p in pids), 20), "left running"
    print(f"client SIGKILL: agents and their children gone in {time.monotonic() - killed:.1f} s")


def test_a_host_whose_every_process_dies_fails_the_call_and_can_be_replaced(
    netns_hosts: Hosts,
) -> None:
    """A reboot, as near as a namespace gets: every process in it is killed (sshd, agent,
    what the agent started). The call fails at once naming the node; once sshd is back,
    `replace` brings the node back."""
    host = netns_hosts.net.hosts[-1]
    assert host.server is not None
    provider = netns_hosts.provider(len(netns_hosts.net.hosts))
    provider.endpoints = provider.endpoints[-1:]
    with start(provider, nodes=1) as pool:
        first = node_pid() >> pool

        def reboot() -> None:
            for pid in host.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        rebooting = threading.Timer(0.5, reboot)
        rebooting.start()
        began = time.monotonic()
        try:
            with pytest.raises(sky.WorkerError) as caught:
                nap(60) >> pool
            assert caught.value.node == 0
            assert time.monotonic() - began < 10
        finally:
            # The call can fail before the reboot has killed sshd: restart it only once the
            # old one is gone, or start() finds it running and the kill then takes it down.
            rebooting.join()
            deadline = time.monotonic() + 10
            while host.server.running and time.monotonic() < deadline:
                time.sleep(0.02)
            host.server.start()  # the host is back
        pool.replace(0)
        assert node_pid() >> pool != first
    assert not sshd.pid_alive(first)


def test_stacks_over_ssh_name_the_stuck_node(local_sshd: Server) -> None:
    """`pool.stacks()` reaches an agent over SSH (a `kill -USR2` on the connection) while its
    main thread is stuck in a call."""
    from tests.test_stacks import assert_stuck_on, stuck_in_a_wait

    with sky.ComputePool(provider=local_sshd.provider(), nodes=1, stream_output=False) as pool:
        pool.submit(stuck_in_a_wait(0, 30), node=0)
        time.sleep(0.5)
        assert_stuck_on(pool.stacks(timeout=10), node=0, nodes=1)
