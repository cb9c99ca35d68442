"""Content-addressed trees: scan a local tree, keep its versions on a node, stream both ways.

Runs on the client and on nodes, with nothing but the standard library (and `skyward.errors`).
The parts: `treemanifest` (what a tree is: entries, digest, hashes), `objectstore` (the node's
store under ``<cache>/data`` and how a received tree is built into it), and this module: the
entry points (`scan` on the client, `tree_path` on a node) and the node's half of the wire.

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
import json
import os
import signal
import stat
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from skyward.cachedir import cache_root, keep_private
from skyward.errors import DataError
from skyward.worker.objectstore import Build, Store, StoreError, store_root
from skyward.worker.treemanifest import (
    FILE,
    Manifest,
    file_entry,
    hash_all,
    root_entry,
    walk,
)

CHUNK = 1 << 20
END = 0xFFFFFFFF  # ends a pull's file stream
SENT, GONE, FAILED = 1, 2, 0  # a pulled file's status byte


def scan(root: Path) -> Manifest:
    """The manifest of `root` (a directory or one file); a `DataError` names what failed."""
    root = Path(root).absolute()
    try:
        top = root.stat()
    except OSError as exc:
        raise DataError(f"cannot read {root}: {exc.strerror}", path=str(root)) from None
    if stat.S_ISREG(top.st_mode):
        entries = [file_entry(root.name, top)]
        hash_all(entries, [root])
        return Manifest(tuple(entries), single=True)
    if not stat.S_ISDIR(top.st_mode):
        raise DataError(f"{root} is not a regular file or a directory", path=str(root))
    entries = [root_entry(top)]
    files: list[Path] = []
    for entry, path in walk(root):
        if entry is None:
            raise DataError(
                f"{path} is not a regular file, directory or symlink (a FIFO, socket or device "
                "cannot be sent)",
                path=path,
            )
        entries.append(entry)
        if entry.kind == FILE:
            files.append(Path(path))
    indexed = [i for i, e in enumerate(entries) if e.kind == FILE]
    hashed = [entries[i] for i in indexed]
    hash_all(hashed, files)
    for i, e in zip(indexed, hashed, strict=True):
        entries[i] = e
    return Manifest(tuple(entries))


def tree_path(digest: str, single_name: str = "") -> str:
    """Where tree `digest` is materialized in this machine's store (what a function gets)."""
    return str(Store(store_root()).tree_path(digest, single_name))


# -- the node's half of the wire


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

    def chunks(self) -> Iterator[memoryview]:
        """One content's chunks (``!I n`` + n bytes each) up to its ``!I 0``; each view is
        valid until the next is read."""
        while n := self.length():
            yield self.exact_view(n)

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
            raise StoreError("protocol error: expected the tree's digest")
        digest = data.exact(32).hex()
        have = store.has(digest)
        if have is not None:
            reply(out, {"have": str(have)})
            return True
        reply(out, {"manifest": True})
        if data.exact(1) != b"M":
            raise StoreError("protocol error: expected the manifest")
        manifest = Manifest.decode(data.exact(struct.unpack("!Q", data.exact(8))[0]))
        manifest.check()
        if manifest.digest != digest:
            raise StoreError("the manifest does not match its digest (client and node differ)")
    except (StoreError, ValueError, OSError) as exc:
        _fail(out, data, exc)
        return False
    build: Build | None = None
    try:
        build = Build(store, manifest)
        reply(out, {"need": store.missing(manifest)})
        while (tag := data.exact(1)) == b"C":
            build.receive(data.exact(32).hex(), data.chunks())
        if tag != b"E":
            raise StoreError("protocol error: expected content or the end")
        reply(out, {"done": str(build.finish())})
        return True
    except (StoreError, OSError) as exc:
        if build is not None:
            build.close()
        _fail(out, data, exc)
        return False
    except BaseException:  # end of input (the client aborted), a signal: leave nothing
        if build is not None:
            build.close()
        raise


def import_tree(root: Path, manifest: Manifest, store: Store) -> Path:
    """Build the tree `manifest` describes from the files under `root` (what `scan` read) into
    `store`, as a push would, without a stream: for a client that shares the nodes' store (a
    Slurm cluster's shared home). The tree's path in the store."""
    have = store.has(manifest.digest)
    if have is not None:
        return have
    build = Build(store, manifest)
    try:
        owner = {e.sha256: e.path for e in manifest.files}
        for sha in store.missing(manifest):
            with open(root if manifest.single else root / owner[sha], "rb") as source:
                build.receive(sha, iter(lambda: memoryview(source.read(1 << 20)), b""))
        return build.finish()
    except BaseException:
        build.close()
        raise


def _fail(out: IO[bytes], data: Input, exc: BaseException) -> None:
    """Report a failure (the temp dir is already gone), then swallow what is still coming."""
    path = exc.path if isinstance(exc, StoreError) else getattr(exc, "filename", "") or ""
    message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    with contextlib.suppress(OSError):
        reply(out, {"error": message, "path": str(path)})
        data.drain()


def listing(root: Path) -> dict[str, Any]:
    """What a pull sees on the node: entries with stats, no hashes."""
    if not root.is_dir():
        return {"missing": True, "entries": []}
    entries = [root_entry(root.stat())]
    entries += [e for e, _path in walk(root) if e is not None]
    return {"missing": False, "entries": [[*e[:5], e.target] for e in entries]}


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
    keep_private()
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
