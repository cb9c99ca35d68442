"""`skyward dashboard` as a user meets it: the command started as a process, its page in a real
browser (Debian's chromium through Playwright, every request not to 127.0.0.1 refused), real
detached runs and real pools on Local, each test with its own skyward cache.

Pages are checked by what a person sees: texts, links, buttons, the charts' titles and legends.
With ``SKYWARD_SCREENSHOTS=DIR`` the tests also save the screenshots docs/dashboard.md shows.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward import history
from tests.conftest import alive
from tests.support.browser import Browser, browser_page

pytest.importorskip("playwright")
from playwright.sync_api import expect

# A detached run's script: a line a second, `loss` reported each step, as training would.
TRAINING = """\
import sys, time
import skyward as sky
steps = int(sys.argv[1])
for step in range(steps):
    sky.report({"loss": 1.0 / (step + 1), "step": step})
    print(f"tick {step} at {time.time():.3f}", flush=True)
    time.sleep(1)
"""

# A script with a `with` block: 10 points reported, then the script ends.
POOL_SCRIPT = """\
import skyward as sky

@sky.compute
def train(steps):
    for step in range(steps):
        sky.report({"accuracy": step / 10, "step": step})
    return steps

with sky.ComputePool(nodes=2, name="plain-demo") as pool:
    train(10) @ pool
with sky.ComputePool(nodes=1, name="broken-demo") as pool:
    raise ValueError("the data was not there")
"""


@pytest.fixture
def dashboard(own_cache: Path) -> Iterator[str]:
    """`skyward dashboard --port 0` running; its printed URL. It must end on SIGTERM."""
    process = subprocess.Popen(
        [sys.executable, "-m", "skyward.cli", "dashboard", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        url = ""
        deadline = time.monotonic() + 30
        while not url and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if line.startswith("http://"):
                url = line.strip()
        assert url, process.stderr.read() if process.poll() is not None else "no URL in 30 s"
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail("skyward dashboard did not end within 10 s of SIGTERM")


@pytest.fixture
def browser() -> Iterator[Browser]:
    with browser_page(local_only=True) as opened:
        yield opened
    assert opened.blocked == []  # every asset came from skyward


def _base(url: str) -> str:
    return url.split("/?token=")[0]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _screenshot(browser: Browser, name: str) -> None:
    where = os.environ.get("SKYWARD_SCREENSHOTS")
    if where:
        browser.page.screenshot(path=str(Path(where) / name), full_page=True)


def _skyward(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skyward.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _train_detached(tmp_path: Path, name: str, steps: int) -> None:
    """`TRAINING` started as detached run `name` on 2 Local nodes, for `steps` steps."""
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    started = _skyward("run", "--detach", "--name", name, "--nodes", "2", str(script), str(steps))
    assert started.returncode == 0, started.stderr


def _row(browser: Browser, name: str):  # type: ignore[no-untyped-def]
    return browser.page.get_by_role("row").filter(
        has=browser.page.get_by_role("link", name=name, exact=True)
    )


def test_the_printed_url_loads_without_its_token_nothing_does_and_only_on_127_0_0_1(
    dashboard: str,
) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[\w-]{20,}", dashboard)
    assert _status(dashboard) == 200
    base = _base(dashboard)
    for path in ("/", "/api/runs", "/static/app.js", "/runs/pool/x"):
        assert _status(base + path) == 403, path
    assert _status(base + "/api/runs?token=not-the-token") == 403
    port = int(base.rsplit(":", 1)[1])
    # /proc/net/tcp lists listening sockets by local address: 0100007F is 127.0.0.1.
    listening = [
        line.split()[1]
        for name in ("/proc/net/tcp", "/proc/net/tcp6")
        if Path(name).exists()
        for line in Path(name).read_text().splitlines()[1:]
        if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port
    ]
    assert listening == [f"0100007F:{port:04X}"]


@pytest.mark.slow
def test_a_detached_run_appears_live_its_lines_and_loss_chart_and_it_succeeds(
    dashboard: str, browser: Browser, tmp_path: Path
) -> None:
    page = browser.page
    page.goto(dashboard)
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()
    _train_detached(tmp_path, "watch-me", steps=20)
    # Without a reload: the list polls.
    row = _row(browser, "watch-me")
    expect(row).to_be_visible(timeout=10_000)
    expect(row).to_contain_text("running", timeout=10_000)
    _screenshot(browser, "dashboard-runs.png")
    row.get_by_role("link", name="watch-me", exact=True).click()
    expect(page.get_by_role("heading", name="watch-me")).to_be_visible()
    opened = time.time()
    output = page.locator("#output")
    deadline = time.monotonic() + 5
    while True:  # a line printed after the page was opened, shown within 5 s
        stamps = [float(s) for s in re.findall(r"at (\d+\.\d+)", output.inner_text())]
        if any(stamp > opened for stamp in stamps):
            break
        assert time.monotonic() < deadline, output.inner_text()
        time.sleep(0.2)
    assert "(node 0) tick" in output.inner_text() and "(node 1) tick" in output.inner_text()
    metrics = page.get_by_role("region", name="Metrics")
    expect(metrics.get_by_text("loss", exact=True).first).to_be_visible(timeout=10_000)
    expect(metrics.get_by_text("node 0", exact=True)).to_be_visible()
    expect(metrics.get_by_text("node 1", exact=True)).to_be_visible()
    expect(page.get_by_role("button", name="Stop")).to_be_visible()
    # The chart grows with the run: its step axis reaches the steps printed meanwhile.
    expect(output).to_contain_text("(node 1) tick 12", timeout=20_000)
    page.wait_for_timeout(1500)
    ticks = metrics.locator(".xtick").all_text_contents()
    assert max(float(t) for t in ticks if t.strip()) >= 10, ticks
    _screenshot(browser, "dashboard-run.png")
    page.get_by_role("link", name="skyward").click()
    expect(_row(browser, "watch-me")).to_contain_text("succeeded", timeout=40_000)
    seen = time.time()
    status = json.loads((Path(os.environ["SKYWARD_CACHE_DIR"]) / "runs/watch-me.json").read_text())
    ended = status["last"]["ended_at"]
    assert seen - ended < 10, (seen, ended)


@pytest.mark.slow
def test_the_stop_button_stops_a_running_run_and_leaves_no_rank(
    dashboard: str, browser: Browser, tmp_path: Path
) -> None:
    _train_detached(tmp_path, "stop-me", steps=600)
    page = browser.page
    base = _base(dashboard)
    page.goto(dashboard)
    page.goto(f"{base}/runs/detached/stop-me")
    stop = page.get_by_role("button", name="Stop")
    expect(stop).to_be_visible(timeout=10_000)
    asked: list[str] = []

    def confirm(dialog) -> None:  # type: ignore[no-untyped-def]
        asked.append(dialog.message)
        dialog.accept()

    runs = Path(os.environ["SKYWARD_CACHE_DIR"]) / "runs/stop-me"
    pids = [json.loads(p.read_text()).get("pid") for p in runs.glob("node-*/node.json")]
    assert len(pids) == 2 and all(pid and alive(pid) for pid in pids), pids
    page.on("dialog", confirm)
    stop.click()
    assert asked and "Stop stop-me?" in asked[0]
    deadline = time.monotonic() + 20
    while "stopped" not in (said := _skyward("status").stdout):
        assert time.monotonic() < deadline, said
        time.sleep(0.5)
    expect(page.locator(".facts")).to_contain_text("stopped", timeout=10_000)
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.slow
def test_a_scripts_pools_stay_listed_with_their_outcome_and_charts_after_it_ends(
    dashboard: str, browser: Browser, tmp_path: Path
) -> None:
    script = tmp_path / "pools.py"
    script.write_text(POOL_SCRIPT)
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1 and "the data was not there" in ran.stderr
    page = browser.page
    page.goto(dashboard)
    expect(_row(browser, "plain-demo")).to_contain_text("succeeded", timeout=10_000)
    expect(_row(browser, "broken-demo")).to_contain_text("failed", timeout=10_000)
    expect(_row(browser, "broken-demo")).to_contain_text("the data was not there")
    _row(browser, "plain-demo").get_by_role("link", name="plain-demo").click()
    metrics = page.get_by_role("region", name="Metrics")
    expect(metrics.get_by_text("accuracy", exact=True).first).to_be_visible(timeout=10_000)
    expect(metrics.get_by_text("node 1", exact=True)).to_be_visible()
    expect(page.get_by_role("region", name="Events")).to_contain_text("ready: 2 node(s)")
    csv = page.get_by_role("link", name="CSV")
    with page.expect_download() as download:
        csv.click()
    rows = Path(download.value.path()).read_text().splitlines()
    assert rows[0] == "time,node,rank,metric,value,step" and len(rows) == 1 + 2 * 10


def test_with_a_hundred_ended_runs_the_list_loads_and_an_old_one_is_found(
    dashboard: str, browser: Browser, own_cache: Path
) -> None:
    for i in range(120):
        recorder = history.Recorder(f"old-run-{i}-0000", f"old-run-{i}", "local", 2)
        recorder.update(started=time.time() - 86_400 + i)
        recorder.start()
        recorder.end("succeeded")
    page = browser.page
    page.goto(dashboard)
    expect(_row(browser, "old-run-119")).to_be_visible(timeout=10_000)
    expect(page.get_by_text("100 of 120 shown")).to_be_visible()
    expect(_row(browser, "old-run-3")).to_have_count(0)  # on the second page
    page.get_by_role("textbox", name="Filter runs").fill("old-run-3")
    expect(_row(browser, "old-run-3")).to_be_visible()
    expect(_row(browser, "old-run-30")).to_be_visible()
    expect(_row(browser, "old-run-4")).to_have_count(0)


def test_a_pool_whose_client_died_is_listed_lost(own_cache: Path) -> None:
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """\
                from skyward import history
                recorder = history.Recorder("killed-1234", "killed", "local", 1)
                recorder.start()
                import os; os._exit(0)
                """
            ),
        ],
        timeout=60,
    )
    assert child.returncode == 0
    (found,) = history.runs()
    assert found["name"] == "killed" and found["state"] == "lost"


LONG_POOL = """\
import time
import skyward as sky

@sky.compute
def train():
    for step in range(600):
        print(f"step {step}", flush=True)
        time.sleep(0.5)

with sky.ComputePool(nodes=2, name="stop-my-pool") as pool:
    train() @ pool
"""


@pytest.mark.slow
def test_the_stop_button_stops_a_scripts_pool_as_ctrl_c_would(
    dashboard: str, browser: Browser, tmp_path: Path
) -> None:
    script = tmp_path / "long.py"
    script.write_text(LONG_POOL)
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        page = browser.page
        page.goto(dashboard)
        row = _row(browser, "stop-my-pool")
        expect(row).to_contain_text("running", timeout=30_000)
        row.get_by_role("link", name="stop-my-pool", exact=True).click()
        expect(page.locator("#output")).to_contain_text("(node 1) step 1", timeout=10_000)
        page.on("dialog", lambda dialog: dialog.accept())
        page.get_by_role("button", name="Stop").click()
        _, err = process.communicate(timeout=30)
        assert process.returncode != 0 and "stopped 2 processes" in err, err
        expect(page.locator(".facts")).to_contain_text("stopped", timeout=10_000)
        expect(page.get_by_role("button", name="Stop")).to_be_hidden()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
