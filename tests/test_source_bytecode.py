"""skyward's source as a node gets it (`skyward.providers.source`): unpacked by its own shell
command, an agent's first import reads the shipped bytecode and compiles nothing, and a
traceback still names the source file on the node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from skyward.providers.source import AGENT_MODULES, source_hash, source_tarball, unpack_command


def _unpacked(root: Path) -> Path:
    subprocess.run(
        ["sh", "-c", unpack_command(str(root))], input=source_tarball(), check=True, timeout=60
    )
    return root / source_hash()


def test_a_fresh_nodes_agent_imports_skyward_without_compiling_it(tmp_path: Path) -> None:
    src = _unpacked(tmp_path / "src")
    cached = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.pyc"))
    tag = sys.implementation.cache_tag
    assert f"skyward/worker/__pycache__/agent.{tag}.pyc" in cached
    assert len(cached) == len(AGENT_MODULES)  # the agent's modules only: the tarball stays small
    # The agent's modules' source replaced by a line that fails: an import that read (and
    # compiled) a module's source instead of its shipped bytecode raises.
    for module in AGENT_MODULES:
        path = src / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = src / module.replace(".", "/") / "__init__.py"
        path.write_text("raise ImportError('compiled from source')\n")
    ran = _python(src, "import skyward.worker.agent")
    assert ran.returncode == 0, ran.stderr
    # And the check can fail: a module without shipped bytecode is compiled, and raises.
    for pyc in (src / "skyward/worker/__pycache__").glob("agent.*.pyc"):
        pyc.unlink()
    assert "compiled from source" in _python(src, "import skyward.worker.agent").stderr


def test_the_shipped_bytecode_runs_and_names_its_source(tmp_path: Path) -> None:
    src = _unpacked(tmp_path / "src")
    probe = "import skyward.worker.agent as a; print(a.__file__, a.main.__code__.co_filename)"
    ran = _python(src, probe)
    assert ran.returncode == 0, ran.stderr
    file, code_file = ran.stdout.split()
    assert file == code_file == str(src / "skyward/worker/agent.py")


def _python(src: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by a fresh interpreter with `src` as its skyward, writing no bytecode."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=src.parent
    )
