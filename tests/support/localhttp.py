"""One small HTTP server for the test stand-ins: a function ``answer(request) -> (status,
headers, body)`` served in a thread, on a free port of ``host``.

It speaks HTTP/1.1 and writes a Content-Length on every reply, so the official clients that
keep their connections open (botocore, google's REST transport) reuse them as they would with
the real services; a client that asks for the connection to be closed (urllib) has it closed
after the reply. An exception in `answer` is not caught: the connection is dropped and the
traceback printed, which a test sees as a broken reply rather than a made-up status.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query
    query: dict[str, str]  # each parameter's first value; blank ones left out
    headers: dict[str, str]  # names in lower case: HTTP's are case-insensitive
    body: bytes  # Content-Length bytes (empty without one)


Reply = tuple[int, Mapping[str, str], bytes]  # status, headers (Content-Length added), body
Answer = Callable[[Request], Reply]


class LocalServer:
    """`answer` served on ``host`` (a free port), from `start` (or ``with``) until `close`.

    The port is bound at once, so `url` and `address` are known before it starts; requests
    that come before then wait in the listen queue. `methods` are the ones answered: any
    other is the 501 ``http.server`` gives, as from a service that has no such call.
    """

    def __init__(
        self,
        answer: Answer,
        host: str = "127.0.0.1",
        *,
        methods: Iterable[str] = ("GET", "POST", "PUT", "DELETE", "PATCH"),
        name: str = "localhttp",
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass  # one line a request would bury the test's own output

            def _answer(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(
                    method=self.command,
                    path=parts.path,
                    query={k: v[0] for k, v in parse_qs(parts.query).items()},
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=self.rfile.read(length),
                )
                status, headers, body = answer(request)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        for method in methods:
            setattr(Handler, f"do_{method}", Handler._answer)
        # ThreadingHTTPServer's request threads are daemons: a client that keeps its
        # connection open does not keep the test process alive.
        self._server = ThreadingHTTPServer((host, 0), Handler)
        port = self._server.server_address[1]
        self.address = f"{host}:{port}"
        self.url = f"http://{self.address}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # close() waits up to one poll
            name=name,
            daemon=True,
        )

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, free the port and join the thread. Connections a client keeps open
        are not cut; their daemon threads end with the client or the process."""
        if self._thread.ident is not None:  # shutdown() waits for a serve_forever forever
            self._server.shutdown()
            self._thread.join(10)
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
