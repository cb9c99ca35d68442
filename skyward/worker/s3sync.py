"""Move data between S3 and a node: `download` into a content-addressed cache, `upload` a
directory incrementally. Runs ON the node, with the node's own credentials (boto3's default
chain; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` choose another endpoint).

``python -m skyward.worker.s3sync download URI [--cache DIR]`` and
``python -m skyward.worker.s3sync upload DIR URI`` print one JSON line: the stats, or
``{"error": ..., "path": ...}`` with exit status 1.

Layout of the cache (``$SKYWARD_CACHE_DIR`` or ``~/.cache/skyward``)::

    <cache>/data/s3/<bucket>/<hash of the key>/
        <version>/           one complete tree per listing (keys, sizes, ETags); read-only files
        <version>.json       that listing, to reuse unchanged files in the next version
        latest               the newest version's name
        .lock                flock held while a version is built
        .tmp-*               a version being built; renamed to <version> when complete
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from skyward.errors import DataError
from skyward.info import cache_root as cache_root_dir

WORKERS = 16  # concurrent requests per node; S3 scales per connection, moto does not care
PART_SIZE = 32 * 1024 * 1024  # objects above this are fetched as ranged GETs in parallel
CHUNK = 1024 * 1024
MTIME_KEY = "skyward-mtime"  # object metadata: the local st_mtime_ns it was uploaded from
ATTEMPTS = 3  # an object that changes between listing and GET restarts the download
_RETRY_CODES = frozenset({"PreconditionFailed", "NoSuchKey", "404", "412"})
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AccountProblem",
    }
)


@dataclass(frozen=True)
class S3Location:
    """A parsed ``s3://bucket/key`` URI."""

    uri: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise DataError(f"{uri!r} is not an s3:// URI", path=uri)
        bucket, _, key = uri[5:].partition("/")
        if not bucket:
            raise DataError(f"{uri!r} names no bucket (s3://bucket/prefix)", path=uri)
        return cls(uri, bucket, key)


@dataclass(frozen=True)
class S3Object:
    key: str
    rel: str  # local path relative to the version's root, '/'-separated
    size: int
    etag: str


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
    """``$SKYWARD_CACHE_DIR`` or ``~/.cache/skyward`` (`skyward.info.cache_root`)."""
    return Path(cache_root_dir())


def cache_root(uri: str, cache: Path | None = None) -> Path:
    """The folder that holds every version of `uri` (and its lock)."""
    loc = S3Location.parse(uri)
    return (cache or cache_dir()) / "data" / "s3" / loc.bucket / _digest(loc.key.rstrip("/"))[:16]


def download(uri: str, cache: Path | None = None) -> str:
    """The local path holding `uri`: a directory for a prefix, a file for one object."""
    return fetch(uri, cache).path


def fetch(uri: str, cache: Path | None = None) -> DownloadStats:
    """`download`, with what it cost. Raises `DataError` (path=uri) saying what to do."""
    loc = S3Location.parse(uri)
    root = cache_root(uri, cache)
    client = _client(loc)
    for attempt in range(ATTEMPTS):
        with _errors(loc, "read", root):
            single, objects = _listing(client, loc)
            version = _digest(json.dumps([single, [_entry(o) for o in objects]]))[:24]
            path = root / version
            result = path / objects[0].rel if single else path
            if path.is_dir():  # renamed into place only when complete
                return DownloadStats(str(result), len(objects), 0, 0, 0, cached=True)
            root.mkdir(parents=True, exist_ok=True)
            with _locked(root / ".lock"):
                try:
                    built = _build(client, loc, root, version, objects)
                except Exception as exc:
                    if attempt + 1 < ATTEMPTS and _error_code(exc) in _RETRY_CODES:
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
    client = _client(loc)
    with _errors(loc, "write", None):
        files = _local_files(local_dir)
        remote = {o.key: o.size for o in _list(client, loc.bucket, f"{prefix}/" if prefix else "")}
        keys = {rel: f"{prefix}/{rel}" if prefix else rel for rel in files}
        same_size = [rel for rel, (size, _) in files.items() if remote.get(keys[rel]) == size]

        def uploaded_mtime(rel: str) -> str | None:
            try:
                head = client.head_object(Bucket=loc.bucket, Key=keys[rel])
            except Exception as exc:
                if _error_code(exc) in ("404", "NoSuchKey"):
                    return None  # deleted since the listing: upload it again
                raise
            value = head.get("Metadata", {}).get(MTIME_KEY)
            return None if value is None else str(value)

        with ThreadPoolExecutor(WORKERS) as pool:
            mtimes = dict(zip(same_size, pool.map(uploaded_mtime, same_size), strict=True))
        todo = [rel for rel, (_, mtime) in files.items() if mtimes.get(rel) != str(mtime)]
        _send(client, loc.bucket, [(local_dir / rel, keys[rel], files[rel][1]) for rel in todo])
    sent = sum(files[rel][0] for rel in todo)
    return UploadStats(len(files), len(todo), len(files) - len(todo), sent)


# -- listing ---------------------------------------------------------------------------------


def _list(client: Any, bucket: str, prefix: str) -> Iterator[S3Object]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        for item in page.get("Contents", ()):
            key = item["Key"]
            yield S3Object(key, key[len(prefix) :], item["Size"], item["ETag"])


def _listing(client: Any, loc: S3Location) -> tuple[bool, list[S3Object]]:
    """(single object?, the objects). A key that has objects under ``key/`` is a directory;
    otherwise an object with exactly that key is one file. Keys ending in '/' are the zero-byte
    "folder" markers consoles create, not files."""
    prefix = loc.key if loc.key.endswith("/") or not loc.key else loc.key + "/"
    objects = [o for o in _list(client, loc.bucket, prefix) if not o.key.endswith("/")]
    if objects:
        _check_paths(loc, objects)
        return False, sorted(objects, key=lambda o: o.key)
    if loc.key and not loc.key.endswith("/"):
        # The exact key sorts first among the keys it prefixes: one short listing finds it.
        page = client.list_objects_v2(Bucket=loc.bucket, Prefix=loc.key, MaxKeys=1)
        first = page.get("Contents", [{}])[0]
        if first.get("Key") == loc.key:
            name = loc.key.rsplit("/", 1)[-1]
            return True, [S3Object(loc.key, name, first["Size"], first["ETag"])]
    raise DataError(
        f"nothing at {loc.uri}: no object with that key and none under it; check the prefix "
        f"(aws s3 ls {loc.uri})",
        path=loc.uri,
    )


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


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- building a version -----------------------------------------------------------------------


def _build(
    client: Any, loc: S3Location, root: Path, version: str, objects: Sequence[S3Object]
) -> tuple[int, int, int]:
    """Make `root/version` under the lock: link what the latest version already has, fetch
    the rest into a temporary tree, rename it into place. Returns (downloaded, reused, bytes)."""
    if (root / version).is_dir():  # another process built it while we waited for the lock
        return 0, 0, 0
    for stale in root.glob(".tmp-*"):  # left by a process killed mid-build (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    previous = _previous_files(root)
    tmp = root / f".tmp-{version}-{os.getpid()}"
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
        _get_all(client, loc.bucket, [(o, tmp / o.rel) for o in todo])
        for obj in todo:
            (tmp / obj.rel).chmod(0o444)  # shared by hard links with later versions
        manifest = json.dumps({"uri": loc.uri, "objects": [_entry(o) for o in objects]})
        _write_atomic(root / f"{version}.json", manifest)
        tmp.rename(root / version)
        _write_atomic(root / "latest", version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(todo), reused, need


def _previous_files(root: Path) -> dict[tuple[int, str], Path]:
    """(size, ETag) -> file, for every object of the latest complete version."""
    try:
        version = (root / "latest").read_text().strip()
        objects = json.loads((root / f"{version}.json").read_text())["objects"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(size, etag): root / version / rel for rel, size, etag in objects}


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


def _get_all(client: Any, bucket: str, jobs: Sequence[tuple[S3Object, Path]]) -> None:
    """GET every object into its path, WORKERS requests at a time; a large object as ranged
    parts. Each GET carries If-Match with the listed ETag, so the tree is exactly that listing."""
    parts: list[Callable[[], None]] = []
    for obj, path in jobs:
        with path.open("wb") as out:
            out.truncate(obj.size)
        for offset in range(0, max(obj.size, 1), PART_SIZE):
            length = min(PART_SIZE, obj.size - offset)
            parts.append(_part(client, bucket, obj, path, offset, length))
    _run_all(parts)


def _part(
    client: Any, bucket: str, obj: S3Object, path: Path, offset: int, length: int
) -> Callable[[], None]:
    def get() -> None:
        extra = {"Range": f"bytes={offset}-{offset + length - 1}"} if length < obj.size else {}
        reply = client.get_object(Bucket=bucket, Key=obj.key, IfMatch=obj.etag, **extra)
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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- uploading --------------------------------------------------------------------------------


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


def _send(client: Any, bucket: str, jobs: Sequence[tuple[Path, str, int]]) -> None:
    """Upload (path, key, mtime_ns) jobs with boto3's transfer manager (multipart for big
    checkpoints), the mtime in each object's metadata."""
    if not jobs:
        return
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    config = TransferConfig(max_concurrency=WORKERS)
    with create_transfer_manager(client, config) as manager:
        futures = [
            manager.upload(str(path), bucket, key, {"Metadata": {MTIME_KEY: str(mtime)}})
            for path, key, mtime in jobs
        ]
        for future in futures:
            future.result()


# -- clients and errors -----------------------------------------------------------------------


def _client(loc: S3Location) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise DataError(
            f"cannot move {loc.uri}: this node's Python environment lacks boto3; add it to "
            'the image: sky.Image(pip=["boto3"])',
            path=loc.uri,
        ) from None
    config = Config(max_pool_connections=WORKERS, retries={"mode": "standard"})
    return boto3.session.Session().client("s3", config=config)


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


@contextlib.contextmanager
def _errors(loc: S3Location, verb: str, root: Path | None) -> Iterator[None]:
    """Turn boto and file-system failures into a `DataError` naming the URI and the fix."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        raise DataError(_explain(exc, loc, verb, root), path=loc.uri) from exc


def _explain(exc: Exception, loc: S3Location, verb: str, root: Path | None) -> str:
    import botocore.exceptions as boto

    action = "s3:ListBucket and s3:GetObject"
    if verb != "read":
        action = "s3:ListBucket, s3:GetObject and s3:PutObject"
    code = _error_code(exc)
    if code == "NoSuchBucket":
        return (
            f"cannot {verb} {loc.uri}: bucket {loc.bucket!r} does not exist (check the name, "
            "and AWS_ENDPOINT_URL / the region if you use another S3 service)"
        )
    if code in _DENIED_CODES:
        return (
            f"cannot {verb} {loc.uri}: this node's AWS credentials were refused ({code}); give "
            f"them {action} on it (on EC2: an instance profile with that policy; elsewhere: "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile on the node)"
        )
    if code in _RETRY_CODES:
        return f"cannot {verb} {loc.uri}: its objects kept changing while they were downloaded"
    if code:
        message = getattr(exc, "response", {}).get("Error", {}).get("Message", "")
        return f"cannot {verb} {loc.uri}: S3 answered {code}: {message}"
    if isinstance(exc, boto.NoCredentialsError):
        return (
            f"cannot {verb} {loc.uri}: no AWS credentials on this node (on EC2: give the "
            "instances an instance profile; elsewhere: AWS_* variables or ~/.aws on the node)"
        )
    if isinstance(exc, boto.EndpointConnectionError | boto.ConnectTimeoutError):
        return f"cannot {verb} {loc.uri}: S3 is unreachable from this node ({exc})"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"cannot download {loc.uri}: no space left under {root} ({exc.strerror}); free "
            "space there or point SKYWARD_CACHE_DIR at a larger disk"
        )
    if isinstance(exc, OSError):
        where = f"the cache {root}" if root is not None else "local files"
        return f"cannot {verb} {loc.uri}: {where}: {exc}"
    return f"cannot {verb} {loc.uri}: {type(exc).__name__}: {exc}"


# -- command line -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``download URI [--cache DIR]`` or ``upload DIR URI``; one JSON line on stdout."""
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
