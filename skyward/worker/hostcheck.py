"""What an interpreter already has for an image, and what to do about it: one check, one decision.

`check` looks at the interpreter it runs in and at skyward's cache directory: the Python
version, the machine's OS, architecture and C library, skyward's source, a usable uv (skyward's
own copy, or one on PATH of the same minor version), an environment already built for the image,
the setup marker, the apt packages missing, whether the interpreter satisfies the image's
requirements, and (when asked) the machine's GPUs that its ``CUDA_VISIBLE_DEVICES`` leaves it.
`decide` turns that `HostReport` into the interpreter the nodes run, or a build, by one rule. Every
provider uses these two: Local calls `check` in-process; on a remote host `program()` runs with
the host's interpreter (``python3 -c PROGRAM QUERY_JSON``), one command that prints the report.

Standard library only, and Python 3.8+: it runs with the host's own python3, before skyward's
source or any environment is on the host. The requirement probe (`skyward.worker.probe`,
standard library and the interpreter's own `packaging`) and the GPU inventory
(`skyward.worker.gpus`, standard library) travel inside `program()`, so even a first contact
reports whether the host's interpreter has what the image asks, and its GPUs: one command, with
no second check once skyward's source is there.
"""

from __future__ import annotations

import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: on a host, `program()` hands `find` over instead
    from skyward.worker.gpus import Inventory

READY_MARKER = ".skyward-ready"  # as in skyward.worker.envbuild (not imported: stdlib only)


@dataclass(frozen=True)
class Query:
    """What to look for: paths under `cache`, the image's requirements and apt packages."""

    # skyward's cache directory, ``~`` expanded where the check runs; on a remote host, ""
    # and `main`'s second argument, as the host's shell resolved it
    cache: str
    env: str  # the environment's hash (`EnvSpec.hash`)
    src: str = ""  # the hash of skyward's shipped source, "" when not shipped
    uv: str = ""  # the uv version looked for under bootstrap/, "" for none
    apt: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    probe: bool = True  # whether this interpreter may serve the nodes (then: probe it)
    # whether to list the GPUs this process may use (`skyward.worker.gpus.find_visible`)
    gpus: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))


# A file a client writes a fresh token into, in its own cache, before it checks hosts that may
# share that directory (a Slurm cluster's shared home): the check reads it back at no extra cost.
CLIENT_TOKEN = ".client-token"


@dataclass(frozen=True)
class HostReport:
    """What `check` found."""

    python: str  # this interpreter
    version: str  # its version, e.g. "3.12.3"
    uid: int
    src: bool  # skyward's source (`Query.src`) is unpacked in the cache
    # A uv to build with: skyward's copy of `Query.uv` in the cache, else a uv on PATH (or in
    # ~/.local/bin) of the same minor version; None when there is neither.
    uv: str | None
    env: str | None  # the built environment's interpreter, when complete
    setup: bool  # the image's setup commands already ran for this interpreter
    apt_missing: tuple[str, ...]
    # Whether this interpreter has every requirement; None when not probed: skyward (the probe)
    # cannot be imported yet, or the interpreter may not serve the nodes (`Query.probe`).
    satisfied: bool | None
    gpus: Inventory | None = None  # the machine's GPUs; None when not asked (`Query.gpus`)
    # The machine, as `platform` names it: whether the client's own uv binary runs there.
    system: str = ""
    machine: str = ""
    libc: str = ""  # "glibc" on most Linux machines, "" where unknown (musl)
    # What the cache's CLIENT_TOKEN file holds ("" without one): the token the client wrote in
    # its own cache when the host sees that very directory (a shared home).
    client_token: str = ""

    @classmethod
    def from_json(cls, text: str) -> HostReport:
        from skyward.worker.gpus import Inventory  # on the client, where skyward is importable

        data = json.loads(text)
        data["apt_missing"] = tuple(data["apt_missing"])
        if data.get("gpus") is not None:
            data["gpus"] = Inventory.from_dict(data["gpus"])
        return cls(**data)


@dataclass(frozen=True)
class Decision:
    """What the nodes run: `python` as it is, or (None) an environment built with uv."""

    python: str | None
    setup: bool = False  # run the image's setup commands once before using `python`


def check(
    query: Query,
    find_gpus: Callable[[], Inventory] | None = None,
    probe: Callable[[Sequence[str]], bool] | None = None,
) -> HostReport:
    """Look at this interpreter and the cache directory for `query`; `find_gpus` lists the
    GPUs (default: `skyward.worker.gpus.find_visible`, imported) and `probe` says whether the
    requirements are met (default: `skyward.worker.probe.satisfied`, imported when it can be:
    else ``satisfied=None``)."""
    home = os.path.expanduser(query.cache)
    env_dir = os.path.join(home, "envs", query.env)
    ready = os.path.exists(os.path.join(env_dir, READY_MARKER))
    satisfied: bool | None = False
    if query.probe and probe is not None:
        satisfied = probe(query.requirements)
    elif query.probe:
        try:
            from skyward.worker.probe import satisfied as imported
        except ImportError:
            satisfied = None
        else:
            satisfied = imported(query.requirements)
    system = platform.system()
    return HostReport(
        python=sys.executable,
        version=platform.python_version(),
        uid=os.getuid(),
        src=bool(query.src) and os.path.isfile(_source_init(home, query.src)),
        uv=_find_uv(home, query.uv) if query.uv else None,
        env=os.path.join(env_dir, "bin", "python") if ready else None,
        setup=os.path.exists(os.path.join(home, "setup", f"{query.env}.done")),
        apt_missing=tuple(p for p in query.apt if not _dpkg_installed(p)),
        satisfied=satisfied,
        gpus=(find_gpus or _find_gpus)() if query.gpus else None,
        system=system,
        machine=platform.machine(),
        libc=platform.libc_ver()[0] if system == "Linux" else "",
        client_token=_read_token(os.path.join(home, CLIENT_TOKEN)),
    )


def _read_token(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read(64).strip()
    except OSError:
        return ""


def same_python(version: str, wanted: str) -> bool:
    """Whether Python `version` ("3.11.2") is the `wanted` one ("3.11", or "3.11.2")."""
    return version.split(".")[: len(wanted.split("."))] == wanted.split(".")


def decide(report: HostReport, python_version: str | None, has_setup: bool) -> Decision:
    """The interpreter for the nodes, by one rule whatever earlier runs left in the cache: the
    inspected interpreter itself when it is the image's Python and has every requirement; else
    the environment built for the image, when complete; else a build."""
    version_ok = not python_version or same_python(report.version, python_version)
    if report.satisfied and version_ok:
        return Decision(report.python, setup=has_setup and not report.setup)
    if report.env is not None:
        return Decision(report.env)
    return Decision(None)


def _find_uv(home: str, version: str) -> str | None:
    """skyward's own uv `version` under `home`, else a uv on PATH or in ~/.local/bin (where
    uv's installer puts it) of the same minor version."""
    own = os.path.join(home, "bootstrap", f"uv-{version}", "bin", "uv")
    if os.access(own, os.X_OK):
        return own
    local = os.path.expanduser("~/.local/bin/uv")
    for found in dict.fromkeys((shutil.which("uv"), local if os.access(local, os.X_OK) else None)):
        if found is None:
            continue
        try:
            said = subprocess.run(
                [found, "--version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            continue
        if len(said) > 1 and said[1].split(".")[:2] == version.split(".")[:2]:
            return found
    return None


def _find_gpus() -> Inventory:
    from skyward.worker.gpus import find_visible

    return find_visible()


def _source_init(home: str, src: str) -> str:
    return os.path.join(home, "src", src, "skyward", "__init__.py")


def _dpkg_installed(package: str) -> bool:
    try:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:  # not a Debian system: nothing counts as installed
        return False
    return "install ok installed" in result.stdout


def program() -> str:
    """The check as one ``python3 -c`` program (the query's JSON on stdin) for a host where
    skyward may not be importable yet: this module's source, the GPU inventory's and the
    requirement probe's, each run as a module of its own, then `main` with the inventory's
    `find_visible` (a Slurm step's GPUs are those its CUDA_VISIBLE_DEVICES names) and the
    probe's `satisfied`. Built on the client."""
    from skyward.worker import gpus, hostcheck, probe

    return (
        "import sys, types\n"
        "def _module(name, source):\n"
        "    module = sys.modules[name] = types.ModuleType(name)\n"
        "    exec(compile(source, name, 'exec'), module.__dict__)\n"
        "    return module\n"
        f"gpus = _module('_skyward_gpus', {inspect.getsource(gpus)!r})\n"
        f"probe = _module('_skyward_probe', {inspect.getsource(probe)!r})\n"
        f"_module('_skyward_hostcheck', {inspect.getsource(hostcheck)!r})"
        ".main(gpus.find_visible, probe.satisfied)\n"
    )


def main(
    find_gpus: Callable[[], Inventory] | None = None,
    probe: Callable[[Sequence[str]], bool] | None = None,
) -> None:
    """``python -c PROGRAM [CACHE]`` (or ``-m skyward.worker.hostcheck``), the query's JSON on
    stdin: print the report. CACHE, when given, is the cache directory (the query's is then
    unused). The query comes on stdin, not as an argument: a requirement may be a URL with a
    token in it, and a command line is public on its machine.

    skyward's shipped source, when there, comes first on the path, so the probe is the client's.
    """
    data = json.loads(sys.stdin.read())
    if len(sys.argv) > 1:
        data["cache"] = sys.argv[1]
    query = Query(
        **{**data, "apt": tuple(data["apt"]), "requirements": tuple(data["requirements"])}
    )
    if query.src:
        home = os.path.expanduser(query.cache)
        sys.path.insert(0, os.path.join(home, "src", query.src))
    print(json.dumps(asdict(check(query, find_gpus, probe))))


if __name__ == "__main__":
    main()
