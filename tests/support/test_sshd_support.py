"""Prove that tests/support/sshd.py gives real, working, self-cleaning OpenSSH servers."""

from __future__ import annotations

import asyncio
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .sshd import (
    SSHD,
    TEST_USER,
    KeyPair,
    NetnsHosts,
    SshdServer,
    SshUser,
    _netns_names,
    ensure_openssh_server,
    is_root,
    kill_processes_of,
    known_hosts_line,
    netns_unavailable_reason,
    pid_alive,
    processes_of,
    ssh_command,
)

pytestmark = [
    pytest.mark.ssh,
    pytest.mark.skipif(not is_root(), reason="real sshd tests need root (useradd, sshd, netns)"),
]


def _ssh(argv: list[str], timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
    )


def _wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sshd_path() -> Path:
    """Install openssh-server with our own function (no-op when already there)."""
    return ensure_openssh_server()


@pytest.fixture(scope="module")
def keydir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys")


@pytest.fixture(scope="module")
def user_key(keydir: Path) -> KeyPair:
    return KeyPair.generate(keydir, "user_key")


@pytest.fixture(scope="module")
def root_key(keydir: Path) -> KeyPair:
    return KeyPair.generate(keydir, "root_key")


@pytest.fixture(scope="module")
def test_user(sshd_path: Path, user_key: KeyPair) -> Iterator[SshUser]:
    """skyward-test with user_key in ~/.ssh/authorized_keys (removed afterwards)."""
    user = SshUser.ensure()
    user.authorize(user_key)
    yield user
    user.revoke(user_key)


@pytest.fixture(scope="module")
def server(sshd_path: Path, test_user: SshUser, root_key: KeyPair) -> Iterator[SshdServer]:
    """Run sshd on 127.0.0.1: user_key via ~skyward-test/.ssh, root_key via the server file."""
    with SshdServer(authorized_keys=[root_key]) as srv:
        yield srv


@pytest.fixture(scope="module")
def known_hosts(server: SshdServer, keydir: Path) -> Path:
    return server.write_known_hosts(keydir / "known_hosts_local")


@pytest.fixture(scope="module")
def netns_hosts(sshd_path: Path, user_key: KeyPair, test_user: SshUser) -> Iterator[NetnsHosts]:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NetnsHosts(3) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def netns_known_hosts(netns_hosts: NetnsHosts, keydir: Path) -> Path:
    return netns_hosts.write_known_hosts(keydir / "known_hosts_netns")


# --------------------------------------------------------------------------- basics


def test_ensure_openssh_server_leaves_no_system_sshd(sshd_path: Path) -> None:
    assert sshd_path == SSHD
    assert SSHD.exists()
    assert ensure_openssh_server() == SSHD  # idempotent, no apt the second time
    with socket.socket() as sock:
        sock.settimeout(1)
        assert sock.connect_ex(("127.0.0.1", 22)) != 0, "a system sshd listens on port 22"


def test_keypair_and_known_hosts_format(user_key: KeyPair) -> None:
    assert user_key.private_path.stat().st_mode & 0o777 == 0o600
    assert user_key.key_type == "ssh-ed25519"
    assert user_key.key_base64.startswith("AAAA")
    line = known_hosts_line("127.0.0.1", 2222, user_key.public_line)
    assert line == f"[127.0.0.1]:2222 ssh-ed25519 {user_key.key_base64}"
    assert known_hosts_line("10.213.0.11", 22, user_key.public_line).startswith("10.213.0.11 ")


def test_test_user_authorized_keys(test_user: SshUser, user_key: KeyPair) -> None:
    path = test_user.authorized_keys_path
    assert test_user.name == TEST_USER
    assert user_key.public_line in path.read_text().splitlines()
    assert path.stat().st_uid == test_user.uid
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


# --------------------------------------------------------------------------- localhost sshd


def test_ssh_echo_hi_as_test_user(server: SshdServer, user_key: KeyPair, known_hosts: Path) -> None:
    proc = _ssh(server.ssh_command(TEST_USER, user_key, known_hosts, "echo", "hi"))
    assert proc.returncode == 0, proc.stderr + server.log_tail()
    assert proc.stdout == "hi\n"


def test_ssh_exact_command_from_brief(
    server: SshdServer, user_key: KeyPair, known_hosts: Path
) -> None:
    argv = [
        "ssh", "-i", str(user_key.private_path),
        "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes",
        f"{TEST_USER}@127.0.0.1", "-p", str(server.port), "echo", "hi",
    ]  # fmt: skip
    proc = _ssh(argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "hi"


def test_ssh_as_root(server: SshdServer, root_key: KeyPair, known_hosts: Path) -> None:
    proc = _ssh(server.ssh_command("root", root_key, known_hosts, "id", "-u"))
    assert proc.returncode == 0, proc.stderr + server.log_tail()
    assert proc.stdout.strip() == "0"


def test_ssh_round_trip_time(
    server: SshdServer, user_key: KeyPair, root_key: KeyPair, known_hosts: Path
) -> None:
    timings: dict[str, list[float]] = {TEST_USER: [], "root": []}
    for user, key in ((TEST_USER, user_key), ("root", root_key)):
        for _ in range(3):
            start = time.perf_counter()
            proc = _ssh(server.ssh_command(user, key, known_hosts, "true"))
            timings[user].append(time.perf_counter() - start)
            assert proc.returncode == 0, proc.stderr
    print()
    for user, values in timings.items():
        print(
            f"ssh round trip ({user}, `true`, new connection each): "
            f"median {statistics.median(values) * 1000:.0f} ms, "
            f"min {min(values) * 1000:.0f} ms over {len(values)}"
        )


def test_asyncssh_with_known_hosts(
    server: SshdServer, user_key: KeyPair, known_hosts: Path
) -> None:
    asyncssh = pytest.importorskip("asyncssh")

    async def go() -> tuple[str, float]:
        start = time.perf_counter()
        async with asyncssh.connect(
            server.host,
            port=server.port,
            username=TEST_USER,
            client_keys=[str(user_key.private_path)],
            known_hosts=str(known_hosts),
        ) as conn:
            result = await conn.run("echo hi", check=True)
            return str(result.stdout), time.perf_counter() - start

    out, elapsed = asyncio.run(go())
    assert out == "hi\n"
    print(f"\nasyncssh connect + run `echo hi`: {elapsed * 1000:.0f} ms")


def test_asyncssh_rejects_unknown_host_key(
    server: SshdServer, user_key: KeyPair, keydir: Path
) -> None:
    asyncssh = pytest.importorskip("asyncssh")
    other = server.generate_host_key("other_for_asyncssh")
    bad = keydir / "known_hosts_wrong"
    bad.write_text(server.known_hosts_line(other.public_line) + "\n")

    async def go() -> None:
        async with asyncssh.connect(
            server.host,
            port=server.port,
            username=TEST_USER,
            client_keys=[str(user_key.private_path)],
            known_hosts=str(bad),
        ):
            pass

    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        asyncio.run(go())


# --------------------------------------------------------------------------- broken toolbox


def test_changed_host_key_is_rejected(
    sshd_path: Path, test_user: SshUser, user_key: KeyPair, tmp_path: Path
) -> None:
    with SshdServer() as srv:
        known = srv.write_known_hosts(tmp_path / "known_hosts")
        assert _ssh(srv.ssh_command(TEST_USER, user_key, known, "true")).returncode == 0
        port = srv.port
        srv.restart(host_key=srv.generate_host_key())
        assert srv.port == port
        proc = _ssh(srv.ssh_command(TEST_USER, user_key, known, "true"))
        assert proc.returncode == 255
        assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in proc.stderr


def test_stop_kills_sessions_and_refuses(
    sshd_path: Path, test_user: SshUser, user_key: KeyPair, tmp_path: Path
) -> None:
    marker = "31.4159"
    srv = SshdServer()
    try:
        srv.start()
        known = srv.write_known_hosts(tmp_path / "known_hosts")
        client = subprocess.Popen(
            srv.ssh_command(TEST_USER, user_key, known, "sleep", marker),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

        def remote_sleep() -> list[int]:
            return [p.pid for p in processes_of(TEST_USER) if f"sleep {marker}" in p.args]

        assert _wait_for(remote_sleep), srv.log_tail()
        sessions = srv.session_processes()
        assert sessions, "the live session should be below the listening sshd"
        srv.stop()
        assert not srv.running
        assert client.wait(timeout=10) != 0
        assert _wait_for(lambda: not remote_sleep(), timeout=5), "remote process survived"
        assert not any(pid_alive(pid) for pid in sessions)
        with socket.socket() as sock:
            sock.settimeout(1)
            assert sock.connect_ex((srv.host, srv.port)) != 0  # refused now
    finally:
        srv.close()
    assert not srv.workdir.exists()


def test_sshd_start_failure_reports_log(sshd_path: Path) -> None:
    srv = SshdServer(extra_config=["NoSuchSshdOption yes"], start_timeout=5)
    try:
        with pytest.raises(RuntimeError, match="NoSuchSshdOption"):
            srv.start()
        assert not srv.running
    finally:
        srv.close()


# --------------------------------------------------------------------------- namespaces


def test_ssh_to_every_netns_host(
    netns_hosts: NetnsHosts, user_key: KeyPair, netns_known_hosts: Path
) -> None:
    assert netns_hosts.addresses == ["10.213.0.11", "10.213.0.12", "10.213.0.13"]
    for host in netns_hosts:
        assert host.known_hosts_line().startswith(f"{host.address} ssh-ed25519 AAAA")
        proc = _ssh(
            ssh_command(host.address, 22, TEST_USER, user_key, netns_known_hosts, "echo hi")
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "hi\n"
        inside = host.run("ip", "-4", "-o", "addr", "show", "dev", "eth0").stdout
        assert f"{host.address}/24" in inside


def test_netns_hosts_reach_each_other_and_the_host(netns_hosts: NetnsHosts) -> None:
    connect = (
        "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
        "timeout=2).close(); print('ok')"
    )
    a, b, c = netns_hosts.hosts
    for src, dst in ((a, b), (b, c), (c, a)):
        out = src.run("python3", "-c", connect, dst.address, "22").stdout
        assert out.strip() == "ok", f"{src.netns} cannot reach {dst.address}:22"
    with socket.socket() as listener:
        listener.bind((netns_hosts.bridge_address, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        out = a.run("python3", "-c", connect, netns_hosts.bridge_address, str(port)).stdout
        assert out.strip() == "ok"


def test_netns_processes_are_per_namespace(
    netns_hosts: NetnsHosts, user_key: KeyPair, netns_known_hosts: Path
) -> None:
    marker = "27.1828"
    a, b, _ = netns_hosts.hosts
    client = subprocess.Popen(
        ssh_command(a.address, 22, TEST_USER, user_key, netns_known_hosts, "sleep", marker),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def in_a() -> bool:
            return any(f"sleep {marker}" in p.args for p in a.processes_of(TEST_USER))

        assert _wait_for(in_a)
        assert not any(f"sleep {marker}" in p.args for p in b.processes_of(TEST_USER))
        assert any(f"sleep {marker}" in p.args for p in processes_of(TEST_USER))
        # Restarting a host's sshd kills its live sessions and what they run.
        assert a.server is not None
        a.server.restart()
        assert _wait_for(lambda: not in_a(), timeout=5)
        assert client.wait(timeout=10) != 0
    finally:
        client.kill()
        client.wait()


def test_unreachable_address_fails_fast(
    netns_hosts: NetnsHosts, user_key: KeyPair, tmp_path: Path
) -> None:
    start = time.perf_counter()
    proc = _ssh(
        ssh_command(
            netns_hosts.unreachable_address, 22, TEST_USER, user_key, tmp_path / "kh", "true"
        )
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 255
    assert "No route to host" in proc.stderr
    assert elapsed < 2.0


def test_netns_hosts_clean_up_after_failure(sshd_path: Path) -> None:
    if (reason := netns_unavailable_reason()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    hosts = NetnsHosts(2, subnet="10.213.1.0/24", run_id="tclean")
    # A "crashed previous run" left a namespace and the bridge behind under the same names.
    subprocess.run(["ip", "netns", "add", hosts.netns_names[0]], check=True)
    subprocess.run(["ip", "link", "add", hosts.bridge, "type", "bridge"], check=True)
    sshd_pids: list[int] = []
    with pytest.raises(ZeroDivisionError), hosts:
        assert [h.address for h in hosts] == ["10.213.1.11", "10.213.1.12"]
        sshd_pids = [h.server.pid for h in hosts if h.server is not None and h.server.pid]
        assert len(sshd_pids) == 2
        _ = 1 / 0
    assert hosts.leftovers() == []
    netns = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=False).stdout
    assert "tclean" not in netns + links
    assert "10.213.1." not in routes
    assert not any(pid_alive(pid) for pid in sshd_pids)


def test_a_set_killed_before_its_teardown_does_not_take_its_subnet_from_the_next(
    sshd_path: Path,
) -> None:
    """A run killed mid-way (a timeout, a cancelled CI job) leaves a live bridge on its subnet
    under another run id; the next set on that subnet must still be reachable (it was not:
    the machine routed into the dead bridge, and every test of the folder errored)."""
    if (reason := netns_unavailable_reason()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    killed = NetnsHosts(1, subnet="10.213.1.0/24", run_id="tdead").build()
    assert killed._claim is not None
    killed._claim.close()  # what the dead process's exit does to its lock; nothing else ran
    killed._claim = None
    try:
        with NetnsHosts(1, subnet="10.213.1.0/24", run_id="tnext") as hosts:
            assert hosts.hosts[0].server is not None and hosts.hosts[0].server.running
            links = subprocess.run(
                ["ip", "-o", "link"], capture_output=True, text=True, check=False
            ).stdout
            assert "tdead" not in links and "tdead" not in " ".join(_netns_names())
            dead = killed.hosts[0].server
            assert dead is not None and dead._proc is not None
            assert dead._proc.wait(timeout=10) is not None  # its sshd was killed with it
    finally:
        killed._built = False  # its remains went with the next set's build


def test_netns_hosts_setup_failure_cleans_up(sshd_path: Path) -> None:
    if (reason := netns_unavailable_reason()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    hosts = NetnsHosts(
        2, subnet="10.213.3.0/24", run_id="tfail", sshd_extra_config=["NoSuchSshdOption yes"]
    )
    with pytest.raises(RuntimeError, match="NoSuchSshdOption"), hosts:
        pass
    assert hosts.leftovers() == []
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert "tfail" not in out


def test_orphaned_remote_process_is_found_and_killed(
    netns_hosts: NetnsHosts, user_key: KeyPair, netns_known_hosts: Path
) -> None:
    marker = "41.4142"
    host = netns_hosts[2]
    detach = f"nohup sleep {marker} >/dev/null 2>&1 &"
    argv = ssh_command(host.address, 22, TEST_USER, user_key, netns_known_hosts, detach)
    assert _ssh(argv).returncode == 0
    # The session is over (sshd's side winds down a moment after the client returns),
    # so the sleep now lives outside sshd's process tree ...
    server = host.server
    assert server is not None
    assert _wait_for(lambda: not any(pid_alive(p) for p in server.session_processes()), 5)
    assert any(f"sleep {marker}" in p.args for p in host.processes_of(TEST_USER))
    # ... and only a per-user (or per-namespace) sweep finds it.
    assert kill_processes_of(TEST_USER, netns=host.netns) >= 1
    assert not any(f"sleep {marker}" in p.args for p in host.processes_of(TEST_USER))


def test_overlapping_real_network_is_refused(sshd_path: Path) -> None:
    if (reason := netns_unavailable_reason()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    dummy = "skytovl-test"
    subprocess.run(["ip", "link", "del", dummy], capture_output=True, check=False)
    subprocess.run(["ip", "link", "add", dummy, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", "10.214.0.1/24", "dev", dummy], check=True)
        subprocess.run(["ip", "link", "set", dummy, "up"], check=True)
        hosts = NetnsHosts(1, subnet="10.214.7.0/24", run_id="tovl")
        with pytest.raises(RuntimeError, match="overlaps a real route"):
            hosts.build()
        assert hosts.leftovers() == []
    finally:
        subprocess.run(["ip", "link", "del", dummy], check=True)
