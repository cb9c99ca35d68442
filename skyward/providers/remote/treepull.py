"""A pull's local half: mirror a node's listing into a local directory, file by file.

Directories and symlinks are made from the listing; a file is fetched only when its size or
mtime differ from the local copy, written to a temp name and renamed, so a reader never sees
half a file. Mtimes are kept, and modes less their group and other bits.

The listing comes from the node and is not trusted: `check_listing` refuses, before anything
is written, a path that is absolute, has a ``..``, or lies under a symlink the listing makes,
and every write first checks that its directory resolves inside the local one (a symlink
already there cannot lead out either). A node that could name ``../../.bashrc`` would
otherwise write anywhere the client's user can.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import stat
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import asyncssh

from skyward.providers.remote.treepeer import U32, Peer
from skyward.worker.treemanifest import DIR, FILE, LINK, Entry
from skyward.worker.treestore import END, FAILED, GONE

# Outputs keep their owner's bits only: they may hold what the pool computed from private
# data, and a node's modes (or umask) are not the client's to choose.
PRIVATE = 0o700


def check_listing(local_dir: Path, entries: list[Entry]) -> str | None:
    """The first entry path that would land outside `local_dir`, or None when all are inside."""
    links = {e.path for e in entries if e.kind == LINK}
    for e in entries:
        if e.path == ".":  # the directory itself
            continue
        parts = e.path.split("/")
        if e.path.startswith("/") or any(part in ("", ".", "..") for part in parts):
            return e.path
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            return e.path
        if not inside(local_dir, e.path):
            return e.path
    return None


def inside(local_dir: Path, rel: str) -> bool:
    """Whether `rel`'s directory, symlinks resolved, is `local_dir` or under it."""
    root = local_dir.resolve()
    parent = (local_dir / rel).parent.resolve()
    return parent == root or root in parent.parents


def forget(local_dir: Path, gone: Iterable[str]) -> None:
    """Remove the local copies of entries the node no longer has (deepest first)."""
    for rel in sorted(gone, key=lambda p: p.count("/"), reverse=True):
        target = local_dir / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()


def plan(local_dir: Path, entries: list[Entry]) -> list[int]:
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


async def receive_files(peer: Peer, local_dir: Path, entries: list[Entry]) -> tuple[int, int]:
    """Write the files the node sends into `local_dir`; (files written, their bytes)."""
    stdout = peer.proc.process.stdout
    read = stdout.readexactly
    files = written = 0
    try:
        while (index := U32.unpack(await read(U32.size))[0]) != END:
            status = (await read(1))[0]
            if status == GONE:
                continue
            if status == FAILED:
                await peer.reply()  # raises its error
            mtime_ns, mode = struct.unpack("!qI", await read(12))
            target = local_dir / entries[index].path
            if not inside(local_dir, entries[index].path):  # a link made since the check
                raise peer.error("its output listing leads outside", entries[index].path)
            temp = _temp_name(target)
            try:
                with open(temp, "wb") as out:
                    size = await _copy_chunks(read, out)
                os.chmod(temp, mode & PRIVATE)
                os.utime(temp, ns=(mtime_ns, mtime_ns))
                _replace(temp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    temp.unlink()
                raise
            files += 1
            written += size
    except asyncio.IncompleteReadError:
        raise peer.error(await peer.ended()) from None
    except (asyncssh.Error, ConnectionError) as exc:
        raise peer.error(f"the connection broke ({exc})") from None
    return files, written


def set_dirs(local_dir: Path, entries: list[Entry]) -> None:
    """Give the directories their modes and mtimes, once nothing more is written in them."""
    for e in reversed(entries):  # deepest first: a parent's mtime is set last
        if e.kind == DIR:
            target = local_dir / e.path
            os.chmod(target, e.mode & PRIVATE)
            os.utime(target, ns=(e.mtime_ns, e.mtime_ns))


async def _copy_chunks(read: Callable[[int], Any], out: IO[bytes]) -> int:
    total = 0
    while n := U32.unpack(await read(U32.size))[0]:
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
