"""S3 downloads against moto as a real server: 100 objects of 1 MB.

Compares the ways a node can fetch many objects in parallel, best and median of `--repeat` runs
each, fresh directory every run: a thread pool of ``get_object`` streams (what
`skyward.worker.s3sync` does, with If-Match on every GET), boto3's transfer manager with the sizes
and ETags from the listing (no HEAD), and the transfer manager as ``download_file`` uses it
(a HEAD per object). Then `s3sync.fetch` itself: cold, warm (nothing to fetch) and after one
object changed. moto on this machine is the bottleneck, so the absolute figures say little about
S3; the ratios between the ways say more. Run: ``python benchmarks/bench_s3.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from s3transfer.subscribers import BaseSubscriber

from skyward.worker import s3sync
from tests.support.motos3 import moto_s3, s3_env

BUCKET = "bench"
COUNT, SIZE = 100, 1024 * 1024


class _Known(BaseSubscriber):  # type: ignore[misc]
    """Hands the transfer manager the size and ETag from the listing, so it sends no HEAD."""

    def __init__(self, size: int, etag: str) -> None:
        self.size, self.etag = size, etag

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self.size)
        future.meta.provide_object_etag(self.etag)


def thread_pool(client: Any, objects: list[dict[str, Any]], dest: Path, workers: int) -> None:
    def one(obj: dict[str, Any]) -> None:
        reply = client.get_object(Bucket=BUCKET, Key=obj["Key"], IfMatch=obj["ETag"])
        with (dest / obj["Key"].replace("/", "_")).open("wb") as out:
            for chunk in reply["Body"].iter_chunks(1024 * 1024):
                out.write(chunk)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, objects))


def transfer_manager(
    client: Any, objects: list[dict[str, Any]], dest: Path, workers: int, head: bool
) -> None:
    with create_transfer_manager(client, TransferConfig(max_concurrency=workers)) as manager:
        futures = [
            manager.download(
                BUCKET,
                obj["Key"],
                str(dest / obj["Key"].replace("/", "_")),
                subscribers=[] if head else [_Known(obj["Size"], obj["ETag"])],
            )
            for obj in objects
        ]
        for future in futures:
            future.result()


def measure(run: Callable[[Path], Any], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        dest = Path(tempfile.mkdtemp(prefix="bench-s3-"))
        try:
            start = time.perf_counter()
            run(dest)
            times.append(time.perf_counter() - start)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
    return times


def row(name: str, times: list[float], rate: bool = True) -> None:
    best, median = min(times), statistics.median(times)
    mb_s = f"  ({COUNT * SIZE / 1e6 / median:4.0f} MB/s)" if rate else ""
    print(f"{name:44s} best {best:6.3f} s  median {median:6.3f} s{mb_s}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    with tempfile.TemporaryDirectory() as logs, moto_s3(Path(logs)) as moto:
        os.environ.update(s3_env(moto.url))
        client = boto3.client("s3", config=Config(max_pool_connections=32))
        client.create_bucket(Bucket=BUCKET)
        body = os.urandom(SIZE)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: client.put_object(Bucket=BUCKET, Key=f"d/{i:03}", Body=body),
                          range(COUNT)))  # fmt: skip
        objects = client.list_objects_v2(Bucket=BUCKET, Prefix="d/")["Contents"]
        print(f"{COUNT} objects x {SIZE // 1024} KiB from moto; {os.cpu_count()} CPUs")
        for workers in (1, 4, 16):
            row(
                f"thread pool get_object, {workers} workers",
                measure(lambda d, w=workers: thread_pool(client, objects, d, w), args.repeat),
            )
            row(
                f"transfer manager, sizes given, {workers}",
                measure(
                    lambda d, w=workers: transfer_manager(client, objects, d, w, head=False),
                    args.repeat,
                ),
            )
            row(
                f"transfer manager, HEAD each, {workers}",
                measure(
                    lambda d, w=workers: transfer_manager(client, objects, d, w, head=True),
                    args.repeat,
                ),
            )
        uri = f"s3://{BUCKET}/d"
        row("s3sync.fetch cold", measure(lambda d: s3sync.fetch(uri, d), args.repeat))
        with tempfile.TemporaryDirectory() as cache:
            s3sync.fetch(uri, Path(cache))
            warm = measure(lambda _: s3sync.fetch(uri, Path(cache)), args.repeat)
            row("s3sync.fetch warm (listing only)", warm, rate=False)
            changed = []
            for i in range(args.repeat):
                client.put_object(Bucket=BUCKET, Key="d/000", Body=os.urandom(SIZE) + bytes([i]))
                start = time.perf_counter()
                stats = s3sync.fetch(uri, Path(cache))
                changed.append(time.perf_counter() - start)
                assert (stats.downloaded, stats.reused) == (1, COUNT - 1), stats
            row("s3sync.fetch after one object changed", changed, rate=False)


if __name__ == "__main__":
    main()
