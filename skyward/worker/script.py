"""Run a user's script on a node, as ``python script.py args`` would (what ``skyward run`` does).

`run_script` runs in the agent: it starts the script as a child process, in the agent's process
group (so stopping the agent stops it) with the agent's environment (the JAX_* variables a
plugin exported), and returns its exit status. The child's output goes to the agent's fds 1 and
2, which are the node's output stream.

``python -m skyward.worker.script SCRIPT [ARGS...]`` is the child: it arranges that a bare
``jax.distributed.initialize()`` reads the JAX_* variables, then runs SCRIPT as ``__main__``
with ``sys.argv == [SCRIPT, *ARGS]`` and the script's directory first on ``sys.path``.

Runs on the nodes: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

from skyward import reports
from skyward.worker import jaxenv

# The file where the script's process names a module it could not import, for `run_script`.
_MISSING_MODULE = "SKYWARD_SCRIPT_MISSING_MODULE"


def run_script(
    script: str | os.PathLike[str], args: Sequence[str], cwd: str | os.PathLike[str] | None = None
) -> int:
    """Run `script` with `args` in `cwd` (default: the agent's) and return its exit status
    (``-N`` when signal N killed it). On the node, a `sky.Data` argument is already a path.
    A script that died of a ``ModuleNotFoundError`` raises one here, naming the module (its
    traceback is in the node's output already)."""
    with tempfile.NamedTemporaryFile("r", prefix="skyward-script-", suffix=".missing") as missing:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",  # its output streams as it is printed
            _MISSING_MODULE: missing.name,
        }
        command = [sys.executable, "-m", "skyward.worker.script", os.fspath(script), *args]
        read_end, write_end = os.pipe()
        env[reports.REPORTS_FD_ENV] = f"{write_end}:{os.fstat(write_end).st_ino}"
        try:
            child = subprocess.Popen(
                command, cwd=cwd, env=env, preexec_fn=die_with_parent, pass_fds=(write_end,)
            )
        finally:
            os.close(write_end)
        relay = threading.Thread(target=_relay_reports, args=(read_end,), name="skyward-script")
        relay.start()
        try:
            status = child.wait()
        finally:
            if child.poll() is None:  # the call was interrupted: the script goes with it
                child.kill()
                child.wait()
            relay.join(timeout=5)  # its reports before its result; a grandchild may hold the pipe
        name = missing.read().strip()
    if status != 0 and name:
        raise ModuleNotFoundError(f"No module named {name!r} on this node", name=name)
    return status


def _relay_reports(fd: int) -> None:
    """Hand the script's reports (a JSON line each, `reports.REPORTS_FD_ENV`) to this agent's
    outbox, as its own calls' reports go, until the script's end closes the pipe."""
    with open(fd, "rb") as pipe:
        for line in pipe:
            put = reports._put
            try:
                entry = reports.entry_of(line)
            except (ValueError, KeyError, TypeError):
                continue
            if put is not None:
                put(entry)


def die_with_parent() -> None:
    """In the child: SIGKILL when the agent dies, however it dies (Linux only)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: Sequence[str]) -> None:
    """Run ``argv[0]`` as the main script with ``argv[1:]`` as its arguments."""
    if not argv:
        sys.exit("usage: python -m skyward.worker.script SCRIPT [ARGS...]")
    script = argv[0]
    if "JAX_NUM_PROCESSES" in os.environ:
        jaxenv.teach_jax_when_imported()
    if os.environ.get(reports.REPORTS_FILE_ENV):  # a detached run's rank
        from skyward.worker import tensorboard

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        tensorboard.install_for_script(int(os.environ.get("RANK", "0") or 0), per_node)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except ModuleNotFoundError as exc:
        # The traceback is printed as ever; the agent also learns which module was missing.
        report = os.environ.get(_MISSING_MODULE)
        if report and exc.name:
            with open(report, "w") as out:
                out.write(exc.name)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
