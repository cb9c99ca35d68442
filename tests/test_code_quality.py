"""The code stays ruff-clean, formatted and type-checked (the checks CI would otherwise skip)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.typecheck import MypyReport

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_lint_and_format() -> None:
    lint = _run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_strict_on_the_package(mypy_report: MypyReport) -> None:
    assert mypy_report.errors["skyward"] == [], mypy_report.output


# Small modules with one job each (docs/architecture.md): past these sizes a module is doing
# more than one job and wants splitting, and the pool keeps its lifecycle only.
MAX_MODULE_LINES = 450
MAX_POOL_LINES = 350


def test_no_module_is_too_long() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in (ROOT / "skyward").rglob("*.py")
    }
    too_long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
    assert sizes["skyward/pool.py"] <= MAX_POOL_LINES, sizes["skyward/pool.py"]
