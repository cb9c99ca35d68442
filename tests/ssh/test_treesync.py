"""The data sync over real sshd: content-addressed pushes to many hosts, incremental pulls, each
node's receiver kept open across pushes.

Each sshd gives its sessions their own ``SKYWARD_CACHE_DIR`` (``SetEnv``), a symlink that a test
can point elsewhere (a fresh dir, a tiny tmpfs). Nodes are built the way `sky.SSH` builds them:
its `launch` and `prepare` verbs, run on one event loop kept for the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import skyward as sky
from skyward.console.progress import Progress
from skyward.errors import DataError
from skyward.hardware import ClusterSpec
from skyward.providers.remote import files
from skyward.providers.remote.bootstrap import RemoteNode, close_hosts, remote_nodes
from skyward.providers.remote.files import PullStats, PushStats, pull_tree, push_tree
from skyward.worker import treemanifest, treestore
from skyward.worker.objectstore import Store
from skyward.worker.treemanifest import Manifest
from skyward.worker.treestore import scan
from tests.ssh.conftest import processes_with, wait_until
from tests.support import sshd

pytestmark = pytest.mark.ssh

T = TypeVar("T")


class Loop:
    """One event loop in a thread for a module's connections; `run` waits for a coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@contextlib.contextmanager
def ssh_nodes(provider: sky.SSH, count: int) -> Iterator[tuple[Loop, list[RemoteNode]]]:
    """`count` prepared RemoteNodes (the source shipped, the interpreter set)."""
    loop = Loop()
    spec = ClusterSpec(nodes=count, pool_id="treesync", provider="ssh")
    cluster = loop.run(provider.launch(spec, Progress()))
    try:
        loop.run(provider.prepare(cluster, sky.Image(), Progress()), 120)
        yield loop, remote_nodes(cluster)
    finally:
        loop.run(close_hosts(cluster))
        loop.close()


def cache_link(base: Path, name: str) -> Path:
    """A symlink the sshd's SetEnv names; tests point it at a fresh dir."""
    link = base / name
    target = base / f"{name}-0"
    target.mkdir()
    link.symlink_to(target)
    return link


def repoint(link: Path, target: Path) -> Path:
    """Point the node's cache at `target`, a fresh store; skyward's copy of itself, which the
    node's preparation put in the first cache (`cache_link`'s), comes along (the node runs
    from it)."""
    target.mkdir(parents=True, exist_ok=True)
    src = link.with_name(f"{link.name}-0") / "src"
    if src.is_dir() and not (target / "src").exists():
        (target / "src").symlink_to(src)
    temp = link.with_name(link.name + ".new")
    temp.symlink_to(target)
    os.replace(temp, link)
    return target


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    # Not under pytest's tmp_path (mode 0700): the unreadable-file test scans as nobody.
    path = Path(tempfile.mkdtemp(prefix="skyward-treesync-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def one(keys: sshd.KeyPair, base: Path) -> Iterator[tuple[Loop, RemoteNode, Path]]:
    """One node on its own sshd whose cache is the symlink `base/cache`."""
    link = cache_link(base, "cache")
    server = sshd.SshdServer(
        authorized_keys=[keys], extra_config=[f"SetEnv SKYWARD_CACHE_DIR={link}"]
    )
    with server:
        provider = sky.SSH(
            [f"root@127.0.0.1:{server.port}"],
            key=str(keys.private_path),
            known_hosts=[server.known_hosts_line()],
            python=sys.executable,
        )
        with ssh_nodes(provider, 1) as (loop, nodes):
            yield loop, nodes[0], link


@pytest.fixture
def node(one: tuple[Loop, RemoteNode, Path], tmp_path: Path) -> tuple[Loop, RemoteNode, Path]:
    """The node with an empty store of its own for this test; returns the store's data dir."""
    loop, remote, link = one
    cache = repoint(link, tmp_path / "node-cache")
    return loop, remote, cache / "data"


def make_tree(root: Path) -> Path:
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a" / "b" / "deep.txt").write_text("deep\n")
    (root / "a" / "same.bin").write_bytes(b"x" * 300_000)
    (root / "copy.bin").write_bytes(b"x" * 300_000)  # same content as a/same.bin
    run = root / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    (root / "link").symlink_to("a/b/deep.txt")
    os.utime(root / "a" / "b" / "deep.txt", ns=(1_000_000_000, 1_000_000_000))
    os.utime(root / "a", ns=(2_000_000_000, 2_000_000_000))
    return root


def push(
    loop: Loop, nodes: list[RemoteNode], root: Path, stats: PushStats | None = None
) -> list[str]:
    return loop.run(push_tree(nodes, root, scan(root), stats=stats))


def assert_same_tree(local: Path, remote: Path) -> None:
    """`remote` mirrors `local`, with its owner's permission bits only (pushed and pulled
    copies are private)."""
    want = [
        e if e.kind == treemanifest.LINK else e._replace(mode=e.mode & 0o700)
        for e in scan(local).entries
    ]
    assert list(scan(remote).entries) == want


def test_first_push_materializes_the_tree(node: Any, tmp_path: Path) -> None:
    loop, remote, data = node
    root = make_tree(tmp_path / "src")
    stats = PushStats()
    [path] = push(loop, [remote], root, stats)
    tree = Path(path)
    assert tree.resolve().parent.parent == data / "trees"
    assert_same_tree(root, tree)
    assert (tree / "empty").is_dir()
    assert os.readlink(tree / "link") == "a/b/deep.txt"
    assert os.access(tree / "run.sh", os.X_OK) and (tree / "run.sh").stat().st_mode & 0o777 == 0o700
    assert (tree / "a").stat().st_mtime_ns == 2_000_000_000
    assert (tree / "a/b/deep.txt").stat().st_mtime_ns == 1_000_000_000
    # The duplicate content went once; nothing is left in tmp.
    assert stats.files_sent[remote.index] == 3
    assert 300_000 < stats.bytes_sent[remote.index] < 330_000
    assert not list((data / "tmp").iterdir())


def test_second_push_sends_nothing_and_a_change_sends_one_file(node: Any, tmp_path: Path) -> None:
    loop, remote, _data = node
    root = make_tree(tmp_path / "src")
    [first] = push(loop, [remote], root)
    again = PushStats()
    assert push(loop, [remote], root, again) == [first]
    assert again.files_sent[remote.index] == 0
    assert again.bytes_sent[remote.index] == 33  # the digest and its tag

    (root / "a" / "b" / "deep.txt").write_text("changed, and longer\n")
    changed = PushStats()
    [second] = push(loop, [remote], root, changed)
    assert second != first
    assert changed.files_sent[remote.index] == 1
    manifest = len(scan(root).encoded)
    assert changed.bytes_sent[remote.index] < manifest + 200
    assert_same_tree(root, Path(second))
    assert_same_tree(tmp_path / "src", Path(second))
    assert (Path(first) / "a/b/deep.txt").read_text() == "deep\n"  # the old version stays


def test_new_mode_or_mtime_reuses_content_without_sharing_the_inode(
    node: Any, tmp_path: Path
) -> None:
    loop, remote, _data = node
    root = make_tree(tmp_path / "src")
    [first] = push(loop, [remote], root)
    (root / "copy.bin").chmod(0o700)  # the owner's bits: the node's copies keep only those
    stats = PushStats()
    [second] = push(loop, [remote], root, stats)
    assert stats.files_sent[remote.index] == 0
    assert (Path(second) / "copy.bin").stat().st_mode & 0o777 == 0o700
    assert (Path(first) / "copy.bin").stat().st_mode & 0o777 == 0o600
    assert_same_tree(root, Path(second))


def test_a_single_file_as_root(node: Any, tmp_path: Path) -> None:
    loop, remote, _data = node
    file = tmp_path / "weights.bin"
    file.write_bytes(os.urandom(100_000))
    [path] = push(loop, [remote], file)
    assert Path(path).name == "weights.bin"
    assert Path(path).read_bytes() == file.read_bytes()
    assert Path(path).stat().st_mtime_ns == file.stat().st_mtime_ns


def test_two_pushes_of_the_same_tree_at_once(
    node: Any, one: tuple[Loop, RemoteNode, Path], tmp_path: Path
) -> None:
    loop, remote, data = node
    root = tmp_path / "src"
    root.mkdir()
    for i in range(20):
        (root / f"f{i}").write_bytes(os.urandom(200_000))
    manifest = scan(root)

    async def both() -> list[list[str]]:
        return list(await asyncio.gather(*(push_tree([remote], root, manifest) for _ in range(2))))

    [a], [b] = loop.run(both())
    assert a == b
    assert_same_tree(root, Path(a))
    assert not list((data / "tmp").iterdir())


def receiver_pid(remote: RemoteNode) -> int:
    receiver = files._receivers.get(remote)
    assert receiver is not None and receiver.peer is not None
    pid = receiver.peer.proc.pid  # the group's leader, which exec'd the interpreter
    assert b"skyward.worker.treestore" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return pid


def test_pushes_reuse_one_receiver(node: Any, tmp_path: Path) -> None:
    loop, remote, _data = node
    root = make_tree(tmp_path / "src")
    push(loop, [remote], root)
    pid = receiver_pid(remote)
    (root / "run.sh").write_text("#!/bin/sh\necho again\n")
    stats = PushStats()
    [path] = push(loop, [remote], root, stats)
    assert stats.files_sent[remote.index] == 1
    assert_same_tree(root, Path(path))
    assert receiver_pid(remote) == pid


def test_a_killed_receiver_is_reopened_by_the_next_push(node: Any, tmp_path: Path) -> None:
    loop, remote, _data = node
    root = make_tree(tmp_path / "src")
    push(loop, [remote], root)
    pid = receiver_pid(remote)
    os.kill(pid, signal.SIGKILL)  # namespaces share our pids
    assert wait_until(lambda: not sshd.pid_alive(pid), 5)
    (root / "run.sh").write_text("#!/bin/sh\necho after\n")
    stats = PushStats()
    [path] = push(loop, [remote], root, stats)
    assert_same_tree(root, Path(path))
    assert receiver_pid(remote) != pid
    assert stats.bytes_sent[remote.index] < len(scan(root).encoded) + 200  # one digest sent


def test_different_trees_at_once_take_turns(node: Any, tmp_path: Path) -> None:
    loop, remote, data = node
    roots = [tmp_path / "one", tmp_path / "two"]
    for root in roots:
        root.mkdir()
        for i in range(10):
            (root / f"f{i}").write_bytes(os.urandom(300_000))

    async def both() -> list[list[str]]:
        pushes = (push_tree([remote], r, scan(r)) for r in roots)
        return list(await asyncio.gather(*pushes))

    [a], [b] = loop.run(both())
    assert_same_tree(roots[0], Path(a))
    assert_same_tree(roots[1], Path(b))
    assert not list((data / "tmp").iterdir())


def receivers_of(cache: Path) -> list[int]:
    """Live treestore processes whose sshd session set SKYWARD_CACHE_DIR to `cache`."""
    mine = f"SKYWARD_CACHE_DIR={cache}".encode()
    found = []
    for pid in processes_with("skyward.worker.treestore"):
        with contextlib.suppress(OSError):
            if mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def test_closing_the_hosts_ends_the_receivers(
    keys: sshd.KeyPair, base: Path, tmp_path: Path
) -> None:
    link = cache_link(base, "closing")
    server = sshd.SshdServer(
        authorized_keys=[keys], extra_config=[f"SetEnv SKYWARD_CACHE_DIR={link}"]
    )
    with server:
        provider = sky.SSH(
            [f"root@127.0.0.1:{server.port}"] * 2,
            key=str(keys.private_path),
            known_hosts=[server.known_hosts_line()],
            python=sys.executable,
        )
        pids: list[int] = []
        try:
            with ssh_nodes(provider, 2) as (loop, nodes):
                push(loop, nodes, make_tree(tmp_path / "src"))
                pids = [receiver_pid(n) for n in nodes]
                assert sorted(receivers_of(link)) == sorted(pids)
                # One receiver would end by itself at the end of its input; a stopped one
                # must be killed by its host's close (its process group was adopted).
                os.kill(pids[1], signal.SIGSTOP)
            assert wait_until(lambda: not receivers_of(link), 10), receivers_of(link)
        finally:
            for pid in receivers_of(link):
                os.kill(pid, signal.SIGKILL)


def node_side(*pushes: bytes, store: Store) -> list[dict[str, Any]]:
    """`treestore.receive` in this process over `pushes`; the replies it wrote."""
    out = io.BytesIO()
    treestore.receive(io.BytesIO(b"".join(pushes)), out, store)
    replies, view = [], out.getvalue()
    while view:
        size = struct.unpack("!I", view[:4])[0]
        replies.append(json.loads(view[4 : 4 + size]))
        view = view[4 + size :]
    return replies


def frames(root: Path, manifest: Manifest, send: set[str] | None = None) -> bytes:
    """A whole push of `manifest` from `root`, with the contents `send` (None: all)."""
    wire = b"D" + bytes.fromhex(manifest.digest)
    wire += b"M" + struct.pack("!Q", len(manifest.encoded)) + manifest.encoded
    todo = {e.sha256 for e in manifest.files} if send is None else set(send)
    for e in manifest.files:
        if e.sha256 in todo:
            todo.discard(e.sha256)
            body = (root / e.path).read_bytes()
            wire += b"C" + bytes.fromhex(e.sha256) + struct.pack("!I", len(body)) + body
            wire += struct.pack("!I", 0)
    return wire + b"E"


def test_one_receive_serves_pushes_in_turn_until_an_error(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    (root / "a").write_bytes(b"a" * 1000)
    (root / "b").write_bytes(b"b" * 1000)
    first = scan(root)
    first_push = frames(root, first)
    (root / "b").write_bytes(b"B" * 1000)
    second = scan(root)
    changed = {e.sha256 for e in second.files} - {e.sha256 for e in first.files}
    store = Store(tmp_path / "data")
    replies = node_side(
        first_push, b"D" + bytes.fromhex(first.digest), frames(root, second, changed), store=store
    )
    assert [next(iter(r)) for r in replies] == [
        *("manifest", "need", "done"),
        "have",
        *("manifest", "need", "done"),
    ]
    assert replies[5]["need"] == sorted(changed)
    assert (Path(replies[6]["done"]) / "b").read_bytes() == b"B" * 1000
    # After an error the rest of the input is discarded: the push after it is not served.
    (root / "c").write_bytes(b"c")
    third = scan(root)
    sha = bytes.fromhex(third.files[-1].sha256)
    bad = frames(root, third).replace(b"C" + sha, b"C" + bytes(32))
    replies = node_side(bad, b"D" + bytes.fromhex(first.digest), store=store)
    assert [next(iter(r)) for r in replies] == ["manifest", "need", "error"]
    assert "not in the manifest" in replies[2]["error"]
    assert not list(store.tmp.iterdir())
    assert store.has(third.digest) is None


def test_missing_path_and_special_files_fail_before_sending(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere") as missing:
        scan(tmp_path / "nowhere")
    assert missing.value.path.endswith("nowhere")
    root = tmp_path / "src"
    root.mkdir()
    os.mkfifo(root / "pipe")
    with pytest.raises(DataError, match="not a regular file") as fifo:
        scan(root)
    assert fifo.value.path == str(root / "pipe")


def test_an_unreadable_file_fails(base: Path) -> None:
    # Root reads every file, so the scan runs as nobody for a moment (the real uid stays 0,
    # which lets the test switch back).
    root = Path(tempfile.mkdtemp(dir=base))
    root.chmod(0o755)
    (root / "ok").write_text("ok")
    secret = root / "secret"
    secret.write_text("no")
    secret.chmod(0)
    os.seteuid(65534)
    try:
        with pytest.raises(DataError, match="Permission denied") as denied:
            scan(root)
    finally:
        os.seteuid(0)
    assert denied.value.path == str(secret)


def test_a_full_disk_on_the_node_leaves_nothing(
    one: tuple[Loop, RemoteNode, Path], tmp_path: Path
) -> None:
    loop, remote, link = one
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        repoint(link, mount)
        root = tmp_path / "src"
        root.mkdir()
        (root / "small").write_bytes(b"s" * 1000)
        (root / "big").write_bytes(os.urandom(4_000_000))
        with pytest.raises(DataError, match="No space left on device") as full:
            push(loop, [remote], root)
        assert full.value.node == remote.index
        assert str(remote.host) in str(full.value)
        assert full.value.path == "big"
        assert not list((mount / "data" / "tmp").iterdir())
        assert not list((mount / "data" / "trees").iterdir())
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_missing_interpreter_is_a_data_error(node: Any, tmp_path: Path) -> None:
    loop, remote, _data = node
    bare = RemoteNode(remote.index, remote.host)
    with pytest.raises(DataError, match="not prepared"):
        loop.run(push_tree([bare], tmp_path, scan(tmp_path)))


def test_pull_mirrors_incrementally(node: Any, tmp_path: Path) -> None:
    loop, remote, _data = node
    src = tmp_path / "outputs"
    (src / "ckpt" / "empty").mkdir(parents=True)
    for i in range(5):
        (src / "ckpt" / f"step{i}").write_bytes(os.urandom(50_000))
    (src / "metrics.jsonl").write_text('{"loss": 1}\n')
    (src / "latest").symlink_to("ckpt/step4")
    (src / "ckpt" / "step0").chmod(0o600)
    local = tmp_path / "local"

    first = loop.run(pull_tree(remote, str(src), local))
    assert (first.files, first.bytes) == (6, 5 * 50_000 + 12)
    assert_same_tree(src, local)

    again = loop.run(pull_tree(remote, str(src), local))
    assert (again.files, again.bytes) == (0, 0) and again.paths == first.paths

    with (src / "metrics.jsonl").open("a") as fh:
        fh.write('{"loss": 0.5}\n')
    third = loop.run(pull_tree(remote, str(src), local))
    assert (third.files, third.bytes) == (1, 26)
    assert_same_tree(src, local)
    assert not [p for p in local.rglob("*") if ".skyward-" in p.name]


def test_pull_removes_only_what_it_brought_and_the_node_no_longer_has(
    node: Any, tmp_path: Path
) -> None:
    """A checkpoint's temporary directory caught mid-write goes once the node renamed it; a
    file made here, or a pull that knows of nothing before it (a replaced node), removes
    nothing."""
    loop, remote, _data = node
    src, local = tmp_path / "outputs", tmp_path / "local"
    (src / "step-1.tmp").mkdir(parents=True)
    (src / "step-1.tmp" / "state").write_text("half")
    first = loop.run(pull_tree(remote, str(src), local))
    (src / "step-1.tmp").rename(src / "step-1")
    (local / "mine.txt").write_text("made here")
    loop.run(pull_tree(remote, str(src), local, first.paths))
    assert sorted(p.name for p in local.iterdir()) == ["mine.txt", "step-1"]
    shutil.rmtree(src / "step-1")
    loop.run(pull_tree(remote, str(src), local))  # knows of nothing before it
    assert sorted(p.name for p in local.iterdir()) == ["mine.txt", "step-1"]


def test_pull_of_a_missing_dir_is_nothing(node: Any, tmp_path: Path) -> None:
    loop, remote, _data = node
    stats = loop.run(pull_tree(remote, str(tmp_path / "not-there"), tmp_path / "local"))
    assert stats == PullStats(0, 0)


def test_rescan_hashes_only_what_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_tree(tmp_path / "src")
    scan(root)
    hashed: list[Path] = []
    real = treemanifest._hash_file
    monkeypatch.setattr(treemanifest, "_hash_file", lambda p: hashed.append(p) or real(p))
    scan(root)
    assert hashed == []
    (root / "copy.bin").write_bytes(b"y" * 10)
    scan(root)
    assert hashed == [root / "copy.bin"]


def test_push_to_three_hosts_at_once(keys: sshd.KeyPair, base: Path, tmp_path: Path) -> None:
    reason = sshd.netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    links = [cache_link(base, f"host{i}") for i in range(3)]
    net = sshd.NetnsHosts(
        3,
        subnet="10.213.14.0/24",  # its own: the bare hosts' tests use .12 and .13
        authorized_keys=[keys],
        sshd_host_config=[[f"SetEnv SKYWARD_CACHE_DIR={link}"] for link in links],
    )
    with net:
        provider = sky.SSH(
            net.addresses,
            user="root",
            key=str(keys.private_path),
            known_hosts=net.known_hosts_lines(),
            python=sys.executable,
        )
        root = make_tree(tmp_path / "src")
        with ssh_nodes(provider, 3) as (loop, nodes):
            stats = PushStats()
            paths = push(loop, nodes, root, stats)
            assert [Path(p).parents[2] for p in paths] == [link / "data" for link in links]
            for path in paths:
                assert_same_tree(root, Path(path))
            assert sorted(stats.files_sent.values()) == [3, 3, 3]
            # One node already has it, the others receive a change: all at once again.
            (root / "run.sh").write_text("#!/bin/sh\necho changed\n")
            repoint(links[1], base / "host1-fresh")
            again = PushStats()
            paths = push(loop, nodes, root, again)
            assert again.files_sent == {0: 1, 1: 3, 2: 1}
            for path in paths:
                assert_same_tree(root, Path(path))
