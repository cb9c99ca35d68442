"""SSH-provider benchmarks: each skyward figure beside a baseline measured in the same run.

Run as root: ``python benchmarks/bench_ssh.py [--quick]``. It starts its own sshd on 127.0.0.1
and three network-namespace hosts (tests/support/sshd.py). The round trip logs in as root and
runs this interpreter directly; the bootstrap figures log in as the unprivileged `skyward-test`
user with the host's python3, as on a fresh machine, after one warm-up that builds its uv
environment (so they measure a start with the environment built). The namespace hosts have no
route off the machine, so that build installs uv and the agent's packages from a wheelhouse of
this client's own (tests/support/wheels.py), as the AWS contract tests do. A MISS is printed,
never an exit status.

- rtt: no-op ``call >> pool`` over SSH vs an echo round trip over an open asyncssh channel.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncssh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import skyward as sky
from skyward.providers.ssh import SSH
from tests.support import sshd, wheels


@sky.compute
def noop() -> None:
    return None


def median_seconds(op: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        op()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def report(name: str, value: float, baseline: float, target: float, unit: str = "ms") -> None:
    ratio = value / baseline
    verdict = "ok" if ratio <= target else "MISS"
    scale = 1000 if unit == "ms" else 1
    print(
        f"{name:<28} {value * scale:9.3f} {unit}  baseline {baseline * scale:9.3f} {unit}  "
        f"ratio {ratio:5.2f}x (target <= {target}x) {verdict}"
    )


async def raw_echo_rtt(server: sshd.SshdServer, key: str, runs: int) -> float:
    """Median round trip of one line through ``cat`` on an already-open channel."""
    known = asyncssh.import_known_hosts(server.known_hosts_line() + "\n")
    async with asyncssh.connect(
        server.host, server.port, username="root", client_keys=[key], known_hosts=known
    ) as conn:
        process = await conn.create_process("cat", encoding=None)
        times = []
        for _ in range(runs):
            began = time.perf_counter()
            process.stdin.write(b"x\n")
            await process.stdout.readline()
            times.append(time.perf_counter() - began)
        process.stdin.write_eof()
        return statistics.median(times)


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
    args = parser.parse_args()
    if not sshd.is_root():
        sys.exit("bench_ssh needs root (it starts sshd and network namespaces)")
    runs = 100 if args.quick else 1000
    starts = 3 if args.quick else 7
    work = Path(tempfile.mkdtemp(prefix="skyward-bench-ssh-"))
    try:
        run(work, runs, starts)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, runs: int, starts: int) -> None:
    work.chmod(0o755)  # skyward-test's bootstrap reads the wheelhouse inside
    build_env = wheels.offline_build_env(wheels.wheelhouse(work / "wheels"))
    key = sshd.KeyPair.generate(work)
    with sshd.SshdServer(authorized_keys=[key]) as server:
        provider = SSH(
            [f"root@127.0.0.1:{server.port}"],
            key=str(key.private_path),
            known_hosts=[server.known_hosts_line()],
            python=sys.executable,
        )
        with sky.ComputePool(provider=provider, nodes=1, stream_output=False) as pool:
            for _ in range(20):
                noop() >> pool
            call = median_seconds(lambda: noop() >> pool, runs)
        echo = asyncio.run(raw_echo_rtt(server, str(key.private_path), runs))
        report("rtt: noop >> pool", call, echo, 1.5)

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
