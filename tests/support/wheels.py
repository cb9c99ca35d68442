"""Wheels made on the spot, so environment builds in the tests need no package index.

Plain Python (no pytest). :func:`make_wheel` writes a pure-Python wheel from a dict of files;
:func:`wheel_of_installed` packs a distribution this interpreter already has (cloudpickle,
packaging, uv with its binary) into a wheel of the same version and tags. An image whose every
requirement is ``name @ file:///...whl``, and a bootstrap whose pip reads a directory of such
wheels, then build on hosts that cannot reach any index (the network-namespace hosts have no
route off the machine).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as metadata
import io
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from packaging.utils import canonicalize_name

__all__ = [
    "AGENT_PACKAGES",
    "OFFLINE_PACKAGES",
    "make_wheel",
    "offline_build_env",
    "requirement",
    "wheel_of_installed",
    "wheelhouse",
]

AGENT_PACKAGES = ("cloudpickle", "packaging")
"""The agent's own requirements: what every environment a node builds installs."""

OFFLINE_PACKAGES = ("uv", *AGENT_PACKAGES)
"""What a node's bootstrap may install from an index: uv itself, then the agent's requirements."""

# Written by the installer, not part of a wheel.
_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def _record_line(path: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def _write(
    directory: Path, name: str, version: str, files: Mapping[str, bytes], tag: str = "py3-none-any"
) -> Path:
    stem = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    dist_info = f"{stem}.dist-info"
    contents = dict(files)
    contents.setdefault(
        f"{dist_info}/METADATA",
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
    )
    contents.setdefault(
        f"{dist_info}/WHEEL",
        b"Wheel-Version: 1.0\nGenerator: skyward-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    )
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in sorted(contents.items()):
        writer.writerow(_record_line(path, data))
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    contents[f"{dist_info}/RECORD"] = record.getvalue().encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{stem}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:  # stored: uv's 40 MB binary packs at once
        for path, data in contents.items():
            info = zipfile.ZipInfo(path)
            info.external_attr = (0o100755 if "/scripts/" in path else 0o100644) << 16
            archive.writestr(info, data)
    return wheel


def make_wheel(directory: Path, name: str, version: str, files: Mapping[str, str]) -> Path:
    """A pure-Python wheel of `name` `version` holding `files` (path in the wheel -> text)."""
    return _write(directory, name, version, {p: t.encode() for p, t in files.items()})


def wheel_of_installed(directory: Path, name: str) -> Path:
    """The installed distribution `name`, packed again as a wheel in `directory`.

    Files under the environment's ``bin`` (uv's binary) go back into the wheel's scripts; the
    wheel keeps the first tag the installed one had.
    """
    dist = metadata.distribution(name)
    stem = f"{canonicalize_name(name).replace('-', '_')}-{dist.version}"
    files: dict[str, bytes] = {}
    for path in dist.files or ():
        parts = path.parts
        if "__pycache__" in parts or path.suffix == ".pyc":
            continue
        if parts[0].endswith(".dist-info") and parts[-1] in _INSTALLER_FILES:
            continue
        data = Path(str(dist.locate_file(path))).read_bytes()
        if ".." in parts:
            if parts[-2] != "bin":
                continue
            files[f"{stem}.data/scripts/{parts[-1]}"] = data
        else:
            files[path.as_posix()] = data
    wheel_text = dist.read_text("WHEEL") or ""
    tags = [
        line.split(":", 1)[1].strip() for line in wheel_text.splitlines() if line.startswith("Tag:")
    ]
    return _write(
        directory, dist.metadata["Name"], dist.version, files, tags[0] if tags else "py3-none-any"
    )


def requirement(name: str, wheel: Path) -> str:
    """The PEP 508 direct reference ``name @ file:///...`` to `wheel`."""
    return f"{name} @ {wheel.resolve().as_uri()}"


def wheelhouse(directory: Path, names: Sequence[str] = OFFLINE_PACKAGES) -> Path:
    """A directory every user can read, with a wheel of each installed distribution in `names`.

    With `offline_build_env` the bootstrap on a host that cannot reach an index (a network
    namespace host) installs from it, as a host behind an air gap would from a local mirror.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        wheel_of_installed(directory, name).chmod(0o644)
    directory.chmod(0o755)  # other users read it too, when its parents let them
    return directory


def offline_build_env(directory: Path) -> dict[str, str]:
    """Build environment (``sky.SSH(build_env=...)``) in which uv installs only from
    `directory` (uv itself arrives as the client's own binary)."""
    return {
        "UV_OFFLINE": "1",  # uv has no variable for --no-index; offline, it takes find-links
        "UV_FIND_LINKS": str(directory),
    }
