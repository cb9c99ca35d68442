"""Trees to and from SSH nodes: a content-addressed push to many nodes, an incremental pull.

`push_tree` makes a scanned local tree (`treestore.scan`) exist in every node's store at once
and returns where; `pull_tree` mirrors a node's directory into a local one. Both talk to
``python -m skyward.worker.treestore`` on the node, with the framing described in
`skyward.worker.treestore`: a pull over an exec channel of its own, pushes over the node's
`Receiver`, one ``receive`` process opened by the node's first push and kept for the next ones
(an exec channel costs a login shell and an interpreter's start: 0.2-0.4 s where measured,
below, most of a small re-push). Its process group is the host's (`SSHHost.start` adopts it),
so closing the host, which a pool's end or `replace` does, ends it. Pushes to one node take
turns on its receiver; a push that fails closes the receivers it used (a node that reported
an error discards the rest of its input), and the next push opens new ones. A kept receiver
that died since its last push (killed on the host) is reopened once, transparently, when its
first reply fails.

Push, per node: the tree's digest (a node that has the tree answers at once: one small round
trip), then the manifest, to which the node answers the contents it lacks; only those are sent
(`treepush`: each file read once for every node that lacks it). Pull: the node lists its
directory, and only what differs from the local copy is sent (`treepull`). The node's process,
for either, is a `treepeer.Peer`.

Why an exec channel and not SFTP (benchmarks/bench_data.py, 3 namespace hosts on one loaded
2-core machine, asyncssh with skyward's ciphers, medians of 3): 1,000 files of 1 MiB to 3 hosts
took 23.0 s by SFTP ``put`` and 22.9 s as a ``tar`` stream on an exec channel, 19.6 s by
`push_tree`; 200 x 1 MB from each of 3 hosts took 4.0 s by SFTP ``get``, 4.3 s by ``tar c`` on
an exec channel, 3.3 s by `pull_tree`. Bulk throughput is the same (the cipher is the cost);
SFTP cannot carry the manifest exchange or a node's store logic, and needs a request per block
and a round trip per file. SFTP wins only on small transfers: ``internal-sftp`` starts no login
shell and no interpreter, which on that machine cost 0.2-0.4 s per exec channel
(benchmarks/README.md, bench_data).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from skyward.providers.remote.bootstrap import RemoteNode, all_or_none
from skyward.providers.remote.treepeer import U32, Peer
from skyward.providers.remote.treepull import (
    check_listing,
    forget,
    plan,
    receive_files,
    set_dirs,
)
from skyward.providers.remote.treepush import offer, send_contents
from skyward.worker.treemanifest import Entry, Manifest


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


class Receiver:
    """A node's ``treestore receive`` process (`peer`, None until a push opens one), kept for
    its later pushes, which take turns on `lock`."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.peer: Peer | None = None


# Each node's receiver, kept while the node is (a replaced node's goes with it).
_receivers: weakref.WeakKeyDictionary[RemoteNode, Receiver] = weakref.WeakKeyDictionary()


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
            paths = dict(await all_or_none(*(offer(p, manifest, say) for p in peers)))
            await send_contents(Path(root), manifest, [p for p in peers if p.need])
            waiting = [p for p in peers if p.final is not None]
            for p in waiting:
                p.write(b"E")
            finals = await all_or_none(*(p.final for p in waiting if p.final is not None))
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
    return _receivers.setdefault(node, Receiver())


async def _open(nodes: Sequence[RemoteNode], receivers: Sequence[Receiver]) -> list[Peer]:
    """Each node's receiver process, started where there is none (those that start are kept
    when another fails)."""

    async def one(node: RemoteNode, receiver: Receiver) -> Peer:
        if receiver.peer is None:
            receiver.peer = await Peer.start(node, "sending data", "receive")
        return receiver.peer

    started = await asyncio.gather(
        *(one(n, r) for n, r in zip(nodes, receivers, strict=True)), return_exceptions=True
    )
    for failure in started:
        if isinstance(failure, BaseException):
            raise failure
    return [p for p in started if isinstance(p, Peer)]


async def pull_tree(
    node: RemoteNode, remote_dir: str, local_dir: Path, pulled: frozenset[str] = frozenset()
) -> PullStats:
    """Make `local_dir` mirror `remote_dir` on `node` (a relative one is under the node's
    skyward cache directory, as its output directories are).

    Incremental: only files whose size or mtime differ from the local copy are sent, each
    written to a temp name and renamed, so a reader never sees half a file. Mtimes, symlinks
    and empty directories are kept, and modes less their group and other bits. A missing
    `remote_dir` means nothing to pull.
    What an earlier pull from this node brought (`pulled`, its `PullStats.paths`) and the node
    no longer has is removed here (a checkpoint's temporary directory caught mid-write); nothing
    else local is ever removed, so a replaced node's empty directory deletes nothing. A file the
    node rewrites during the pull may arrive torn, but keeps its pre-read mtime, so the next
    pull fetches it again.
    """
    local_dir = Path(local_dir)
    peer = await Peer.start(node, "pulling data", "send", remote_dir)
    stats = PullStats()
    try:
        listing = await peer.reply()
        if listing["missing"]:
            return stats
        entries = [Entry(p, k, m, t, s, "", g) for p, k, m, t, s, g in listing["entries"]]
        if (bad := check_listing(local_dir, entries)) is not None:
            raise peer.error(
                f"its output listing names {bad!r}, which is outside {local_dir}; nothing was"
                " written. A node's outputs must be relative paths under its sky.output_dir()"
                " (no '..', no absolute path, nothing under a symlink)",
                bad,
            )
        stats.paths = frozenset(e.path for e in entries)
        forget(local_dir, pulled - stats.paths)
        body = json.dumps({"want": plan(local_dir, entries)}).encode()
        peer.write(U32.pack(len(body)) + body)
        stats.files, stats.bytes = await receive_files(peer, local_dir, entries)
        set_dirs(local_dir, entries)
    except OSError as exc:
        raise peer.error(f"writing {exc.filename or local_dir}: {exc.strerror}") from None
    finally:
        await peer.close()
    return stats
