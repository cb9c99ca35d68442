"""What a tree is: its entries, its manifest and digest, and its files' hashes.

A `Manifest` lists a file or directory tree (path, kind, mode, mtime, size, sha256 or symlink
target per entry); `Manifest.digest` is the tree's identity. A file is hashed only when its
(size, mtime_ns, ctime_ns, inode, device) changed since this process last saw it, so rescanning
an unchanged tree costs one stat per entry. Standard library only: it runs on nodes too.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from skyward.errors import DataError

FILE, DIR, LINK = "f", "d", "l"


class Entry(NamedTuple):
    """One entry of a tree; `path` is relative ("." is a directory root itself)."""

    path: str
    kind: str  # FILE, DIR or LINK
    mode: int  # permission bits only
    mtime_ns: int
    size: int = 0
    sha256: str = ""  # files only
    target: str = ""  # symlinks only


@dataclass(frozen=True)
class Manifest:
    """A tree's entries, sorted by path; `single` when the root is one file (one entry)."""

    entries: tuple[Entry, ...]
    single: bool = False
    encoded: bytes = field(init=False, repr=False, compare=False)
    digest: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        entries = tuple(sorted(self.entries))
        body = {"v": 1, "single": self.single, "entries": [list(e) for e in entries]}
        encoded = json.dumps(body, separators=(",", ":")).encode()
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "encoded", encoded)
        object.__setattr__(self, "digest", hashlib.sha256(encoded).hexdigest())

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        body = json.loads(data)
        return cls(tuple(Entry(*e) for e in body["entries"]), bool(body["single"]))

    @property
    def files(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == FILE]

    @property
    def size(self) -> int:
        """Bytes of file content, duplicates counted once."""
        return sum({e.sha256: e.size for e in self.files}.values())

    def check(self) -> None:
        """Refuse entries that would land outside the tree (or through one of its symlinks)."""
        dirs = {e.path for e in self.entries if e.kind == DIR} | {"."}
        for e in self.entries:
            parts = set(e.path.split("/"))
            bad = e.path != "." and (not e.path or "\0" in e.path or {"", ".", ".."} & parts)
            orphan = _parent(e) not in dirs or (self.single and "/" in e.path)
            if bad or orphan or e.kind not in (FILE, DIR, LINK):
                raise ValueError(f"manifest entry {e.path!r} is not a valid tree path")
        if self.single and (len(self.entries) != 1 or self.entries[0].kind != FILE):
            raise ValueError("a single-file manifest must hold exactly one file")


def _parent(entry: Entry) -> str:
    return entry.path.rpartition("/")[0] or "."


def root_entry(st: os.stat_result) -> Entry:
    """The entry of a directory tree's root itself."""
    return Entry(".", DIR, stat.S_IMODE(st.st_mode), st.st_mtime_ns)


def walk(top: Path) -> Iterator[tuple[Entry | None, str]]:
    """Every entry below `top`, depth first in name order, with its path, no hashes; None
    for what a tree cannot hold (a FIFO, socket or device). A `DataError` names what failed."""
    for rel, path, st in _walk(top, ""):
        mode, mtime = stat.S_IMODE(st.st_mode), st.st_mtime_ns
        if stat.S_ISDIR(st.st_mode):
            yield Entry(rel, DIR, mode, mtime), path
        elif stat.S_ISLNK(st.st_mode):
            yield Entry(rel, LINK, mode, mtime, 0, "", _read_link(path)), path
        elif stat.S_ISREG(st.st_mode):
            yield file_entry(rel, st), path
        else:
            yield None, path


def _walk(top: Path, prefix: str) -> Iterator[tuple[str, str, os.stat_result]]:
    try:
        with os.scandir(top) as listing:
            found = sorted(listing, key=lambda d: d.name)
    except OSError as exc:
        raise DataError(f"cannot list {top}: {exc.strerror}", path=str(top)) from None
    for item in found:
        rel = f"{prefix}{item.name}"
        try:
            st = item.stat(follow_symlinks=False)
        except OSError as exc:
            raise DataError(f"cannot read {item.path}: {exc.strerror}", path=item.path) from None
        yield rel, item.path, st
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(Path(item.path), f"{rel}/")


def _read_link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}", path=path) from None


def file_entry(rel: str, st: os.stat_result) -> Entry:
    """A file's entry from its stat, not yet hashed."""
    return Entry(rel, FILE, stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_size)


# path -> (size, mtime_ns, ctime_ns, inode, device, sha256): what this process last hashed.
_HASHED: dict[str, tuple[int, int, int, int, int, str]] = {}


def hash_all(entries: list[Entry], paths: list[Path]) -> None:
    """Fill in each entry's sha256, hashing only files that changed since this process saw
    them (in threads: hashlib releases the GIL, so big trees hash on every core)."""
    todo = []
    for i, (entry, path) in enumerate(zip(entries, paths, strict=True)):
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        known = _HASHED.get(str(path))
        if known is not None and known[:5] == key:
            entries[i] = entry._replace(sha256=known[5])
        else:
            todo.append((i, path, key))
    if not todo:
        return
    from concurrent.futures import ThreadPoolExecutor  # here: a node's receive never needs it

    workers = min(len(todo), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda item: _hash_file(item[1]), todo))
    for (i, path, key), digest in zip(todo, digests, strict=True):
        _HASHED[str(path)] = (*key, digest)
        entries[i] = entries[i]._replace(sha256=digest)


def unchanged(path: Path, entry: Entry, st: os.stat_result, read: int) -> bool:
    """Whether `path`, just read (`read` bytes, then fstat `st`), is still what was scanned:
    the check `hash_all`'s own cache relies on, so a push never hashes a file twice."""
    if (read, st.st_size, st.st_mtime_ns) != (entry.size, entry.size, entry.mtime_ns):
        return False
    known = _HASHED.get(str(Path(path).absolute()))
    key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    return known is None or (known[:5] == key and known[5] == entry.sha256)


def _hash_file(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}", path=str(path)) from None
