"""The packages ``skyward run`` puts on the nodes, from everywhere a user writes them down.

- the script's own inline metadata (PEP 723, as ``uv run`` reads it): a ``# /// script`` block
  with ``dependencies``, ``requires-python`` and ``[tool.uv]`` index settings;
- ``--pip SPEC``, ``-r/--requirements FILE``, ``--index URL`` and ``--find-links URL`` (and the
  profile keys ``pip``, ``requirements``, ``indexes``, ``find_links``);
- with ``--workdir``, the work directory's ``pyproject.toml`` ``[project] dependencies``.

They become one `sky.Image` (`Packages.image`). Indexes are read as uv and pip read them: an
``index-url`` (``-i``, ``[[tool.uv.index]] default = true``) replaces the default index (PyPI),
an ``extra-index-url`` (``--index``, any other ``[[tool.uv.index]]``) is asked before it. A
``[tool.uv.sources]`` entry becomes an index scoped to the package or a direct reference
(``name @ git+...``, ``name @ https://...``); one the nodes cannot follow (a path on this
machine, markers) is an error. A malformed source is a `ConfigError` that names the file (and
line) before anything starts; a requirement no index serves fails the nodes' environment build,
and `unresolved` turns that into an error naming it and the indexes asked.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from skyward.errors import BootstrapError, ConfigError
from skyward.image import Image, Index
from skyward.worker.redact import redact_urls

# PEP 723's reference expression for a metadata block.
_BLOCK = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")
DEFAULT_INDEX = "then the default index (PyPI, unless the host's uv configuration names another)"


@dataclass(frozen=True)
class Packages:
    """Requirements and the indexes to find them on; `sources` says where they were read."""

    pip: tuple[str, ...] = ()
    indexes: tuple[Index, ...] = ()
    sources: tuple[str, ...] = ()

    def __add__(self, other: Packages) -> Packages:
        defaults = dict.fromkeys(i.url for i in (*self.indexes, *other.indexes) if i.default)
        if len(defaults) > 1:
            raise ConfigError(
                "more than one index replaces the default index (an index-url, a -i/--index-url "
                "line, a [[tool.uv.index]] with default = true): "
                f"{redact_urls(', '.join(defaults))} (from "
                f"{', '.join(dict.fromkeys((*self.sources, *other.sources)))}); keep one, and "
                "make the others extra indexes (extra-index-url, --extra-index-url, --index)"
            )
        return Packages(
            tuple(dict.fromkeys((*self.pip, *other.pip))),
            tuple(dict.fromkeys((*self.indexes, *other.indexes))),
            tuple(dict.fromkeys((*self.sources, *other.sources))),
        )

    def image(self) -> Image:
        """The nodes' image: these requirements, the extra indexes ahead of the default one
        (this one's if it names one, in place of PyPI)."""
        return Image(pip=self.pip, indexes=self.indexes)


def _requirements(specs: Iterable[Any], where: str) -> tuple[str, ...]:
    """`specs` checked as PEP 508 requirements; a bad one is a ConfigError naming `where`."""
    checked = []
    for spec in specs:
        if not isinstance(spec, str):
            raise ConfigError(f"{where}: a requirement must be a string, got {spec!r}")
        try:
            Requirement(spec)
        except InvalidRequirement as exc:
            raise ConfigError(f"{where}: {spec!r} is not a valid requirement: {exc}") from None
        checked.append(spec.strip())
    return tuple(checked)


def from_flags(
    pip: Sequence[str],
    requirements: Sequence[str],
    indexes: Sequence[str],
    find_links: Sequence[str],
) -> Packages:
    """``--pip`` specs, ``-r`` files, ``--index`` and ``--find-links`` URLs (or the profile's)."""
    found = Packages(
        _requirements(pip, "--pip"),
        (*(Index(url) for url in indexes), *(Index(url, flat=True) for url in find_links)),
        ("--pip",) if pip else (),
    )
    for name in requirements:
        found += requirements_file(Path(name))
    return found


def requirements_file(path: Path, seen: tuple[Path, ...] = ()) -> Packages:
    """What ``pip install -r PATH`` reads: requirements, ``-r`` includes, ``-i/--index-url``
    (the default index, in place of PyPI), ``--extra-index-url`` and ``-f/--find-links``;
    anything else is a ConfigError."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: includes itself (through -r)")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"-r {path}: cannot be read: {exc.strerror or exc}") from None
    found = Packages(sources=(str(path),))
    for number, line in _logical_lines(text):
        where = f"{path}:{number}"
        option, _, value = line.partition(" ") if line.startswith("-") else ("", "", line)
        value = value.strip()
        if "=" in option and option.startswith("--"):
            option, _, value = option.partition("=")
        if not option:
            found += Packages(_requirements([value], where))
        elif option in ("-r", "--requirement"):
            found += requirements_file(path.parent / value, (*seen, path.resolve()))
        elif option in ("-i", "--index-url"):
            found += Packages(indexes=(Index(value, default=True),))
        elif option == "--extra-index-url":
            found += Packages(indexes=(Index(value),))
        elif option in ("-f", "--find-links"):
            found += Packages(indexes=(Index(value, flat=True),))
        else:
            raise ConfigError(
                f"{where}: {option} is not supported in a requirements file for the nodes (they "
                "take requirements, -r, -i/--index-url, --extra-index-url and -f/--find-links)"
            )
    return found


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each requirement line: comments gone, ``\\`` continuations
    joined, blank lines skipped."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = " ".join((pending + line).split()), ""
        if line:
            lines.append((start, line))
    return lines


def script_metadata(path: Path) -> Packages:
    """The script's PEP 723 ``script`` block: its ``dependencies``, and the indexes and sources
    of its ``[tool.uv]`` table; its ``requires-python`` must admit this client's Python (the
    nodes run the client's). No block: nothing."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from None
    blocks = [m for m in _BLOCK.finditer(text) if m["type"] == "script"]
    if not blocks:
        if re.search(r"(?m)^# /// script\s*$", text):
            raise ConfigError(
                f"{path}: the '# /// script' metadata block is not closed by a '# ///' line (or "
                "a line inside it does not start with '#'): see PEP 723"
            )
        return Packages()
    if len(blocks) > 1:
        raise ConfigError(f"{path}: more than one '# /// script' metadata block (PEP 723)")
    block = blocks[0]
    line = text.count("\n", 0, block.start()) + 1
    where = f"{path}:{line} (its '# /// script' metadata)"
    content = "".join(
        row[2:] if row.startswith("# ") else row[1:]
        for row in block["content"].splitlines(keepends=True)
    )
    try:
        table = tomllib.loads(content)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    dependencies = table.get("dependencies", [])
    if not isinstance(dependencies, list):
        raise ConfigError(f"{where}: dependencies must be a list of requirement strings")
    _check_python(table.get("requires-python"), where)
    tool = table.get("tool", {})
    uv = tool.get("uv", {}) if isinstance(tool, dict) else {}
    uv = uv if isinstance(uv, dict) else {}
    sent, direct = _uv_sources(uv, where)
    return Packages(
        _with_direct_sources(_requirements(dependencies, where), direct, where),
        _uv_indexes(uv, sent, where),
        (f"{path.name}'s metadata",),
    )


def _check_python(requires: Any, where: str) -> None:
    if requires is None:
        return
    try:
        wanted = SpecifierSet(str(requires))
    except InvalidSpecifier:
        raise ConfigError(f"{where}: requires-python {requires!r} is not a version range") from None
    have = "{}.{}.{}".format(*sys.version_info[:3])
    if have not in wanted:
        raise ConfigError(
            f"{where}: requires-python {requires!r}, but the nodes run this client's Python "
            f"{have} (functions and results cross as pickles): run skyward with a Python that "
            "the script admits"
        )


def _uv_indexes(uv: dict[str, Any], sent: dict[str, list[str]], where: str) -> tuple[Index, ...]:
    """The indexes of a ``[tool.uv]`` table, in uv's order of priority: ``[[tool.uv.index]]``,
    then ``extra-index-url`` and ``find-links``; ``index-url`` and a ``[[tool.uv.index]]`` with
    ``default = true`` replace the default index. `sent` (index name: packages, from
    ``[tool.uv.sources]``) scopes an index to packages: an explicit one serves only those, and
    a package sent to an index is taken from it alone."""
    found: list[Index] = []
    named: set[str] = set()
    for entry in _list(uv.get("index", []), "[[tool.uv.index]]", where):
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"{where}: each [[tool.uv.index]] needs a url")
        named.add(str(entry.get("name")))
        url, flat = entry["url"], entry.get("format") == "flat"
        packages = sent.get(str(entry.get("name")), [])
        if packages:
            found.append(Index(url, packages=tuple(packages), flat=flat))
        if entry.get("explicit"):
            continue
        if entry.get("default"):
            if flat:
                raise ConfigError(
                    f"{where}: the [[tool.uv.index]] {redact_urls(url)} with default = true is "
                    'a flat page (format = "flat"): the default index must be a PEP 503 index'
                )
            found.append(Index(url, default=True))
        else:
            found.append(Index(url, flat=flat))
    for name, packages in sent.items():
        if name not in named:
            raise ConfigError(
                f"{where}: [tool.uv.sources] sends {', '.join(packages)} to the index {name!r}, "
                "which no [[tool.uv.index]] names: add one with that name (and its url)"
            )
    found += [Index(url) for url in _list(uv.get("extra-index-url", []), "extra-index-url", where)]
    found += [Index(u, flat=True) for u in _list(uv.get("find-links", []), "find-links", where)]
    if isinstance(uv.get("index-url"), str):
        found.append(Index(uv["index-url"], default=True))
    defaults = list(dict.fromkeys(i.url for i in found if i.default))
    if len(defaults) > 1:
        raise ConfigError(
            f"{where}: [tool.uv] names more than one default index "
            f"({redact_urls(', '.join(defaults))}: "
            "index-url and [[tool.uv.index]] with default = true): keep one"
        )
    return tuple(found)


# What a [tool.uv.sources] entry may hold for each kind of source the nodes can follow.
_SOURCE_KEYS = {
    "index": {"index"},
    "git": {"git", "rev", "tag", "branch", "subdirectory"},
    "url": {"url", "subdirectory"},
}


def _uv_sources(uv: dict[str, Any], where: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``[tool.uv.sources]`` as the nodes can follow it: (index name: the packages sent to it,
    package: the direct URL of its git or url source). A source on this machine (``path``,
    ``workspace``), a list of sources, or one for a marker, an extra or a group only, is a
    ConfigError that names the package: none is left out quietly."""
    sources = uv.get("sources", {})
    if not isinstance(sources, dict):
        raise ConfigError(f"{where}: [tool.uv.sources] must be a table")
    sent: dict[str, list[str]] = {}
    direct: dict[str, str] = {}
    for package, source in sources.items():
        entry = f"{where}: [tool.uv.sources] {package}"
        if isinstance(source, list):
            raise ConfigError(
                f"{entry} is a list of sources (one per marker); the nodes take one source a "
                "package: keep the one for the nodes (Linux, this client's Python), without "
                "its marker"
            )
        if not isinstance(source, dict):
            raise ConfigError(f"{entry} must be a table ({{ index = ... }}, {{ git = ... }}, ...)")
        if "path" in source or "workspace" in source:
            what = f"path {source['path']!r}" if "path" in source else "a workspace member"
            raise ConfigError(
                f"{entry} is {what} on this machine, which the nodes cannot see: publish the "
                "package to an index (and name the index in [tool.uv] or with --index), or, "
                "for a package beside the script, drop it from dependencies and run with "
                "--workdir DIR (the directory is copied to every node, and the script imports "
                "its sibling packages from there)"
            )
        kind = next((k for k in _SOURCE_KEYS if k in source), None)
        if kind is None:
            raise ConfigError(
                f"{entry} = {_redacted(source)} is not a source the nodes can follow: use "
                "{ index = NAME }, { git = URL } or { url = URL }"
            )
        unknown = sorted(set(source) - _SOURCE_KEYS[kind])
        if unknown:
            raise ConfigError(
                f"{entry}: {', '.join(unknown)} in a {kind} source is not supported for the "
                f"nodes (they take {', '.join(sorted(_SOURCE_KEYS[kind]))}): a source for a "
                "marker, an extra or a group only cannot be honoured; give the package one "
                "source for every node"
            )
        if kind == "index":
            sent.setdefault(str(source["index"]), []).append(package)
        else:
            direct[canonicalize_name(package)] = _direct_url(kind, source, entry)
    return sent, direct


def _direct_url(kind: str, source: dict[str, Any], entry: str) -> str:
    """A git or url source as the URL of a PEP 508 direct reference (``git+URL@REF``, with
    ``#subdirectory=`` where it names one)."""
    url = source[kind]
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{entry}: {kind} must be a URL")
    if url.removeprefix("git+").startswith("file:"):
        raise ConfigError(
            f"{entry}: {redact_urls(url)} is on this machine, which the nodes cannot see: "
            "publish it where the nodes can reach it (a git server, a web server, an index)"
        )
    if kind == "git":
        refs = [source[k] for k in ("rev", "tag", "branch") if k in source]
        if len(refs) > 1:
            raise ConfigError(f"{entry}: give one of rev, tag and branch")
        url = url if url.startswith("git+") else f"git+{url}"
        url += f"@{refs[0]}" if refs else ""
    if "subdirectory" in source:
        url += f"#subdirectory={source['subdirectory']}"
    return str(url)


def _with_direct_sources(
    pip: tuple[str, ...], direct: dict[str, str], where: str
) -> tuple[str, ...]:
    """`pip` with each requirement that has a git or url source as a direct reference to it
    (its extras and marker kept; the source decides the version)."""
    rewritten = []
    for spec in pip:
        requirement = Requirement(spec)
        url = direct.pop(canonicalize_name(requirement.name), None)
        if url is None:
            rewritten.append(spec)
            continue
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        marker = f" ; {requirement.marker}" if requirement.marker else ""
        rewritten.append(f"{requirement.name}{extras} @ {url}{marker}")
    if direct:
        raise ConfigError(
            f"{where}: [tool.uv.sources] gives a git or url source for "
            f"{', '.join(direct)}, which the dependencies do not list: a source applies to a "
            "dependency; add it to dependencies, or remove the source"
        )
    return tuple(rewritten)


def _redacted(value: Any) -> str:
    return redact_urls(repr(value))


def _list(value: Any, key: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: [tool.uv] {key} must be a list")
    return value


def project_dependencies(workdir: Path) -> Packages:
    """``[project] dependencies`` of the work directory's ``pyproject.toml`` (none without
    one)."""
    path = workdir / "pyproject.toml"
    if not path.is_file():
        return Packages()
    try:
        project = tomllib.loads(path.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from None
    dependencies = project.get("dependencies", []) if isinstance(project, dict) else []
    if not isinstance(dependencies, list):
        raise ConfigError(f"{path}: [project] dependencies must be a list")
    where = f"{path} [project] dependencies"
    return Packages(_requirements(dependencies, where), sources=(str(path),))


def unresolved(error: BootstrapError, asked: Packages) -> ConfigError | None:
    """A pool start that failed because uv could not resolve the nodes' requirements, as one
    error that says which (uv's own reason) and which indexes were asked; None for any other
    failure."""
    reason = _uv_reason(error.output or str(error))
    if reason is None:
        return None
    indexes = [
        f"{i.url} (for {', '.join(i.packages)})" if i.packages else i.url
        for i in asked.indexes
        if not i.default
    ]
    default = next((i.url for i in asked.indexes if i.default), None)
    last = DEFAULT_INDEX if default is None else f"then the default index {default}, not PyPI"
    where = redact_urls(", ".join([*indexes, last]))
    return ConfigError(
        f"the nodes' packages cannot be installed: {redact_urls(reason)} Indexes asked: {where}\n"
        f"Asked for: {', '.join(asked.pip)} (from {', '.join(asked.sources)}). Fix the "
        "requirement, or name the index that serves it with --index URL (or [tool.uv] in the "
        "script's metadata)."
    )


def _uv_reason(output: str) -> str | None:
    """uv's explanation of an unsatisfiable resolution ("Because foo was not found in the
    package registry and you require foo, ..."), on one line; None if the output has none."""
    lines = output.splitlines()
    for number, line in enumerate(lines):
        if "No solution found when resolving" in line:
            rest: list[str] = []
            for part in lines[number + 1 :]:
                part = part.strip().lstrip("╰─▶").strip().removeprefix("cause:").strip()
                if not part:  # the hints that follow are uv's, for uv's own command line
                    break
                rest.append(part)
            reason = " ".join(rest) or line.strip()
            # The requirements reach uv as a project of that name (`envbuild`).
            return reason.replace("skyward-node-environment depends on", "the nodes need")
    return None


def missing_module_hint(name: str) -> str:
    """What to say of a rank that died for want of module `name`: whether this client has
    it, and how to give it to the nodes."""
    top = name.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return (
            f"this client does not have {top!r} either: if it is a package, add it to the "
            f"nodes with --pip, -r FILE or the script's '# /// script' dependencies"
        )
    distributions = metadata.packages_distributions().get(top, [top])
    spec = distributions[0]
    how = f"--plugin {top}" if top in ("torch", "jax") else f"--pip {spec}"
    return (
        f"this client has it ({spec} {_version(spec)}), the nodes do not: add it with {how}, "
        f'or list it in the script\'s metadata (# /// script, dependencies = ["{spec}"])'
    )


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "installed"
