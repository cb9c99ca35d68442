"""A skyward pod's main process: it holds the pod while skyward uses it, and ends it after.

A pod's container must run something while the client's commands (the host check, the build,
the agent) come in through the exec stream; this is it. It ends the container, and with it the
pod's hold on its GPUs, once no other process has run in the pod for `idle` seconds: the
client's teardown deletes the pod first, but a client that died (SIGKILL, a laptop gone) leaves
its agents to end on their own (their control stream closes, or their heartbeat stops), and
this to end the pod after them. It counts the processes it sees in ``/proc``: in a container
those are the pod's own (its PID namespace). SIGTERM (the pod's deletion) ends it at once.

Standard library only, Python 3.8+: it runs with the image's python3 (``python3 -c``), before
skyward is on the pod.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL = 1.0


def others() -> int:
    """How many processes other than this one the pod runs now."""
    me = os.getpid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (me, 1 if me != 1 else -1):
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    state = stat.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != b"Z":  # a zombie is already gone; reaped below when it is ours
                count += 1
    return count


def _reap() -> None:
    # As the container's init, orphans are ours to reap.
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def main(argv: list[str]) -> int:
    idle = float(argv[1]) if len(argv) > 1 else 60.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"skyward pod keeper: up; the pod ends {idle:g} s after its last process", flush=True)
    quiet_since = time.monotonic()
    while True:
        time.sleep(POLL)
        _reap()
        if others():
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= idle:
            print(
                f"skyward pod keeper: nothing ran in the pod for {idle:g} s (its client is "
                "gone or done): ending the pod",
                flush=True,
            )
            return 0


def program() -> str:
    """This module as the one ``python3 -c`` program a pod's container runs (its argument:
    the idle seconds). Built on the client."""
    import inspect

    return inspect.getsource(sys.modules[__name__])  # its ``__main__`` guard runs it


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
