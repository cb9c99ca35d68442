"""Content-addressed trees: scan a local tree, keep its versions on a node, stream both ways.

Runs on the client and on nodes, with nothing but the standard library (and `skyward.errors`).

`scan(root)` lists a file or directory tree as a `Manifest` (path, kind, mode, mtime, size,
sha256 or symlink target per entry); `Manifest.digest` is the tree's identity. A file is hashed
only when its (size, mtime_ns, ctime_ns, inode, device) changed since this process last saw it,
so rescanning an unchanged tree costs one stat per entry.

The node's store lives under ``<cache>/data``, ``<cache>`` being ``$SKYWARD_CACHE_DIR`` or else
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

Wire, ``python -m skyward.worker.treestore receive``: one process serves any number of pushes,
one after another (integers big-endian; a node's reply is ``!I`` length + a JSON object). A push::

    client: b"D" + digest (32 bytes)          node: {"have": path} | {"manifest": true}
    client: b"M" + !Q length + manifest JSON  node: {"need": [sha256, ...]}
    client: b"C" + sha256 (32 bytes) + chunks (!I n + n bytes) + !I 0   (one per needed content)
    client: b"E"                              node: {"done": path}

End of input between pushes ends the process (status 0); within a push it aborts that push.
Any failure on the node: {"error": message, "path": entry} (its temp dir already removed), and
the rest of the input is discarded: the channel is spent, its client closes it and opens
another for the next push. The process holds no lock between pushes.

``python -m skyward.worker.treestore send DIR`` (for a pull): the node writes a listing
(``!I`` + JSON {"missing": bool, "entries": [[path, kind, mode, mtime_ns, size, target], ...]},
no hashes), the client answers ``!I`` + JSON {"want": [index, ...]}, and the node sends each
wanted file: ``!I index`` + a status byte (1: content follows; 2: the file is gone; 0: ``!I`` +
JSON {"error", "path"}), then chunks as above and ``!qI`` mtime_ns, mode; ``!I`` 0xFFFFFFFF ends.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

from skyward.errors import DataError
from skyward.info import cache_root

CHUNK = 1 << 20
END = 0xFFFFFFFF  # ends a pull's file stream
FILE, DIR, LINK = "f", "d", "l"
SENT, GONE, FAILED = 1, 2, 0  # a pulled file's status byte


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


# -- scanning (client side)

# path -> (size, mtime_ns, ctime_ns, inode, device, sha256): what this process last hashed.
_HASHED: dict[str, tuple[int, int, int, int, int, str]] = {}


def scan(root: Path) -> Manifest:
    """The manifest of `root` (a directory or one file); a `DataError` names what failed."""
    root = Path(root).absolute()
    try:
        top = root.stat()
    except OSError as exc:
        raise DataError(f"cannot read {root}: {exc.strerror}", path=str(root)) from None
    if stat.S_ISREG(top.st_mode):
        entries = [_file_entry(root.name, top)]
        _hash_all(entries, [root])
        return Manifest(tuple(entries), single=True)
    if not stat.S_ISDIR(top.st_mode):
        raise DataError(f"{root} is not a regular file or a directory", path=str(root))
    entries = [Entry(".", DIR, stat.S_IMODE(top.st_mode), top.st_mtime_ns)]
    files: list[Path] = []
    for rel, path, st in _walk(root, ""):
        if stat.S_ISDIR(st.st_mode):
            entries.append(Entry(rel, DIR, stat.S_IMODE(st.st_mode), st.st_mtime_ns))
        elif stat.S_ISLNK(st.st_mode):
            target = _read_link(path)
            entries.append(
                Entry(rel, LINK, stat.S_IMODE(st.st_mode), st.st_mtime_ns, 0, "", target)
            )
        elif stat.S_ISREG(st.st_mode):
            entries.append(_file_entry(rel, st))
            files.append(Path(path))
        else:
            raise DataError(
                f"{path} is not a regular file, directory or symlink (a FIFO, socket or device "
                "cannot be sent)",
                path=path,
            )
    indexed = [i for i, e in enumerate(entries) if e.kind == FILE]
    hashed = [entries[i] for i in indexed]
    _hash_all(hashed, files)
    for i, e in zip(indexed, hashed, strict=True):
        entries[i] = e
    return Manifest(tuple(entries))


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


def _file_entry(rel: str, st: os.stat_result) -> Entry:
    return Entry(rel, FILE, stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_size)


def _hash_all(entries: list[Entry], paths: list[Path]) -> None:
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
    the check `scan`'s own cache relies on, so a push never hashes a file twice."""
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


# -- the node's store


def store_root() -> Path:
    """``<cache>/data`` on this machine (`skyward.info.cache_root`)."""
    return Path(cache_root()).absolute() / "data"


def tree_path(digest: str, single_name: str = "") -> str:
    """Where tree `digest` is materialized in this machine's store (what a function gets)."""
    return str(Store(store_root()).tree_path(digest, single_name))


class Failure(Exception):
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

    def receive(self, sha: str, source: Input) -> None:
        """Write one content's chunks to incoming/<sha>."""
        if sha not in self.sizes:
            raise Failure(f"content {sha} is not in the manifest")
        where = self.owner[sha]
        total = 0
        try:
            with open(self.incoming / sha, "wb", buffering=0) as out:
                while n := source.length():
                    view = source.exact_view(n)
                    total += n
                    while view:
                        view = view[out.write(view) :]
        except OSError as exc:
            raise Failure(f"writing {where}: {exc.strerror}", where) from None
        if total != self.sizes[sha]:
            raise Failure(f"{where} arrived with {total} bytes, not {self.sizes[sha]}", where)
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
                raise Failure(f"writing {e.path}: {exc.strerror}", e.path) from None
        for sha in received:
            with contextlib.suppress(FileExistsError):
                os.link(self.incoming / sha, self.store.objects / sha)
        for e in reversed(manifest.entries):  # deepest first: a parent's mtime is set last
            if e.kind == DIR:
                os.chmod(tree / e.path, e.mode)
                os.utime(tree / e.path, ns=(e.mtime_ns, e.mtime_ns))
        (final / "manifest.json").write_bytes(manifest.encoded)
        target = self.store.trees / manifest.digest
        with open(self.store.root / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
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
            os.chmod(source, e.mode)
            os.utime(source, ns=(e.mtime_ns, e.mtime_ns))
        elif not source.exists():
            source = self.store.objects / sha
        st = source.stat()
        if stat.S_IMODE(st.st_mode) == e.mode and st.st_mtime_ns == e.mtime_ns:
            try:
                os.link(source, dest)
                return
            except OSError as exc:
                if exc.errno != errno.EMLINK:
                    raise
        # Hard links share mode and mtime, so different ones need their own copy.
        shutil.copyfile(source, dest)
        os.chmod(dest, e.mode)
        os.utime(dest, ns=(e.mtime_ns, e.mtime_ns))

    def close(self) -> None:
        """Remove the temp dir and its lock (the tree, if renamed, is no longer inside)."""
        _remove(self.work)
        with contextlib.suppress(OSError):
            self.lock.unlink()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Input:
    """Exact reads from a byte stream; `EOFError` when it ends early."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.buffer = bytearray(CHUNK)

    def exact(self, n: int) -> bytes:
        data = self.stream.read(n)
        if len(data) != n:
            raise EOFError
        return data

    def exact_view(self, n: int) -> memoryview:
        """The next `n` bytes in a reused buffer (valid until the next call)."""
        if n > len(self.buffer):
            self.buffer = bytearray(n)
        view = memoryview(self.buffer)[:n]
        got = 0
        while got < n:
            k = self.stream.readinto(view[got:])  # type: ignore[attr-defined]
            if not k:
                raise EOFError
            got += k
        return view

    def length(self) -> int:
        value: int = struct.unpack("!I", self.exact(4))[0]
        return value

    def drain(self) -> None:
        while self.stream.read(CHUNK):
            pass


def reply(out: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    out.write(struct.pack("!I", len(data)) + data)
    out.flush()


def receive(source: IO[bytes], out: IO[bytes], store: Store) -> None:
    """Serve pushes until the input ends (see the module docstring for the wire)."""
    data = Input(source)
    while tag := source.read(1):
        if not _push(tag, data, out, store):
            return  # the input was discarded to its end


def _push(tag: bytes, data: Input, out: IO[bytes], store: Store) -> bool:
    """Serve one push that began with `tag`; False when it failed (and the input is spent)."""
    try:
        if tag != b"D":
            raise Failure("protocol error: expected the tree's digest")
        digest = data.exact(32).hex()
        have = store.has(digest)
        if have is not None:
            reply(out, {"have": str(have)})
            return True
        reply(out, {"manifest": True})
        if data.exact(1) != b"M":
            raise Failure("protocol error: expected the manifest")
        manifest = Manifest.decode(data.exact(struct.unpack("!Q", data.exact(8))[0]))
        manifest.check()
        if manifest.digest != digest:
            raise Failure("the manifest does not match its digest (client and node differ)")
    except (Failure, ValueError, OSError) as exc:
        _fail(out, data, exc)
        return False
    build: Build | None = None
    try:
        build = Build(store, manifest)
        reply(out, {"need": store.missing(manifest)})
        while (tag := data.exact(1)) == b"C":
            build.receive(data.exact(32).hex(), data)
        if tag != b"E":
            raise Failure("protocol error: expected content or the end")
        reply(out, {"done": str(build.finish())})
        return True
    except (Failure, OSError) as exc:
        if build is not None:
            build.close()
        _fail(out, data, exc)
        return False
    except BaseException:  # end of input (the client aborted), a signal: leave nothing
        if build is not None:
            build.close()
        raise


def _fail(out: IO[bytes], data: Input, exc: BaseException) -> None:
    """Report a failure (the temp dir is already gone), then swallow what is still coming."""
    path = exc.path if isinstance(exc, Failure) else getattr(exc, "filename", "") or ""
    message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    with contextlib.suppress(OSError):
        reply(out, {"error": message, "path": str(path)})
        data.drain()


def listing(root: Path) -> dict[str, Any]:
    """What a pull sees on the node: entries with stats, no hashes."""
    if not root.is_dir():
        return {"missing": True, "entries": []}
    top = root.stat()
    entries = [[".", DIR, stat.S_IMODE(top.st_mode), top.st_mtime_ns, 0, ""]]
    for rel, path, st in _walk(root, ""):
        mode, mtime = stat.S_IMODE(st.st_mode), st.st_mtime_ns
        if stat.S_ISDIR(st.st_mode):
            entries.append([rel, DIR, mode, mtime, 0, ""])
        elif stat.S_ISLNK(st.st_mode):
            entries.append([rel, LINK, mode, mtime, 0, _read_link(path)])
        elif stat.S_ISREG(st.st_mode):
            entries.append([rel, FILE, mode, mtime, st.st_size, ""])
    return {"missing": False, "entries": entries}


def send(root: Path, source: IO[bytes], out: IO[bytes]) -> None:
    """Serve one pull of `root` (see the module docstring for the wire)."""
    try:
        listed = listing(root)
    except DataError as exc:
        reply(out, {"error": str(exc), "path": exc.path})
        return
    reply(out, listed)
    data = Input(source)
    entries = listed["entries"]
    want = json.loads(data.exact(data.length()))["want"]
    buffer = bytearray(CHUNK)
    for index in want:
        rel = entries[index][0]
        try:
            fh = open(root / rel, "rb", buffering=0)  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            out.write(struct.pack("!IB", index, GONE))
            continue
        except OSError as exc:
            out.write(struct.pack("!IB", index, FAILED))
            reply(out, {"error": f"cannot read {rel}: {exc.strerror}", "path": rel})
            continue
        with fh:
            # Metadata from before the read: a file that changes meanwhile looks changed later.
            st = os.fstat(fh.fileno())
            out.write(struct.pack("!IBqI", index, SENT, st.st_mtime_ns, stat.S_IMODE(st.st_mode)))
            while n := fh.readinto(buffer):
                out.write(struct.pack("!I", n))
                out.write(memoryview(buffer)[:n])
            out.write(struct.pack("!I", 0))
    out.write(struct.pack("!I", END))
    out.flush()


def main(argv: list[str]) -> int:
    """``receive`` or ``send DIR`` over stdin/stdout."""
    # A hang-up or termination unwinds, so a receive's temp dir is removed on the way out.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: sys.exit(1))
    source, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        if argv[:1] == ["receive"]:
            receive(source, out, Store(store_root()))
        elif argv[:1] == ["send"] and len(argv) == 2:
            # A relative directory is under skyward's cache directory (a node's outputs).
            send(Path(cache_root()) / Path(argv[1]).expanduser(), source, out)
        else:
            print("usage: python -m skyward.worker.treestore receive | send DIR", file=sys.stderr)
            return 2
    except (EOFError, BrokenPipeError):
        return 1  # the client went away
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
