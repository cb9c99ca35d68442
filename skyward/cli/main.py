"""The ``skyward`` command: run a script on a pool, list live pools, cached environments, and
what pools left with a provider.

``skyward run script.py`` runs an unmodified script on every node (see `skyward.cli.runner`);
``skyward status`` lists this user's live pools; ``skyward ls --provider NAME`` lists every pool
that provider can see (a cloud's region or project, a cluster's queue); ``skyward down POOL``
(or ``--all``) removes it: the sweep for pools whose client died before its teardown. The
providers and their flags come from the registry (`skyward.providers.registry`): this module
names none. An error is one line on stderr (the traceback too with ``--debug``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

from skyward import checks
from skyward.cachedir import cache_root
from skyward.errors import ConfigError
from skyward.providers import registry
from skyward.providers.base import Capability, Provider, created
from skyward.providers.source import source_hash
from skyward.version import __version__
from skyward.worker import envbuild

_DESCRIPTION = (
    "Run a script on a pool, list live pools, cached environments, and what pools left with a "
    "provider. 'skyward run --nodes 2 script.py' runs an unmodified script on every node; "
    "'skyward status' lists your live pools; 'skyward ls --provider NAME' lists every pool that "
    "provider can see; 'skyward down POOL' (or --all) removes it: the sweep for pools whose "
    "client died before its teardown."
)
_RUN_EPILOG = (
    "Every rank (one a node, or --nproc-per-node of them) runs 'python SCRIPT ARGS' with "
    "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
    "JAX_PROCESS_ID set, so jax.distributed.initialize() needs no arguments, and torchrun's "
    "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT, so "
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


def _listing_provider(args: argparse.Namespace) -> Provider:
    """The provider `skyward ls`/`down` asks: `--provider` (else the default profile's), built
    from the default profile's settings and the flags that say where to look."""
    from skyward.cli import profiles

    profile = profiles.load_profile(None)
    name = args.provider or profile.provider
    entry = registry.entry(name)
    cls = entry.load()
    if Capability.LIST not in cls.capabilities:
        able = ", ".join(_listing_names())
        raise ConfigError(
            f"the {name} provider cannot {Capability.LIST.value}; name one that can with "
            f"--provider ({able})"
        )
    keys = {o.key for o in entry.options if o.listing}
    settings = {k: v for k, v in profile.options.items() if k in keys and name == profile.provider}
    return cls(**{**settings, **entry.arguments(vars(args), listing=True)})


def _listing_names() -> list[str]:
    """The providers that can list and clean up pools (those whose classes can be imported)."""
    found = []
    for name, entry in registry.entries().items():
        try:
            if Capability.LIST in entry.load().capabilities:
                found.append(name)
        except ConfigError:
            continue  # its extra is not installed
    return found


def _ls(provider: Provider) -> int:
    """`skyward ls`: every pool the provider finds, under its resources."""
    pools = provider.find()
    if not pools:
        print(f"no skyward resources found by the {provider.name} provider")
    for _, pool in sorted(pools.items()):
        print(f"{pool.pool_id}  created {created(pool)} by {pool.created_by or '?'}")
        for line in pool.describe():
            print(f"    {line}")
    return 0


def _down(provider: Provider, args: argparse.Namespace) -> int:
    """`skyward down POOL` (or `--all`): what those pools left, removed."""
    removed = provider.cleanup(None if args.all else args.pool)
    for line in removed:
        print(f"removed {line}")
    if not removed:
        print("nothing to remove")
    return 0


def _listing(args: argparse.Namespace) -> int:
    """`skyward ls` / `skyward down`. A bare `skyward down` is refused before any provider is
    asked: it must never mean "everything"."""
    if args.command == "down" and not args.all and not args.pool:
        print("skyward down: name a POOL (see `skyward ls`) or pass --all", file=sys.stderr)
        return 2
    provider = _listing_provider(args)
    return _ls(provider) if args.command == "ls" else _down(provider, args)


def _provider_flags(
    parser: argparse.ArgumentParser, entries: Mapping[str, registry.ProviderEntry], listing: bool
) -> None:
    """Every provider's flags for `skyward run` (or, with `listing`, `ls`/`down`), from their
    registry `entries`: a flag two providers take is added once, its help naming both."""
    flags: dict[str, tuple[list[str], registry.Option]] = {}
    for name, entry in entries.items():
        for option in entry.options:
            if option.listing if listing else option.run:
                flags.setdefault(option.flag, ([], option))[0].append(name)
    for flag, (names, option) in flags.items():
        parser.add_argument(
            flag,
            dest=option.key,
            action="store_true" if option.kind == "switch" else "store",
            default=None,
            help=f"{', '.join(names)}: {option.help}",
        )


def _provider_options(args: argparse.Namespace) -> dict[str, Any]:
    """The provider settings `skyward run`'s flags give, by key (those not given left out); a
    flag the chosen provider does not take is refused when the pool's provider is built."""
    given = vars(args)
    return {k: v for e in registry.entries().values() for k, v in e.arguments(given).items()}


def _run(args: argparse.Namespace) -> int:
    from skyward.cli import profiles, runner

    flags = {
        "provider": args.provider,
        "nodes": args.nodes,
        "processes_per_node": args.nproc_per_node,
        "accelerator": args.accelerator,
        "plugins": profiles.check_plugins(args.plugin, "--plugin"),
        "env": profiles.parse_env(args.env),
        "workdir": args.workdir,
        "max_cost": args.max_cost,
        "pip": args.pip,
        "requirements": args.requirements,
        "indexes": args.index,
        "find_links": args.find_links,
        "options": _provider_options(args),
    }
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {args.nodes}")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(
            f"--nproc-per-node (processes_per_node) must be at least 1, got {args.nproc_per_node}"
        )
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

    if args.forget or args.forget_ended:
        return detached.forget(args.forget, every_ended=args.forget_ended)
    found = detached.print_runs()
    # This machine's pools, whatever started them: the embedded default provider's answer.
    found += runner.print_live_pools(registry.provider_class(registry.DEFAULT)()) or 0
    chosen = [profiles.load_profile(args.profile)] if args.profile else profiles.all_profiles()
    seen: set[str] = set()
    for profile in chosen:
        key = f"{profile.provider} {sorted(profile.options.items())}"
        if key in seen:
            continue
        seen.add(key)
        provider = profile.build_provider()  # a profile's mistake is said, whichever it is
        if profile.provider == registry.DEFAULT:
            continue  # its pools are this machine's, listed above
        count = runner.print_live_pools(provider)
        if count is None:
            print(f"{profile.provider:<6} profile {profile.name!r}: not checked")
        found += count or 0
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
    entries = registry.entries()  # every provider's flags, read once for every command
    parser = argparse.ArgumentParser(prog="skyward", description=_DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"skyward {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run(commands, common, entries)
    _add_status(commands, common)
    _add_detached(commands, common)
    _add_cache(commands, common)
    _add_dashboard(commands, common)
    _add_listing(commands, common, entries)
    return parser


# What `add_subparsers` returns (generic only to a type checker).
_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _add_run(
    commands: _Commands,
    common: argparse.ArgumentParser,
    entries: Mapping[str, registry.ProviderEntry],
) -> None:
    """`skyward run`: the pool's flags, the nodes' packages, --detach's, then the script."""
    run = commands.add_parser(
        "run",
        parents=[common],
        help="run an unmodified script on every node of a pool",
        usage="skyward run [options] SCRIPT [ARGS...]",
        epilog=_RUN_EPILOG,
    )
    run.add_argument("--profile", help="the profile to start from (default: 'default', if any)")
    run.add_argument(
        "--provider", help=f"one of {', '.join(entries)} (default: {registry.DEFAULT})"
    )
    run.add_argument("--nodes", type=int, help="how many nodes (default: the provider's)")
    run.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="P",
        help="ranks on each node, as torchrun's (default: 1, or one per GPU with --plugin torch)",
    )
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
    _add_packages(run)
    run.add_argument("--workdir", help="a directory to copy to every node and run the script in")
    run.add_argument(
        "--max-cost",
        type=float,
        metavar="DOLLARS",
        help="a budget: the pool stops and is torn down once it has spent this much",
    )
    _provider_flags(run, entries, listing=False)
    _add_detach_flags(run)
    run.add_argument("script", help="the script, as you would give it to python")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def _add_packages(run: argparse.ArgumentParser) -> None:
    """What the nodes install for `skyward run` besides the script's PEP 723 metadata."""
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


def _add_detach_flags(run: argparse.ArgumentParser) -> None:
    """`skyward run --detach` and the flags only a detached run reads."""
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
        help="--detach on machines the run made (a cloud's): how long they wait after the run "
        "for its outputs",
    )


def _add_status(commands: _Commands, common: argparse.ArgumentParser) -> None:
    status = commands.add_parser(
        "status", parents=[common], help="this user's live pools on every configured provider"
    )
    status.add_argument("--profile", help="only this profile's provider (and this machine)")
    status.add_argument(
        "--forget",
        action="append",
        default=[],
        metavar="RUN",
        help="forget this ended detached run: its record and what was kept of it here "
        "(repeatable; a run still going is refused)",
    )
    status.add_argument(
        "--forget-ended",
        action="store_true",
        help="forget every detached run that has ended (each is named as it goes)",
    )


def _add_detached(commands: _Commands, common: argparse.ArgumentParser) -> None:
    """A detached run's commands: logs, stop, fetch."""
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


def _add_cache(commands: _Commands, common: argparse.ArgumentParser) -> None:
    cache = commands.add_parser(
        "cache", parents=[common], help="node environments and sky.Data stored on this machine"
    )
    cache.add_argument("action", choices=["list", "clear"])


def _add_dashboard(commands: _Commands, common: argparse.ArgumentParser) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        parents=[common],
        help="a page of every run and pool: live output, sky.report charts, cost, a Stop button",
    )
    dashboard.add_argument("--port", type=int, default=8787, help="default: 8787 (0: any free)")
    dashboard.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)"
    )
    dashboard.add_argument("--open", action="store_true", help="open it in the browser too")


def _add_listing(
    commands: _Commands,
    common: argparse.ArgumentParser,
    entries: Mapping[str, registry.ProviderEntry],
) -> None:
    """`skyward ls` and `skyward down`: a provider's pools, found and removed."""
    for name, text in (
        ("ls", "list the pools a provider can see (a cloud's resources, a cluster's jobs)"),
        ("down", "remove them"),
    ):
        sub = commands.add_parser(name, parents=[common], help=text)
        sub.add_argument(
            "--provider",
            "--cloud",
            dest="provider",
            help="a provider that can list pools, e.g. the cloud's (default: the default "
            "profile's)",
        )
        _provider_flags(sub, entries, listing=True)
        if name == "down":
            sub.add_argument("pool", nargs="?", help="the pool id (see `skyward ls`)")
            sub.add_argument("--all", action="store_true", help="every skyward pool")


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
    try:
        if args.command in ("ls", "down"):
            return _listing(args)
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
        if args.command == "dashboard":
            from skyward.cli import dashboard

            return dashboard.serve(args.host, args.port, args.open)
        if args.command == "cache":
            where = Path(cache_root())
            return _cache_list(where) if args.action == "list" else _cache_clear(where)
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(_one_line(args.command, exc), file=sys.stderr)
        return 1
    return 2
