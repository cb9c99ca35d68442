"""The node's cache of S3 downloads: one complete, read-only tree per listing of a URI.

Layout, under ``<cache>/data/s3/<bucket>/<hash of the key>/`` (`s3sync.cache_root`)::

    <version>/           one complete tree per listing (keys, sizes, ETags); read-only files
    <version>.json       that listing, to reuse unchanged files in the next version
    latest               the newest version's name
    .lock                flock held while a version is built
    .tmp-*               a version being built; renamed to <version> when complete
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from skyward.errors import DataError
from skyward.worker.s3client import WORKERS, S3Location, S3Object, list_objects

PART_SIZE = 32 * 1024 * 1024  # objects above this are fetched as ranged GETs in parallel
CHUNK = 1024 * 1024


def digest(text: str) -> str:
    """The sha256 of `text`, in hex: how keys and listings are named in the cache."""
    return hashlib.sha256(text.encode()).hexdigest()


def listing(s3: Any, loc: S3Location) -> tuple[bool, list[S3Object]]:
    """(single object?, the objects). A key that has objects under ``key/`` is a directory;
    otherwise an object with exactly that key is one file. Keys ending in '/' are the zero-byte
    "folder" markers consoles create, not files."""
    prefix = loc.key if loc.key.endswith("/") or not loc.key else loc.key + "/"
    objects = [o for o in list_objects(s3, loc.bucket, prefix) if not o.key.endswith("/")]
    if objects:
        _check_paths(loc, objects)
        return False, sorted(objects, key=lambda o: o.key)
    if loc.key and not loc.key.endswith("/"):
        # The exact key sorts first among the keys it prefixes: one short listing finds it.
        page = s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.key, MaxKeys=1)
        first = page.get("Contents", [{}])[0]
        if first.get("Key") == loc.key:
            name = loc.key.rsplit("/", 1)[-1]
            return True, [S3Object(loc.key, name, first["Size"], first["ETag"])]
    raise DataError(
        f"nothing at {loc.uri}: no object with that key and none under it; check the prefix "
        f"(aws s3 ls {loc.uri})",
        path=loc.uri,
    )


def version(single: bool, objects: Sequence[S3Object]) -> str:
    """The name of the version that holds exactly this listing."""
    return digest(json.dumps([single, [_entry(o) for o in objects]]))[:24]


def _check_paths(loc: S3Location, objects: Sequence[S3Object]) -> None:
    """Refuse keys that cannot be local paths under the version's root (no escaping it)."""
    dirs: set[str] = set()
    for obj in objects:
        parts = obj.rel.split("/")
        if any(part in ("", ".", "..") for part in parts) or "\0" in obj.rel:
            raise DataError(
                f"{loc.uri}: key {obj.key!r} cannot be a local path ('', '.' or '..' in it)",
                path=loc.uri,
            )
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = next((o.key for o in objects if o.rel in dirs), None)
    if clash is not None:
        raise DataError(
            f"{loc.uri}: {clash!r} is both an object and a prefix of others; a local "
            "directory cannot hold both",
            path=loc.uri,
        )


def _entry(obj: S3Object) -> list[Any]:
    return [obj.rel, obj.size, obj.etag]


def build(
    s3: Any, loc: S3Location, root: Path, name: str, objects: Sequence[S3Object]
) -> tuple[int, int, int]:
    """Make `root/name` under the lock: link what the latest version already has, fetch
    the rest into a temporary tree, rename it into place. Returns (downloaded, reused, bytes)."""
    if (root / name).is_dir():  # another process built it while we waited for the lock
        return 0, 0, 0
    for stale in root.glob(".tmp-*"):  # left by a process killed mid-build (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    previous = _previous_files(root)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        tmp.mkdir()
        todo: list[S3Object] = []
        reused = 0
        for obj in objects:
            target = tmp / obj.rel
            target.parent.mkdir(parents=True, exist_ok=True)
            old = previous.get((obj.size, obj.etag))
            if old is not None and _link(old, target):
                reused += 1
            else:
                todo.append(obj)
        need = sum(o.size for o in todo)
        free = shutil.disk_usage(tmp).free
        if need > free:
            raise OSError(errno.ENOSPC, f"{need} bytes to download, {free} free")
        _get_all(s3, loc.bucket, [(o, tmp / o.rel) for o in todo])
        for obj in todo:
            (tmp / obj.rel).chmod(0o444)  # shared by hard links with later versions
        manifest = json.dumps({"uri": loc.uri, "objects": [_entry(o) for o in objects]})
        _write_atomic(root / f"{name}.json", manifest)
        tmp.rename(root / name)
        _write_atomic(root / "latest", name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(todo), reused, need


def _previous_files(root: Path) -> dict[tuple[int, str], Path]:
    """(size, ETag) -> file, for every object of the latest complete version."""
    try:
        latest = (root / "latest").read_text().strip()
        objects = json.loads((root / f"{latest}.json").read_text())["objects"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(size, etag): root / latest / rel for rel, size, etag in objects}


def _link(source: Path, target: Path) -> bool:
    try:
        os.link(source, target)
    except OSError:
        return False  # gone, or a file system without hard links: download it again
    return True


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _get_all(s3: Any, bucket: str, jobs: Sequence[tuple[S3Object, Path]]) -> None:
    """GET every object into its path, WORKERS requests at a time; a large object as ranged
    parts. Each GET carries If-Match with the listed ETag, so the tree is exactly that listing."""
    parts: list[Callable[[], None]] = []
    for obj, path in jobs:
        with path.open("wb") as out:
            out.truncate(obj.size)
        for offset in range(0, max(obj.size, 1), PART_SIZE):
            length = min(PART_SIZE, obj.size - offset)
            parts.append(_part(s3, bucket, obj, path, offset, length))
    _run_all(parts)


def _part(
    s3: Any, bucket: str, obj: S3Object, path: Path, offset: int, length: int
) -> Callable[[], None]:
    def get() -> None:
        extra = {"Range": f"bytes={offset}-{offset + length - 1}"} if length < obj.size else {}
        reply = s3.get_object(Bucket=bucket, Key=obj.key, IfMatch=obj.etag, **extra)
        written = 0
        with path.open("r+b") as out:
            out.seek(offset)
            for chunk in reply["Body"].iter_chunks(CHUNK):
                out.write(chunk)
                written += len(chunk)
        if written != length:
            raise OSError(errno.EIO, f"{obj.key}: got {written} bytes of {length}")

    return get


def _run_all(tasks: Sequence[Callable[[], None]]) -> None:
    """Run `tasks` on a thread pool. The first failure (or a Ctrl-C) cancels what has not
    started and waits for what has, so no thread still writes when the caller cleans up."""
    pool = ThreadPoolExecutor(max(1, min(WORKERS, len(tasks))), thread_name_prefix="s3sync")
    try:
        done, _ = wait([pool.submit(task) for task in tasks], return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()  # raises the failure, if any
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
