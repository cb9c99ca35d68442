"""The node's store of content-addressed trees, and how one received tree is built into it.

It lives under ``<cache>/data``, ``<cache>`` being ``$SKYWARD_CACHE_DIR`` or else
``~/.cache/skyward``::

    trees/<digest>/tree/           a materialized tree: what the function receives (a single
                                   file as root: trees/<digest>/tree/<name>)
    trees/<digest>/manifest.json   its manifest
    objects/<sha256>               a hard link to every content the store holds: a new version
                                   of a tree links (or, when mode or mtime differ, copies) what
                                   is already here instead of receiving it again
    tmp/<token>/, tmp/<token>.lock a receive in progress, flocked by its receiver; a temp dir
                                   whose lock is free belongs to a dead receiver and is removed
    lock                           flocked while a finished tree is renamed into trees/

A tree is built in its temp dir and renamed into trees/ only when complete, so a partial
transfer is never visible. Two receivers of the same tree (two pools, or hosts sharing a home
over NFS) both build it; whoever renames second discards its copy. Trees share inodes with
objects/: a function must not modify its input files in place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from skyward.cachedir import cache_root
from skyward.worker.filelock import locked
from skyward.worker.treemanifest import DIR, LINK, Entry, Manifest


def store_root() -> Path:
    """``<cache>/data`` on this machine (`skyward.cachedir.cache_root`)."""
    return Path(cache_root()).absolute() / "data"


class StoreError(Exception):
    """A receive that failed on the node; `path` is the tree entry involved, if any."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class Store:
    """The trees and contents of one ``<cache>/data`` directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees, self.objects, self.tmp = root / "trees", root / "objects", root / "tmp"

    def tree_path(self, digest: str, single_name: str = "") -> Path:
        tree = self.trees / digest / "tree"
        return tree / single_name if single_name else tree

    def has(self, digest: str) -> Path | None:
        tree = self.trees / digest / "manifest.json"
        if not tree.exists():
            return None
        manifest = Manifest.decode(tree.read_bytes())
        return self.tree_path(digest, manifest.entries[0].path if manifest.single else "")

    def missing(self, manifest: Manifest) -> list[str]:
        """Contents of `manifest` the store does not hold, in manifest order."""
        seen: set[str] = set()
        need = []
        for e in manifest.files:
            if e.sha256 not in seen and not (self.objects / e.sha256).exists():
                need.append(e.sha256)
            seen.add(e.sha256)
        return need

    def clean(self) -> None:
        """Remove temp dirs whose receiver is gone (its lock is free)."""
        with contextlib.suppress(FileNotFoundError):
            for item in self.tmp.iterdir():
                if item.suffix == ".lock" or not item.is_dir():
                    continue
                lock = item.with_name(item.name + ".lock")
                try:
                    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    _remove(item)
                    lock.unlink()
                except OSError:
                    continue  # a live receiver holds the lock (or removing failed: next time)
                finally:
                    os.close(fd)


def _remove(path: Path) -> None:
    """rm -rf that also enters directories a tree made read-only; missing is fine."""

    def retry(fn: Any, name: str) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
            fn(name)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda fn, name, _exc: retry(fn, name))
    else:
        shutil.rmtree(path, onerror=lambda fn, name, _exc: retry(fn, name))


class Build:
    """One tree being received into its own temp dir, flocked until it is finished or gone."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store, self.manifest = store, manifest
        for folder in (store.trees, store.objects, store.tmp):
            folder.mkdir(parents=True, exist_ok=True)
        store.clean()
        token = f"{manifest.digest[:16]}-{os.urandom(4).hex()}"
        self.work = store.tmp / token
        self.lock = store.tmp / f"{token}.lock"
        # The lock is taken before the dir exists, so a cleaner never sees it unlocked.
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.incoming = self.work / "in"
        self.incoming.mkdir(parents=True)
        self.sizes = {e.sha256: e.size for e in manifest.files}
        self.owner = {e.sha256: e.path for e in reversed(manifest.files)}
        self.fresh: set[str] = set()  # received, not yet given a mode and mtime

    def receive(self, sha: str, chunks: Iterable[memoryview]) -> None:
        """Write one content, arriving as `chunks`, to incoming/<sha>."""
        if sha not in self.sizes:
            raise StoreError(f"content {sha} is not in the manifest")
        where = self.owner[sha]
        total = 0
        try:
            with open(self.incoming / sha, "wb", buffering=0) as out:
                for view in chunks:
                    total += len(view)
                    while view:
                        view = view[out.write(view) :]
        except OSError as exc:
            raise StoreError(f"writing {where}: {exc.strerror}", where) from None
        if total != self.sizes[sha]:
            raise StoreError(f"{where} arrived with {total} bytes, not {self.sizes[sha]}", where)
        self.fresh.add(sha)

    def finish(self) -> Path:
        """Materialize the tree, publish its new contents, rename it into trees/."""
        final = self.work / "t"
        tree = final / "tree"
        tree.mkdir(parents=True)
        manifest = self.manifest
        received = set(self.fresh)
        for e in manifest.entries:
            dest = tree / e.path
            try:
                if e.kind == DIR:
                    dest.mkdir(exist_ok=e.path == ".")
                elif e.kind == LINK:
                    os.symlink(e.target, dest)
                    os.utime(dest, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
                else:
                    self._place(e, dest)
            except OSError as exc:
                raise StoreError(f"writing {e.path}: {exc.strerror}", e.path) from None
        for sha in received:
            with contextlib.suppress(FileExistsError):
                os.link(self.incoming / sha, self.store.objects / sha)
        for e in reversed(manifest.entries):  # deepest first: a parent's mtime is set last
            if e.kind == DIR:
                os.chmod(tree / e.path, owner_only(e.mode))
                os.utime(tree / e.path, ns=(e.mtime_ns, e.mtime_ns))
        (final / "manifest.json").write_bytes(manifest.encoded)
        target = self.store.trees / manifest.digest
        with locked(self.store.root / "lock"):
            if not target.exists():
                os.rename(final, target)
        self.close()
        name = manifest.entries[0].path if manifest.single else ""
        return self.store.tree_path(manifest.digest, name)

    def _place(self, e: Entry, dest: Path) -> None:
        """Link the content with the entry's mode and mtime, or copy it when none has them."""
        sha = e.sha256
        source = self.incoming / sha
        if sha in self.fresh:  # a new inode nobody shares yet: give it this entry's metadata
            self.fresh.discard(sha)
            os.chmod(source, owner_only(e.mode))
            os.utime(source, ns=(e.mtime_ns, e.mtime_ns))
        elif not source.exists():
            source = self.store.objects / sha
        st = source.stat()
        if stat.S_IMODE(st.st_mode) == owner_only(e.mode) and st.st_mtime_ns == e.mtime_ns:
            try:
                os.link(source, dest)
                return
            except OSError as exc:
                if exc.errno != errno.EMLINK:
                    raise
        # Hard links share mode and mtime, so different ones need their own copy.
        shutil.copyfile(source, dest)
        os.chmod(dest, owner_only(e.mode))
        os.utime(dest, ns=(e.mtime_ns, e.mtime_ns))

    def close(self) -> None:
        """Remove the temp dir and its lock (the tree, if renamed, is no longer inside)."""
        _remove(self.work)
        with contextlib.suppress(OSError):
            self.lock.unlink()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def owner_only(mode: int) -> int:
    """`mode` less its group and other bits: a node's copy of the user's data is theirs alone
    (the store is often on a cluster's shared home), whatever the client's modes were."""
    return mode & 0o700
