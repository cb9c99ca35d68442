"""How skyward itself reaches a node: the client's own package, content-hashed, unpacked once.

Every provider ships skyward the same way, so client and nodes never run different versions: the
client's package dir as a .tar.gz whose hash covers every file's name and bytes, unpacked by one
shell command to ``<cache>/src/<hash>/skyward`` (on a remote host over SSH, on this machine for
Local), and that directory's parent on the nodes' ``PYTHONPATH``. Whether it is already there is
part of the one host check (`skyward.worker.hostcheck`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import marshal
import tarfile
from functools import cache
from pathlib import Path

# This file is skyward/providers/source.py: the package is two levels up. Found by path, not by
# importing `skyward`, whose lazy names import the providers back.
_PACKAGE = Path(__file__).resolve().parents[1]


@cache
def _files() -> tuple[tuple[str, bytes], ...]:
    paths = sorted(
        p
        for p in _PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in {".pyc", ".pyo"}
    )
    return tuple((p.relative_to(_PACKAGE.parent).as_posix(), p.read_bytes()) for p in paths)


@cache
def source_hash() -> str:
    """The content hash of the client's skyward package (file names and bytes)."""
    digest = hashlib.sha256()
    for name, data in _files():
        digest.update(name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()[:16]


# The modules an agent imports to start (docs/architecture.md lists them; a test holds the
# two lists equal): shipped with their bytecode too (`_bytecode`), the rest as source only,
# which keeps the tarball small for slow links (all of it compiled would triple its size).
AGENT_MODULES = (
    "skyward",
    "skyward.cachedir",
    "skyward.errors",
    "skyward.info",
    "skyward.preemption",
    "skyward.reports",
    "skyward.transport",
    "skyward.transport.agentwire",
    "skyward.transport.frames",
    "skyward.transport.messages",
    "skyward.version",
    "skyward.worker",
    "skyward.worker.agent",
    "skyward.worker.hookrunner",
    "skyward.worker.notices",
)


def _module_of(name: str) -> str:
    dotted = name.removesuffix(".py").replace("/", ".")
    return dotted.removesuffix(".__init__")


@cache
def source_tarball() -> bytes:
    """The client's skyward package as a .tar.gz (built only when a node lacks it), with the
    bytecode of the agent's modules for the client's Python (`_bytecode`)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for name, data in _files():
            _add(tar, name, data)
            if name.endswith(".py") and _module_of(name) in AGENT_MODULES:
                _add(tar, importlib.util.cache_from_source(name), _bytecode(name, data))
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _bytecode(name: str, source: bytes) -> bytes:
    """`source` compiled as a .pyc that its interpreter never checks against the source
    (PEP 552's unchecked hash): the directory is named by the content's hash, so its source
    never changes, and the first agent on a fresh node imports without compiling (on a pod,
    124 ms of imports compiling, 45-59 ms with bytecode). The nodes run the client's Python
    minor version (the host check's rule), which the bytecode is for; another ignores it."""
    code = compile(source, name, "exec", dont_inherit=True)
    flags = (0b01).to_bytes(4, "little")  # hash-based, unchecked
    hashed = importlib.util.source_hash(source)
    return importlib.util.MAGIC_NUMBER + flags + hashed + marshal.dumps(code)


def unpack_command(src_root: str) -> str:
    """The shell command that unpacks `source_tarball` (its stdin) under `src_root`, an
    expression valid inside double quotes (``$HOME/.cache/skyward/src``, ``$SKYWARD_SRC``)."""
    # Unpack beside, then rename: a host sharing the home never sees half a tree. mv -T fails
    # when another bootstrap won the race, which is fine. In a subshell with umask 077 and
    # tar's modes narrowed by it (root keeps the archive's otherwise): the cache is the
    # user's alone (`skyward.cachedir.cache_root`), and this may make its first directories.
    target = f"{src_root}/{source_hash()}"
    return (
        f'(set -e; umask 077; mkdir -p "{target}"; T=$(mktemp -d "{src_root}/.tmp-XXXXXX"); '
        f'tar --no-same-permissions -xzf - -C "$T"; '
        # Python makes __pycache__ under the umask of whoever imports first (a host check,
        # an agent before it sets its own): made here, they are 0700 too, and the bytecode
        # takes its source's 0600.
        f'find "$T/skyward" -type d ! -name __pycache__ -exec mkdir -p "{{}}/__pycache__" \\;; '
        f'mv -T "$T/skyward" "{target}/skyward" 2>/dev/null || true; '
        f'rm -rf "$T"; test -f "{target}/skyward/__init__.py")'
    )
