"""The ``skyward`` command: versions, cached environments, and skyward's EC2 resources.

``skyward ls`` lists everything tagged ``skyward:pool`` in a region; ``skyward down POOL`` (or
``--all``) removes it: the orphan sweep for pools whose client died before its teardown.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from skyward import __version__
from skyward.providers.local import cache_dir
from skyward.providers.source import source_hash
from skyward.worker import envbuild

_DESCRIPTION = (
    "Versions, cached environments, and skyward's EC2 resources. 'skyward ls' lists everything "
    "tagged skyward:pool in a region; 'skyward down POOL' (or --all) removes it: the orphan "
    "sweep for pools whose client died before its teardown."
)


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


def _old_sources(cache: Path) -> list[Path]:
    """Copies of skyward other than this client's own (one is made per version of the source)."""
    src = cache / "src"
    if not src.exists():
        return []
    return sorted(p for p in src.iterdir() if p.is_dir() and p.name != source_hash())


def _cache_clear(cache: Path) -> int:
    envs = _environments(cache)
    sources = _old_sources(cache)
    for path in [*envs, *sources]:
        shutil.rmtree(path, ignore_errors=True)
    print(f"removed {len(envs)} environment(s) from {cache / 'envs'}")
    print(f"removed {len(sources)} old copy(ies) of skyward from {cache / 'src'}")
    return 0


def _aws_session(region: str | None, profile: str | None) -> Any:
    import boto3

    return boto3.session.Session(region_name=region, profile_name=profile)


def _aws(args: argparse.Namespace) -> Any:
    from skyward.providers.aws import AWS

    aws = AWS(session=_aws_session(args.region, args.profile))
    aws.check_access()  # no region or no credentials: one clear line, not a botocore traceback
    return aws


def _aws_ls(args: argparse.Namespace) -> int:
    from skyward.providers.aws import resources

    pools = resources.find(_aws(args).client("ec2"))
    if not pools:
        print("no skyward resources in this region")
    for pool in sorted(pools.values(), key=lambda p: p.pool_id):
        when = pool.created_at.strftime("%Y-%m-%d %H:%M UTC") if pool.created_at else "?"
        print(f"{pool.pool_id}  created {when} by {pool.created_by or '?'}")
        for line in pool.describe():
            print(f"    {line}")
    return 0


def _aws_down(args: argparse.Namespace) -> int:
    if not args.all and not args.pool:
        print("skyward down: name a POOL (see `skyward ls`) or pass --all", file=sys.stderr)
        return 2
    removed = _aws(args).cleanup(older_than=0, pool=None if args.all else args.pool)
    for line in removed:
        print(f"removed {line}")
    if not removed:
        print("nothing to remove")
    return 0


def _aws_command(args: argparse.Namespace) -> int:
    """`skyward ls` / `skyward down`; an AWS problem is one line on stderr and exit status 1."""
    from botocore.exceptions import BotoCoreError, ClientError

    from skyward.errors import SkywardError

    try:
        return _aws_ls(args) if args.command == "ls" else _aws_down(args)
    except (SkywardError, BotoCoreError, ClientError) as exc:
        print(f"skyward {args.command}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="skyward", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"skyward {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    cache = commands.add_parser("cache", help="node environments built on this machine")
    cache.add_argument("action", choices=["list", "clear"])
    for name, text in (("ls", "list skyward's EC2 resources"), ("down", "remove them")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--region", help="AWS region (default: the standard resolution)")
        sub.add_argument("--profile", help="AWS profile")
        if name == "down":
            sub.add_argument("pool", nargs="?", help="the pool id (see `skyward ls`)")
            sub.add_argument("--all", action="store_true", help="every skyward pool")
    args = parser.parse_args(argv)
    if args.command in ("ls", "down"):
        return _aws_command(args)
    if args.command == "cache":
        where = cache_dir()
        return _cache_list(where) if args.action == "list" else _cache_clear(where)
    return 2


if __name__ == "__main__":
    sys.exit(main())
