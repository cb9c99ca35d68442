"""Build a node's Python environment with uv, once per image hash, under a cache directory.

Runs on the node (``python -m skyward.worker.envbuild`` reads a JSON `EnvSpec` on stdin and prints
the environment's interpreter path, or with ``--setup-only`` only runs the setup commands once)
and in-process for the Local provider. Standard library only, Python 3.8+: it runs with the
host's own python3, before the environment it builds exists.

The environment's Python is the spec's (the client's major.minor unless the image names one):
the interpreter this runs with when it is that version, else whatever uv finds for the version
(a ``python3.X`` on PATH, a Python uv manages, one uv downloads: under ``<cache>/python`` unless
``UV_PYTHON_INSTALL_DIR`` says otherwise). The image's indexes reach uv as configuration it
reads: unscoped ones as ``[[index]]`` entries of a ``--config-file``, ahead of the default index;
ones scoped to packages as explicit indexes of the requirements' pyproject.toml, with a source
for each package; the image's default index, when it names one, as ``UV_DEFAULT_INDEX`` in uv's
environment (where a host's own ``UV_DEFAULT_INDEX`` or ``UV_INDEX_URL`` would otherwise win
over any configuration file).

Layout of the cache directory::

    <cache>/envs/<hash>/            the virtual environment (built in place under a lock)
    <cache>/envs/<hash>/.skyward-ready   written last: the environment is complete
    <cache>/envs/<hash>.lock        flock held while building, so concurrent pools wait
    <cache>/python/                 Pythons uv downloads (where the host has not the client's)
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from skyward.worker.filelock import locked
from skyward.worker.hostcheck import READY_MARKER as READY_MARKER
from skyward.worker.hostcheck import same_python
from skyward.worker.redact import redact_urls

OUTPUT_TAIL_LINES = 40


@dataclass(frozen=True)
class EnvSpec:
    """Everything needed to build one environment; travels as JSON to remote nodes."""

    hash: str
    python: str | None = None  # "3.11": the environment's Python; None: the base interpreter's
    pip: tuple[str, ...] = ()
    # [url, [package, ...], flat]; an index with packages serves only those packages
    indexes: tuple[tuple[str, tuple[str, ...], bool], ...] = ()
    default_index: str | None = None  # in place of PyPI (and of the host's UV_DEFAULT_INDEX)
    setup: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EnvSpec:
        data = json.loads(text)
        data["pip"] = tuple(data.get("pip", ()))
        data["indexes"] = tuple((u, tuple(p), bool(f)) for u, p, f in data.get("indexes", ()))
        data["setup"] = tuple(data.get("setup", ()))
        return cls(**data)


class BuildFailed(Exception):
    """A step of the build failed; `output` holds the tail of what it printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def build(
    spec: EnvSpec,
    cache: Path,
    uv: str,
    log: Callable[[str], None] = lambda line: None,
    *,
    base_python: str | None = None,
) -> Path:
    """Return the interpreter of the environment for `spec`, building it if it is not there.

    `base_python` (default: this interpreter) is the one the environment is made from when it
    is the spec's Python; otherwise uv finds (or downloads) that version.
    """
    envs = cache / "envs"
    envs.mkdir(mode=0o700, parents=True, exist_ok=True)
    env_dir = envs / spec.hash
    if (env_dir / READY_MARKER).exists():
        return env_python(env_dir)
    with locked(envs / f"{spec.hash}.lock"):
        if (env_dir / READY_MARKER).exists():  # another pool built it while we waited
            return env_python(env_dir)
        shutil.rmtree(env_dir, ignore_errors=True)
        try:
            _build_into(spec, env_dir, uv, log, base_python)
        except BaseException:
            shutil.rmtree(env_dir, ignore_errors=True)
            raise
        # uv makes the environment's own lock 0666 whatever the umask (for other users who
        # share an environment): this one is the user's alone.
        if (env_dir / ".lock").exists():
            os.chmod(env_dir / ".lock", 0o600)
        _write_private(env_dir / READY_MARKER, spec.to_json())
    return env_python(env_dir)


def run_setup_once(spec: EnvSpec, cache: Path, log: Callable[[str], None]) -> None:
    """Run the image's setup commands once per image hash (for environments not built here)."""
    if not spec.setup:
        return
    marks = cache / "setup"
    marks.mkdir(mode=0o700, parents=True, exist_ok=True)
    done = marks / f"{spec.hash}.done"
    with locked(marks / f"{spec.hash}.lock"):
        if done.exists():
            return
        _run_setup(spec, log)
        _write_private(done, "ok\n")


def _write_private(path: Path, text: str) -> None:
    """Write `path` 0600 whatever the umask (a Local build runs in the client's, often 022):
    `.skyward-ready` holds the image's env= values."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        out.write(text)


def _build_into(
    spec: EnvSpec, env_dir: Path, uv: str, log: Callable[[str], None], base_python: str | None
) -> None:
    base = base_python or sys.executable
    python = base if spec.python is None or _is_version(base, spec.python) else spec.python
    env = dict(os.environ)
    env.setdefault("UV_PYTHON_INSTALL_DIR", str(env_dir.parent.parent / "python"))
    if spec.default_index is not None:
        # In the environment, not on the command line, which is public on its machine.
        env.pop("UV_INDEX_URL", None)
        env["UV_DEFAULT_INDEX"] = spec.default_index
    try:
        _run([uv, "venv", "--quiet", "--python", python, str(env_dir)], log, "uv venv", env=env)
    except BuildFailed as exc:
        if python == base:
            raise
        have = _version_of(base)
        raise BuildFailed(
            f"the nodes must run Python {spec.python}, the client's (functions pickled by "
            f"cloudpickle do not cross minor versions), but this host's {base} is {have} and uv "
            f"found no Python {spec.python} here nor could download one. Install python"
            f"{spec.python} on the host, let uv download it (a route to GitHub, or "
            "UV_PYTHON_INSTALL_MIRROR in the provider's build_env), or run the client on "
            f"Python {'.'.join(have.split('.')[:2])}",
            exc.output,
        ) from None
    if spec.pip:
        with tempfile.TemporaryDirectory(prefix="skyward-req-") as tmp:
            project = Path(tmp) / "pyproject.toml"
            project.write_text(_requirements_project(spec))
            command = [uv, "pip", "install", "--python", str(env_python(env_dir))]
            config = _index_config(spec)
            if config:
                (Path(tmp) / "uv.toml").write_text(config)
                command += ["--config-file", str(Path(tmp) / "uv.toml")]
            command += ["-r", str(project)]
            _run(command, log, "uv pip install", env=env)
    _run_setup(spec, log, env_dir)


def _version_of(python: str) -> str:
    """The full version of interpreter `python` ("3.11.2"); "unknown" if it cannot be asked."""
    if python == sys.executable:
        return platform.python_version()
    try:
        done = subprocess.run(
            [python, "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def _is_version(python: str, wanted: str) -> bool:
    return same_python(_version_of(python), wanted)


def _run_setup(spec: EnvSpec, log: Callable[[str], None], env_dir: Path | None = None) -> None:
    env = {**os.environ, **spec.env}
    if env_dir is not None:
        env["VIRTUAL_ENV"] = str(env_dir)
        env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    for command in spec.setup:
        what = f"setup command {redact_urls(command)!r}"
        _run(["/bin/sh", "-c", command], log, what, env=env)


def _requirements_project(spec: EnvSpec) -> str:
    """The requirements as a pyproject.toml, with the indexes scoped to packages: the form in
    which uv takes an index for some packages only (it reads nothing else of such a file)."""
    lines = [
        "[project]",
        'name = "skyward-node-environment"',
        'version = "0"',
        "dependencies = [" + ", ".join(json.dumps(r) for r in spec.pip) + "]",
        "",
    ]
    sources: dict[str, str] = {}
    for number, (url, packages, flat) in enumerate(spec.indexes):
        if not packages:
            continue  # in the config file (`_index_config`)
        name = f"index-{number}"
        lines += ["[[tool.uv.index]]", *_index_lines(name, url, flat), "explicit = true", ""]
        sources.update(dict.fromkeys(packages, name))
    if sources:
        lines.append("[tool.uv.sources]")
        lines += [f'{pkg} = {{ index = "{index}" }}' for pkg, index in sources.items()]
    return "\n".join(lines) + "\n"


def _index_config(spec: EnvSpec) -> str:
    """A uv.toml with the unscoped indexes, in order, ahead of the default index ("" when there
    are none: then uv reads its usual configuration, e.g. a host's /etc/uv/uv.toml)."""
    lines: list[str] = []
    for number, (url, packages, flat) in enumerate(spec.indexes):
        if not packages:
            lines += ["[[index]]", *_index_lines(f"index-{number}", url, flat), ""]
    return "\n".join(lines)


def _index_lines(name: str, url: str, flat: bool) -> list[str]:
    lines = [f'name = "{name}"', f"url = {json.dumps(url)}"]
    return [*lines, 'format = "flat"'] if flat else lines


def _run(
    command: list[str],
    log: Callable[[str], None],
    what: str,
    env: dict[str, str] | None = None,
) -> None:
    tail: list[str] = []
    # uv and the setup commands run under umask 077: `main` sets it on a host, but a Local
    # build runs in the client's process, under the user's umask. So the venv, the new entries
    # of uv's cache its files are linked from, a Python uv downloads and what setup commands
    # write are owner-only. A shell sets it: Popen's `umask=` needs Python 3.9.
    private = ["/bin/sh", "-c", 'umask 077 && exec "$@"', "sh", *command]
    with subprocess.Popen(
        private,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            # uv, pip and a setup command may echo an index URL with its password in it.
            line = redact_urls(line.rstrip("\n"))
            log(line)
            tail = [*tail[-(OUTPUT_TAIL_LINES - 1) :], line]
        status = proc.wait()
    if status != 0:
        raise BuildFailed(f"{what} failed with exit status {status}", "\n".join(tail))


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    """``python -m skyward.worker.envbuild CACHE UV``: build the spec read from stdin and print
    ``{"python": ...}``; ``CACHE --setup-only``: run its setup commands once, print
    ``{"ok": true}``.
    A failure prints ``{"error", "output"}`` and exits 1."""
    # What the build writes (the environment, `.skyward-ready` with the image's env) is owner-only,
    # as `skyward.cachedir.keep_private` makes it for the other node programs. Not imported from
    # there: this runs under whatever python3 the host has (3.8 on some), and skyward needs
    # 3.10.
    os.umask(0o077)
    cache, uv = Path(sys.argv[1]).expanduser(), sys.argv[2]
    spec = EnvSpec.from_json(sys.stdin.read())
    try:
        if uv == "--setup-only":
            run_setup_once(spec, cache, _to_stderr)
            print(json.dumps({"ok": True}))
        else:
            print(json.dumps({"python": str(build(spec, cache, uv, _to_stderr))}))
    except BuildFailed as exc:
        print(json.dumps({"error": str(exc), "output": exc.output}))
        sys.exit(1)


if __name__ == "__main__":
    main()
