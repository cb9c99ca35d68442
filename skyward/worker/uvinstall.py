"""Put uv on a host that has nothing but a shell and python3: no pip, no venv module, no compiler.

Runs on the host with its own python3 (any 3.8+, as cloud images have), before any environment
exists, so it is standard library only. Two ways in, chosen by the client
(`skyward.providers.remote.hoststeps.install_uv`):

- ``--receive``: the client's own uv binary arrives gzip-compressed on stdin (the client sends it
  when the host's OS, architecture and C library match its own);
- ``--fetch``: the uv wheel for this host's platform is found on the image's indexes
  (flat pages or PEP 503 simple indexes, in order, then those of ``UV_INDEX`` and the default
  index: the image's own if it names one, else ``UV_DEFAULT_INDEX`` or ``UV_INDEX_URL`` or
  PyPI, as uv would read them), downloaded with urllib, checked against the sha256 the index
  gives, and the binary taken out of it. The image's indexes arrive on stdin as JSON, not as
  an argument: a URL may hold a password, and a command line is public on its machine.

Either way the binary lands at DEST (``<cache>/bootstrap/uv-<version>/bin/uv``) atomically, under
a lock, and must answer ``uv --version`` with the version asked for. The last line printed is
``{"uv": DEST}`` or ``{"error": ..., "output": ...}``.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from html.parser import HTMLParser

from skyward.worker.redact import redact_urls

DEFAULT_INDEX = "https://pypi.org/simple/"
TIMEOUT = 30.0  # seconds for one request; a host with no route fails at once anyway


class Failed(Exception):
    """uv could not be put on this host; the message says why, `output` what was tried."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


def platform_key() -> tuple[str, str, str]:
    """(system, machine, libc) of this interpreter's host, as the client compares them."""
    libc = platform.libc_ver()[0] if platform.system() == "Linux" else ""
    return platform.system(), platform.machine(), libc


def wheel_fits(filename: str, version: str, key: tuple[str, str, str]) -> bool:
    """Whether `filename` is the uv `version` wheel for a host of `key` (see `platform_key`)."""
    prefix = f"uv-{version}-"
    if not (filename.startswith(prefix) and filename.endswith(".whl")):
        return False
    system, machine, libc = key
    tags = filename[len(prefix) : -len(".whl")].split("-")[-1].split(".")
    if system == "Linux":
        family = "manylinux" if libc == "glibc" else "musllinux"
        return any(t.startswith(family) and t.endswith("_" + machine) for t in tags)
    if system == "Darwin":
        arch = {"arm64", "universal2"} if machine == "arm64" else {"x86_64", "universal2"}
        return any(t.startswith("macosx") and t.split("_")[-1] in arch for t in tags)
    return False


class _Links(HTMLParser):
    """The ``<a href>`` targets of an index page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            for name, value in attrs:
                if name == "href" and value:
                    self.hrefs.append(value)


def _get(url: str) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "text/html", "User-Agent": "skyward"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
        data: bytes = reply.read()
        return data


def candidates(index: str, flat: bool, version: str, key: tuple[str, str, str]) -> list[str]:
    """Links (with their ``#sha256=`` fragments) to fitting uv wheels on one index."""
    page = index if flat else index.rstrip("/") + "/uv/"
    folder = urllib.request.url2pathname(urllib.parse.urlsplit(page).path)
    if page.startswith("file:") and os.path.isdir(folder):  # a flat index that is a folder
        base = page.rstrip("/") + "/"
        links = [urllib.parse.urljoin(base, name) for name in sorted(os.listdir(folder))]
    else:
        parser = _Links()
        parser.feed(_get(page).decode("utf-8", "replace"))
        links = [urllib.parse.urljoin(page, href) for href in parser.hrefs]
    return [
        link
        for link in links
        if wheel_fits(
            urllib.parse.unquote(urllib.parse.urlsplit(link).path.rsplit("/", 1)[-1]), version, key
        )
    ]


def _binary_of(wheel: bytes, version: str) -> bytes:
    with zipfile.ZipFile(io.BytesIO(wheel)) as archive:
        name = f"uv-{version}.data/scripts/uv"
        try:
            return archive.read(name)
        except KeyError:
            raise Failed(f"the uv {version} wheel holds no {name}") from None


def fetch(version: str, indexes: list[tuple[str, bool, bool]]) -> bytes:
    """The uv binary, from the first of `indexes` ((url, flat, default): the extra ones, then
    the default index) that serves a fitting wheel."""
    key = platform_key()
    extra = [(url, flat) for url, flat, default in indexes if not default]
    # The indexes uv itself would read from the build's environment come after the image's.
    configured = [(u.split("=", 1)[-1], False) for u in os.environ.get("UV_INDEX", "").split()]
    # The image's default index replaces the host's, as it does for the build (`envbuild`).
    default = next((url for url, _, is_default in indexes if is_default), None) or (
        os.environ.get("UV_DEFAULT_INDEX") or os.environ.get("UV_INDEX_URL") or DEFAULT_INDEX
    )
    tried: list[str] = []
    for url, flat in [*extra, *configured, (default, False)]:
        try:
            links = candidates(url, flat, version, key)
            if not links:
                tried.append(f"{url}: no uv {version} wheel for {'/'.join(key)}")
                continue
            link = links[0]
            data = _get(link.split("#", 1)[0])
        except (OSError, ValueError) as exc:  # URLError is an OSError; a bad URL a ValueError
            tried.append(f"{url}: {exc}")
            continue
        fragment = urllib.parse.urlsplit(link).fragment
        if fragment.startswith("sha256=") and hashlib.sha256(data).hexdigest() != fragment[7:]:
            tried.append(f"{link}: the download does not match its sha256")
            continue
        return _binary_of(data, version)
    raise Failed(f"no index served uv {version} for {'/'.join(key)}", "\n".join(tried))


def install(dest: str, version: str, binary: bytes) -> None:
    """Put `binary` at `dest` (``.../uv-<version>/bin/uv``) once it answers as uv `version`:
    built in a folder beside, then renamed, so a failure (a full disk, a binary for another
    platform) leaves nothing that looks like an installed uv."""
    home = os.path.dirname(os.path.dirname(dest))  # .../uv-<version>
    staging = tempfile.mkdtemp(dir=os.path.dirname(home), prefix=".uv-")
    try:
        binary_path = os.path.join(staging, "bin", "uv")
        os.makedirs(os.path.dirname(binary_path))
        with open(binary_path, "wb") as out:
            out.write(binary)
        os.chmod(binary_path, 0o700)
        try:
            said = subprocess.run(
                [binary_path, "--version"], capture_output=True, text=True, timeout=60
            ).stdout.split()
        except OSError as exc:  # e.g. ENOEXEC: a binary for another platform
            raise Failed(f"the uv binary does not run on this host: {exc}") from None
        if said[:2] != ["uv", version]:
            raise Failed(f"the uv binary says {' '.join(said) or 'nothing'}, not uv {version}")
        shutil.rmtree(home, ignore_errors=True)  # an incomplete one from an older skyward
        os.rename(staging, home)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main() -> None:
    """``python3 -m skyward.worker.uvinstall DEST VERSION --receive`` (the binary gzipped on
    stdin) or ``... --fetch`` (a JSON list of ``[url, flat, default]`` on stdin)."""
    # What this makes under the cache (bootstrap/, the lock, uv's folder) is owner-only, as in
    # the rest of the cache (`skyward.cachedir`; not imported: this runs on the host's python3).
    os.umask(0o077)
    dest, version, how = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(dest)))  # <cache>/bootstrap
        os.makedirs(root, mode=0o700, exist_ok=True)
        lock_fd = os.open(f"{root}/uv-{version}.lock", os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(lock_fd, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # hosts sharing a home install once
            if not os.access(dest, os.X_OK):
                if how == "--receive":
                    binary = gzip.decompress(sys.stdin.buffer.read())
                else:
                    listed = json.loads(sys.stdin.read())
                    binary = fetch(version, [(u, bool(f), bool(d)) for u, f, d in listed])
                install(dest, version, binary)
    except Failed as exc:
        # What was tried names each index: without the passwords some of their URLs hold.
        print(json.dumps({"error": redact_urls(str(exc)), "output": redact_urls(exc.output)}))
        sys.exit(1)
    except OSError as exc:
        print(json.dumps({"error": f"installing uv at {dest} failed: {exc}", "output": ""}))
        sys.exit(1)
    print(json.dumps({"uv": dest}))


if __name__ == "__main__":
    main()
