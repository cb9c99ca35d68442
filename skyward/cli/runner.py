"""``skyward run`` and ``skyward status``: an unmodified script on every node of a pool, and the
pools of this user that are alive.

`run` starts a pool from a `Profile`, runs the script in every rank (one a node, or the
profile's ``processes_per_node``: ``--nproc-per-node``, by default one per GPU with ``--plugin
torch``) as a child of the rank's agent (`skyward.worker.script`), with
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, and torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` (each coordinator's port picked by node 0; `skyward.plugins.launcher`),
and streams the ranks' output. The script is the one that initializes JAX or
torch.distributed: the agent never does. The first rank to fail ends the run and the pool; its
status is the run's.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path

from skyward.calls import compute
from skyward.cli.packages import (
    Packages,
    from_flags,
    missing_module_hint,
    project_dependencies,
    script_metadata,
    unresolved,
)
from skyward.cli.profiles import Profile
from skyward.detached.submit import script_target
from skyward.errors import BootstrapError
from skyward.plugins.base import Plugin
from skyward.plugins.jax_plugin import jax
from skyward.plugins.launcher import LauncherEnv
from skyward.plugins.torch_plugin import torch
from skyward.pool import ComputePool
from skyward.providers.base import Provider
from skyward.worker.script import run_script


@dataclass(frozen=True)
class RunEnd:
    """How a run ended: the exit status, and the line that says why when it is not 0."""

    status: int
    message: str | None = None


def run(profile: Profile, script: str, args: Sequence[str]) -> RunEnd:
    """Run `script` with `args` in every rank of a pool made from `profile`."""
    target, cwd = script_target(script, profile.workdir)
    packages = script_packages(profile, Path(script))
    plugins = script_plugins(profile, ranks_per_gpu=True)
    node_call = compute(run_script)
    failure: RunEnd | None = None
    with contextlib.ExitStack() as stack:
        pool = ComputePool(
            provider=profile.build_provider(),
            nodes=profile.nodes,
            accelerator=profile.accelerator,
            image=packages.image(),
            plugins=plugins,
            env=profile.env,
            name="run",
            max_cost=profile.max_cost,
            processes_per_node=profile.processes_per_node,
        )
        pool.listed_as = f"{Path(script).name} ({pool.pool_id})"
        try:
            stack.enter_context(pool)
        except BootstrapError as exc:
            better = unresolved(exc, packages) if packages.pip else None
            if better is None:
                raise
            raise better from exc
        world = pool.spec.nodes * pool.spec.processes_per_node
        ranks: dict[Future[int], int] = {
            pool.submit(node_call(target, list(args), cwd), rank=rank): rank
            for rank in range(world)
        }
        failure = _first_failure(ranks)
    return failure or RunEnd(0)


def script_plugins(profile: Profile, ranks_per_gpu: bool = False) -> list[Plugin]:
    """The plugins a script's pool runs with: every launcher's variables (``JAX_*``,
    torchrun's), and the frameworks ``--plugin`` names installed but left for the script to
    initialize; with `ranks_per_gpu`, ``--plugin torch`` makes a pool that is not told
    ``processes_per_node`` hold a rank for each GPU of a node."""
    plugins: list[Plugin] = [LauncherEnv()]
    if "jax" in profile.plugins:
        plugins.append(jax(initialize=False))
    if "torch" in profile.plugins:
        plugins.append(torch(initialize=False, per_gpu=True if ranks_per_gpu else None))
    return plugins


def script_packages(profile: Profile, script: Path) -> Packages:
    """What the nodes need: the profile's and the flags' packages, the script's metadata, and
    the work directory's project dependencies."""
    found = from_flags(profile.pip, profile.requirements, profile.indexes, profile.find_links)
    found += script_metadata(script)
    if profile.workdir is not None:
        found += project_dependencies(Path(profile.workdir).expanduser())
    return found


def _first_failure(ranks: dict[Future[int], int]) -> RunEnd | None:
    """Wait for every rank; the first one to fail (in time) as a `RunEnd`, or None."""
    pending = set(ranks)
    while pending:
        done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
        for future in sorted(done, key=ranks.__getitem__):
            rank = ranks[future]
            error = future.exception()
            if error is not None:
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                if isinstance(error, ModuleNotFoundError) and error.name:
                    first = f"{first}; {missing_module_hint(error.name)}"
                return RunEnd(1, f"rank {rank} failed: {type(error).__name__}: {first}")
            status = future.result()
            if status > 0:
                return RunEnd(status, f"rank {rank} exited with status {status}")
            if status < 0:
                name = _signal_name(-status)
                return RunEnd(128 - status, f"rank {rank} was killed by signal {-status} ({name})")
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


# -- skyward status ------------------------------------------------------------------------------


def print_live_pools(provider: Provider) -> int | None:
    """`skyward status` for one provider: this user's live pools it can see, each a heading
    and its lines; how many (None: the provider cannot tell)."""
    live = provider.live_pools()
    for pool in live or []:
        print(pool.heading)
        for line in pool.lines:
            print(f"           {line}")
    return None if live is None else len(live)


def out(line: str) -> None:
    """One line on stderr."""
    print(line, file=sys.stderr)
