"""The dashboard's web server: one page, its data as JSON, behind a token.

A Starlette app served by uvicorn. Every request needs the token the URL printed at start
carries (``?token=``, as Jupyter's does): the page's first load sets it as an HTTP-only cookie,
which the page's own requests then carry; anything else gets 403. Other users of a shared
login node reach 127.0.0.1 too, which is why a local address alone is not enough.

Every asset is served from here (the page, its script, plotly's JavaScript from the plotly
package): the page works on a machine with no internet.
"""

from __future__ import annotations

import csv
import functools
import hmac
import io
import json
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import plotly
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from skyward.dashboard.runs import KINDS, Runs
from skyward.errors import ConfigError

COOKIE = "skyward_dashboard"
_STATIC = Path(__file__).with_name("static")
_PLOTLY = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
_ASSETS = {
    "app.js": (_STATIC / "app.js", "text/javascript"),
    "style.css": (_STATIC / "style.css", "text/css"),
    "plotly.min.js": (_PLOTLY, "text/javascript"),
}
_WHAT = ("events", "metrics", "output")

Endpoint = Callable[[Request], Awaitable[Response]]


def new_token() -> str:
    return secrets.token_urlsafe(24)


def app(runs: Runs, token: str) -> Starlette:
    """The dashboard's ASGI app over `runs`, for requests that carry `token`."""
    ends = _Endpoints(runs)
    guarded = functools.partial(_guarded, token=token)
    routes = [
        Route("/", guarded(ends.page)),
        Route("/runs/{kind}/{id}", guarded(ends.page)),
        Route("/static/{name}", guarded(ends.asset)),
        Route("/api/runs", guarded(ends.listing)),
        Route("/api/runs/{kind}/{id}", guarded(ends.one)),
        Route("/api/runs/{kind}/{id}/metrics.{form}", guarded(ends.download)),
        Route("/api/runs/{kind}/{id}/stop", guarded(ends.stop), methods=["POST"]),
        Route("/api/runs/{kind}/{id}/{what}", guarded(ends.records)),
    ]
    return Starlette(routes=routes)


def _guarded(endpoint: Endpoint, token: str) -> Endpoint:
    """`endpoint` for requests with the token (in ``?token=`` or the cookie the first page
    load set); 403 for the rest."""

    async def checked(request: Request) -> Response:
        given = request.query_params.get("token") or request.cookies.get(COOKIE, "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return PlainTextResponse(
                "403: this dashboard needs its token: open the URL `skyward dashboard` printed",
                status_code=403,
            )
        response = await endpoint(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    return checked


class _Endpoints:
    """What each route answers; the slow parts (reading files, asking nodes) in a thread."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs

    async def page(self, request: Request) -> Response:
        return FileResponse(_STATIC / "index.html", media_type="text/html")

    async def asset(self, request: Request) -> Response:
        found = _ASSETS.get(request.path_params["name"])
        if found is None:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(found[0], media_type=found[1])

    async def listing(self, request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(self.runs.listing))

    async def one(self, request: Request) -> Response:
        kind, run_id = _which(request)
        row = await run_in_threadpool(self.runs.row, kind, run_id)
        if row is None:
            return JSONResponse({"error": f"no {kind} {run_id!r}"}, status_code=404)
        return JSONResponse(row)

    async def records(self, request: Request) -> Response:
        kind, run_id = _which(request)
        what = request.path_params["what"]
        if what not in _WHAT:
            return JSONResponse({"error": f"{what!r} is not one of {_WHAT}"}, status_code=404)
        try:
            after = int(request.query_params.get("after", "0") or 0)
        except ValueError:
            return JSONResponse({"error": "after= takes a whole number"}, status_code=400)
        found = await run_in_threadpool(self.runs.records, kind, run_id, what, after)
        return JSONResponse(found)

    async def download(self, request: Request) -> Response:
        kind, run_id = _which(request)
        form = request.path_params["form"]
        if form not in ("csv", "jsonl"):
            return PlainTextResponse("metrics.csv or metrics.jsonl", status_code=404)
        found = await run_in_threadpool(self.runs.records, kind, run_id, "metrics", 0)
        headers = {"Content-Disposition": f'attachment; filename="{run_id}-metrics.{form}"'}
        if form == "jsonl":
            body = "".join(json.dumps(r) + "\n" for r in found)
            return Response(body, media_type="application/x-ndjson", headers=headers)
        return Response(_csv(found), media_type="text/csv", headers=headers)

    async def stop(self, request: Request) -> Response:
        kind, run_id = _which(request)
        try:
            said = await run_in_threadpool(self.runs.stop, kind, run_id)
        except LookupError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except Exception as exc:
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=409)
        return JSONResponse({"said": said})


def _which(request: Request) -> tuple[str, str]:
    kind = request.path_params["kind"]
    return (kind if kind in KINDS else "pool"), request.path_params["id"]


def _csv(found: list[dict[str, Any]]) -> str:
    """One row per reported metric value: time, node, rank, key, value, step."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["time", "node", "rank", "metric", "value", "step"])
    for entry in found:
        metrics = entry.get("metrics", {})
        step = metrics.get("step", "")
        for key, value in metrics.items():
            if key != "step":
                writer.writerow([entry["time"], entry["node"], entry["rank"], key, value, step])
    return out.getvalue()


def serve(
    runs: Runs, host: str, port: int, token: str, on_listening: Callable[[int], None]
) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's own handlers end it); `on_listening` gets
    the port once the socket is bound (the one chosen, for port 0)."""
    config = uvicorn.Config(
        app(runs, token), host=host, port=port, log_level="warning", access_log=False
    )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"the dashboard cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)  # a request that comes before uvicorn has started waits for it
    on_listening(int(sock.getsockname()[1]))
    uvicorn.Server(config).run(sockets=[sock])
