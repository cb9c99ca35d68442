"""A pool in a real Jupyter kernel (nbclient, ipykernel): each call's output in its own cell.

The notebook starts a 2-node Local pool in one cell and calls it from later ones. Each calling
cell must hold its nodes' lines, in one display whose text grows (display_data, then
update_display_data messages, recorded as they come), a line redrawn with ``\\r`` only in its
last state, and no agent must be left when the pool is closed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent

SETUP = """\
import os, time
import skyward as sky

@sky.compute
def talk(lines):
    node = sky.instance_info().node
    for i in range(lines):
        print(f"line {i} of node {node}", flush=True)
        time.sleep(0.15)
    return os.getpid()

@sky.compute
def progress(steps):
    for i in range(steps + 1):
        print(f"\\rprogress {i}/{steps}", end="", flush=True)
        time.sleep(0.15)
    print()
    print("done", flush=True)
"""

CELLS = [
    SETUP,
    'pool = sky.ComputePool(nodes=2, name="nb")\npool.start()',
    "pids = talk(3) @ pool\npids",
    "progress(5) >> pool",
    'print("later cell")\ntalk(1) >> pool',
    "pool.close()",
    'with sky.ComputePool(nodes=1, name="one") as one:\n    talk(2) >> one',
]


class Recorder(nbclient.NotebookClient):  # type: ignore[misc]
    """A client that keeps every display message a cell got, in order: what the kernel sent,
    not only the final state nbclient leaves in the notebook."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages: dict[int, list[dict[str, Any]]] = {}

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        # nbclient hands over only the messages whose parent is this cell's request: a message
        # recorded here was routed to this cell by the kernel.
        if msg["msg_type"] in ("display_data", "update_display_data", "stream"):
            self.messages.setdefault(cell_index, []).append(msg)
        return super().process_message(msg, cell, cell_index)


@pytest.fixture(scope="module")
def notebook(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Recorder]:
    """The notebook, run once by a kernel of this interpreter that imports this skyward."""
    kernels = tmp_path_factory.mktemp("jupyter") / "kernels" / "python3"
    kernels.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (skyward tests)",
        "language": "python",
        "env": {"PYTHONPATH": str(ROOT), "SKYWARD_QUIET": "0"},
    }
    (kernels / "kernel.json").write_text(json.dumps(spec))
    previous = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(kernels.parent.parent)  # ahead of any installed python3
    try:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
        client = Recorder(nb, timeout=120, kernel_name="python3")
        began = time.monotonic()
        client.execute()
        print(f"the notebook ran in {time.monotonic() - began:.1f} s")
    finally:
        if previous is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = previous
    return nb, client


def text_of(outputs: list[Any]) -> str:
    """Everything the cell shows as text: streams, displays and results."""
    parts = []
    for out in outputs:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)


def displays(outputs: list[Any]) -> list[Any]:
    return [out for out in outputs if out["output_type"] == "display_data"]


def test_a_calls_output_is_in_its_own_cell_as_one_growing_display(
    notebook: tuple[Any, Recorder],
) -> None:
    nb, client = notebook
    start, call = nb.cells[1].outputs, nb.cells[2].outputs
    assert "line 0 of node" not in text_of(start)
    shown = displays(call)
    assert len(shown) == 1, call  # one display for the call, not one output per line
    assert not [out for out in call if out["output_type"] == "stream"], call
    lines = shown[0]["data"]["text/plain"].splitlines()
    for node in (0, 1):
        assert [line for line in lines if line.startswith(f"(node {node})")] == [
            f"(node {node}) line {i} of node {node}" for i in range(3)
        ], lines
    # The text grew as the lines came: several updates of that one display.
    sent = client.messages[2]
    assert sent[0]["msg_type"] == "display_data"
    updates = [m for m in sent if m["msg_type"] == "update_display_data"]
    assert len(updates) >= 2, [m["msg_type"] for m in sent]
    display_id = sent[0]["content"]["transient"]["display_id"]
    assert all(m["content"]["transient"]["display_id"] == display_id for m in updates)
    sizes = [len(m["content"]["data"]["text/plain"]) for m in sent]
    assert sizes == sorted(sizes), sizes


def test_the_pools_status_is_one_line_replaced_in_the_starting_cell(
    notebook: tuple[Any, Recorder],
) -> None:
    nb, client = notebook
    start = nb.cells[1].outputs
    assert len(start) == 1 and start[0]["output_type"] == "display_data", start
    assert start[0]["data"]["text/plain"].startswith("[skyward] nb-"), start
    assert "ready: 2 node(s) in" in start[0]["data"]["text/plain"], start
    assert len(client.messages[1]) >= 2  # launching, ..., ready: the same line, updated


def test_a_line_redrawn_with_cr_shows_its_last_state(notebook: tuple[Any, Recorder]) -> None:
    nb, client = notebook
    (shown,) = displays(nb.cells[3].outputs)
    text = shown["data"]["text/plain"]
    assert text.splitlines() == [line for line in text.splitlines() if "\r" not in line]
    node_lines = [line for line in text.splitlines() if line.startswith("(node")]
    assert node_lines[0].endswith("progress 5/5") and node_lines[1].endswith("done"), text
    assert len(node_lines) == 2, text
    # While it ran, the line was redrawn in place: partial states were shown, one at a time.
    seen = [m["content"]["data"]["text/plain"] for m in client.messages[3]]
    assert any("progress 1/5" in t or "progress 2/5" in t for t in seen), seen
    assert all(t.count("progress") <= 1 for t in seen), seen


def test_a_later_cell_gets_its_own_output(notebook: tuple[Any, Recorder]) -> None:
    nb, _ = notebook
    later = nb.cells[4].outputs
    assert "later cell" in text_of(later)  # the cell's own print, beside the display
    (shown,) = displays(later)
    node_lines = [line for line in shown["data"]["text/plain"].splitlines() if "(node" in line]
    assert len(node_lines) == 1, node_lines
    assert re.fullmatch(r"\(node ([01])\) line 0 of node \1", node_lines[0]), node_lines
    # and none of it went to the earlier cells (their own lines are counted above)
    assert text_of(nb.cells[3].outputs).count("(node") == 2


def test_closing_says_so_in_its_cell_and_leaves_no_agent(notebook: tuple[Any, Recorder]) -> None:
    nb, _ = notebook
    (shown,) = displays(nb.cells[5].outputs)
    assert "stopped 2 processes in" in shown["data"]["text/plain"], shown
    results = [out for out in nb.cells[2].outputs if out["output_type"] == "execute_result"]
    pids = ast.literal_eval(results[0]["data"]["text/plain"])
    assert len(set(pids)) == 2
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"agent {pid} is still running"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_a_pool_in_one_cell_shows_in_one_display(notebook: tuple[Any, Recorder]) -> None:
    nb, _ = notebook
    (shown,) = nb.cells[6].outputs  # start, the call and the teardown: one display
    lines = shown["data"]["text/plain"].splitlines()
    assert lines[:-1] == ["(node 0) line 0 of node 0", "(node 0) line 1 of node 0"], lines
    assert re.fullmatch(r"\[skyward\] one-\w+: stopped 1 process in [\d.]+ s", lines[-1])


def test_a_view_keeps_the_last_lines_and_says_how_many_went() -> None:
    from skyward.console.notebook import LINES, Notebook

    sent: list[str] = []
    board = Notebook()
    with board.calling():
        view = board._view
        assert view is not None
        view.handle = cast(Any, SimpleNamespace(update=lambda bundle, raw: sent.append(bundle)))
        for i in range(LINES + 5):
            board.line(i % 2, f"line {i}")
        board.partial(0, "50%")
        board.partial(0, "100%")
        board.status("[skyward] pool-x: ready")
    lines = sent[-1]["text/plain"].splitlines()
    assert lines[0] == "[skyward] ... 6 earlier lines: pool.logs()"
    assert lines[1] == "(node 0) line 6" and lines[-2] == "(node 0) 100%", lines[-3:]
    assert lines[-1] == "[skyward] pool-x: ready" and len(lines) == LINES + 2
