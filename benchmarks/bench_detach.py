"""Detached runs: ``skyward run --detach`` to "every rank started" beside plain ``skyward run`` to
the first line of the script's output, on the same pool, in the same run.

``python benchmarks/bench_detach.py [--runs N] [--only local|ssh]``. Both are timed as a user
sees them: from starting the command (a new process) to the moment it says so (``--detach``
exits 0; the plain run prints the script's first line). They alternate, N of each, and the
medians are compared (target: within 1.2x). The script prints one line at once and ends
half a second later; each detached run is followed to its end (``skyward logs -f``) outside
the timed part, so no run overlaps the next.

- local: two `sky.Local` nodes.
- ssh: two network-namespace hosts with sshd (tests/support/sshd.py; root), logging in as
  root and running this interpreter, as tests/ssh does. Skipped without root.
A MISS is printed, never an exit status.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import sshd  # noqa: E402

JOB = "import time\nprint('first line', flush=True)\ntime.sleep(0.5)\n"
TARGET = 1.2


def cli(args: Sequence[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "skyward.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def plain(cwd: Path) -> float:
    """Seconds from `skyward run` to the script's first line on its stdout."""
    begun = time.perf_counter()
    process = cli(["run", "job.py"], cwd)
    assert process.stdout is not None
    for line in process.stdout:
        if "first line" in line:
            took = time.perf_counter() - begun
            break
    else:
        raise RuntimeError("skyward run printed no line of the script")
    process.wait()
    return took


def detached(cwd: Path, name: str) -> float:
    """Seconds from `skyward run --detach` to its exit (every rank started); then the run is
    followed to its end, untimed."""
    begun = time.perf_counter()
    process = cli(["run", "--detach", "--name", name, "job.py"], cwd)
    process.communicate()
    took = time.perf_counter() - begun
    if process.returncode != 0:
        raise RuntimeError(f"skyward run --detach exited {process.returncode}")
    follow = cli(["logs", "-f", name], cwd)
    follow.communicate()
    return took


def compare(label: str, cwd: Path, runs: int) -> None:
    plain(cwd), detached(cwd, f"warm-{label}")  # environments built, caches warm
    plains, detaches = [], []
    for i in range(runs):
        plains.append(plain(cwd))
        detaches.append(detached(cwd, f"bench-{label}-{i}"))
    a, b = statistics.median(detaches), statistics.median(plains)
    ratio = a / b
    verdict = "met" if ratio <= TARGET else "MISS"
    print(
        f"{label:<6} run --detach to every rank started: median {a * 1000:.0f} ms "
        f"({min(detaches) * 1000:.0f}-{max(detaches) * 1000:.0f}); plain run to first line: "
        f"median {b * 1000:.0f} ms ({min(plains) * 1000:.0f}-{max(plains) * 1000:.0f}); "
        f"{ratio:.2f}x (target <= {TARGET}x: {verdict})"
    )


def local(work: Path, runs: int) -> None:
    cwd = work / "local"
    cwd.mkdir()
    (cwd / "job.py").write_text(JOB)
    (cwd / "skyward.toml").write_text("[profile.default]\nnodes = 2\n")
    compare("local", cwd, runs)


def ssh(work: Path, runs: int) -> None:
    if not sshd.is_root() or sshd.netns_unavailable_reason():
        print("ssh    skipped: needs root and network namespaces")
        return
    key = sshd.KeyPair.generate(work / "key")
    with sshd.NetnsHosts(2, subnet="10.213.40.0/24", authorized_keys=[key]) as net:
        known = net.write_known_hosts(work / "known_hosts")
        cwd = work / "ssh"
        cwd.mkdir()
        (cwd / "job.py").write_text(JOB)
        (cwd / "skyward.toml").write_text(
            "[profile.default]\n"
            'provider = "ssh"\n'
            f"hosts = {net.addresses!r}\n"
            'user = "root"\n'
            f'key = "{key.private_path}"\n'
            f'known_hosts = "{known}"\n'
            f'python = "{sys.executable}"\n'
        )
        try:
            compare("ssh", cwd, runs)
        finally:
            _remove_run_keys()


def _remove_run_keys() -> None:
    """Runs that ended leave no key line; one cut short by an error might."""
    path = Path.home() / ".ssh" / "authorized_keys"
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if " skyward-run:" not in line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each (default 5)")
    parser.add_argument("--only", choices=("local", "ssh"), help="one provider")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-detach-") as work:
        os.environ["SKYWARD_CACHE_DIR"] = str(Path(work) / "cache")
        if args.only in (None, "local"):
            local(Path(work), args.runs)
        if args.only in (None, "ssh"):
            ssh(Path(work), args.runs)


if __name__ == "__main__":
    main()
