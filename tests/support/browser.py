"""A real browser for tests: Debian's chromium, driven by Playwright's sync API.

Playwright's Python package ships only its node driver here; it never downloads a browser
(nothing calls ``playwright install``). ``ensure_chromium`` installs Debian's ``chromium``
package with apt-get when it is missing, under the same cross-process lock as the other apt
installs the tests make (``bareroots.ensure_debootstrap``).
"""

from __future__ import annotations

import contextlib
import shutil
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support import bareroots, sshd
from tests.support.bareroots import _apt_env

if TYPE_CHECKING:
    from playwright.sync_api import Page, Route

CHROMIUM = Path("/usr/bin/chromium")

CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
]

# Hosts a ``local_only`` page may reach; every other request is aborted.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def ensure_chromium() -> Path:
    """Return ``/usr/bin/chromium``, installing Debian's ``chromium`` with apt-get when missing.

    ``apt-get update`` runs only when the first install attempt fails (stale lists); the
    install holds ``sshd._file_lock("apt")`` so parallel workers do not race on dpkg.
    """
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        raise RuntimeError(
            f"{CHROMIUM} is missing and there is no apt-get to install chromium with"
        )
    if not sshd.is_root():
        raise RuntimeError(f"{CHROMIUM} is missing and we are not root to apt-get install chromium")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    with sshd._file_lock("apt"):
        if not CHROMIUM.exists():  # another worker may have installed it while we waited
            proc = sshd._run(install, check=False, env=_apt_env(), timeout=900)
            if proc.returncode != 0:
                if not bareroots._apt_updated:
                    sshd._run(["apt-get", "update"], env=_apt_env(), timeout=600)
                    bareroots._apt_updated = True
                sshd._run(install, env=_apt_env(), timeout=900)
    if not CHROMIUM.exists():
        raise RuntimeError(f"installed chromium but {CHROMIUM} does not exist")
    return CHROMIUM


@dataclass
class Browser:
    """What ``browser_page`` yields: the open ``page`` and, with ``local_only``, the URLs it
    aborted (``blocked``, in request order; always empty without ``local_only``)."""

    page: Page
    blocked: list[str] = field(default_factory=list)


@contextlib.contextmanager
def browser_page(
    *, local_only: bool = False, viewport: tuple[int, int] = (1280, 800)
) -> Iterator[Browser]:
    """Open one headless chromium page; yield ``Browser(page, blocked)``.

    ``page`` is a ``playwright.sync_api.Page`` in a fresh context of ``viewport`` (width,
    height). With ``local_only=True`` every request whose host is not ``127.0.0.1``,
    ``localhost`` or ``::1`` is aborted and its URL appended to ``blocked``. The browser is
    closed and Playwright stopped on exit, also when the body raises.
    """
    from playwright.sync_api import sync_playwright

    executable = ensure_chromium()
    blocked: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(executable), args=CHROMIUM_ARGS, headless=True
        )
        try:
            context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
            page = context.new_page()
            if local_only:

                def _route(route: Route) -> None:
                    url = route.request.url
                    if urllib.parse.urlsplit(url).hostname in LOCAL_HOSTS:
                        route.continue_()
                    else:
                        blocked.append(url)
                        route.abort()

                page.route("**/*", _route)
            yield Browser(page, blocked)
        finally:
            browser.close()
