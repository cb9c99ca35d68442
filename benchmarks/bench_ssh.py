"""SSH-provider benchmarks: each skyward figure beside a baseline measured in the same run.

Run as root: ``python benchmarks/bench_ssh.py [--quick] [--only rtt|bootstrap]``. It starts its
own sshd on 127.0.0.1 and three network-namespace hosts (tests/support/sshd.py). The round trip
logs in as root and runs this interpreter directly; the bootstrap figures log in as the
unprivileged `skyward-test` user with the host's python3, as on a fresh machine, after one
warm-up that builds its uv environment (so they measure a start with the environment built).
The namespace hosts have no route off the machine, so that build installs uv and the agent's
packages from a wheelhouse of this client's own (tests/support/wheels.py), as the AWS contract
tests do. A MISS is printed, never an exit status.

- rtt: no-op ``call >> pool`` over SSH vs an echo round trip over an open asyncssh channel
  with the same ciphers (timed inside an event loop run by the same thread), sampled in
  alternating blocks; an echo over asyncssh's default ciphers is printed for scale.
- bulk: a large ``bytes`` result back (``make(n) >> pool``) and argument out over SSH vs the
  same bytes through an open asyncssh channel with the same ciphers (``head -c`` read back,
  ``cat > /dev/null`` written), as MB/s. No target: it shows what the agent's framing and
  pickling add to asyncssh, which bounds both.
- bootstrap: pool start (connect, check, agent) on 3 hosts at once vs on 1 host.
- restart: a second pool with the environment already there, split into connect / check /
  agent start + handshake.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncssh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import skyward as sky
from skyward.providers.ssh import SSH
from skyward.transport.sshhost import ENCRYPTION_ALGS
from tests.support import sshd, wheels


@sky.compute
def noop() -> None:
    return None


@sky.compute
def make(n: int) -> bytes:
    return bytes(n)


@sky.compute
def size(data: bytes) -> int:
    return len(data)


def report(name: str, value: float, baseline: float, target: float, unit: str = "ms") -> None:
    ratio = value / baseline
    verdict = "ok" if ratio <= target else "MISS"
    scale = 1000 if unit == "ms" else 1
    print(
        f"{name:<28} {value * scale:9.3f} {unit}  baseline {baseline * scale:9.3f} {unit}  "
        f"ratio {ratio:5.2f}x (target <= {target}x) {verdict}"
    )


class RawEcho:
    """An echo round trip through ``cat`` on an already-open asyncssh channel, timed inside an
    event loop that this thread runs one block at a time, so blocks alternate with the pool's."""

    def __init__(self, server: sshd.SshdServer, key: str, algs: Sequence[str] = ()) -> None:
        self._loop = asyncio.new_event_loop()
        self._server, self._key = server, key
        self._options = {"encryption_algs": list(algs)} if algs else {}
        self._conn: Any = None
        self._process: Any = self._loop.run_until_complete(self._open())

    async def _open(self) -> Any:
        known = asyncssh.import_known_hosts(self._server.known_hosts_line() + "\n")
        self._conn = await asyncssh.connect(
            self._server.host,
            self._server.port,
            username="root",
            client_keys=[self._key],
            known_hosts=known,
            **self._options,
        )
        return await self._conn.create_process("cat", encoding=None)

    async def _block(self, runs: int) -> list[float]:
        times = []
        for _ in range(runs):
            began = time.perf_counter()
            self._process.stdin.write(b"x\n")
            await self._process.stdout.readline()
            times.append(time.perf_counter() - began)
        return times

    def block(self, runs: int) -> list[float]:
        result: list[float] = self._loop.run_until_complete(self._block(runs))
        return result

    def close(self) -> None:
        async def shut() -> None:
            self._process.stdin.write_eof()
            self._conn.close()
            await self._conn.wait_closed()

        self._loop.run_until_complete(shut())
        self._loop.close()


def interleaved_rtt(
    pool: sky.ComputePool, echoes: Sequence[RawEcho], runs: int
) -> tuple[float, list[float]]:
    """Medians of the pool's no-op call and of each raw echo, sampled in alternating blocks."""
    calls: list[float] = []
    floors: list[list[float]] = [[] for _ in echoes]
    block = max(1, runs // 10)
    while len(calls) < runs:
        for _ in range(block):
            began = time.perf_counter()
            noop() >> pool
            calls.append(time.perf_counter() - began)
        for echo, samples in zip(echoes, floors, strict=True):
            samples += echo.block(block)
    return statistics.median(calls), [statistics.median(samples) for samples in floors]


def pool_start(provider: SSH, nodes: int) -> tuple[float, dict[str, float]]:
    """Seconds from ComputePool(...) to ready, and the provider steps' share of it."""
    steps: dict[str, float] = {}
    real_launch, real_prepare = provider.launch, provider.prepare

    async def launch(spec: Any, log: Any) -> Any:
        began = time.perf_counter()
        try:
            return await real_launch(spec, log)
        finally:
            steps["connect"] = time.perf_counter() - began

    async def prepare(cluster: Any, image: Any, log: Any) -> None:
        began = time.perf_counter()
        try:
            await real_prepare(cluster, image, log)
        finally:
            steps["check"] = time.perf_counter() - began

    provider.launch = launch  # type: ignore[method-assign]
    provider.prepare = prepare  # type: ignore[method-assign]
    began = time.perf_counter()
    pool = sky.ComputePool(provider=provider, nodes=nodes, stream_output=False)
    pool.start()
    total = time.perf_counter() - began
    pool.close()
    steps["agent start + handshake"] = total - steps["connect"] - steps["check"]
    return total, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--only", choices=("rtt", "bulk", "bootstrap"), help="run one part")
    args = parser.parse_args()
    if not sshd.is_root():
        sys.exit("bench_ssh needs root (it starts sshd and network namespaces)")
    runs = 400 if args.quick else 2000
    starts = 3 if args.quick else 7
    work = Path(tempfile.mkdtemp(prefix="skyward-bench-ssh-"))
    try:
        run(work, runs, starts, args.only)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, runs: int, starts: int, only: str | None) -> None:
    work.chmod(0o755)  # skyward-test's bootstrap reads the wheelhouse inside
    key = sshd.KeyPair.generate(work)
    if only in (None, "rtt"):
        rtt(key, runs)
    if only in (None, "bulk"):
        bulk(key, 64 << 20 if runs < 1000 else 256 << 20)
    if only in (None, "bootstrap"):
        bootstrap(work, key, starts)


def as_root(server: sshd.SshdServer, key: sshd.KeyPair) -> SSH:
    """The provider for `server` logged in as root, running this interpreter directly."""
    return SSH(
        [f"root@127.0.0.1:{server.port}"],
        key=str(key.private_path),
        known_hosts=[server.known_hosts_line()],
        python=sys.executable,
    )


def rtt(key: sshd.KeyPair, runs: int) -> None:
    with sshd.SshdServer(authorized_keys=[key]) as server:
        provider = as_root(server, key)
        # The floor talks over the same ciphers as skyward's connections; asyncssh's default
        # (ChaCha20-Poly1305 first) is shown for scale.
        echoes = [
            RawEcho(server, str(key.private_path), ENCRYPTION_ALGS),
            RawEcho(server, str(key.private_path)),
        ]
        try:
            with sky.ComputePool(provider=provider, nodes=1, stream_output=False) as pool:
                for _ in range(20):
                    noop() >> pool
                for echo in echoes:
                    echo.block(20)
                call, (floor, default) = interleaved_rtt(pool, echoes, runs)
        finally:
            for echo in echoes:
                echo.close()
        report("rtt: noop >> pool", call, floor, 1.5)
        print(f"    for scale, an echo over asyncssh's default ciphers: {default * 1000:.3f} ms")


async def raw_bulk(server: sshd.SshdServer, key: str, n: int) -> tuple[float, float]:
    """Seconds to read `n` bytes from ``head -c`` and to write them to ``cat``, over one
    asyncssh connection with skyward's ciphers."""
    known = asyncssh.import_known_hosts(server.known_hosts_line() + "\n")
    async with asyncssh.connect(
        server.host, server.port, username="root", client_keys=[key], known_hosts=known,
        encryption_algs=list(ENCRYPTION_ALGS),
    ) as conn:  # fmt: skip
        began = time.perf_counter()
        reader = await conn.create_process(f"head -c {n} /dev/zero", encoding=None)
        got = 0
        while chunk := await reader.stdout.read(1 << 22):
            got += len(chunk)
        down = time.perf_counter() - began
        assert got == n
        began = time.perf_counter()
        writer = await conn.create_process("cat > /dev/null", encoding=None)
        writer.stdin.write(bytes(n))
        writer.stdin.write_eof()
        await writer.wait_closed()
        return down, time.perf_counter() - began


def bulk(key: sshd.KeyPair, n: int) -> None:
    with sshd.SshdServer(authorized_keys=[key]) as server:
        provider = as_root(server, key)
        downs, ups, raw_downs, raw_ups = [], [], [], []
        with sky.ComputePool(provider=provider, nodes=1, stream_output=False) as pool:
            for _ in range(3):
                began = time.perf_counter()
                data = make(n) >> pool
                downs.append(time.perf_counter() - began)
                began = time.perf_counter()
                assert size(data) >> pool == n
                ups.append(time.perf_counter() - began)
                del data
                down, up = asyncio.run(raw_bulk(server, str(key.private_path), n))
                raw_downs.append(down)
                raw_ups.append(up)
    mb = n / 1e6
    for name, sky_s, raw_s in (("back", downs, raw_downs), ("out", ups, raw_ups)):
        ours, floor = mb / statistics.median(sky_s), mb / statistics.median(raw_s)
        print(
            f"bulk {name:<4} {n >> 20} MiB over SSH: {ours:6.0f} MB/s  asyncssh channel "
            f"{floor:6.0f} MB/s  ({floor / ours:4.2f}x the time)"
        )


def bootstrap(work: Path, key: sshd.KeyPair, starts: int) -> None:
    build_env = wheels.offline_build_env(wheels.wheelhouse(work / "wheels"))
    sshd.SshUser.ensure().authorize(key)
    with sshd.NetnsHosts(3, subnet="10.213.4.0/24", authorized_keys=[key]) as net:
        known = net.known_hosts_lines()

        def provider_for(count: int) -> SSH:
            # A plain login, as on a real host: root's shell here runs pyenv's start-up hooks
            # on every command, which would dominate what is measured.
            return SSH(net.addresses[:count], user=sshd.TEST_USER, key=str(key.private_path),
                       known_hosts=known, build_env=build_env)  # fmt: skip

        pool_start(provider_for(3), 3)  # warm-up: skyward is copied and the env built once
        one = statistics.median(pool_start(provider_for(1), 1)[0] for _ in range(starts))
        three = statistics.median(pool_start(provider_for(3), 3)[0] for _ in range(starts))
        report("bootstrap: 3 hosts vs 1", three, one, 1.3, unit="s")
        results = [pool_start(provider_for(3), 3) for _ in range(starts)]
        total = statistics.median(r[0] for r in results)
        print(f"restart (env built), 3 hosts: {total:.3f} s from ComputePool(...) to ready")
        for step in ("connect", "check", "agent start + handshake"):
            value = statistics.median(r[1][step] for r in results)
            print(f"    {step:<26} {value:.3f} s")


if __name__ == "__main__":
    main()
