"""The ``skyward`` command: versions, and the environments cached on this machine."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from skyward import __version__
from skyward.providers.local import cache_dir
from skyward.worker import envbuild


def _environments(cache: Path) -> list[Path]:
    envs = cache / "envs"
    return sorted(p for p in envs.iterdir() if p.is_dir()) if envs.exists() else []


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _cache_list(cache: Path) -> int:
    envs = _environments(cache)
    if not envs:
        print(f"no environments in {cache / 'envs'}")
    for env in envs:
        state = "ready" if (env / envbuild.READY_MARKER).exists() else "incomplete"
        print(f"{env.name}  {_size(env) / 1e6:8.1f} MB  {state}")
    return 0


def _cache_clear(cache: Path) -> int:
    envs = _environments(cache)
    for env in envs:
        shutil.rmtree(env, ignore_errors=True)
    print(f"removed {len(envs)} environment(s) from {cache / 'envs'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="skyward", description=__doc__)
    parser.add_argument("--version", action="version", version=f"skyward {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    cache = commands.add_parser("cache", help="node environments built on this machine")
    cache.add_argument("action", choices=["list", "clear"])
    args = parser.parse_args(argv)
    if args.command == "cache":
        where = cache_dir()
        return _cache_list(where) if args.action == "list" else _cache_clear(where)
    return 2


if __name__ == "__main__":
    sys.exit(main())
