"""The bare-host stand-in itself: fresh Debian images, no internet, a local index, total cleanup."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.bare.conftest import Bare, MakeBareHosts
from tests.support import bareroots, sshd

pytestmark = pytest.mark.ssh

PROBE = """
import json, socket, sys, time
out = {"version": list(sys.version_info[:2]), "hostname": socket.gethostname()}
start = time.monotonic()
try:
    socket.create_connection(("151.101.0.223", 443), timeout=3)
    out["connect"] = "connected"
except OSError as exc:
    out["connect"] = exc.errno
out["connect_s"] = time.monotonic() - start
start = time.monotonic()
try:
    out["dns"] = socket.getaddrinfo("pypi.org", 443)[0][4][0]
except OSError as exc:
    out["dns"] = "failed: %s" % exc
out["dns_s"] = time.monotonic() - start
print(json.dumps(out))
"""


def probe(bare: Bare, index: int) -> dict[str, object]:
    proc = bare.ssh(index, f"python3 -c '{PROBE}'", check=True)
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_bookworm_is_a_fresh_debian_12_without_venv_or_pip(bookworm_hosts: Bare) -> None:
    for i, host in enumerate(bookworm_hosts.hosts):
        found = probe(bookworm_hosts, i)
        assert found["version"] == [3, 11]
        assert found["hostname"] == host.name
        assert bookworm_hosts.ssh(i, "cat /etc/debian_version", check=True).stdout.startswith("12")
    venv = bookworm_hosts.ssh(0, "python3 -m venv /tmp/env")
    assert venv.returncode != 0
    assert "ensurepip" in venv.stdout + venv.stderr
    pip = bookworm_hosts.ssh(0, "python3 -m pip --version")
    assert pip.returncode != 0 and "No module named pip" in pip.stderr
    tools = bookworm_hosts.ssh(0, "command -v pip pip3 uv virtualenv curl wget")
    assert tools.stdout == ""


def test_trixie_is_a_fresh_debian_13(trixie_host: Bare) -> None:
    found = probe(trixie_host, 0)
    assert found["version"] == [3, 13]
    assert trixie_host.ssh(0, "cat /etc/debian_version", check=True).stdout.startswith("13")
    assert trixie_host.ssh(0, "python3 -m pip --version").returncode != 0
    assert trixie_host.ssh(0, "python3 -m venv /tmp/env").returncode != 0


def test_hosts_reach_no_internet_but_each_other(bookworm_hosts: Bare) -> None:
    found = probe(bookworm_hosts, 0)
    assert found["connect"] == 101  # ENETUNREACH: no route at all, no timeout
    assert isinstance(found["connect_s"], float) and found["connect_s"] < 2
    assert str(found["dns"]).startswith("failed")
    assert isinstance(found["dns_s"], float) and found["dns_s"] < 2
    other = bookworm_hosts.addresses[1]
    banner = bookworm_hosts.ssh(
        0,
        "python3 -c 'import socket; "
        f's = socket.create_connection(("{other}", 22), timeout=3); print(s.recv(4))\'',
        check=True,
    )
    assert "SSH-" in banner.stdout


def test_hosts_fetch_from_the_package_index(
    bookworm_hosts: Bare, bare_index: bareroots.PackageIndex
) -> None:
    script = (
        "import sys, urllib.request; "
        "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
    )
    page = bookworm_hosts.ssh(
        1, f'python3 -c "{script}" {bare_index.simple_url}numpy/', check=True
    ).stdout
    links = re.findall(r'href="([^"]+)"', page)
    assert links and all(re.search(r"/files/numpy-.*\.whl#sha256=[0-9a-f]{64}$", u) for u in links)
    assert "/simple/numpy/" in bare_index.requests
    # A whole file, checked against the fragment of the flat page.
    flat = urllib.request.urlopen(bare_index.flat_url, timeout=5).read().decode()
    (href,) = re.findall(r'href="(/files/packaging-[^"]+)"', flat)
    path, digest = href.split("#sha256=")
    fetch = (
        "import hashlib, sys, urllib.request; "
        "print(hashlib.sha256(urllib.request.urlopen(sys.argv[1], timeout=5).read()).hexdigest())"
    )
    got = bookworm_hosts.ssh(0, f'python3 -c "{fetch}" {bare_index.url}{path}', check=True)
    assert got.stdout.strip() == digest
    assert path in bare_index.requests


def test_package_index_pages(bare_index: bareroots.PackageIndex, bare_wheels: Path) -> None:
    def get(url: str) -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    wheels = sorted(p.name for p in bare_wheels.glob("*.whl"))
    assert any(w.startswith(f"uv-{bareroots.client_uv_version()}-") for w in wheels)
    assert any(w.startswith("numpy-") and "cp311" in w for w in wheels)
    flat = get(bare_index.flat_url)
    for wheel in wheels:
        digest = hashlib.sha256((bare_wheels / wheel).read_bytes()).hexdigest()
        assert f'href="/files/{wheel}#sha256={digest}"' in flat
    (cloudpickle,) = (w for w in wheels if w.startswith("cloudpickle-"))
    assert get(f"{bare_index.url}/files/{cloudpickle}.metadata").startswith("Metadata-Version")
    projects = re.findall(r'href="/simple/([^/"]+)/"', get(bare_index.simple_url))
    assert {"numpy", "cloudpickle", "packaging", "uv"} <= set(projects)
    # Not normalized: redirected to the PEP 503 name; unknown projects: 404.
    assert "cloudpickle-" in get(f"{bare_index.simple_url}CloudPickle")
    with pytest.raises(urllib.error.HTTPError, match="404"):
        get(f"{bare_index.simple_url}no-such-project/")


def test_host_filesystem_is_its_own(
    bookworm_hosts: Bare, bookworm_root: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "client-only"
    mine.write_text("x")
    assert bookworm_hosts.ssh(0, f"test -e {mine}").returncode == 1
    assert bookworm_hosts.ssh(0, f"test -e {sys.executable}").returncode == 1
    keys = bookworm_hosts.ssh(0, "cat /root/.ssh/authorized_keys", check=True).stdout
    assert keys.strip() == bookworm_hosts.key.public_line
    # Writes land in the host's overlay, never in the cached root nor the other host.
    bookworm_hosts.ssh(0, "echo hello > /root/marker", check=True)
    host = bookworm_hosts.hosts[0]
    assert (host.upper / "root" / "marker").read_text() == "hello\n"
    assert (host.root / "root" / "marker").exists()
    assert not (bookworm_root / "root" / "marker").exists()
    assert bookworm_hosts.ssh(1, "test -e /root/marker").returncode == 1
    # `run` is the same host as ssh sees, without the client's environment.
    assert host.run("cat", "/root/marker").stdout == "hello\n"
    assert host.run("hostname").stdout.strip() == host.name
    assert "SSL_CERT_FILE" not in host.run("env").stdout


def test_stop_start_and_kill(bookworm_hosts: Bare) -> None:
    host = bookworm_hosts.hosts[0]
    bookworm_hosts.ssh(0, "setsid nohup sleep 600 >/dev/null 2>&1 < /dev/null &", check=True)
    sleepers = [p for p in host.pids() if "sleep" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(sleepers) == 1
    host.stop()
    assert bookworm_hosts.ssh(0, "true", timeout=10).returncode == 255
    assert sshd.pid_alive(sleepers[0])  # detached: survives sshd, as on a real machine
    host.start()
    assert bookworm_hosts.ssh(0, "true").returncode == 0  # same host key: known_hosts holds
    host.kill_all()
    assert host.pids() == [] and not sshd.pid_alive(sleepers[0])


def test_mounts_are_private_and_close_leaves_nothing(make_bare_hosts: MakeBareHosts) -> None:
    first = make_bare_hosts(2, "bookworm")
    workdir = first.net.workdir
    assert workdir is not None
    host = first.hosts[0]
    first.ssh(0, "echo one > /root/marker", check=True)
    pid = host.sshd_pid
    assert pid is not None
    # /proc, /dev... exist only in the sshd's own mount namespace; the overlay in ours.
    # (A chrooted process sees its mount points relative to its root.)
    theirs = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    ours = Path("/proc/self/mountinfo").read_text().splitlines()
    assert any(line.split()[4] == "/" and f"upperdir={host.upper}," in line for line in theirs)
    assert {"/proc", "/sys", "/dev", "/dev/shm"} <= {line.split()[4] for line in theirs}
    our_points = [line.split()[4] for line in ours]
    assert str(host.root) in our_points
    assert not [p for p in our_points if p.startswith(f"{host.root}/")]
    pids = first.net.pids()
    netns = first.net.netns_names
    assert pids
    first.net.close()
    assert bareroots.mounts_with(str(workdir)) == {}  # in no process's namespace
    assert not any(sshd.pid_alive(p) for p in pids)
    assert not set(netns) & set(sshd._netns_names())
    assert not workdir.exists() and first.net.leftovers() == []
    # A new set on the same subnet starts from the clean root again.
    second = make_bare_hosts(1, "bookworm")
    assert second.ssh(0, "test -e /root/marker").returncode == 1
    assert second.hosts[0].host_key.public_line != host.host_key.public_line
