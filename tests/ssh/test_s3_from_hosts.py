"""Nodes download from S3 themselves: moto listens on the namespace bridge, and each namespace
host runs ``python -m skyward.worker.s3sync download`` over SSH with its own cache. moto's access
log says which address asked for what, so each host is seen fetching its own copy."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from tests.ssh.conftest import Hosts
from tests.support import sshd
from tests.support.motos3 import MotoS3, moto_s3, s3_env

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

pytestmark = pytest.mark.ssh

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "skyward-shared"


@pytest.fixture
def bridge_moto(netns_hosts: Hosts, tmp_path: Path) -> Iterator[MotoS3]:
    with moto_s3(tmp_path, host=netns_hosts.net.bridge_address) as server:
        yield server


def download_on_hosts(hosts: Hosts, moto: MotoS3, uri: str, caches: Path) -> list[dict[str, Any]]:
    """Run the download on every host at once, each into its own cache; their JSON results."""
    procs = []
    for i, host in enumerate(hosts.net.hosts):
        env = {**s3_env(moto.url), "PYTHONPATH": str(ROOT)}
        env["SKYWARD_CACHE_DIR"] = str(caches / f"host-{i}")
        remote = ["env", *(f"{k}={v}" for k, v in env.items())]
        remote += [sys.executable, "-m", "skyward.worker.s3sync", "download", uri]
        argv = sshd.ssh_command(
            host.address, host.port, "root", hosts.key, hosts.known_hosts, shlex.join(remote)
        )
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    return [json.loads(out) for out, _ in outputs]


def test_each_host_downloads_from_s3_itself(
    netns_hosts: Hosts, bridge_moto: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_env(bridge_moto.url).items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    files = {f"shard-{i}/part.bin": os.urandom(100_000) for i in range(5)}
    for rel, body in files.items():
        client.put_object(Bucket=BUCKET, Key=f"dataset/{rel}", Body=body)
    uri = f"s3://{BUCKET}/dataset"
    addresses = [host.address for host in netns_hosts.net.hosts]

    mark = bridge_moto.mark()
    first = download_on_hosts(netns_hosts, bridge_moto, uri, tmp_path)

    gets = bridge_moto.object_gets(BUCKET, mark)
    assert sorted({r.client for r in gets}) == sorted(addresses)
    for i, (address, result) in enumerate(zip(addresses, first, strict=True)):
        assert result["downloaded"] == len(files)
        assert sum(r.client == address for r in gets) == len(files)
        path = Path(result["path"])
        assert path.is_relative_to(tmp_path / f"host-{i}")
        assert {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*.bin")} == (
            files
        )

    mark = bridge_moto.mark()
    second = download_on_hosts(netns_hosts, bridge_moto, uri, tmp_path)

    assert [r["path"] for r in second] == [r["path"] for r in first]
    assert all(r["cached"] and r["downloaded"] == 0 for r in second)
    served = bridge_moto.requests(mark)
    assert all(r.is_listing for r in served), served
    assert sorted(r.client for r in served) == sorted(addresses)


@sky.compute
def checksum_data(path: str) -> tuple[int, int]:
    out = Path(sky.output_dir()) / "ckpt"
    out.mkdir(exist_ok=True)
    (out / "state.bin").write_bytes(b"state of node %d" % sky.instance_info().node)
    return sky.instance_info().node, sum(len(p.read_bytes()) for p in Path(path).rglob("*.bin"))


def test_a_pool_on_hosts_reads_s3_data_and_uploads_outputs_to_s3(
    netns_hosts: Hosts, bridge_moto: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    env = s3_env(bridge_moto.url)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    for i in range(3):
        client.put_object(Bucket=BUCKET, Key=f"pool-ds/{i}.bin", Body=os.urandom(1000))
    addresses = {host.address for host in netns_hosts.net.hosts[:2]}
    mark = bridge_moto.mark()
    with sky.ComputePool(
        provider=netns_hosts.provider(2),
        env=env,
        output_dir=f"s3://{BUCKET}/runs",
        stream_output=False,
    ) as pool:
        assert checksum_data(sky.Data(f"s3://{BUCKET}/pool-ds")) @ pool == [(0, 3000), (1, 3000)]
        with pytest.raises(sky.DataError, match="nothing at") as caught:
            checksum_data(sky.Data(f"s3://{BUCKET}/no-such-prefix")) >> pool
        assert caught.value.node in (0, 1)
    # the hosts themselves asked moto, and uploaded their outputs themselves
    assert {r.client for r in bridge_moto.requests(mark) if r.method == "GET"} <= addresses
    assert {r.client for r in bridge_moto.object_puts(BUCKET, mark)} == addresses
    for node in (0, 1):
        key = f"runs/node-{node}/ckpt/state.bin"
        assert (
            client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"state of node %d" % node
        )
