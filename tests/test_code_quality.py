"""The code stays ruff-clean, formatted and type-checked (the checks CI would otherwise skip)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


# What a reader of the product cannot follow: the tracker's numbers, a commit given as the
# reason for code, and the story of how or where the project was built.
_HISTORY = re.compile(r"[Ii]ssue [0-9]+|this session|CI machines|commits? [0-9a-f]{7}\b")


def test_the_product_speaks_of_the_product() -> None:
    """Code, docs, benchmarks/README.md, pyproject.toml and the README say the reason itself
    (a measured figure, what broke before); the history belongs to the commit messages."""
    files = [
        *(ROOT / "skyward").rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "benchmarks").rglob("*"),
        ROOT / "pyproject.toml",
        ROOT / "README.md",
    ]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        if path.is_file() and path.suffix in (".py", ".md", ".toml")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _HISTORY.search(line)
    ]
    assert found == []


def _imports() -> dict[str, set[str]]:
    """Which skyward modules each skyward module imports: every import statement, at the top,
    inside a function or under TYPE_CHECKING (a circle for the type checker only still means a
    name lives in the wrong place). The package root counts too: its TYPE_CHECKING block
    imports every public name's module, so a module that imported the root would close a
    circle."""
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
    """No import circles: docs/architecture.md's one-way imports, typing-only and lazy imports
    included."""
    graph = _imports()
    assert "skyward.client.session" in graph["skyward.client.dispatch"], (
        "the import graph was not read"
    )
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


# The vocabulary at the top: what a pool, a provider, a plugin and a node all speak.
VOCABULARY = (
    "skyward.errors",
    "skyward.checks",
    "skyward.image",
    "skyward.data",
    "skyward.info",
    "skyward.reports",
    "skyward.preemption",
    "skyward.hardware",
    "skyward.cost",
    "skyward.version",
)
# Every folder of providers/ (a provider's own, or what several share: remote/, cloud/), not
# the base class, the registry or the environment key: what the client and the command line
# never name. Read from the tree, so a new provider's folder is under the same rules.
CONCRETE_PROVIDERS = tuple(
    sorted(
        f"skyward.providers.{folder.name}"
        for folder in (ROOT / "skyward" / "providers").iterdir()
        if (folder / "__init__.py").is_file()
    )
)
# What detached/ may use of them: the SSH machinery the providers whose nodes are hosts share
# (a node's verified connection, its host key); the rest it asks the provider.
SHARED_REMOTE = "skyward.providers.remote"

# What a package must not import (docs/architecture.md, "What each package may import").
FORBIDDEN = {
    **{
        name: (
            "skyward.client",
            "skyward.providers",
            "skyward.console",
            "skyward.cli",
            "skyward.plugins",
            "skyward.transport",
            "skyward.pool",
            "skyward.calls",
        )
        for name in VOCABULARY
    },
    "skyward.calls": (
        "skyward.pool",
        "skyward.providers",
        "skyward.console",
        "skyward.cli",
        "skyward.detached",
    ),
    "skyward.pool": ("skyward.cli", "skyward.detached"),
    "skyward.detached": (
        "skyward.cli",
        *(name for name in CONCRETE_PROVIDERS if name != SHARED_REMOTE),
    ),
    "skyward.cli": CONCRETE_PROVIDERS,
    "skyward.transport": (
        "skyward.client",
        "skyward.detached",
        "skyward.providers",
        "skyward.console",
        "skyward.cli",
        "skyward.plugins",
        "skyward.worker",
        "skyward.pool",
        "skyward.calls",
        *(name for name in VOCABULARY if name != "skyward.errors"),
    ),
    "skyward.worker": (
        "skyward.client",
        "skyward.detached",
        "skyward.providers",
        "skyward.console",
        "skyward.cli",
        "skyward.plugins",
        "skyward.image",
        "skyward.hardware",
        "skyward.data",
        "skyward.cost",
        "skyward.pool",
        "skyward.calls",
    ),
    "skyward.console": (
        "skyward.client",
        "skyward.detached",
        "skyward.providers",
        "skyward.cli",
        "skyward.pool",
        "skyward.calls",
        "skyward.transport",
        "skyward.plugins",
    ),
    "skyward.client": (
        "skyward.pool",
        "skyward.calls",
        "skyward.cli",
        "skyward.detached",
        *CONCRETE_PROVIDERS,
    ),
    "skyward.providers": (
        "skyward.client",
        "skyward.detached",
        "skyward.pool",
        "skyward.calls",
        "skyward.cli",
        "skyward.plugins",
        "skyward.console.console",
        "skyward.console.terminal",
        "skyward.console.rendering",
        "skyward.console.notebook",
    ),
    "skyward.plugins": (
        "skyward.client",
        "skyward.detached",
        "skyward.providers",
        "skyward.console",
        "skyward.transport",
        "skyward.pool",
        "skyward.calls",
        "skyward.cli",
    ),
    "skyward.providers.aws": ("skyward.providers.gcp", "skyward.providers.slurm"),
    "skyward.providers.gcp": ("skyward.providers.aws", "skyward.providers.slurm"),
    "skyward.providers.slurm": ("skyward.providers.aws", "skyward.providers.gcp"),
}


def _breaches(graph: dict[str, set[str]]) -> list[str]:
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    found = {
        f"{source} imports {target}"
        for source, targets in graph.items()
        for package, banned in FORBIDDEN.items()
        if inside(source, package)
        for target in targets
        if any(inside(target, b) for b in banned)
    }
    # The root holds the public names only; a module imports the module that defines a name.
    found.update(
        f"{source} imports the package root" for source, t in graph.items() if "skyward" in t
    )
    return sorted(found)


def test_packages_import_only_what_the_architecture_allows() -> None:
    breaches = _breaches(_imports())
    assert not breaches, "imports across the architecture's lines: " + "; ".join(breaches)


def test_the_rule_checker_finds_a_breach() -> None:
    graph = {
        "skyward.transport.x": {"skyward.client.session"},
        "skyward.client.session": set(),
        "skyward.worker.y": {"skyward"},
    }
    assert _breaches(graph) == [
        "skyward.transport.x imports skyward.client.session",
        "skyward.worker.y imports the package root",
    ]


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


# The names more than one file may have: each does the same job in a different place
# (docs/architecture.md, "The parts").
SHARED_NAMES = {
    "__init__.py",
    "__main__.py",
    "base.py",  # its package's interface
    "provider.py",  # its folder's provider class
    "entry.py",  # its folder's registry entry (`skyward.providers.registry`)
    "instances.py",  # one job each for AWS and for GCP
    "resources.py",
    "teardown.py",
    "prices.py",
    "quotas.py",
    "api.py",  # the calls a provider makes to its service's API (GCP's, a cluster's)
}


def test_two_files_share_a_name_only_for_the_same_job() -> None:
    names = [path.name for path in (ROOT / "skyward").rglob("*.py")]
    shared = {name for name in names if names.count(name) > 1}
    assert shared <= SHARED_NAMES, f"files that share a name: {sorted(shared - SHARED_NAMES)}"


def _documented_agent_imports() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- agent-imports -->\n```\n(.*?)```\n<!-- /agent-imports -->", text, re.S)
    assert block, "docs/architecture.md lost its list of the agent's imports"
    return block.group(1).split()


def test_the_shipped_bytecode_is_for_the_agents_modules() -> None:
    """The source tarball compiles what an agent imports to start, the list above."""
    from skyward.providers.source import AGENT_MODULES

    assert sorted(AGENT_MODULES) == _documented_agent_imports()


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


def test_an_agent_unpickles_plugins_without_the_client_side() -> None:
    """The plugins an agent unpickles from `Hello` (as `client.plan.pickled` made them) load
    their own modules and the base class, not the image, packaging or the cluster spec: those
    name the client-side hooks' types, for the type checker only."""
    import skyward as sky
    from skyward.client.plan import pickled

    class Logged(sky.Plugin):  # defined in a function: pickled by value, as a notebook's is
        name = "logged"

    blob = pickled([sky.Plugin("x", around_app=lambda info: None), Logged(), sky.plugins.jax()])
    probe = (
        "import sys, skyward.worker.agent\n"
        "from skyward.transport import frames\n"
        "plugins = frames.loads([sys.stdin.buffer.read()])\n"
        "print(*[p.name for p in plugins])\n"
        "print(*sorted(sys.modules))\n"
    )
    names, modules = (
        subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, input=blob, capture_output=True, check=True
        )
        .stdout.decode()
        .splitlines()
    )
    assert names.split() == ["x", "logged", "jax"]
    loaded = set(modules.split())
    assert "skyward.plugins.jax_plugin" in loaded, "the jax plugin was not unpickled"
    assert sorted(loaded & {"packaging", "skyward.image", "skyward.hardware"}) == []


# The longest a function may be: one screen.
FUNCTION_LINES = 60
# Functions not yet split by job (empty: every function fits on a screen).
NOT_YET_SPLIT: set[str] = set()


def long_functions(root: Path = ROOT / "skyward") -> dict[str, int]:
    """Every function over `FUNCTION_LINES` lines under `root` (its `def` line to its last,
    decorators not counted), as ``path::Class.name`` -> lines. `python
    tests/test_code_quality.py` prints them."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for owner, node in _functions(tree, ""):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > FUNCTION_LINES:
                found[f"{path.relative_to(root.parent)}::{owner}{node.name}"] = lines
    return found


def _functions(
    tree: ast.AST, owner: str
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield owner, node
            yield from _functions(node, f"{owner}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{owner}{node.name}.")


def test_functions_fit_on_a_screen() -> None:
    found = long_functions()
    long = {where: lines for where, lines in found.items() if where not in NOT_YET_SPLIT}
    assert long == {}, f"functions over {FUNCTION_LINES} lines: split them by job"
    # The list says what is left: a function split (or gone) leaves it.
    split = sorted(NOT_YET_SPLIT - found.keys())
    assert split == [], f"no longer over {FUNCTION_LINES} lines: remove from NOT_YET_SPLIT"


def test_the_length_check_finds_a_long_function(tmp_path: Path) -> None:
    def function(name: str, lines: int) -> str:
        return f"    def {name}(self):\n" + "".join(f"        x = {i}\n" for i in range(lines - 1))

    short, long = function("short", FUNCTION_LINES), function("long", FUNCTION_LINES + 1)
    (tmp_path / "code.py").write_text(f"class A:\n{short}{long}")
    assert long_functions(tmp_path) == {f"{tmp_path.name}/code.py::A.long": FUNCTION_LINES + 1}


if __name__ == "__main__":
    for where, lines in long_functions().items():
        print(lines, where)
