"""Watch every process's command line on this machine for a secret, while a pool lives.

The test hosts (sshd in network namespaces, slurmd and the Slurm steps likewise) share this
machine's process table: a network namespace is not a PID namespace, so /proc here lists the
client, the login node's srun and every node's processes alike. `Watch` samples all of them
every 20 ms from a thread and remembers any command line that held the secret; the `seen`
markers prove the sampler did see the processes that matter (a node's agent, an srun).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Sequence
from types import TracebackType

INTERVAL = 0.02


def canary() -> str:
    """A value no process would have on its command line by chance."""
    return f"canary-{secrets.token_hex(12)}"


class Watch:
    """A context manager: on exit, `leaks` holds every command line that showed `secret`, and
    `seen` the markers that some sample found (substrings of a command line whose arguments
    are joined by spaces, one after the last: ``" -m skyward.worker "`` is the agent)."""

    def __init__(self, secret: str, markers: Sequence[str] = ()) -> None:
        self.secret = secret.encode()
        self.markers = [m.encode() for m in markers]
        self.leaks: list[str] = []
        self.seen: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmdline-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(INTERVAL):
                self._sample()  # once more: what ran until the very end
                return

    def _sample(self) -> None:
        self.samples += 1
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                    line = handle.read()
            except OSError:  # it ended meanwhile
                continue
            line = line.replace(b"\0", b" ")
            if self.secret in line:
                self.leaks.append(line.decode(errors="replace"))
            for marker in self.markers:
                if marker in line:
                    self.seen.add(marker.decode())
