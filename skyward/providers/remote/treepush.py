"""A push's steps on its nodes' `Peer`s: offer the tree, then stream the contents they lack.

Each local file is read once, in a thread, and the same chunks are written to every node that
lacks it, waiting for the slowest node's flow control before the next chunk (bounded memory).
A file is checked against its scan after it was read (size, mtime, ctime, inode), so a file
that changed in between fails the push instead of poisoning a node's store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable
from pathlib import Path

import asyncssh

from skyward.errors import DataError
from skyward.providers.remote.treepeer import U32, Peer
from skyward.worker.treemanifest import Entry, Manifest, unchanged
from skyward.worker.treestore import CHUNK


async def offer(peer: Peer, manifest: Manifest, say: Callable[[str], None]) -> tuple[int, str]:
    """Digest, then (if the node lacks the tree) manifest; sets `peer.need`. Returns the node's
    index and, when it has the tree already, its path there."""
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


async def send_contents(root: Path, manifest: Manifest, peers: list[Peer]) -> None:
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


async def _stream_file(path: Path, entry: Entry, peers: list[Peer]) -> None:
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
            frame = U32.pack(len(data))
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
        p.write(U32.pack(0))


async def _drain(peers: list[Peer]) -> None:
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
