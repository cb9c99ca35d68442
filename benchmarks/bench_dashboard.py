"""How fast the dashboard's runs list loads with many runs in the history.

    python benchmarks/bench_dashboard.py            # 100 and 1,000 ended runs, 5 loads each
    python benchmarks/bench_dashboard.py --runs 300 --loads 3

For each count of ended pools (written to a fresh cache with the real `history.Recorder`), a
`skyward dashboard` process serves the list and headless chromium (Debian's, through Playwright,
as the tests drive it) loads it: the figure is the median time from `page.goto` to the newest
run's row being on screen. The floor is the same browser loading a static page with the same
rows as a plain HTML table from Python's `http.server`, in alternating loads. The target is the
issue's: within 2 s with 100 runs. A report, not a test: it always exits 0.
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyward import history
from tests.support.browser import browser_page

TARGET_SECONDS = 2.0


def _fill(cache: Path, runs: int) -> None:
    os.environ["SKYWARD_CACHE_DIR"] = str(cache)
    for i in range(runs):
        recorder = history.Recorder(f"bench-{i:05d}-0000", f"bench-{i:05d}", "local", 2)
        recorder.update(started=time.time() - 86_400 + i)
        recorder.start()
        recorder.end("succeeded")


def _dashboard(cache: Path) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "skyward.cli", "dashboard", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "SKYWARD_CACHE_DIR": str(cache)},
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("http://"):
            return process, line.strip()
    raise RuntimeError("skyward dashboard printed no URL")


def _static_table(directory: Path, runs: int) -> None:
    rows = "".join(
        f"<tr><td><a href='#'>{html.escape(f'bench-{i:05d}')}</a></td><td>pool</td><td>local"
        "</td><td>2</td><td>succeeded</td><td>yesterday</td><td>0s</td><td>$0.00</td>"
        "<td>$0.00</td></tr>"
        for i in reversed(range(runs))
    )
    (directory / "index.html").write_text(f"<!doctype html><table>{rows}</table>")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve_static(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/index.html"


def _load(page: object, url: str, name: str) -> float:
    began = time.perf_counter()
    page.goto(url)  # type: ignore[attr-defined]
    page.get_by_role("link", name=name, exact=True).wait_for(state="visible")  # type: ignore[attr-defined]
    return time.perf_counter() - began


def measure(runs: int, loads: int) -> None:
    with tempfile.TemporaryDirectory(prefix="skyward-bench-dashboard-") as where:
        cache, static = Path(where) / "cache", Path(where) / "static"
        static.mkdir()
        _fill(cache, runs)
        _static_table(static, runs)
        process, url = _dashboard(cache)
        server, static_url = _serve_static(static)
        newest = f"bench-{runs - 1:05d}"
        figures: list[float] = []
        floors: list[float] = []
        try:
            with browser_page(local_only=True) as browser:
                _load(browser.page, url, newest)  # warm: the browser's first page, the cookie
                _load(browser.page, static_url, newest)
                for i in range(loads):
                    sides = [(figures, url), (floors, static_url)]
                    for samples, target in sides if i % 2 == 0 else reversed(sides):
                        samples.append(_load(browser.page, target, newest))
        finally:
            process.terminate()
            process.wait(timeout=10)
            server.shutdown()
        figure, floor = statistics.median(figures), statistics.median(floors)
        verdict = "PASS" if figure <= TARGET_SECONDS else "MISS"
        print(
            f"list, {runs:>5} runs   {figure * 1000:8.0f} ms   floor {floor * 1000:6.0f} ms   "
            f"{figure / floor:5.1f}x   target <= {TARGET_SECONDS:g} s   {verdict}"
        )
        print(f"    samples: {', '.join(f'{s * 1000:.0f}' for s in figures)} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, action="append", help="default: 100 and 1000")
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for runs in args.runs or [100, 1000]:
        measure(runs, args.loads)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
