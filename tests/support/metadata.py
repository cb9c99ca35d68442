"""A small HTTP server for the stand-ins of the clouds' instance metadata services (AWS's IMDS,
GCP's metadata server), on an address the test hosts reach (their bridge).

The caller gives one function, ``answer(method, path, headers) -> (status, body)`` (header
names in lower case: HTTP's are case-insensitive); this module serves it on a free port in a
thread and stops it on `close`.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Mapping
from typing import Any

Answer = Callable[[str, str, Mapping[str, str]], tuple[int, bytes]]


class MetadataServer:
    """`answer` served over HTTP on ``host`` (a free port): `address` is ``host:port``."""

    def __init__(self, host: str, answer: Answer) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._reply("GET")

            def do_PUT(self) -> None:
                self._reply("PUT")

            def _reply(self, method: str) -> None:
                headers = {name.lower(): value for name, value in self.headers.items()}
                status, body = answer(method, self.path, headers)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
