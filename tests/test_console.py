"""The console: a live region in a real terminal (tmux), plain lines anywhere else.

The terminal tests run `tests/support/console_demo.py` (a 2-node pool whose call prints, reports
and sleeps) in a tmux pane and read the screen while it runs: a line per node with its phase
and time, the summary line, `running` while the call is in flight, node output above the region
with its prefix, and after the pool the teardown line with the region gone. The SSH twin is in
tests/ssh/test_ssh_console.py.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console as RichConsole

import skyward as sky
from skyward.console.console import MAX_ROWS, Console
from skyward.console.progress import Phase
from tests.support import terminal

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "tests" / "support" / "console_demo.py"
ANSI = re.compile(r"\x1b\[")
NODE_LINE = re.compile(r"^\(node ([01])\) step ([012]) of node \1$")


def demo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SKYWARD_QUIET"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def run_in_terminal(config: dict[str, object], tmp_path: Path) -> tuple[list[str], str, str]:
    """The screens seen while the demo ran, the last screen, and its `skyward` log."""
    try:
        terminal.ensure_tmux()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    log = tmp_path / "skyward.log"
    config = {**config, "log": str(log)}
    env = {"PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "SKYWARD_QUIET": "0"}
    term = terminal.Terminal([sys.executable, str(DEMO), json.dumps(config)], env, tmp_path)
    try:
        screens = term.watch(lambda screen: False, timeout=60)
        last = term.screen()
    finally:
        term.close()
    return screens, last, log.read_text() if log.exists() else ""


def node_row(screen: str, node: int, phase: str) -> bool:
    """Whether `screen` has node `node`'s region line in `phase`, with its time (``3s``)."""
    return re.search(rf"^\s+node {node}\s+{phase}\s+\d+s\b", screen, re.M) is not None


def check_terminal_run(screens: list[str], last: str, teardown: str) -> None:
    """What both providers' terminal runs must show."""
    assert terminal.EXITED + "0]" in last, f"the demo failed:\n{last}"
    assert any(re.search(r"^skyward pool-\w+ .*2 node\(s\)", s, re.M) for s in screens), (
        "no summary line:\n" + "\n---\n".join(screens)
    )
    for node in (0, 1):
        assert any(node_row(s, node, "ready") for s in screens), f"node {node} never ready"
        assert any(node_row(s, node, "running") for s in screens), f"node {node} never running"
    # node 0's line carries its latest sky.report while the call runs
    assert any(re.search(r"node 0\s+running.*loss=", s) for s in screens)
    # After the pool: the region is gone, the teardown line is the pool's last word.
    assert re.search(rf"\[skyward\] pool-\w+: {teardown} in [\d.]+ s$", last, re.M), last
    assert not node_row(last, 0, r"\w+") and "skyward pool-" not in last, last
    node_lines = [line for line in last.splitlines() if line.startswith("(node")]
    assert len(node_lines) == 6, last
    assert all(NODE_LINE.match(line) for line in node_lines), node_lines  # never mid-line
    assert "client: results [0, 1]" in last


def test_live_console_on_local_in_a_terminal(tmp_path: Path) -> None:
    screens, last, log = run_in_terminal({"provider": "local"}, tmp_path)
    check_terminal_run(screens, last, "stopped 2 processes")
    # Every phase change is a logging record too, in order.
    assert_logged_in_order(
        log, ["launching 2 node(s) on local", "building environment", "starting agent", "ready"]
    )
    assert "stopped 2 processes in" in log


def assert_logged_in_order(log: str, phrases: list[str]) -> None:
    at = 0
    for phrase in phrases:
        found = log.find(phrase, at)
        assert found >= 0, f"{phrase!r} is not logged after offset {at}:\n{log}"
        at = found


def run_plain(tmp_path: Path, **config: object) -> subprocess.CompletedProcess[str]:
    """The demo with its output on pipes (not a terminal), as in a CI log."""
    return subprocess.run(
        [sys.executable, str(DEMO), json.dumps({"provider": "local", "seconds": 0.3, **config})],
        env=demo_env(**{k: str(v) for k, v in config.items() if k == "SKYWARD_QUIET"}),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_plain_lines_when_not_a_terminal(tmp_path: Path) -> None:
    done = run_plain(tmp_path)
    assert not ANSI.search(done.stdout + done.stderr) and "\r" not in done.stdout + done.stderr
    node_lines = [line for line in done.stdout.splitlines() if line.startswith("(node")]
    assert len(node_lines) == 6 and all(NODE_LINE.match(line) for line in node_lines)
    status = [re.sub(r"^\[skyward\] pool-\w+: ", "", line) for line in done.stderr.splitlines()]
    assert status[0] == "launching 2 node(s) on local"
    assert status[1] == "costs nothing: the local provider runs on machines you already have"
    assert status[2].startswith("all 2 nodes building environment")
    assert status[3] == "all 2 nodes starting agent"
    assert re.fullmatch(r"ready: 2 node\(s\) in [\d.]+ s", status[4]), status
    assert status[5] == "stopping"
    assert re.fullmatch(r"stopped 2 processes in [\d.]+ s", status[6]), status
    assert len(status) == 7, status  # one line per change: no redraws, no per-call lines


def test_stream_output_false_prints_status_lines_only(tmp_path: Path) -> None:
    done = run_plain(tmp_path, stream_output=False)
    assert "(node" not in done.stdout
    assert "client: results [0, 1]" in done.stdout
    assert "stopped 2 processes in" in done.stderr


def test_quiet_prints_node_output_only(tmp_path: Path) -> None:
    done = run_plain(tmp_path, SKYWARD_QUIET="1")
    assert done.stderr == ""
    assert len([line for line in done.stdout.splitlines() if line.startswith("(node")]) == 6


def test_phases_are_logged_on_the_skyward_logger(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="skyward"):
        with sky.ComputePool(nodes=2, stream_output=False) as pool:
            pass
    messages = [r.getMessage() for r in caplog.records if r.name == "skyward"]
    prefix = f"{pool.pool_id}: "
    assert messages[0] == prefix + "launching 2 node(s) on local"
    assert prefix + "all 2 nodes starting agent" in messages
    assert messages[-1].startswith(prefix + "stopped 2 processes in")


def render(console: Console, width: int = 100) -> str:
    out = io.StringIO()
    RichConsole(file=out, width=width, color_system=None).print(console)
    return out.getvalue()


def test_region_shows_what_a_node_does_and_folds_a_large_pool() -> None:
    console = Console("pool-x", nodes=MAX_ROWS + 4, provider="aws")
    console.phase(None, Phase.READY)
    console.phase(3, Phase.BUILDING, "")
    console.detail(3, "Resolved 12 packages in 40ms")
    console.activity = lambda node: (Phase.RUNNING, "") if node == 1 else None
    shown = render(console)
    assert re.search(r"^\s+node 1\s+running\s+0s", shown, re.M), shown
    assert re.search(r"^\s+node 3\s+building environment\s+0s\s+Resolved 12 packages", shown, re.M)
    assert re.search(r"^skyward pool-x\s+aws\s+20 node\(s\): 1 building environment", shown, re.M)
    assert "+5 more" in shown and f"node {MAX_ROWS - 1} " not in shown, shown
