"""tests/support/browser.py drives Debian's chromium: it clicks, JS runs, and a
``local_only`` page reaches nothing but the loopback host."""

from __future__ import annotations

import http.server
import threading

import pytest

from tests.support.browser import browser_page

PAGE = b"""<!doctype html>
<html><head><title>browser support</title></head>
<body>
  <p id="status">Waiting for a click</p>
  <button type="button" id="go">Press me</button>
  <img src="http://example.com/x.png" alt="remote">
  <script>
    document.getElementById("go").addEventListener("click", () => {
      document.getElementById("status").textContent = "Clicked by chromium";
    });
  </script>
</body></html>
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.slow
def test_browser_page_clicks_and_blocks_remote_requests() -> None:
    from playwright.sync_api import expect

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        with browser_page(local_only=True) as browser:
            page = browser.page
            page.goto(url)
            expect(page.get_by_text("Waiting for a click")).to_be_visible()
            expect(page.get_by_text("Clicked by chromium")).to_have_count(0)
            page.get_by_role("button", name="Press me").click()
            expect(page.get_by_text("Clicked by chromium")).to_be_visible()
            page.wait_for_load_state("load")
            assert "http://example.com/x.png" in browser.blocked, browser.blocked
            assert not [u for u in browser.blocked if u.startswith(url)], browser.blocked
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
