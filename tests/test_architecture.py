"""docs/architecture.md stays true to the code: the modules and paths it names exist, its
message table is the wire's messages, and the layers it states are the imports' (no module
imports one from a layer above its own, and no import circle). Each check is also run on a
page that is wrong, so it can fail."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward.providers.base import Capability, Provider, missing_verbs
from skyward.providers.local.provider import Local
from skyward.transport import messages
from tests.test_code_quality import _circles, _imports

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"


def _page() -> str:
    return PAGE.read_text()


# -- the modules and paths the page names ----------------------------------------------------


def _tree(text: str) -> str:
    found = re.search(r"## The parts\n.*?```\n(skyward/\n.*?)```", text, re.S)
    assert found, "docs/architecture.md lost its tree of the parts"
    return found.group(1)


_ENTRY = re.compile(r"^( {0,8})((?:[^ ,]+, )*[^ ,]+)(?: +(.*))?$")
_FILE = re.compile(r"(?<![\w/.<>-])(__\w+__\.py|[a-z]\w*\.py)\b")


def tree_paths(tree: str) -> Iterator[str]:
    """Every path the tree names, relative to the repository: each entry (a folder ends with
    ``/``; a line may list several, comma-separated), and each file an entry's words mention
    (``main.py ... profiles.py: ...``), which lives in that entry's folder."""
    folders: list[str] = []
    here = ""
    for line in tree.splitlines():
        entry = _ENTRY.match(line)
        words = line
        if entry and len(entry.group(1)) % 2 == 0 and len(entry.group(1)) <= 8:
            depth = len(entry.group(1)) // 2
            del folders[depth:]
            names = [n.strip() for n in entry.group(2).split(",") if n.strip()]
            words = entry.group(3) or ""
            for name in names:
                if "<" not in name:
                    yield "/".join([*folders, name]).rstrip("/")
            last = names[-1]
            here = (
                "/".join([*folders, last.rstrip("/")]) if last.endswith("/") else "/".join(folders)
            )
            if last.endswith("/"):
                folders.append(last.rstrip("/"))
        for mention in _FILE.findall(words):
            yield f"{here}/{mention}"


_SLASHED = re.compile(r"(?<![\w./<>-])((?:[a-z_]+/)+[a-z_]+\.(?:py|md))\b")
_DOTTED = re.compile(r"`(skyward(?:\.\w+)+)")


def missing_paths(text: str) -> list[str]:
    """The paths and `skyward.` module names in `text` that the repository does not have."""
    missing = [path for path in tree_paths(_tree(text)) if not (ROOT / path).exists()]
    for path in _SLASHED.findall(text):
        bases = (ROOT / "skyward", ROOT / "skyward" / "providers", ROOT, ROOT / "docs")
        if not any((base / path).exists() for base in bases):
            missing.append(path)
    missing += [name for name in _DOTTED.findall(text) if not _names_something(name)]
    return sorted(set(missing))


def _names_something(dotted: str) -> bool:
    """Whether `dotted` is a skyward module, or a name a module defines at its top."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                rest = parts[cut:]
                return not rest or rest[0] in _top_names(path)
    return False


def _top_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _defined(paths: list[Path]) -> set[str]:
    """Every name `paths` define anywhere: functions, classes, assigned names and attributes,
    and what they import."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


_QUALIFIED = re.compile(r"`([A-Za-z_]\w*)\.([A-Za-z_]\w*)")
# `sky.X` is the package as users import it; `ENTRY.attr` a provider folder's entry's field.
_NOT_CODE = {"sky", "ENTRY"}


def missing_names(text: str) -> list[str]:
    """The page's `module.name` and `Class.name` (backticked) that the code does not have:
    a module (by its file's name) or class skyward lacks, or a name it does not define. A
    lower-case name before the dot that is no module is a variable (`spec.nodes`), unless a
    class follows it (`callframes.Outcome`)."""
    modules: dict[str, list[Path]] = {}
    classes: dict[str, list[Path]] = {}
    for path in (ROOT / "skyward").rglob("*.py"):
        name = path.parent.name if path.name == "__init__.py" else path.stem
        modules.setdefault(name, []).append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(path)
    missing = []
    for owner, name in sorted(set(_QUALIFIED.findall(text))):
        if owner in _NOT_CODE or name == "py":  # `frames.py`: a file, checked above
            continue
        homes = classes.get(owner) if owner[0].isupper() else modules.get(owner)
        if homes is None:
            if owner[0].isupper() or name[0].isupper():
                missing.append(f"{owner}.{name}")
            continue
        submodule = any(
            (path.parent / f"{name}.py").is_file() or (path.parent / name / "__init__.py").is_file()
            for path in homes
            if path.name == "__init__.py"
        )
        if name not in _defined(homes) and not submodule:
            missing.append(f"{owner}.{name}")
    return missing


def test_every_module_and_path_the_page_names_exists() -> None:
    assert "skyward/worker/agent.py" in set(tree_paths(_tree(_page()))), "the tree was not read"
    assert missing_paths(_page()) == []
    assert missing_names(_page()) == []


def test_a_page_naming_a_module_the_code_lacks_fails() -> None:
    wrong = (
        _page()
        .replace("    dispatch.py      Dispatch", "    dispatcher.py    Dispatch", 1)
        .replace("`skyward.worker.agent`", "`skyward.worker.agents`", 1)
    )
    wrong += "\nSee `providers/remote/nowhere.py` and `skyward.errors.NoSuchError`.\n"
    assert missing_paths(wrong) == [
        "providers/remote/nowhere.py",
        "skyward.errors.NoSuchError",
        "skyward.worker.agents",
        "skyward/client/dispatcher.py",
    ]


def test_a_page_naming_what_the_code_lacks_fails() -> None:
    wrong = _page() + (
        "\n`callframes.Outcome`, `ReplyDecoder.fed`, `Dispatch.run`, `Dispatch.fly`,"
        " `eventloop.LoopThread`, `eventloop.Missing`, `spec.nodes`, `transport.frames`\n"
    )
    assert missing_names(wrong) == [
        "Dispatch.fly",
        "ReplyDecoder.fed",
        "callframes.Outcome",
        "eventloop.Missing",
    ]


# -- the message table -----------------------------------------------------------------------


def documented_messages(text: str) -> dict[int, tuple[str, tuple[str, ...]]]:
    """The page's message table: kind -> (message, its fields in order). A field is a
    backticked lower-case name in the fields column; the rest are its words."""
    table = {}
    for row in re.findall(r"^\| (\d+) \| `(\w+)` \|[^|]*\|([^|]*)\|", text, re.M):
        kind, name, column = row
        fields = tuple(re.findall(r"`([a-z_][a-z0-9_]*)`", column))
        table[int(kind)] = (name, fields)
    return table


def wire_messages() -> dict[int, tuple[str, tuple[str, ...]]]:
    """The messages `transport/messages.py` defines: kind -> (name, fields in order)."""
    return {
        cls.KIND: (cls.__name__, tuple(f.name for f in dataclasses.fields(cls)))
        for cls in vars(messages).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and hasattr(cls, "KIND")
    }


def test_the_message_table_is_the_wires() -> None:
    assert len(wire_messages()) > 10, "the wire's messages were not read"
    assert documented_messages(_page()) == wire_messages()


def test_a_table_without_a_message_or_a_field_fails() -> None:
    text = _page()
    without_ping = re.sub(r"^\| 5 \| `Ping` .*\n", "", text, flags=re.M)
    assert 5 not in documented_messages(without_ping)
    assert documented_messages(without_ping) != wire_messages()
    fewer = text.replace("`info` (InstanceInfo), `silence_timeout`", "`info` (InstanceInfo)", 1)
    assert fewer != text, "the Hello row changed: update this test's wrong version"
    assert documented_messages(fewer) != wire_messages()


# -- the layers ------------------------------------------------------------------------------


def documented_layers(text: str) -> list[list[str]]:
    """The page's layers, top first: each a line of modules and packages."""
    block = re.search(r"<!-- layers -->\n```\n(.*?)```\n<!-- /layers -->", text, re.S)
    assert block, "docs/architecture.md lost its list of layers"
    return [line.split("#")[0].split() for line in block.group(1).splitlines() if line.strip()]


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The layer of `module`: that of the longest name it is, or is inside of."""
    best: tuple[int, int] | None = None
    for index, names in enumerate(layers):
        for name in names:
            inside = module == name or (name != "skyward" and module.startswith(name + "."))
            if inside and (best is None or len(name) > best[1]):
                best = (index, len(name))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Every import from a layer above the importer's, and every module in no layer."""
    found = [f"{module} is in no layer" for module in graph if layer_of(module, layers) is None]
    for module, targets in graph.items():
        own = layer_of(module, layers)
        for target in sorted(targets):
            theirs = layer_of(target, layers)
            if own is not None and theirs is not None and theirs < own:
                found.append(f"{module} imports {target}, a layer above it")
    return sorted(found)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    graph = _imports()
    layers = documented_layers(_page())
    assert upward_imports(graph, layers) == []
    assert _circles(graph) == []


def test_a_layer_breach_is_found() -> None:
    layers = documented_layers(_page())
    graph = _imports()
    graph["skyward.worker.agent"] = graph["skyward.worker.agent"] | {"skyward.plugins.hooks"}
    graph["skyward.newmodule"] = set()
    assert upward_imports(graph, layers) == [
        "skyward.newmodule is in no layer",
        "skyward.worker.agent imports skyward.plugins.hooks, a layer above it",
    ]
    # The same pair with the page's layers swapped reads the other way.
    worker = next(i for i, names in enumerate(layers) if "skyward.worker" in names)
    swapped = [n for i, n in enumerate(layers) if i != worker]
    swapped.insert(0, layers[worker])
    assert any("skyward.worker" in breach for breach in upward_imports(_imports(), swapped))


# -- a capability's verbs --------------------------------------------------------------------


class _Listless(Local):
    """Declares listing without writing `find` or `cleanup`: it would list nothing."""

    capabilities = frozenset({*Local.capabilities, Capability.LIST})


@pytest.mark.parametrize("provider", [Local, _Listless])
def test_a_capability_without_its_verbs_is_named(provider: type[Provider]) -> None:
    expected = ["LIST: find", "LIST: cleanup"] if provider is _Listless else []
    assert missing_verbs(provider) == expected


def test_the_page_points_to_the_one_list_of_verbs() -> None:
    """The verbs are listed once, in `providers/base.py`'s docstring; the page points there."""
    text = _page()
    assert "`providers/base.py`'s docstring" in text
    assert "| `validate(spec)` |" not in text, "the page lists the provider verbs again"
