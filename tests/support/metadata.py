"""A small HTTP server for the stand-ins of the clouds' instance metadata services (AWS's IMDS,
GCP's metadata server), on an address the test hosts reach (their bridge).

The caller gives one function, ``answer(method, path, headers) -> (status, body)`` (header
names in lower case: HTTP's are case-insensitive; the path without its query); this module
serves it on a free port in a thread and stops it on `close`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tests.support.localhttp import LocalServer, Reply, Request

Answer = Callable[[str, str, Mapping[str, str]], tuple[int, bytes]]


class MetadataServer:
    """`answer` served over HTTP on ``host`` (a free port): `address` is ``host:port``."""

    def __init__(self, host: str, answer: Answer) -> None:
        def reply(request: Request) -> Reply:
            status, body = answer(request.method, request.path, request.headers)
            return status, {}, body

        # GET and PUT only: the token is a PUT (IMDSv2), every other read a GET.
        self._server = LocalServer(reply, host, methods=("GET", "PUT"), name="metadata").start()
        self.address = self._server.address

    def close(self) -> None:
        self._server.close()
