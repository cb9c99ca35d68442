"""``skyward dashboard``: serve the page of runs (`skyward.dashboard`) until Ctrl-C."""

from __future__ import annotations

import sys
import webbrowser

from skyward.errors import ConfigError


def serve(host: str, port: int, open_browser: bool) -> int:
    """Serve the dashboard on `host`:`port`; print its URL, with its token, on a line of its
    own once it listens; end on SIGINT or SIGTERM."""
    try:
        from skyward.dashboard import server
        from skyward.dashboard.runs import Runs
    except ImportError as exc:
        raise ConfigError(
            f"skyward dashboard needs the dashboard extra ({exc.name} is missing): "
            "pip install 'skyward[dashboard]'"
        ) from None
    token = server.new_token()
    runs = Runs()
    runs.start()

    def listening(bound: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound}/?token={token}"
        print("skyward dashboard: open this URL (Ctrl-C ends it):", flush=True)
        print(url, flush=True)
        if open_browser and not webbrowser.open(url):
            print("skyward dashboard: no browser to open here", file=sys.stderr)

    try:
        server.serve(runs, host, port, token, listening)
    finally:
        runs.close()
    return 0
