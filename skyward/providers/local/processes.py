"""This user's skyward agents among this machine's processes, by the client that started them:
what ``skyward status`` lists as ``here`` (`Local.live_pools`), whatever started them (a pool
of this machine's, or an SSH pool's agents on this host, under sshd).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from skyward.console.progress import clock
from skyward.providers.base import LivePool


@dataclass(frozen=True)
class LocalPool:
    """Agents of this user on this machine, under one client process."""

    client: int
    command: str
    agents: tuple[int, ...]
    age: float

    def live(self) -> LivePool:
        """As ``skyward status`` prints it: one line."""
        command = self.command if len(self.command) <= 60 else self.command[:57] + "..."
        return LivePool(
            f"here   client pid {self.client} ({command}): {len(self.agents)} agent(s) "
            f"[{', '.join(map(str, self.agents))}], up {clock(self.age)}"
        )


def local_pools() -> list[LocalPool]:
    """Every client process of this user with skyward agents (``-m skyward.worker``) under it."""
    uid, now, boot = os.getuid(), time.time(), _boot_time()
    ticks = os.sysconf("SC_CLK_TCK")
    clients: dict[int, list[tuple[int, float]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if argv[1:3] != [b"-m", b"skyward.worker"] or fields[0] == "Z":
            continue
        started = boot + int(fields[19]) / ticks
        clients.setdefault(int(fields[1]), []).append((int(entry), started))
    found = []
    for client, agents in sorted(clients.items()):
        try:
            argv = Path(f"/proc/{client}/cmdline").read_bytes().split(b"\0")
            command = " ".join(a.decode(errors="replace") for a in argv if a)
        except OSError:
            command = "?"
        if command.startswith("sshd"):
            command = f"agents started by sshd: {command}"
        oldest = min(started for _, started in agents)
        pids = tuple(sorted(pid for pid, _ in agents))
        found.append(LocalPool(client, command, pids, now - oldest))
    return found


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0
