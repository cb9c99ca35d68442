"""`skyward.worker.s3sync` against moto as a real S3 server process.

Requests are counted from moto's access log, on the server's side, not from the code's own stats
(which are checked too).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

import skyward as sky  # noqa: E402
from skyward.errors import DataError  # noqa: E402
from skyward.worker import s3cache, s3sync  # noqa: E402
from tests.support import sshd  # noqa: E402
from tests.support.motos3 import MotoS3, moto_s3, s3_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "skyward-data"
FILES = {
    "top.txt": b"top",
    "a/b/c.bin": os.urandom(300_000),
    "a/d.txt": b"d" * 1000,
    "e/empty": b"",
}


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    with moto_s3(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def s3(moto: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh moto with one bucket; this process's AWS settings point only at it."""
    moto.reset()
    for name in list(os.environ):
        if name.startswith("AWS_") or name == "SKYWARD_CACHE_DIR":
            monkeypatch.delenv(name)
    for name, value in s3_env(moto.url).items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    return client


def put_tree(client: Any, prefix: str, files: dict[str, bytes]) -> None:
    for rel, body in files.items():
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=body)


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def leftovers(cache: Path) -> list[Path]:
    return list(cache.rglob(".tmp-*"))


# -- download ---------------------------------------------------------------------------------


def test_download_prefix_with_nested_keys(s3: Any, moto: MotoS3, tmp_path: Path) -> None:
    put_tree(s3, "ds", FILES)
    s3.put_object(Bucket=BUCKET, Key="ds/folder/", Body=b"")  # a console's folder marker
    s3.put_object(Bucket=BUCKET, Key="ds-other/x", Body=b"not under ds/")
    s3.put_object(Bucket=BUCKET, Key="dsx", Body=b"not under ds/")
    mark = moto.mark()

    stats = s3sync.fetch(f"s3://{BUCKET}/ds", tmp_path)

    path = Path(stats.path)
    assert path.is_relative_to(tmp_path / "data" / "s3" / BUCKET)
    assert tree(path) == FILES
    assert (stats.objects, stats.downloaded, stats.reused) == (4, 4, 0)
    assert stats.bytes == sum(map(len, FILES.values()))
    assert len(moto.object_gets(BUCKET, mark)) == 4
    assert s3sync.download(f"s3://{BUCKET}/ds/", tmp_path) == stats.path  # same data, same path
    assert not (path / "top.txt").stat().st_mode & 0o222  # shared by hard links: read-only
    assert not leftovers(tmp_path)


def test_second_download_gets_nothing_and_a_change_gets_only_it(
    s3: Any, moto: MotoS3, tmp_path: Path
) -> None:
    put_tree(s3, "ds", FILES)
    first = s3sync.fetch(f"s3://{BUCKET}/ds", tmp_path)
    mark = moto.mark()

    again = s3sync.fetch(f"s3://{BUCKET}/ds", tmp_path)

    assert again.path == first.path
    assert (again.downloaded, again.cached) == (0, True)
    assert moto.object_gets(BUCKET, mark) == []
    assert all(r.is_listing for r in moto.requests(mark))

    s3.put_object(Bucket=BUCKET, Key="ds/a/d.txt", Body=b"changed")
    mark = moto.mark()
    changed = s3sync.fetch(f"s3://{BUCKET}/ds", tmp_path)

    assert changed.path != first.path
    assert (changed.downloaded, changed.reused, changed.bytes) == (1, 3, len(b"changed"))
    assert [r.path for r in moto.object_gets(BUCKET, mark)] == [f"/{BUCKET}/ds/a/d.txt"]
    new, old = Path(changed.path), Path(first.path)
    assert tree(new) == {**FILES, "a/d.txt": b"changed"}
    assert tree(old) == FILES  # the previous version is untouched
    assert (new / "a/b/c.bin").stat().st_ino == (old / "a/b/c.bin").stat().st_ino
    assert not leftovers(tmp_path)


def test_single_object(s3: Any, moto: MotoS3, tmp_path: Path) -> None:
    put_tree(s3, "ds", FILES)
    path = Path(s3sync.download(f"s3://{BUCKET}/ds/a/b/c.bin", tmp_path))
    assert path.name == "c.bin"
    assert path.read_bytes() == FILES["a/b/c.bin"]
    mark = moto.mark()
    assert s3sync.download(f"s3://{BUCKET}/ds/a/b/c.bin", tmp_path) == str(path)
    assert moto.object_gets(BUCKET, mark) == []


def test_large_object_in_ranged_parts(
    s3: Any, moto: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3cache, "PART_SIZE", 100_000)
    put_tree(s3, "ds", FILES)
    mark = moto.mark()
    path = Path(s3sync.download(f"s3://{BUCKET}/ds", tmp_path))
    assert tree(path) == FILES
    gets = Counter((r.path, r.status) for r in moto.object_gets(BUCKET, mark))
    # c.bin (300 kB) as three partial GETs (206), the small files whole (200), each once: with
    # the bytes right, three ranges fetched once each can only be the file's three parts.
    assert gets == {
        (f"/{BUCKET}/ds/a/b/c.bin", 206): 3,
        (f"/{BUCKET}/ds/a/d.txt", 200): 1,
        (f"/{BUCKET}/ds/e/empty", 200): 1,
        (f"/{BUCKET}/ds/top.txt", 200): 1,
    }


def test_two_processes_download_the_same_uri_at_once(s3: Any, moto: MotoS3, tmp_path: Path) -> None:
    files = {f"part-{i:02}": os.urandom(200_000) for i in range(40)}
    put_tree(s3, "many", files)
    uri = f"s3://{BUCKET}/many"
    command = [sys.executable, "-m", "skyward.worker.s3sync", "download", uri]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SKYWARD_CACHE_DIR": str(tmp_path)}
    root = s3sync.cache_root(uri, tmp_path)
    root.mkdir(parents=True)
    mark = moto.mark()
    # Hold the build lock until both processes have listed the prefix, so that both are
    # certainly downloading at once, whatever the machine's load; then let them race for it.
    with (root / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(2)
        ]
        deadline = time.monotonic() + 30
        while sum(r.is_listing for r in moto.requests(mark)) < 2:
            assert time.monotonic() < deadline, moto.requests(mark)
        assert moto.object_gets(BUCKET, mark) == []
    outputs = [p.communicate(timeout=60) for p in procs]

    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [json.loads(out) for out, _ in outputs]
    assert results[0]["path"] == results[1]["path"]
    assert sorted(r["downloaded"] for r in results) == [0, 40]
    assert len(moto.object_gets(BUCKET, mark)) == 40
    assert tree(Path(results[0]["path"])) == files
    assert not leftovers(tmp_path)


# -- download errors --------------------------------------------------------------------------


def test_missing_bucket(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="bucket 'no-such-bucket' does not exist") as caught:
        s3sync.download("s3://no-such-bucket/ds", tmp_path)
    assert caught.value.path == "s3://no-such-bucket/ds"
    assert not (tmp_path / "data").exists()  # failed before creating anything


@pytest.mark.parametrize("uri", [f"s3://{BUCKET}/nothing", f"s3://{BUCKET}/nothing/"])
def test_missing_prefix(s3: Any, tmp_path: Path, uri: str) -> None:
    s3.put_object(Bucket=BUCKET, Key="nothing-here-either", Body=b"x")
    with pytest.raises(DataError, match="nothing at") as caught:
        s3sync.download(uri, tmp_path)
    assert caught.value.path == uri


def test_unsafe_key_is_refused(s3: Any, tmp_path: Path) -> None:
    s3.put_object(Bucket=BUCKET, Key="ds/../../escape", Body=b"x")
    with pytest.raises(DataError, match="cannot be a local path"):
        s3sync.download(f"s3://{BUCKET}/ds", tmp_path)
    assert not list(tmp_path.rglob("escape"))


def test_cli_prints_one_json_line(s3: Any, tmp_path: Path) -> None:
    put_tree(s3, "ds", FILES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SKYWARD_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-m", "skyward.worker.s3sync"]
    ok = subprocess.run([*run, "download", f"s3://{BUCKET}/ds"], env=env, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    assert tree(Path(json.loads(ok.stdout)["path"])) == FILES
    bad = subprocess.run([*run, "download", f"s3://{BUCKET}/no"], env=env, capture_output=True)
    assert bad.returncode == 1
    error = json.loads(bad.stdout)
    assert error["path"] == f"s3://{BUCKET}/no"
    assert "nothing at" in error["error"]


def test_access_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """moto enforces IAM after its first INITIAL_NO_AUTH_ACTION_COUNT actions (the set-up
    below), for a server of its own: a user without a policy is refused, one with is served."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    with moto_s3(tmp_path, env={"INITIAL_NO_AUTH_ACTION_COUNT": "7"}) as server:
        for name, value in s3_env(server.url).items():
            monkeypatch.setenv(name, value)
        admin, iam = boto3.client("s3"), boto3.client("iam")
        admin.create_bucket(Bucket=BUCKET)  # 1
        admin.put_object(Bucket=BUCKET, Key="ds/x", Body=b"x")  # 2
        keys = {}
        for user in ("nobody", "reader"):
            iam.create_user(UserName=user)  # 3, 5
            keys[user] = iam.create_access_key(UserName=user)["AccessKey"]  # 4, 6
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(  # 7
            UserName="reader", PolicyName="read", PolicyDocument=json.dumps(policy)
        )

        def as_user(user: str) -> None:
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys[user]["AccessKeyId"])
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys[user]["SecretAccessKey"])

        # The whole bucket: moto 5 miscomputes the signature of a query value holding '/'
        # (Prefix=ds/), answering SignatureDoesNotMatch even to an allowed user.
        uri = f"s3://{BUCKET}"
        as_user("nobody")
        with pytest.raises(DataError, match=r"credentials were refused \(AccessDenied\)") as caught:
            s3sync.download(uri, tmp_path / "cache")
        assert caught.value.path == uri
        assert "s3:GetObject" in str(caught.value)
        as_user("reader")
        assert tree(Path(s3sync.download(uri, tmp_path / "cache"))) == {"ds/x": b"x"}


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.skipif(not sshd.is_root(), reason="mounting a tmpfs needs root")
def test_full_disk(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {f"f{i}": os.urandom(400_000) for i in range(4)}  # 1.6 MB into a 1 MB tmpfs
    put_tree(s3, "big", files)
    uri = f"s3://{BUCKET}/big"
    with small_tmpfs(tmp_path / "cache", "1m") as cache:
        # Known before any download: refused up front.
        with pytest.raises(DataError, match="no space left under") as caught:
            s3sync.download(uri, cache)
        assert caught.value.path == uri
        assert "SKYWARD_CACHE_DIR" in str(caught.value)
        assert "bytes to download" in str(caught.value)
        assert not leftovers(cache)
        # Space that vanishes during the download (the check is fooled): the same error.
        fooled = shutil._ntuple_diskusage(2**40, 0, 2**40)  # type: ignore[attr-defined]
        monkeypatch.setattr(s3cache.shutil, "disk_usage", lambda _: fooled)
        with pytest.raises(DataError, match="No space left on device"):
            s3sync.download(uri, cache)
        assert not leftovers(cache)
        assert not [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size]


# -- upload -----------------------------------------------------------------------------------


def test_upload_is_incremental(s3: Any, moto: MotoS3, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for rel, body in FILES.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(body)
    uri = f"s3://{BUCKET}/run-1/node-0"

    first = s3sync.upload(out, uri)

    assert (first.files, first.uploaded, first.skipped) == (4, 4, 0)
    for rel, body in FILES.items():
        reply = s3.get_object(Bucket=BUCKET, Key=f"run-1/node-0/{rel}")
        assert reply["Body"].read() == body
        assert reply["Metadata"]["skyward-mtime"] == str((out / rel).stat().st_mtime_ns)

    mark = moto.mark()
    again = s3sync.upload(out, uri + "/")
    assert (again.uploaded, again.skipped, again.bytes) == (0, 4, 0)
    assert moto.object_puts(BUCKET, mark) == []

    (out / "a/d.txt").write_bytes(b"D" * 1000)  # same size, new mtime
    (out / "new.txt").write_bytes(b"new")
    mark = moto.mark()
    third = s3sync.upload(out, uri)
    assert (third.uploaded, third.skipped) == (2, 3)
    puts = sorted(r.path for r in moto.object_puts(BUCKET, mark))
    assert puts == [f"/{BUCKET}/run-1/node-0/a/d.txt", f"/{BUCKET}/run-1/node-0/new.txt"]
    body = s3.get_object(Bucket=BUCKET, Key="run-1/node-0/a/d.txt")["Body"].read()
    assert body == b"D" * 1000


def test_upload_errors_name_the_uri(s3: Any, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match="bucket 'no-such-bucket' does not exist") as caught:
        s3sync.upload(tmp_path, "s3://no-such-bucket/out")
    assert caught.value.path == "s3://no-such-bucket/out"
    with pytest.raises(DataError, match="not a directory"):
        s3sync.upload(tmp_path / "missing", f"s3://{BUCKET}/out")
    with pytest.raises(DataError, match="not an s3:// URI"):
        s3sync.upload(tmp_path, "gs://elsewhere/out")


def test_missing_boto3_says_how_to_add_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed: import raises
    with pytest.raises(DataError, match=r'lacks boto3.*sky\.Image\(pip=\["boto3"\]\)') as caught:
        s3sync.download(f"s3://{BUCKET}/ds", tmp_path)
    assert caught.value.path == f"s3://{BUCKET}/ds"
    with pytest.raises(DataError, match="lacks boto3"):
        s3sync.upload(tmp_path, f"s3://{BUCKET}/out")


# -- through a pool (Local nodes; tests/ssh/test_s3_from_hosts.py does SSH hosts) -----------


@sky.compute
def read_s3_data(path: str) -> tuple[int, dict[str, bytes]]:
    out = Path(sky.output_dir())
    (out / "metrics.json").write_text('{"loss": 0.5}')
    return sky.instance_info().node, tree(Path(path))


def test_a_pool_reads_s3_data_and_uploads_its_outputs(
    s3: Any, moto: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path / "cache"))
    files = {"a.bin": b"A" * 100, "sub/b.bin": b"B" * 10}
    put_tree(s3, "ds", files)
    mark = moto.mark()
    with sky.ComputePool(nodes=2, output_dir=f"s3://{BUCKET}/runs/", stream_output=False) as pool:
        seen = read_s3_data(sky.Data(f"s3://{BUCKET}/ds")) @ pool
        assert seen == [(0, files), (1, files)]
        # both nodes share this machine's cache: the objects were fetched once
        assert len(moto.object_gets(BUCKET, mark)) == len(files)
        with pytest.raises(sky.DataError, match="does not exist") as caught:
            read_s3_data(sky.Data("s3://no-such-bucket/ds")) >> pool
        assert caught.value.path == "s3://no-such-bucket/ds" and caught.value.node in (0, 1)
    for node in (0, 1):
        body = s3.get_object(Bucket=BUCKET, Key=f"runs/node-{node}/metrics.json")["Body"].read()
        assert body == b'{"loss": 0.5}'
    assert not leftovers(tmp_path / "cache")
