"""A real terminal for tests: a command in a tmux pane whose screen the test reads.

`ensure_tmux` installs tmux with apt when it is missing (root, as `sshd.ensure_openssh_server`
does for openssh-server), so a fresh CI machine runs these tests. Each `Terminal` has its own
tmux server (``tmux -L``), so tests never touch anyone's sessions, and kills only that server.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests.support import sshd

EXITED = "[terminal: exit "


def ensure_tmux() -> str:
    """The tmux binary, installed with apt first if needed; RuntimeError if it cannot be."""
    found = shutil.which("tmux")
    if found:
        return found
    if not sshd.is_root() or shutil.which("apt-get") is None:
        raise RuntimeError("tmux is missing: install it with `apt-get install -y tmux`")
    with sshd._file_lock("apt"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if shutil.which("tmux") is None:
            sshd._run(["apt-get", "update"], env=env, timeout=600)
            sshd._run(["apt-get", "install", "-y", "--no-install-recommends", "tmux"], env=env)
    found = shutil.which("tmux")
    if not found:
        raise RuntimeError("apt-get installed tmux, but it is not on PATH")
    return found


class Terminal:
    """`command` running in a `width` x `height` tmux pane; the pane stays after it exits."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        width: int = 120,
        height: int = 40,
    ) -> None:
        self.tmux = ensure_tmux()
        self.socket = f"skyward-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # The exit line tells the test the program is done; the sleep keeps the pane readable.
        script = (
            f"cd {shlex.quote(str(cwd))} && env {exports} {shlex.join(command)}; "
            f'echo "{EXITED}$?]"; sleep 600'
        )
        self._tmux(
            "new-session", "-d", "-s", "test", "-x", str(width), "-y", str(height), "sh", "-c",
            script,
        )  # fmt: skip

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            [self.tmux, "-L", self.socket, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        return done.stdout

    def screen(self, colours: bool = False) -> str:
        """What the pane shows now (with its ANSI colours when `colours`)."""
        return self._tmux("capture-pane", "-p", *(["-e"] if colours else []), "-t", "test")

    def watch(self, done: Callable[[str], bool], timeout: float, every: float = 0.05) -> list[str]:
        """Every distinct screen until `done(screen)` (or the program exits, or `timeout`)."""
        screens: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.screen()
            if not screens or screens[-1] != shown:
                screens.append(shown)
            if done(shown) or EXITED in shown:
                break
            time.sleep(every)
        return screens

    def close(self) -> None:
        subprocess.run(
            [self.tmux, "-L", self.socket, "kill-server"], capture_output=True, check=False
        )
