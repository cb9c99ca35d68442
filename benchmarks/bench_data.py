"""Data-sync benchmarks: `push_tree` and `pull_tree` beside raw copies over the same connections.

Run as root: ``python benchmarks/bench_data.py [--quick]``. It builds three network-namespace
hosts (tests/support/sshd.py), each sshd giving its sessions a cache dir of its own
(``SetEnv SKYWARD_CACHE_DIR``), so all three really receive the data although they share this
machine's disk. Nodes are made by `sky.SSH`'s own launch and prepare (root, this interpreter).
Everything (data, caches, copies) lives in one temp dir removed at the end. A report: it always
exits 0.

- push: a tree of 1,000 files of 1 MiB (``--quick``: 100) to 3 hosts at once, stores emptied
  before each run (the first run opens the nodes' receivers, later ones reuse them), vs the
  faster of two raw copies of the same files to the same 3 hosts over the same asyncssh
  connections: one local ``tar c`` stream written to ``tar x`` on an exec channel per host, and
  SFTP ``put`` (recursive, preserving times) to each host at once.
- re-push: one 1 MiB file changed, then scan + push to the 3 hosts (which hold the previous
  version), over the receivers the push runs opened, as a pool's later pushes do; the bytes on
  each node's wire are printed. Floor: that one file as a tar stream (a new exec channel).
- pull: 200 files of 1 MB (``--quick``: 20) from each of 3 hosts at once into empty local dirs,
  vs the faster of ``tar c`` on each host read into a local ``tar x``, and SFTP ``get``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import skyward as sky
from skyward.hardware import ClusterSpec
from skyward.providers.remote.bootstrap import RemoteNode, close_hosts, remote_nodes
from skyward.providers.remote.files import PushStats, pull_tree, push_tree
from skyward.worker.treestore import scan
from tests.support import sshd

MiB = 1 << 20
SUBNET = "10.213.14.0/24"


@dataclass(frozen=True)
class Settings:
    push_files: int  # of 1 MiB
    pull_files: int  # of 1 MB, per host
    runs: int  # samples of each figure and floor, alternating
    changes: int  # re-push samples


FULL = Settings(push_files=1000, pull_files=200, runs=3, changes=5)
QUICK = Settings(push_files=100, pull_files=20, runs=3, changes=3)


def spread(samples: Sequence[float]) -> str:
    """Every sample when there are few; p10 / p50 / p90 otherwise."""
    ordered = sorted(samples)
    if len(ordered) <= 5:
        return "[" + ", ".join(f"{x:.3f}" for x in ordered) + "] s"
    deciles = statistics.quantiles(ordered, n=10)
    return f"p10 {deciles[0]:.3f} / p50 {statistics.median(ordered):.3f} / p90 {deciles[-1]:.3f} s"


def row(name: str, figure: list[float], floor: list[float], floor_name: str, target: str,
        passed: bool, extra: str = "") -> None:  # fmt: skip
    value, base = statistics.median(figure), statistics.median(floor)
    verdict = "PASS" if passed else "MISS"
    print(
        f"{name:<34} {value:8.3f} s  floor {base:8.3f} s ({floor_name:<8}) "
        f"{value / base:5.2f}x  target {target:<16} {verdict}",
        flush=True,
    )
    print(f"    figure {spread(figure)}; floor {spread(floor)}{extra}", flush=True)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def fill(folder: Path, count: int, size: int) -> Path:
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"part-{i:05d}.bin").write_bytes(os.urandom(size))
    return folder


async def timed(make: Callable[[], Awaitable[object]]) -> float:
    began = time.perf_counter()
    await make()
    return time.perf_counter() - began


# -- the floors: raw copies over the nodes' own connections


async def tar_push(nodes: Sequence[RemoteNode], src: Path, dests: Sequence[Path]) -> None:
    """One local ``tar c`` stream, written to ``tar x`` on an exec channel per host."""
    tar = await asyncio.create_subprocess_exec(
        "tar", "c", "-C", str(src), ".", stdout=asyncio.subprocess.PIPE
    )
    assert tar.stdout is not None
    procs = [
        await n.host.conn.create_process(f"mkdir -p {d} && tar x -C {d}", encoding=None)
        for n, d in zip(nodes, dests, strict=True)
    ]
    while data := await tar.stdout.read(MiB):
        for p in procs:
            p.stdin.write(data)
        await asyncio.gather(*(p.stdin.drain() for p in procs))
    for p in procs:
        p.stdin.write_eof()
    await asyncio.gather(*(p.wait(check=True) for p in procs))
    await tar.wait()


async def sftp_push(nodes: Sequence[RemoteNode], src: Path, dests: Sequence[Path]) -> None:
    async def one(node: RemoteNode, dest: Path) -> None:
        async with node.host.conn.start_sftp_client() as sftp:
            await sftp.put(str(src), str(dest), recurse=True, preserve=True)

    await asyncio.gather(*(one(n, d) for n, d in zip(nodes, dests, strict=True)))


async def tar_pull(
    nodes: Sequence[RemoteNode], srcs: Sequence[Path], dests: Sequence[Path]
) -> None:
    async def one(node: RemoteNode, src: Path, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        tar = await asyncio.create_subprocess_exec(
            "tar", "x", "-C", str(dest), stdin=asyncio.subprocess.PIPE
        )
        assert tar.stdin is not None
        proc = await node.host.conn.create_process(f"tar c -C {src} .", encoding=None)
        while data := await proc.stdout.read(MiB):
            tar.stdin.write(data)
            await tar.stdin.drain()
        tar.stdin.close()
        await tar.wait()
        await proc.wait(check=True)

    await asyncio.gather(*(one(*args) for args in zip(nodes, srcs, dests, strict=True)))


async def sftp_pull(
    nodes: Sequence[RemoteNode], srcs: Sequence[Path], dests: Sequence[Path]
) -> None:
    async def one(node: RemoteNode, src: Path, dest: Path) -> None:
        async with node.host.conn.start_sftp_client() as sftp:
            await sftp.get(str(src), str(dest), recurse=True, preserve=True)

    await asyncio.gather(*(one(*args) for args in zip(nodes, srcs, dests, strict=True)))


# -- the run


def clear(*paths: Path) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


async def bench_push(nodes: list[RemoteNode], work: Path, caches: list[Path], s: Settings) -> None:
    src = fill(work / "src", s.push_files, MiB)
    began = time.perf_counter()
    manifest = scan(src)
    first_scan = time.perf_counter() - began
    began = time.perf_counter()
    scan(src)
    rescan = time.perf_counter() - began
    size = manifest.size
    print(f"tree: {s.push_files} files, {size / MiB:.0f} MiB; first scan (hashing) "
          f"{first_scan:.3f} s, rescan {rescan * 1000:.1f} ms", flush=True)  # fmt: skip
    copies = [work / f"copy{i}" for i in range(len(nodes))]
    stores = [c / "data" for c in caches]
    figure: list[float] = []
    floors: dict[str, list[float]] = {"tar/exec": [], "sftp": []}
    for _ in range(s.runs):
        clear(*stores)
        figure.append(await timed(lambda: push_tree(nodes, src, manifest)))
        clear(*copies)
        floors["tar/exec"].append(await timed(lambda: tar_push(nodes, src, copies)))
        clear(*copies)
        floors["sftp"].append(await timed(lambda: sftp_push(nodes, src, copies)))
        clear(*copies)
    name, floor = min(floors.items(), key=lambda kv: statistics.median(kv[1]))
    other = "sftp" if name == "tar/exec" else "tar/exec"
    ratio = statistics.median(figure) / statistics.median(floor)
    rate = 3 * size / statistics.median(figure) / MiB
    row(f"push {size / MiB:.0f} MiB to 3 hosts", figure, floor, name, "<= 1.3x", ratio <= 1.3,
        f"\n    {other} floor {spread(floors[other])}; push {rate:.0f} MiB/s on the wire "
        "(all hosts)")  # fmt: skip

    # Re-push: the stores hold the last version; one file changes each time.
    times: list[float] = []
    wires: list[int] = []
    floor_one: list[float] = []
    for k in range(s.changes):
        changed = src / f"part-{k:05d}.bin"
        changed.write_bytes(os.urandom(MiB))
        stats = PushStats()

        async def again(stats: PushStats = stats) -> None:
            await push_tree(nodes, src, scan(src), stats=stats)

        times.append(await timed(again))
        wires.append(max(stats.bytes_sent.values()))
        one = work / "one"
        clear(one)
        one.mkdir()
        shutil.copy2(changed, one / changed.name)
        floor_one.append(await timed(lambda one=one: tar_push(nodes, one, copies)))
        clear(*copies)
    wire = statistics.median(wires)
    row("re-push, one 1 MiB file changed", times, floor_one, "tar/exec", "< 0.5 s",
        statistics.median(times) < 0.5,
        f"\n    on the wire per node: {wire / MiB:.3f} MiB (the manifest: "
        f"{len(manifest.encoded) / 1024:.0f} KiB)")  # fmt: skip
    clear(src, *stores)


async def bench_pull(nodes: list[RemoteNode], work: Path, s: Settings) -> None:
    outs = [fill(work / f"out{i}", s.pull_files, 1_000_000) for i in range(len(nodes))]
    dests = [work / f"pulled{i}" for i in range(len(nodes))]
    total = s.pull_files * 1_000_000
    figure: list[float] = []
    floors: dict[str, list[float]] = {"tar/exec": [], "sftp": []}

    async def pull_all() -> None:
        await asyncio.gather(
            *(pull_tree(n, str(o), d) for n, o, d in zip(nodes, outs, dests, strict=True))
        )

    for _ in range(s.runs):
        clear(*dests)
        figure.append(await timed(pull_all))
        clear(*dests)
        floors["tar/exec"].append(await timed(lambda: tar_pull(nodes, outs, dests)))
        clear(*dests)
        floors["sftp"].append(await timed(lambda: sftp_pull(nodes, outs, dests)))
        clear(*dests)
    name, floor = min(floors.items(), key=lambda kv: statistics.median(kv[1]))
    other = "sftp" if name == "tar/exec" else "tar/exec"
    ratio = statistics.median(figure) / statistics.median(floor)
    row(f"pull {total / 1e6:.0f} MB from each of 3 hosts", figure, floor, name, "<= 1.3x",
        ratio <= 1.3, f"\n    {other} floor {spread(floors[other])}")  # fmt: skip
    clear(*outs)


async def run(work: Path, net: sshd.NetnsHosts, key: sshd.KeyPair, caches: list[Path],
              s: Settings) -> None:  # fmt: skip
    provider = sky.SSH(
        net.addresses,
        user="root",
        key=str(key.private_path),
        known_hosts=net.known_hosts_lines(),
        python=sys.executable,
    )
    cluster = await provider.launch(ClusterSpec(3, "bench-data", provider="ssh"), print)
    try:
        await provider.prepare(cluster, sky.Image(), print)
        nodes = remote_nodes(cluster)
        await bench_push(nodes, work, caches, s)
        await bench_pull(nodes, work, s)
    finally:
        await close_hosts(cluster)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 MiB pushed, 20 MB pulled")
    args = parser.parse_args()
    if not sshd.is_root():
        print("bench_data needs root (it starts sshd and network namespaces)")
        return
    settings = QUICK if args.quick else FULL
    print(load(), flush=True)
    work = Path(tempfile.mkdtemp(prefix="skyward-bench-data-"))
    began = time.perf_counter()
    try:
        key = sshd.KeyPair.generate(work)
        caches = [work / f"cache{i}" for i in range(3)]
        config = [[f"SetEnv SKYWARD_CACHE_DIR={c}"] for c in caches]
        with sshd.NetnsHosts(
            3, subnet=SUBNET, authorized_keys=[key], sshd_host_config=config
        ) as net:
            asyncio.run(run(work, net, key, caches, settings))
    except Exception as exc:  # a report, not a test: say what broke and exit 0
        print(f"bench_data could not finish: {type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - began:.1f} s; {load()}")


if __name__ == "__main__":
    main()
