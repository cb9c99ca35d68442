"""Move data between S3 and a node: `download` into a content-addressed cache, `upload` a
directory incrementally. Runs ON the node, with the node's own credentials (boto3's default
chain; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` choose another endpoint).

``python -m skyward.worker.s3sync download URI [--cache DIR]`` and
``python -m skyward.worker.s3sync upload DIR URI`` print one JSON line: the stats, or
``{"error": ..., "path": ...}`` with exit status 1.

The cache (``$SKYWARD_CACHE_DIR`` or ``~/.cache/skyward``) keeps one read-only tree per listing
of a URI under ``<cache>/data/s3/``; its layout and how a version is built are `s3cache`'s.
S3 itself (URIs, the client, listings, errors in words) is `s3client`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from skyward.cachedir import cache_root as cache_root_dir
from skyward.cachedir import keep_private
from skyward.errors import DataError
from skyward.worker import s3cache
from skyward.worker.filelock import locked
from skyward.worker.s3client import (
    RETRY_CODES,
    WORKERS,
    S3Location,
    client,
    error_code,
    errors,
    list_objects,
)

MTIME_KEY = "skyward-mtime"  # object metadata: the local st_mtime_ns it was uploaded from
ATTEMPTS = 3  # an object that changes between listing and GET restarts the download


@dataclass(frozen=True)
class DownloadStats:
    """What `fetch` did: `path` is the local copy; `downloaded` objects came over the network,
    `reused` were hard links to the previous version; `cached` means nothing was built."""

    path: str
    objects: int
    downloaded: int
    reused: int
    bytes: int
    cached: bool


@dataclass(frozen=True)
class UploadStats:
    """What `upload` did: `uploaded` files were sent (`bytes` in all), `skipped` were in S3."""

    files: int
    uploaded: int
    skipped: int
    bytes: int


def cache_dir() -> Path:
    """``$SKYWARD_CACHE_DIR`` or ``~/.cache/skyward`` (`skyward.cachedir.cache_root`)."""
    return Path(cache_root_dir())


def cache_root(uri: str, cache: Path | None = None) -> Path:
    """The folder that holds every version of `uri` (and its lock)."""
    loc = S3Location.parse(uri)
    key = s3cache.digest(loc.key.rstrip("/"))[:16]
    return (cache or cache_dir()) / "data" / "s3" / loc.bucket / key


def download(uri: str, cache: Path | None = None) -> str:
    """The local path holding `uri`: a directory for a prefix, a file for one object."""
    return fetch(uri, cache).path


def fetch(uri: str, cache: Path | None = None) -> DownloadStats:
    """`download`, with what it cost. Raises `DataError` (path=uri) saying what to do."""
    loc = S3Location.parse(uri)
    root = cache_root(uri, cache)
    s3 = client(loc)
    for attempt in range(ATTEMPTS):
        with errors(loc, "read", root):
            single, objects = s3cache.listing(s3, loc)
            version = s3cache.version(single, objects)
            path = root / version
            result = path / objects[0].rel if single else path
            if path.is_dir():  # renamed into place only when complete
                return DownloadStats(str(result), len(objects), 0, 0, 0, cached=True)
            root.mkdir(parents=True, exist_ok=True)
            with locked(root / ".lock"):
                try:
                    built = s3cache.build(s3, loc, root, version, objects)
                except Exception as exc:
                    if attempt + 1 < ATTEMPTS and error_code(exc) in RETRY_CODES:
                        continue  # an object changed after the listing: list again
                    raise
            return DownloadStats(str(result), len(objects), *built, cached=built == (0, 0, 0))
    raise AssertionError("unreachable")  # the last attempt returns or raises


def upload(local_dir: Path, uri: str) -> UploadStats:
    """Mirror `local_dir` under `uri` (as a prefix). A file whose size and mtime match the
    object's (mtime in its ``skyward-mtime`` metadata) is not sent again; nothing is deleted."""
    loc = S3Location.parse(uri)
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise DataError(f"cannot upload {local_dir} to {uri}: not a directory", path=uri)
    prefix = loc.key.rstrip("/")
    s3 = client(loc)
    with errors(loc, "write", None):
        files = _local_files(local_dir)
        listed = list_objects(s3, loc.bucket, f"{prefix}/" if prefix else "")
        remote = {o.key: o.size for o in listed}
        keys = {rel: f"{prefix}/{rel}" if prefix else rel for rel in files}
        same_size = [rel for rel, (size, _) in files.items() if remote.get(keys[rel]) == size]

        def uploaded_mtime(rel: str) -> str | None:
            try:
                head = s3.head_object(Bucket=loc.bucket, Key=keys[rel])
            except Exception as exc:
                if error_code(exc) in ("404", "NoSuchKey"):
                    return None  # deleted since the listing: upload it again
                raise
            value = head.get("Metadata", {}).get(MTIME_KEY)
            return None if value is None else str(value)

        with ThreadPoolExecutor(WORKERS) as pool:
            mtimes = dict(zip(same_size, pool.map(uploaded_mtime, same_size), strict=True))
        todo = [rel for rel, (_, mtime) in files.items() if mtimes.get(rel) != str(mtime)]
        _send(s3, loc.bucket, [(local_dir / rel, keys[rel], files[rel][1]) for rel in todo])
    sent = sum(files[rel][0] for rel in todo)
    return UploadStats(len(files), len(todo), len(files) - len(todo), sent)


def _local_files(local_dir: Path) -> dict[str, tuple[int, int]]:
    """'/'-separated relative path -> (size, st_mtime_ns) of every regular file (symlinks to
    files followed; directory symlinks not, so no cycles)."""
    files: dict[str, tuple[int, int]] = {}
    for folder, _, names in os.walk(local_dir):
        for name in names:
            path = Path(folder) / name
            with contextlib.suppress(FileNotFoundError):  # broken link, or deleted meanwhile
                stat = path.stat()
                if path.is_file():
                    files[path.relative_to(local_dir).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return files


def _send(s3: Any, bucket: str, jobs: Sequence[tuple[Path, str, int]]) -> None:
    """Upload (path, key, mtime_ns) jobs with boto3's transfer manager (multipart for big
    checkpoints), the mtime in each object's metadata."""
    if not jobs:
        return
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    config = TransferConfig(max_concurrency=WORKERS)
    with create_transfer_manager(s3, config) as manager:
        futures = [
            manager.upload(str(path), bucket, key, {"Metadata": {MTIME_KEY: str(mtime)}})
            for path, key, mtime in jobs
        ]
        for future in futures:
            future.result()


def main(argv: Sequence[str] | None = None) -> int:
    """``download URI [--cache DIR]`` or ``upload DIR URI``; one JSON line on stdout."""
    keep_private()
    import argparse

    parser = argparse.ArgumentParser(prog="python -m skyward.worker.s3sync")
    verbs = parser.add_subparsers(dest="verb", required=True)
    get = verbs.add_parser("download")
    get.add_argument("uri")
    get.add_argument("--cache", type=Path, default=None)
    put = verbs.add_parser("upload")
    put.add_argument("dir", type=Path)
    put.add_argument("uri")
    args = parser.parse_args(argv)
    try:
        if args.verb == "download":
            result: dict[str, Any] = asdict(fetch(args.uri, args.cache))
        else:
            result = asdict(upload(args.dir, args.uri))
    except DataError as exc:
        print(json.dumps({"error": str(exc), "path": exc.path}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
