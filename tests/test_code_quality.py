"""The code stays ruff-clean, formatted and type-checked (the checks CI would otherwise skip)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
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


def _imports() -> dict[str, set[str]]:
    """Which skyward modules each skyward module imports: every import statement, at the top,
    inside a function or under TYPE_CHECKING (a circle for the type checker only still means a
    name lives in the wrong place). ``skyward/__init__.py`` is left out: it imports nothing
    itself, its public names load lazily."""
    paths = {}
    for path in (ROOT / "skyward").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        if name == "skyward":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [module_of(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [
                    module_of(f"{node.module}.{alias.name}")
                    if f"{node.module}.{alias.name}" in paths
                    else module_of(node.module)
                    for alias in node.names
                ]
            else:
                continue
            graph[name].update(t for t in targets if t and t != name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_imports_go_one_way() -> None:
    """No import circles: DESIGN.md's one-way imports, typing-only and lazy imports included."""
    graph = _imports()
    assert "skyward.client.session" in graph["skyward.client.dispatch"], (
        "the import graph was not read"
    )
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


# What a package must not import (docs/architecture.md, "What each package may import").
FORBIDDEN = {
    "skyward.transport": (
        "skyward.client",
        "skyward.providers",
        "skyward.console",
        "skyward.cli",
        "skyward.plugins",
        "skyward.pool",
        "skyward.calls",
    ),
    "skyward.worker": (
        "skyward.client",
        "skyward.providers",
        "skyward.console",
        "skyward.cli",
        "skyward.pool",
        "skyward.calls",
    ),
    "skyward.console": (
        "skyward.client",
        "skyward.providers",
        "skyward.cli",
        "skyward.pool",
        "skyward.transport",
        "skyward.plugins",
    ),
    "skyward.client": ("skyward.pool", "skyward.calls", "skyward.cli"),
    "skyward.providers": (
        "skyward.client",
        "skyward.pool",
        "skyward.calls",
        "skyward.cli",
        "skyward.plugins",
    ),
    "skyward.plugins": ("skyward.client", "skyward.providers", "skyward.pool", "skyward.cli"),
    "skyward.providers.aws": ("skyward.providers.gcp", "skyward.providers.slurm"),
    "skyward.providers.gcp": ("skyward.providers.aws", "skyward.providers.slurm"),
    "skyward.providers.slurm": ("skyward.providers.aws", "skyward.providers.gcp"),
}


def _breaches(graph: dict[str, set[str]]) -> list[str]:
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    return sorted(
        f"{source} imports {target}"
        for source, targets in graph.items()
        for package, banned in FORBIDDEN.items()
        if inside(source, package)
        for target in targets
        if any(inside(target, b) for b in banned)
    )


def test_packages_import_only_what_the_architecture_allows() -> None:
    breaches = _breaches(_imports())
    assert not breaches, "imports across the architecture's lines: " + "; ".join(breaches)


def test_the_rule_checker_finds_a_breach() -> None:
    graph = {"skyward.transport.x": {"skyward.client.session"}, "skyward.client.session": set()}
    assert _breaches(graph) == ["skyward.transport.x imports skyward.client.session"]


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def _documented_agent_imports() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- agent-imports -->\n```\n(.*?)```\n<!-- /agent-imports -->", text, re.S)
    assert block, "docs/architecture.md lost its list of the agent's imports"
    return block.group(1).split()


def test_an_agent_imports_only_the_wire_and_the_hook_runner() -> None:
    """An agent loads the wire, the hook runner and the vocabulary it reports with: not the
    plugins, the image, packaging or the client (what docs/architecture.md lists)."""
    probe = (
        "import sys, skyward.worker.agent; "
        "print(*sorted(m for m in sys.modules if m.split('.')[0] == 'skyward'))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert found == _documented_agent_imports()
    assert (
        "packaging"
        not in subprocess.run(
            [sys.executable, "-c", "import sys, skyward.worker.agent; print(*sys.modules)"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    )
