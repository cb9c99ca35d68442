"""The ``skyward`` command: run a script on a pool, list live pools, cached environments, and
skyward's EC2 resources.

``skyward run script.py`` runs an unmodified script on every node (see `skyward.cli.runner`);
``skyward status`` lists this user's live pools; ``skyward ls`` lists everything tagged
``skyward:pool`` in a region; ``skyward down POOL`` (or ``--all``) removes it: the orphan sweep
for pools whose client died before its teardown. An error is one line on stderr (the traceback
too with ``--debug``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from skyward import checks
from skyward.errors import ConfigError
from skyward.info import cache_root
from skyward.providers import registry
from skyward.providers.source import source_hash
from skyward.version import __version__
from skyward.worker import envbuild

_DESCRIPTION = (
    "Run a script on a pool, list live pools, cached environments, and skyward's EC2 resources. "
    "'skyward run --nodes 2 script.py' runs an unmodified script on every node; 'skyward status' "
    "lists your live pools; 'skyward ls' lists everything tagged skyward:pool in a region; "
    "'skyward down POOL' (or --all) removes it: the orphan sweep for pools whose client died "
    "before its teardown."
)
_RUN_EPILOG = (
    "Every node runs 'python SCRIPT ARGS' with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
    "JAX_PROCESS_ID set, so jax.distributed.initialize() needs no arguments, and torchrun's "
    "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so "
    "torch.distributed.init_process_group('gloo') needs none either. Settings come from "
    "[profile.NAME] in ./skyward.toml or [tool.skyward.profile.NAME] in ./pyproject.toml "
    "(default: 'default'); flags override them."
)


def _environments(cache: Path) -> list[Path]:
    envs = cache / "envs"
    return sorted(p for p in envs.iterdir() if p.is_dir()) if envs.exists() else []


def _size(path: Path) -> int:
    """Bytes of the files under `path`, each content once however many hard links it has."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for f in path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _cache_list(cache: Path) -> int:
    envs = _environments(cache)
    if not envs:
        print(f"no environments in {cache / 'envs'}")
    for env in envs:
        state = "ready" if (env / envbuild.READY_MARKER).exists() else "incomplete"
        print(f"{env.name}  {_size(env) / 1e6:8.1f} MB  {state}")
    data = cache / "data"
    if data.exists():
        # Trees are hard links into objects/ (and S3 versions into each other): count each
        # file once.
        print(f"sky.Data on this machine: {_size(data) / 1e6:.1f} MB in {data}")
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
    data = cache / "data"
    for path in [*envs, *sources, data]:
        shutil.rmtree(path, ignore_errors=True)
    print(f"removed {len(envs)} environment(s) from {cache / 'envs'}")
    print(f"removed {len(sources)} old copy(ies) of skyward from {cache / 'src'}")
    print(f"removed the sky.Data store and S3 downloads in {data}")
    return 0


def _aws_session(region: str | None, profile: str | None) -> Any:
    import boto3

    return boto3.session.Session(region_name=region, profile_name=profile)


def _aws(args: argparse.Namespace) -> Any:
    from skyward.providers.aws import AWS

    aws = AWS(session=_aws_session(args.region, args.profile))
    aws.check_access()  # no region or no credentials: one clear line, not a botocore traceback
    return aws


def _ls_or_down(
    args: argparse.Namespace,
    find: Callable[[], Mapping[str, Any]],
    cleanup: Callable[[str | None], list[str]],
    where: str,
) -> int:
    """`skyward ls` (what `find` lists, by pool) or `skyward down` (`cleanup` of one pool, or
    of all with None), for one cloud."""
    if args.command == "ls":
        pools = find()
        if not pools:
            print(f"no skyward resources in this {where}")
        for pool in sorted(pools.values(), key=lambda p: p.pool_id):
            when = pool.created_at.strftime("%Y-%m-%d %H:%M UTC") if pool.created_at else "?"
            print(f"{pool.pool_id}  created {when} by {pool.created_by or '?'}")
            for line in pool.describe():
                print(f"    {line}")
        return 0
    removed = cleanup(None if args.all else args.pool)
    for line in removed:
        print(f"removed {line}")
    if not removed:
        print("nothing to remove")
    return 0


def _cloud_command(
    args: argparse.Namespace, command: Callable[[], int], errors: tuple[type[BaseException], ...]
) -> int:
    """`command()`, with a cloud's problem (`errors`) as one line on stderr and exit status 1
    (the traceback with --debug). A bare `skyward down` is refused before any cloud call: it
    must never mean "everything"."""
    if args.command == "down" and not args.all and not args.pool:
        print("skyward down: name a POOL (see `skyward ls`) or pass --all", file=sys.stderr)
        return 2
    try:
        return command()
    except errors as exc:
        if args.debug:
            traceback.print_exc()
        print(f"skyward {args.command}: {exc}", file=sys.stderr)
        return 1


def _aws_command(args: argparse.Namespace) -> int:
    """`skyward ls` / `skyward down`: the region's skyward resources."""
    from botocore.exceptions import BotoCoreError, ClientError

    from skyward.errors import SkywardError

    def command() -> int:
        from skyward.providers.aws import resources

        aws = _aws(args)
        return _ls_or_down(
            args,
            lambda: resources.find(aws.client("ec2")),
            lambda pool: aws.cleanup(older_than=0, pool=pool),
            "region",
        )

    return _cloud_command(args, command, (SkywardError, BotoCoreError, ClientError))


def _gcp(args: argparse.Namespace) -> Any:
    from skyward.providers.gcp import GCP

    gcp = GCP(project=args.project, zone=args.zone)
    gcp.access()  # no project or no credentials: one clear line, not a traceback
    return gcp


def _gcp_command(args: argparse.Namespace) -> int:
    """`skyward ls --cloud gcp` / `skyward down --cloud gcp`: the project's skyward resources."""
    from skyward.errors import SkywardError

    try:
        from google.api_core.exceptions import GoogleAPIError

        from skyward.providers.gcp import tpus  # noqa: F401  # both clients are installed
    except ModuleNotFoundError as exc:
        print(f"skyward {args.command}: {exc.name} is missing: pip install 'skyward[gcp]'")
        return 1

    def command() -> int:
        gcp = _gcp(args)
        return _ls_or_down(args, gcp.find, lambda pool: gcp.cleanup(pool=pool), "project")

    return _cloud_command(args, command, (SkywardError, GoogleAPIError, OSError))


def _slurm_command(args: argparse.Namespace) -> int:
    """`skyward ls --provider slurm` / `skyward down --provider slurm`: this user's pools' jobs
    in the queue (through `--login`, a login node over SSH, or this machine's Slurm commands)."""
    from skyward.errors import SkywardError
    from skyward.providers.slurm.provider import Slurm

    def command() -> int:
        slurm = Slurm(login=args.login)
        return _ls_or_down(args, slurm.find, lambda pool: slurm.cleanup(pool), "cluster's queue")

    return _cloud_command(args, command, (SkywardError, OSError))


def _run(args: argparse.Namespace) -> int:
    from skyward.cli import profiles, runner

    flags = {
        "provider": args.provider,
        "nodes": args.nodes,
        "accelerator": args.accelerator,
        "plugins": profiles.check_plugins(args.plugin, "--plugin"),
        "env": profiles.parse_env(args.env),
        "workdir": args.workdir,
        "max_cost": args.max_cost,
        "pip": args.pip,
        "requirements": args.requirements,
        "indexes": args.index,
        "find_links": args.find_links,
        "options": {
            "hosts": args.hosts.split(",") if args.hosts else None,
            "user": args.user,
            "key": args.key,
            "region": args.region,
            "instance_type": args.instance_type,
            "spot": True if args.spot else None,
            "project": args.project,
            "zone": args.zone,
            "partition": args.partition,
            "account": args.account,
            "time_limit": args.time_limit,
            "login": args.login,
        },
    }
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {args.nodes}")
    if args.max_cost is not None:  # float() takes "inf" and "nan"
        checks.dollars(args.max_cost, "--max-cost", zero=False)
    profile = profiles.with_flags(profiles.load_profile(args.profile), flags)
    if args.detach:
        from skyward.cli import detached

        return detached.start(
            profile,
            args.script,
            args.args,
            detached.Options(args.name, args.restarts, args.output_dir, args.keep_for),
        )
    if args.name is not None or args.restarts or args.output_dir or args.keep_for:
        raise ConfigError(
            "--name, --restarts, --output-dir and --keep-for are for detached runs: add --detach"
        )
    try:
        outcome = runner.run(profile, args.script, args.args)
    except KeyboardInterrupt:
        print("skyward run: interrupted; every node was stopped", file=sys.stderr)
        return 130
    if outcome.message:
        print(f"skyward run: {outcome.message}", file=sys.stderr)
    return outcome.status


def _status(args: argparse.Namespace) -> int:
    from skyward.cli import detached, profiles, runner

    found = detached.print_runs()
    found += runner.print_local_pools()
    chosen = [profiles.load_profile(args.profile)] if args.profile else profiles.all_profiles()
    seen: set[str] = set()
    for profile in chosen:
        key = f"{profile.provider} {sorted(profile.options.items())}"
        if profile.provider == "local" or key in seen:
            continue
        seen.add(key)
        if profile.provider == "aws":
            found += runner.print_aws_pools(profile)
        elif profile.provider == "gcp":
            found += runner.print_gcp_pools(profile)
        elif profile.provider == "ssh":
            found += runner.print_ssh_pools(profile)
        elif profile.provider == "slurm":
            found += runner.print_slurm_pools(profile)
        else:
            print(f"{profile.provider:<6} profile {profile.name!r}: not checked")
    if not found:
        print("no live pools")
    return 0


def _one_line(command: str, exc: BaseException) -> str:
    text = str(exc).strip()
    lines = text.splitlines()
    first = lines[0] if lines else type(exc).__name__
    more = "; --debug shows the rest" if len(lines) > 1 else ""
    return f"skyward {command}: {first}{more}"


def _parser() -> argparse.ArgumentParser:
    # --debug before or after the command (SUPPRESS: a command's default must not undo it)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    parser = argparse.ArgumentParser(prog="skyward", description=_DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"skyward {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        parents=[common],
        help="run an unmodified script on every node of a pool",
        usage="skyward run [options] SCRIPT [ARGS...]",
        epilog=_RUN_EPILOG,
    )
    run.add_argument("--profile", help="the profile to start from (default: 'default', if any)")
    run.add_argument("--provider", help=f"one of {', '.join(registry.names())} (default: local)")
    run.add_argument("--nodes", type=int, help="how many nodes (default: the provider's)")
    run.add_argument("--accelerator", help="what each node must have, e.g. A100 or A100:8")
    run.add_argument(
        "--plugin",
        action="append",
        default=[],
        help="'jax' or 'torch': install JAX or PyTorch on the nodes (repeatable)",
    )
    run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K[=V]",
        help="node env var; K alone takes its value from this shell (a secret stays off argv)",
    )
    run.add_argument(
        "--pip",
        action="append",
        default=[],
        metavar="SPEC",
        help="a package the nodes need, as pip takes it (repeatable); the script's PEP 723 "
        "metadata is read too",
    )
    run.add_argument(
        "-r",
        "--requirements",
        action="append",
        default=[],
        metavar="FILE",
        help="a requirements file for the nodes (repeatable)",
    )
    run.add_argument(
        "--index",
        action="append",
        default=[],
        metavar="URL",
        help="a PEP 503 package index for the nodes, asked before the default one (repeatable)",
    )
    run.add_argument(
        "--find-links",
        action="append",
        default=[],
        metavar="URL",
        help="a page (or folder) of wheel links for the nodes (repeatable)",
    )
    run.add_argument("--workdir", help="a directory to copy to every node and run the script in")
    run.add_argument(
        "--max-cost",
        type=float,
        metavar="DOLLARS",
        help="a budget: the pool stops and is torn down once it has spent this much",
    )
    run.add_argument("--hosts", help="ssh: comma-separated hosts ('user@host:port' each)")
    run.add_argument("--user", help="ssh/aws: the login user")
    run.add_argument("--key", help="ssh: the private key file")
    run.add_argument("--region", help="aws: the region")
    run.add_argument("--instance-type", help="aws: the instance type")
    run.add_argument("--spot", action="store_true", help="aws, gcp: spot instances or VMs")
    run.add_argument("--project", help="gcp: the project")
    run.add_argument("--zone", help="gcp: the zone")
    run.add_argument("--partition", help="slurm: the partition")
    run.add_argument("--account", help="slurm: the account")
    run.add_argument(
        "--time-limit",
        help="slurm: the allocation's time limit as Slurm writes it, e.g. 2:00:00 (a bare "
        "number is minutes, as for sbatch)",
    )
    run.add_argument("--login", help="slurm: a login node over SSH, user@host (default: here)")
    run.add_argument(
        "--detach",
        "-d",
        action="store_true",
        help="start the run on the nodes and return once every rank has started: the run goes "
        "on without this machine (see 'skyward logs', 'skyward status', 'skyward stop')",
    )
    run.add_argument("--name", help="--detach: the run's name (default: a short made-up one)")
    run.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="--detach: restart every rank, on the same nodes, up to N times when one fails",
    )
    run.add_argument(
        "--output-dir",
        metavar="DIR",
        help="--detach: where 'skyward logs -f' and 'skyward fetch' bring every node's "
        "sky.output_dir() (DIR/node-<i>)",
    )
    run.add_argument(
        "--keep-for",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="--detach on AWS/GCP: how long the machines wait after the run for its outputs",
    )
    run.add_argument("script", help="the script, as you would give it to python")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    status = commands.add_parser(
        "status", parents=[common], help="this user's live pools on every configured provider"
    )
    status.add_argument("--profile", help="only this profile's provider (and this machine)")
    logs = commands.add_parser(
        "logs", parents=[common], help="a detached run's output, every rank's, from its first line"
    )
    logs.add_argument("name", help="the run's name (see 'skyward status')")
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="follow until the run ends, then exit with its status (Ctrl-C stops following only)",
    )
    stop = commands.add_parser("stop", parents=[common], help="end a detached run on every node")
    stop.add_argument("name", help="the run's name (see 'skyward status')")
    fetch = commands.add_parser(
        "fetch", parents=[common], help="bring a detached run's outputs here"
    )
    fetch.add_argument("name", help="the run's name (see 'skyward status')")
    fetch.add_argument("--to", metavar="DIR", help="default: the run's --output-dir, else ./NAME")
    cache = commands.add_parser(
        "cache", parents=[common], help="node environments and sky.Data stored on this machine"
    )
    cache.add_argument("action", choices=["list", "clear"])
    for name, text in (
        ("ls", "list skyward's cloud resources (or Slurm jobs)"),
        ("down", "remove them"),
    ):
        sub = commands.add_parser(name, parents=[common], help=text)
        sub.add_argument(
            "--cloud",
            "--provider",
            dest="cloud",
            choices=["aws", "gcp", "slurm"],
            default="aws",
            help="default: aws",
        )
        sub.add_argument("--region", help="AWS region (default: the standard resolution)")
        sub.add_argument("--profile", help="AWS profile")
        sub.add_argument("--project", help="GCP project (default: the standard resolution)")
        sub.add_argument("--zone", help="GCP zone (default: the standard resolution)")
        sub.add_argument("--login", help="Slurm login node over SSH, user@host (default: here)")
        if name == "down":
            sub.add_argument("pool", nargs="?", help="the pool id (see `skyward ls`)")
            sub.add_argument("--all", action="store_true", help="every skyward pool")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    empty = [
        flag
        for flag, value in vars(args).items()
        if isinstance(value, str) and not value.strip() and flag != "script"
    ]
    if empty:  # e.g. --region "" would otherwise mean the default
        print(
            f"skyward {args.command}: --{empty[0].replace('_', '-')} must not be empty",
            file=sys.stderr,
        )
        return 1
    if args.command in ("ls", "down"):
        if args.cloud == "slurm":
            return _slurm_command(args)
        return _gcp_command(args) if args.cloud == "gcp" else _aws_command(args)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "status":
            return _status(args)
        if args.command in ("logs", "stop", "fetch"):
            from skyward.cli import detached

            if args.command == "logs":
                return detached.logs(args.name, args.follow)
            if args.command == "fetch":
                return detached.fetch(args.name, args.to)
            return detached.stop(args.name)
        if args.command == "cache":
            where = Path(cache_root())
            return _cache_list(where) if args.action == "list" else _cache_clear(where)
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(_one_line(args.command, exc), file=sys.stderr)
        return 1
    return 2
