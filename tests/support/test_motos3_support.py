"""`motos3.stop`, the teardown of the suite's moto servers: it ends a server however slowly it
goes, and never fails the test whose fixture it ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.support import motos3

# A server that ignores SIGTERM, as one too busy to end in time looks to its teardown.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_a_server_that_will_not_end_on_sigterm_is_killed_without_an_error() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"
    started = time.monotonic()
    motos3.stop(process, grace=0.5)
    assert process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5
    process.stdout.close()


def test_a_server_that_ends_on_sigterm_is_not_killed() -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    process = subprocess.Popen(sleeper, start_new_session=True)
    motos3.stop(process)
    assert process.returncode == -signal.SIGTERM
