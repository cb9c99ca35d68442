"""Where the code the client ships by value came from, so remote tracebacks can show it.

cloudpickle sends the functions of ``__main__`` and of the user's own modules by value (their
code, not an import), and since cloudpickle 3.1.3 it names their file ``<dynamic-code>``: a
node's traceback then gives a line number but no file and no source line. The client has both:
`with_sources` puts the client's file name and source line back into such a traceback, finding
each frame's code among the modules it shipped by value (`ship`) by function name and line.
"""

from __future__ import annotations

import inspect
import linecache
import re
import sys
import types
from collections.abc import Iterator

# Top-level names of the modules whose functions travel by value (``__main__`` always does).
_shipped: set[str] = {"__main__"}

_DYNAMIC = re.compile(
    r'^(?P<indent>\s*)File "<dynamic-code>", line (?P<line>\d+), in (?P<name>.+)$'
)


def ship(top: str) -> None:
    """Record that the functions of top-level module `top` now travel by value."""
    _shipped.add(top)


def is_shipped(top: str) -> bool:
    """Whether the functions of top-level module `top` travel by value."""
    return top in _shipped


def with_sources(traceback: str) -> str:
    """`traceback` (a node's, as text) with the client's file and source line for each frame
    of code shipped by value; frames it cannot place are left as they are."""
    lines = traceback.splitlines()
    out: list[str] = []
    for number, line in enumerate(lines):
        found = _DYNAMIC.match(line)
        where = found and _locate(found["name"], int(found["line"]))
        if not found or where is None:
            out.append(line)
            continue
        indent = found["indent"]
        out.append(f'{indent}File "{where}", line {found["line"]}, in {found["name"]}')
        source = linecache.getline(where, int(found["line"])).strip()
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if source and not following.startswith(indent + " "):  # the node had no source line
            out.append(f"{indent}  {source}")
    return "\n".join(out)


def _locate(name: str, line: int) -> str | None:
    """The file of the shipped code object called `name` whose lines include `line`."""
    for code in _shipped_code():
        if name in (code.co_name, getattr(code, "co_qualname", code.co_name)) and any(
            start == line for _, _, start in code.co_lines() if start is not None
        ):
            return code.co_filename
    return None


def _shipped_code() -> Iterator[types.CodeType]:
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in _shipped:
            continue
        for value in list(vars(module).values()):
            for member in [value, *_members(value)]:
                function = inspect.unwrap(getattr(member, "fn", member))
                code = getattr(function, "__code__", None)
                if isinstance(code, types.CodeType):
                    yield from _nested(code)


def _members(value: object) -> list[object]:
    return list(vars(value).values()) if isinstance(value, type) else []


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)
