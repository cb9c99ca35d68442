"""A pool's start on a bare Debian host, cold and warm, beside a by-hand floor in the same run.

Run as root: ``python benchmarks/bench_bare.py [--runs N]``. Each host is a fresh bookworm root
(tests/support/bareroots.py: python3 3.11, no venv, no pip) behind sshd in a network namespace
on 10.213.14.0/24, whose only route is a package index this script serves on the bridge. The
first run on a machine debootstraps the root (about 45 s) and downloads the wheels (cached in
/var/cache/skyward-tests). Every repetition starts two fresh hosts, one after the other: one for
skyward, one for the floor (which goes first alternates), each cold, then warm.

- cold: ``with sky.ComputePool(SSH(host), Image(pip=["numpy"], indexes=[the index])) as pool:
  f() >> pool`` (f imports numpy), from entering the pool to the first result; beside it the
  floor, over one multiplexed ``ssh`` connection (ControlMaster, skyward's first cipher): send
  the client's uv gzip'd at level 1 (the bytes skyward sends), ``uv venv``, ``uv pip install
  numpy cloudpickle packaging`` from the index, ``python -c "import numpy, cloudpickle"``.
- warm: the same again on the same host (environment built), vs a fresh ``ssh`` connection
  running that import with the environment's python.

A report: no targets, it exits 0 (non-zero only when it cannot run: not root, no namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ["SKYWARD_QUIET"] = "1"  # no status lines between the table's

import skyward as sky
from skyward.providers.environment import packaged_uv
from skyward.providers.remote import hoststeps
from skyward.providers.source import source_tarball
from skyward.transport.sshhost import ENCRYPTION_ALGS
from tests.support import bareroots, sshd

SUBNET = "10.213.14.0/24"  # the test suite's bare hosts use 10.213.12 and 10.213.13
WHEELS = ("numpy", "cloudpickle", "packaging", f"uv=={bareroots.client_uv_version()}")
"""The test suite's set (tests/bare/conftest.py), so both share one cached download."""
ENV = "/root/env"
IMPORT = f'{ENV}/bin/python -c "import numpy, cloudpickle"'


@sky.compute
def numpy_sum() -> int:
    import numpy

    return int(numpy.arange(10).sum())


@dataclass
class Sample:
    """One repetition of one side: seconds per figure, bytes into the host, index requests."""

    cold: float = 0.0
    warm: float = 0.0
    cold_bytes: int = 0
    warm_bytes: int = 0
    cold_requests: int = 0
    warm_requests: int = 0
    steps: dict[str, float] = field(default_factory=dict)
    """Parts of the cold figure (skyward: connect / check / build, its bootstrap steps, agent +
    call; the floor: its ssh steps), and skyward's teardowns."""


def into_host(net: bareroots.BareHosts) -> int:
    """Bytes the bridge has sent into the host so far (the host-side veth's tx counter)."""
    veth = net.net.hosts[0].veth
    return int(Path(f"/sys/class/net/{veth}/statistics/tx_bytes").read_text())


@dataclass
class Lab:
    root: Path
    wheels: Path
    key: sshd.KeyPair
    work: Path
    uv_gz: bytes

    def hosts(self) -> bareroots.BareHosts:
        return bareroots.BareHosts(1, subnet=SUBNET, authorized_keys=[self.key], root=self.root)


# --------------------------------------------------------------------------- skyward


# skyward's bootstrap steps on a cold host, by the name each step logs (`hoststeps.send_step`).
BUILD_PARTS = {
    "sending this client's uv": "send uv (gz)",
    "building the environment": "uv venv + pip install",
    "copying skyward": "copy source + check packages",
    "checking the host's packages": "copy source + check packages",
}


@contextlib.contextmanager
def timing_steps(parts: dict[str, float]) -> Iterator[None]:
    """Add the seconds of each of skyward's bootstrap steps named in `BUILD_PARTS` to `parts`."""
    real = hoststeps.send_step

    async def timed(node: Any, bootstrap: Any, command: str, what: str, *rest: Any) -> Any:
        began = time.perf_counter()
        try:
            return await real(node, bootstrap, command, what, *rest)
        finally:
            for prefix, part in BUILD_PARTS.items():
                if what.startswith(prefix):
                    parts[part] = parts.get(part, 0.0) + time.perf_counter() - began

    hoststeps.send_step = timed  # type: ignore[assignment]
    try:
        yield
    finally:
        hoststeps.send_step = real


def timed_pool(provider: sky.SSH, image: sky.Image, steps: dict[str, float]) -> float:
    """Seconds from entering the pool to its first result; the provider's parts of it, its
    bootstrap steps' and the teardown go into `steps`."""
    marks: dict[str, float] = {}
    for name in ("launch", "survey", "prepare"):
        real = getattr(provider, name)

        def wrapped(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            async def call() -> Any:
                began = time.perf_counter()
                try:
                    return await _real(*args, **kw)
                finally:
                    marks[_name] = time.perf_counter() - began

            return call()

        setattr(provider, name, wrapped)
    began = time.perf_counter()
    with timing_steps(steps):
        with sky.ComputePool(provider=provider, image=image, stream_output=False) as pool:
            assert numpy_sum() >> pool == 45
            first = time.perf_counter() - began
            closing = time.perf_counter()
        teardown = time.perf_counter() - closing
    steps["connect"] = marks.get("launch", 0.0)
    steps["check"] = marks.get("survey", 0.0)
    steps["build"] = marks.get("prepare", 0.0)
    steps["agent + call"] = first - steps["connect"] - steps["check"] - steps["build"]
    steps["teardown"] = teardown
    return first


def skyward_side(lab: Lab) -> Sample:
    sample = Sample()
    with lab.hosts() as net:
        known = net.write_known_hosts(lab.work / f"known_hosts-{net.run_id}")
        with bareroots.PackageIndex(lab.wheels, host=net.bridge_address) as index:
            image = sky.Image(pip=["numpy"], indexes=[sky.Index(index.simple_url)])

            def provider() -> sky.SSH:
                return sky.SSH(net.addresses, user="root", key=str(lab.key.private_path),
                               known_hosts=str(known))  # fmt: skip

            before = into_host(net)
            sample.cold = timed_pool(provider(), image, sample.steps)
            sample.cold_bytes, before = into_host(net) - before, into_host(net)
            sample.cold_requests = len(index.requests)
            warm_steps: dict[str, float] = {}
            sample.warm = timed_pool(provider(), image, warm_steps)
            sample.warm_bytes = into_host(net) - before
            sample.warm_requests = len(index.requests) - sample.cold_requests
            sample.steps["warm teardown"] = warm_steps["teardown"]
    return sample


# --------------------------------------------------------------------------- floor


def floor_side(lab: Lab) -> Sample:
    sample = Sample()
    with lab.hosts() as net:
        known = net.write_known_hosts(lab.work / f"known_hosts-{net.run_id}")
        with bareroots.PackageIndex(lab.wheels, host=net.bridge_address) as index:
            host = net.hosts[0]
            base = host.ssh_command(lab.key, known)  # ends with root@address
            ciphers = ["-c", ENCRYPTION_ALGS[0]]  # skyward's first choice
            control = lab.work / f"cm-{net.run_id}"
            mux = ["-o", "ControlMaster=auto", "-o", f"ControlPath={control}",
                   "-o", "ControlPersist=60"]  # fmt: skip
            shared = [*base[:-1], *ciphers, *mux, base[-1]]

            def step(name: str, command: str, stdin: bytes = b"") -> None:
                began = time.perf_counter()
                done = subprocess.run([*shared, command], input=stdin, capture_output=True,
                                      timeout=600, check=False)  # fmt: skip
                sample.steps[name] = time.perf_counter() - began
                if done.returncode != 0:
                    raise RuntimeError(
                        f"floor step {name!r} exited {done.returncode}: "
                        f"{done.stderr.decode(errors='replace')[-2000:]}"
                    )

            before = into_host(net)
            began = time.perf_counter()
            try:
                # The first step also opens the shared connection (ControlMaster=auto).
                step("send uv (gz)", "gzip -dc > /root/uv && chmod +x /root/uv", lab.uv_gz)
                step("uv venv", f"/root/uv venv --quiet --python python3 {ENV}")
                step(
                    "uv pip install",
                    f"/root/uv pip install --quiet --python {ENV}/bin/python "
                    f"--index-url {index.simple_url} numpy cloudpickle packaging",
                )
                step("import", IMPORT)
                sample.cold = time.perf_counter() - began
            finally:
                subprocess.run([*shared[:-1], "-O", "exit", shared[-1]], capture_output=True,
                               timeout=30, check=False)  # fmt: skip
            sample.cold_bytes, before = into_host(net) - before, into_host(net)
            sample.cold_requests = len(index.requests)
            began = time.perf_counter()  # a fresh connection, as a new pool's
            subprocess.run([*base[:-1], *ciphers, base[-1], IMPORT], capture_output=True,
                           timeout=120, check=True)  # fmt: skip
            sample.warm = time.perf_counter() - began
            sample.warm_bytes = into_host(net) - before
            sample.warm_requests = len(index.requests) - sample.cold_requests
    return sample


# --------------------------------------------------------------------------- report


def spread(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def row(name: str, ours: list[float], floor: list[float] | None) -> None:
    mine = statistics.median(ours)
    if floor is None:
        print(f"{name:<34} {mine:8.2f} s  {'':>10}  {'':>6}     [{spread(ours)}]")
        return
    base = statistics.median(floor)
    print(
        f"{name:<34} {mine:8.2f} s  {base:8.2f} s  {mine / base:5.2f}x     "
        f"[{spread(ours)}] vs [{spread(floor)}]"
    )


def report(sky_samples: list[Sample], floor_samples: list[Sample]) -> None:
    def of(samples: list[Sample], pick: Callable[[Sample], float]) -> list[float]:
        return [pick(s) for s in samples]

    print()
    print(f"{'figure (median of ' + str(len(sky_samples)) + ')':<34} {'skyward':>10}  "
          f"{'floor':>10}  {'ratio':>6}     [samples]")  # fmt: skip
    row("cold: start to first result", of(sky_samples, lambda s: s.cold),
        of(floor_samples, lambda s: s.cold))  # fmt: skip
    row("warm: start to first result", of(sky_samples, lambda s: s.warm),
        of(floor_samples, lambda s: s.warm))  # fmt: skip
    print("skyward cold, in parts:")
    for part in ("connect", "check", "build", *dict.fromkeys(BUILD_PARTS.values()),
                 "agent + call", "teardown"):  # fmt: skip
        name = f"      {part}" if part in BUILD_PARTS.values() else f"    {part}"
        row(name, [s.steps.get(part, 0.0) for s in sky_samples], None)
    row("    cold with teardown", of(sky_samples, lambda s: s.cold + s.steps["teardown"]), None)
    row("skyward warm teardown", of(sky_samples, lambda s: s.steps["warm teardown"]), None)
    print("floor cold, in parts (one ssh connection, multiplexed; opened by the first step):")
    for part in ("send uv (gz)", "uv venv", "uv pip install", "import"):
        row(f"    {part}", [s.steps[part] for s in floor_samples], None)
    print()
    for name, samples in (("skyward", sky_samples), ("floor", floor_samples)):
        cold_mb = statistics.median(s.cold_bytes for s in samples) / 1e6
        warm_kb = statistics.median(s.warm_bytes for s in samples) / 1e3
        print(
            f"{name:<8} into the host (veth, all traffic): cold {cold_mb:6.1f} MB, "
            f"warm {warm_kb:6.1f} kB; index requests: cold "
            f"{[s.cold_requests for s in samples]}, warm {[s.warm_requests for s in samples]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="repetitions (default 3)")
    args = parser.parse_args()
    if not sshd.is_root():
        sys.exit("bench_bare needs root (network namespaces, overlay mounts, chroot)")
    reason = sshd.netns_unavailable_reason()
    if reason:
        sys.exit(f"bench_bare cannot start bare hosts: {reason}")
    for tool in ("ssh", "ssh-keygen", "unshare", "chroot", "mount", "gzip"):
        if shutil.which(tool) is None:
            sys.exit(f"bench_bare needs `{tool}`, which is not installed")
    bareroots.remove_stale_bare_resources()  # only what crashed runs (dead owners) left
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)", flush=True)

    if not any(bareroots.roots_dir().glob("bookworm-*")):
        print("debootstrapping a Debian bookworm root (first run only, about 45 s)...", flush=True)
    began = time.perf_counter()
    root = bareroots.cached_root("bookworm")
    print(f"bookworm root: {root} ({time.perf_counter() - began:.1f} s)", flush=True)
    began = time.perf_counter()
    wheel_dir = bareroots.download_wheels(None, WHEELS, python_version="3.11")
    print(f"wheels: {wheel_dir} ({time.perf_counter() - began:.1f} s)", flush=True)

    uv = packaged_uv()
    if uv is None:
        sys.exit("bench_bare needs the `uv` package installed beside skyward (its binary is sent)")
    # skyward compresses the client's uv once per process and caches it; both sides here send
    # those bytes, so neither pays the compression inside its figures.
    began = time.perf_counter()
    uv_gz = hoststeps.compressed_uv(uv)
    gz_s = time.perf_counter() - began
    raw = Path(uv).stat().st_size
    print(
        f"uv {bareroots.client_uv_version()}: {raw / 1e6:.1f} MB raw, {len(uv_gz) / 1e6:.1f} MB "
        f"gzip -1 (crosses to the host, on both sides; compressed once in {gz_s:.2f} s, "
        f"outside the figures); skyward's source tarball {len(source_tarball()) / 1e3:.0f} kB",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="skyward-bench-bare-"))
    try:
        lab = Lab(root, wheel_dir, sshd.KeyPair.generate(work / "keys"), work, uv_gz)
        sky_samples: list[Sample] = []
        floor_samples: list[Sample] = []
        for i in range(args.runs):
            order = [("skyward", skyward_side, sky_samples), ("floor", floor_side, floor_samples)]
            for name, side, samples in order if i % 2 == 0 else order[::-1]:
                sample = side(lab)
                samples.append(sample)
                print(f"run {i + 1}/{args.runs} {name:<8} cold {sample.cold:6.2f} s  "
                      f"warm {sample.warm:6.2f} s", flush=True)  # fmt: skip
        report(sky_samples, floor_samples)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
