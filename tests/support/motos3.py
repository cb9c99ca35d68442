"""moto as a real S3 server process, with its access log to count the requests it served.

``python -m moto.server`` logs one werkzeug line per request (client address, method, path,
status); tests read it to see what a download or upload really cost, from the server's side.
werkzeug wraps the request of a reply other than 200 (a ranged GET's 206, a 404) in ANSI
colour escapes, even in a file; only where colorama is installed does its stream wrapper strip
them from output that is not a terminal. So whether the log has them depends on what else the
environment holds, not on moto's version: they are dropped before a line is read.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.support import sshd

REGION = "us-east-1"
_LINE = re.compile(r'^(\S+) - - \[[^\]]*\] "(\w+) (\S+) HTTP/[\d.]+" (\d+)')
_STYLE = re.compile(r"\x1b\[[\d;]*m")  # werkzeug's colours (SGR escapes)


@dataclass(frozen=True)
class Request:
    client: str  # the address the request came from
    method: str
    path: str  # with its query string
    status: int

    @property
    def is_listing(self) -> bool:
        return "list-type=" in self.path


@dataclass
class MotoS3:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def mark(self) -> int:
        """A position in the access log; `requests(mark)` returns what came after it."""
        return self._settled_size()

    def requests(self, since: int = 0) -> list[Request]:
        size = self._settled_size()
        with self.log.open("rb") as log:
            log.seek(since)
            text = _STYLE.sub("", log.read(size - since).decode(errors="replace"))
        found = (_LINE.match(line) for line in text.splitlines())
        return [Request(m[1], m[2], m[3], int(m[4])) for m in found if m]

    def object_gets(self, bucket: str, since: int = 0) -> list[Request]:
        """GETs of objects (not listings) in `bucket`."""
        return [
            r
            for r in self.requests(since)
            if r.method == "GET" and r.path.startswith(f"/{bucket}/") and not r.is_listing
        ]

    def object_puts(self, bucket: str, since: int = 0) -> list[Request]:
        return [
            r
            for r in self.requests(since)
            if r.method == "PUT" and r.path.startswith(f"/{bucket}/")
        ]

    def _settled_size(self) -> int:
        # werkzeug writes the line after the response; wait until the log stops growing.
        size, stable_since = -1, time.monotonic()
        while True:
            now = self.log.stat().st_size
            if now != size:
                size, stable_since = now, time.monotonic()
            elif time.monotonic() - stable_since > 0.15:
                return size
            time.sleep(0.02)


def s3_env(url: str) -> dict[str, str]:
    """What a process needs to use moto's S3 and nothing else: fake credentials, a region, the
    endpoint, no instance metadata, no config files."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": url,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent/skyward-test",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/skyward-test",
    }


@contextlib.contextmanager
def moto_s3(
    log_dir: Path, host: str = "127.0.0.1", env: Mapping[str, str] | None = None
) -> Iterator[MotoS3]:
    """``python -m moto.server`` on `host` (a free port), stopped on exit. `env` adds to the
    server's environment (e.g. ``INITIAL_NO_AUTH_ACTION_COUNT`` to enforce IAM)."""
    port = sshd.free_port(host)
    log = log_dir / f"moto-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
            stdout=out,
            stderr=out,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    server = MotoS3(f"http://{host}:{port}", process, log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                # Not an AWS action: it does not use up INITIAL_NO_AUTH_ACTION_COUNT.
                server.reset()
                break
            except OSError as exc:
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_bytes()[-2000:]
                    raise RuntimeError(f"moto server did not start: {tail!r}") from exc
                time.sleep(0.1)
        yield server
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """End a server started in a session of its own (``start_new_session``): SIGTERM to its
    group, up to `grace` seconds for it to end, then SIGKILL and as long again. Never raises on
    a slow end, only says so: a fixture's teardown must not fail a test that passed (on a busy
    2-core machine moto once took more than 10 s to end after SIGTERM, and ``wait(10)`` raised
    ``TimeoutExpired`` in the teardown of a test that had passed)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue
    print(f"server pid {process.pid} did not end {2 * grace:g} s after SIGTERM", file=sys.stderr)
