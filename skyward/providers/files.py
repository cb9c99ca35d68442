"""Trees to and from SSH nodes: a content-addressed push to many nodes, an incremental pull.

`push_tree` makes a scanned local tree (`treestore.scan`) exist in every node's store at once
and returns where; `pull_tree` mirrors a node's directory into a local one. Both talk to
``python -m skyward.worker.treestore`` on the node, with the framing described in
`skyward.worker.treestore`: a pull over an exec channel of its own, pushes over the node's
`Receiver`, one ``receive`` process opened by the node's first push and kept for the next ones
(an exec channel costs a login shell and an interpreter's start: 0.2-0.4 s, most of a small
re-push). Its process group is the host's (`SSHHost.start` adopts it), so closing the host,
which a pool's end or `replace` does, ends it. Pushes to one node take turns on its receiver;
a push that fails closes the receivers it used (a node that reported an error discards the rest
of its input), and the next push opens new ones. A kept receiver that died since its last push
(killed on the host) is reopened once, transparently, when its first reply fails.

Push, per node: the tree's digest (a node that has the tree answers at once: one small round
trip), then the manifest, to which the node answers the contents it lacks; only those are sent.
Each local file is read once, in a thread, and the same chunks are written to every node that
lacks it, waiting for the slowest node's flow control before the next chunk (bounded memory).
A file is checked against its scan after it was read (size, mtime, ctime, inode), so a file
that changed in between fails the push instead of poisoning a node's store.

Why an exec channel and not SFTP (benchmarks/bench_data.py, 3 namespace hosts on one loaded
2-core machine, asyncssh with skyward's ciphers, medians of 3): 1,000 files of 1 MiB to 3 hosts
took 23.0 s by SFTP ``put`` and 22.9 s as a ``tar`` stream on an exec channel, 19.6 s by
`push_tree`; 200 x 1 MB from each of 3 hosts took 4.0 s by SFTP ``get``, 4.3 s by ``tar c`` on
an exec channel, 3.3 s by `pull_tree`. Bulk throughput is the same (the cipher is the cost);
SFTP cannot carry the manifest exchange or a node's store logic, and needs a request per block
and a round trip per file. SFTP wins only on small transfers: ``internal-sftp`` starts no login
shell and no interpreter, which on that machine cost 0.2-0.3 s per exec channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import stat
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import asyncssh

from skyward.errors import DataError
from skyward.providers.remote import RemoteNode, module_command
from skyward.transport.ssh import RemoteProcess
from skyward.worker.treemanifest import DIR, FILE, LINK, Entry, Manifest, unchanged
from skyward.worker.treestore import CHUNK, END, FAILED, GONE

MODULE = "skyward.worker.treestore"
_LENGTH = struct.Struct("!I")


@dataclass
class PushStats:
    """What one `push_tree` wrote, by node index: bytes on the channel (framing included) and
    contents (distinct files) sent."""

    bytes_sent: dict[int, int] = field(default_factory=dict)
    files_sent: dict[int, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())


@dataclass
class PullStats:
    """What one `pull_tree` received: files written and their bytes; `paths`: every entry the
    node listed (give them to the next pull as `pulled`)."""

    files: int = 0
    bytes: int = 0
    paths: frozenset[str] = frozenset()


class _Peer:
    """One node's treestore process, its replies, and what one transfer wrote to it."""

    def __init__(self, node: RemoteNode, proc: RemoteProcess, what: str, *args: str) -> None:
        self.node, self.proc, self.what, self.args = node, proc, what, args
        self.kept = False  # a push finished on this process: it is reused, and may have died
        self.reset()

    def reset(self) -> None:
        self.sent = 0
        self.files = 0
        self.need: set[str] = set()
        self.final: asyncio.Task[dict[str, Any]] | None = None

    @classmethod
    async def start(cls, node: RemoteNode, what: str, *args: str) -> _Peer:
        return cls(node, await _launch(node, what, *args), what, *args)

    async def reopen(self) -> None:
        """Replace a broken process with a new one."""
        await self.close(abort=True)
        self.proc = await _launch(self.node, self.what, *self.args)
        self.kept = False
        self.reset()

    def error(self, message: str, path: str = "") -> DataError:
        where = f" ({path})" if path and path not in message else ""
        return DataError(
            f"{self.what} on node {self.node.index} ({self.node.host}) failed: {message}{where}",
            node=self.node.index,
            path=path,
        )

    def write(self, data: bytes) -> None:
        self.proc.process.stdin.write(data)
        self.sent += len(data)

    async def drain(self) -> None:
        await self.proc.process.stdin.drain()

    async def reply(self) -> dict[str, Any]:
        """The node's next message; its error (or a broken channel) as a `DataError`."""
        try:
            size = _LENGTH.unpack(await self.proc.process.stdout.readexactly(4))[0]
            message: dict[str, Any] = json.loads(await self.proc.process.stdout.readexactly(size))
        except asyncio.IncompleteReadError:
            raise self.error(await self._ended()) from None
        except (OSError, asyncssh.Error) as exc:
            raise self.error(f"the connection broke ({exc})") from None
        if "error" in message:
            raise self.error(str(message["error"]), str(message.get("path") or ""))
        return message

    async def _ended(self) -> str:
        """Why the node's process stopped talking: its stderr's last lines, its status."""
        with contextlib.suppress(Exception):
            tail = (await asyncio.wait_for(self.proc.process.stderr.read(), 5)).decode(
                errors="replace"
            )
            status = await asyncio.wait_for(self.proc.exit_status(), 5)
            lines = "\n".join(tail.strip().splitlines()[-10:])
            return f"the node's process ended (exit status {status})" + (
                f":\n{lines}" if lines else ""
            )
        return "the node's process ended"

    async def close(self, abort: bool = False) -> None:
        """End the input (before b"E": the node drops its temp dir) and wait for the exit."""
        with contextlib.suppress(Exception):
            self.proc.process.stdin.write_eof()
        if self.final is not None:
            self.final.cancel()
            with contextlib.suppress(BaseException):
                await self.final  # its error was raised already, or is moot now
        try:
            await asyncio.wait_for(self.proc.exit_status(), 10 if abort else 30)
        except TimeoutError:
            await self.node.host.kill_groups([self.proc.pid])
        self.node.host.groups.discard(self.proc.pid)


async def _launch(node: RemoteNode, what: str, *args: str) -> RemoteProcess:
    """Start the treestore module on the node, in a process group the host adopts."""
    if node.python is None:
        raise DataError(
            f"{what} on {node.host}: the node was not prepared (no interpreter yet)",
            node=node.index,
        )
    # -S: the module needs only the stdlib, and a site with many .pth files costs ~50 ms.
    command = module_command(node.python, MODULE, *args, site=False)
    try:
        return await node.host.start(command)
    except (OSError, asyncssh.Error) as exc:
        raise DataError(f"{what} on {node.host} failed: {exc}", node=node.index) from None


class Receiver:
    """A node's ``treestore receive`` process (`peer`, None until a push opens one), kept for
    its later pushes, which take turns on `lock`."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.peer: _Peer | None = None


async def push_tree(
    nodes: Sequence[RemoteNode],
    root: Path,
    manifest: Manifest,
    log: Callable[[str], None] | None = None,
    *,
    stats: PushStats | None = None,
) -> list[str]:
    """Make the tree `manifest` describes (scanned from `root`) exist on every node at once.

    Returns, per node, the absolute path of the materialized tree there (for a single file, the
    file). Only contents a node's store lacks are sent; an unchanged tree costs one small round
    trip per node. A failure on any node, or a local file that changed since its scan, raises a
    `DataError` naming the node (when there is one) and the path, after every node dropped
    what it had half received. `stats`, if given, is filled in.
    """
    stats = stats if stats is not None else PushStats()
    say = log or (lambda _line: None)
    receivers = [_receiver(n) for n in nodes]
    async with contextlib.AsyncExitStack() as held:
        # One order for every push: two pushes sharing nodes never wait for each other in a cycle.
        for receiver in sorted(set(receivers), key=id):
            await held.enter_async_context(receiver.lock)
        peers = await _open(nodes, receivers)
        try:
            paths = dict(await _gather(*(_offer(p, manifest, say) for p in peers)))
            await _send_contents(Path(root), manifest, [p for p in peers if p.need])
            waiting = [p for p in peers if p.final is not None]
            for p in waiting:
                p.write(b"E")
            finals = await _gather(*(p.final for p in waiting if p.final is not None))
            for peer, final in zip(waiting, finals, strict=True):
                paths[peer.node.index] = str(final["done"])
        except BaseException:
            # A node that failed discards its input until the end, the others are mid-push:
            # their channels are spent, so close them (the nodes drop their temp dirs).
            for r in receivers:
                r.peer = None
            await asyncio.gather(*(p.close(abort=True) for p in peers), return_exceptions=True)
            raise
        finally:
            for p in peers:
                stats.bytes_sent[p.node.index] = p.sent
                stats.files_sent[p.node.index] = p.files
        for p in peers:
            p.kept = True
            p.reset()
    return [paths[n.index] for n in nodes]


def _receiver(node: RemoteNode) -> Receiver:
    if node.receiver is None:
        node.receiver = Receiver()
    return node.receiver


async def _open(nodes: Sequence[RemoteNode], receivers: Sequence[Receiver]) -> list[_Peer]:
    """Each node's receiver process, started where there is none (those that start are kept
    when another fails)."""

    async def one(node: RemoteNode, receiver: Receiver) -> _Peer:
        if receiver.peer is None:
            receiver.peer = await _Peer.start(node, "sending data", "receive")
        return receiver.peer

    started = await asyncio.gather(
        *(one(n, r) for n, r in zip(nodes, receivers, strict=True)), return_exceptions=True
    )
    for failure in started:
        if isinstance(failure, BaseException):
            raise failure
    return [p for p in started if isinstance(p, _Peer)]


async def _gather(*aws: Any) -> list[Any]:
    """All results, or the first failure once every other task was cancelled and awaited."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _offer(peer: _Peer, manifest: Manifest, say: Callable[[str], None]) -> tuple[int, str]:
    """Digest, then (if the node lacks the tree) manifest; sets `peer.need`."""
    digest = b"D" + bytes.fromhex(manifest.digest)
    try:
        peer.write(digest)
        answer = await peer.reply()
    except (DataError, OSError, asyncssh.Error):
        if not peer.kept:
            raise
        # The kept process died since its last push (killed on the host): a new one, once.
        await peer.reopen()
        peer.write(digest)
        answer = await peer.reply()
    if "have" in answer:
        say(f"[{peer.node.host}] the data is already there")
        return peer.node.index, str(answer["have"])
    peer.write(b"M" + struct.pack("!Q", len(manifest.encoded)) + manifest.encoded)
    need = list((await peer.reply())["need"])
    peer.need = set(need)
    sizes = {e.sha256: e.size for e in manifest.files}
    size = sum(sizes[s] for s in peer.need)
    say(f"[{peer.node.host}] sending {len(need)} of {len(sizes)} files ({size / 2**20:.1f} MiB)")
    peer.final = asyncio.ensure_future(peer.reply())
    return peer.node.index, ""


async def _send_contents(root: Path, manifest: Manifest, peers: list[_Peer]) -> None:
    """Each needed content read once and written to every peer that lacks it."""
    if not peers:
        return
    sent: set[str] = set()
    for entry in manifest.files:
        targets = [p for p in peers if entry.sha256 in p.need]
        if entry.sha256 in sent or not targets:
            continue
        sent.add(entry.sha256)
        path = root if manifest.single else root / entry.path
        await _stream_file(path, entry, targets)


async def _stream_file(path: Path, entry: Entry, peers: list[_Peer]) -> None:
    loop = asyncio.get_running_loop()
    for p in peers:
        p.write(b"C" + bytes.fromhex(entry.sha256))
        p.files += 1
    try:
        fh = open(path, "rb", buffering=0)  # noqa: SIM115 (closed below, after the last read)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}", path=str(path)) from None
    try:
        # One read ahead, in a thread: the disk works while the loop encrypts.
        pending = loop.run_in_executor(None, fh.read, CHUNK)
        total = 0
        while True:
            data: bytes = await pending
            if not data:
                break
            pending = loop.run_in_executor(None, fh.read, CHUNK)
            total += len(data)
            frame = _LENGTH.pack(len(data))
            for p in peers:
                p.write(frame)
                p.write(data)
            await _drain(peers)
        same = unchanged(path, entry, os.fstat(fh.fileno()), total)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}", path=str(path)) from None
    finally:
        with contextlib.suppress(BaseException):
            await pending
        fh.close()
    if not same:
        raise DataError(
            f"{path} changed while it was being sent; send it again once it is written",
            path=str(path),
        )
    for p in peers:
        p.write(_LENGTH.pack(0))


async def _drain(peers: list[_Peer]) -> None:
    """Wait for every peer's flow control; a peer that reported an error fails the push."""
    for p in peers:
        if p.final is not None and p.final.done():
            p.final.result()  # its DataError
    try:
        await asyncio.gather(*(p.drain() for p in peers))
    except (OSError, asyncssh.Error) as exc:
        for p in peers:
            if p.final is not None and p.final.done():
                p.final.result()
        raise DataError(f"sending data failed: the connection broke ({exc})") from None


async def pull_tree(
    node: RemoteNode, remote_dir: str, local_dir: Path, pulled: frozenset[str] = frozenset()
) -> PullStats:
    """Make `local_dir` mirror `remote_dir` on `node` (a relative one is under the node's
    skyward cache directory, as its output directories are).

    Incremental: only files whose size or mtime differ from the local copy are sent, each
    written to a temp name and renamed, so a reader never sees half a file. Modes, mtimes,
    symlinks and empty directories are kept. A missing `remote_dir` means nothing to pull.
    What an earlier pull from this node brought (`pulled`, its `PullStats.paths`) and the node
    no longer has is removed here (a checkpoint's temporary directory caught mid-write); nothing
    else local is ever removed, so a replaced node's empty directory deletes nothing. A file the
    node rewrites during the pull may arrive torn, but keeps its pre-read mtime, so the next
    pull fetches it again.
    """
    local_dir = Path(local_dir)
    peer = await _Peer.start(node, "pulling data", "send", remote_dir)
    stats = PullStats()
    try:
        listing = await peer.reply()
        if listing["missing"]:
            return stats
        entries = [Entry(p, k, m, t, s, "", g) for p, k, m, t, s, g in listing["entries"]]
        stats.paths = frozenset(e.path for e in entries)
        _forget(local_dir, pulled - stats.paths)
        want = _plan(local_dir, entries)
        body = json.dumps({"want": want}).encode()
        peer.write(_LENGTH.pack(len(body)) + body)
        await _receive_files(peer, local_dir, entries, stats)
        for e in reversed(entries):  # deepest first: a parent's mtime is set last
            if e.kind == DIR:
                target = local_dir / e.path
                os.chmod(target, e.mode)
                os.utime(target, ns=(e.mtime_ns, e.mtime_ns))
    except OSError as exc:
        raise peer.error(f"writing {exc.filename or local_dir}: {exc.strerror}") from None
    finally:
        await peer.close()
    return stats


def _forget(local_dir: Path, gone: Iterable[str]) -> None:
    """Remove the local copies of entries the node no longer has (deepest first)."""
    for rel in sorted(gone, key=lambda p: p.count("/"), reverse=True):
        target = local_dir / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()


def _plan(local_dir: Path, entries: list[Entry]) -> list[int]:
    """Make directories and symlinks; the indices of the files to fetch."""
    want = []
    for i, e in enumerate(entries):
        target = local_dir / e.path
        try:
            st: os.stat_result | None = target.lstat()
        except FileNotFoundError:
            st = None
        if e.kind == DIR:
            if st is not None and not stat.S_ISDIR(st.st_mode):
                target.unlink()
            target.mkdir(parents=True, exist_ok=True)
        elif e.kind == LINK:
            if st is not None and stat.S_ISLNK(st.st_mode) and os.readlink(target) == e.target:
                continue
            temp = _temp_name(target)
            os.symlink(e.target, temp)
            os.utime(temp, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
            _replace(temp, target, st)
        elif e.kind == FILE:
            current = (st.st_size, st.st_mtime_ns) if st and stat.S_ISREG(st.st_mode) else None
            if current != (e.size, e.mtime_ns):
                want.append(i)
    return want


async def _receive_files(
    peer: _Peer, local_dir: Path, entries: list[Entry], stats: PullStats
) -> None:
    stdout = peer.proc.process.stdout
    read = stdout.readexactly
    try:
        while (index := _LENGTH.unpack(await read(4))[0]) != END:
            status = (await read(1))[0]
            if status == GONE:
                continue
            if status == FAILED:
                await peer.reply()  # raises its error
            mtime_ns, mode = struct.unpack("!qI", await read(12))
            target = local_dir / entries[index].path
            temp = _temp_name(target)
            try:
                with open(temp, "wb") as out:
                    size = await _copy_chunks(read, out)
                os.chmod(temp, mode)
                os.utime(temp, ns=(mtime_ns, mtime_ns))
                _replace(temp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    temp.unlink()
                raise
            stats.files += 1
            stats.bytes += size
    except asyncio.IncompleteReadError:
        raise peer.error(await peer._ended()) from None
    except (asyncssh.Error, ConnectionError) as exc:
        raise peer.error(f"the connection broke ({exc})") from None


async def _copy_chunks(read: Callable[[int], Any], out: IO[bytes]) -> int:
    total = 0
    while n := _LENGTH.unpack(await read(4))[0]:
        out.write(await read(n))
        total += n
    return total


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.skyward-{secrets.token_hex(4)}")


def _replace(temp: Path, target: Path, st: os.stat_result | None = None) -> None:
    """Rename `temp` over `target`, first removing a directory in the way."""
    if st is None:
        with contextlib.suppress(FileNotFoundError):
            st = target.lstat()
    if st is not None and stat.S_ISDIR(st.st_mode):
        shutil.rmtree(target)
    os.replace(temp, target)
