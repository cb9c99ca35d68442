"""`submit`: start a detached run (what ``skyward run --detach`` and `sky.submit` do).

The pool starts as for ``skyward run``: the environment is built, the script (or the workdir)
reaches every node, and each agent exports the launcher variables (``JAX_*``). Then, while
the pool is still up, every agent writes its node's spec (the script's command line and the
agent's environment) and node 0's agent starts the leader (`skyward.worker.supervisor`) in a
session of its own. Once every rank has started, the pool ends as usual: its agents and
connections go, the run stays with its nodes, and the client keeps a record.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyward import checks
from skyward.calls import compute
from skyward.client import plan
from skyward.data import Data
from skyward.detached import batch, launch, record
from skyward.detached.run import Run
from skyward.errors import ConfigError, SkywardError
from skyward.image import Image
from skyward.plugins.base import Plugin
from skyward.plugins.launcher import LauncherEnv
from skyward.pool import ComputePool
from skyward.providers import registry
from skyward.providers.base import Provider
from skyward.worker import supervisor

# Node 0 waits this long for every rank to say it started.
START_TIMEOUT = 120.0


class DetachError(SkywardError):
    """A detached run could not be started: every rank did not start (the pool is gone)."""


def script_target(script: str, workdir: str | None) -> tuple[str | Data, Data | None]:
    """What each node runs and where: the script as a `sky.Data` (or, with `workdir`, its path
    inside the workdir's copy, which is then the working directory)."""
    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"{script}: no such script")
    if workdir is None:
        return Data(path), None  # on each node: the file's copy, run from the agent's directory
    root = Path(workdir).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"--workdir {workdir}: no such directory")
    try:
        target = str(path.resolve().relative_to(root))
    except ValueError:
        raise ConfigError(f"{script} is not inside --workdir {workdir}") from None
    return target, Data(root)  # on each node: the directory's copy, where the script runs


def _output_dir(
    output_dir: str | os.PathLike[str] | None, provider: Provider, keep_for: float
) -> str | None:
    """Where the run's outputs come back to (an absolute local path), or None; the refusals."""
    if output_dir is None:
        return None
    text = os.fspath(output_dir)
    if text.startswith("s3://"):
        return text  # each node uploads its own after its rank ends
    if "://" in text:
        raise ConfigError(
            f"output_dir={text!r}: a detached run's outputs go to a local directory "
            "(`skyward fetch`) or an s3:// prefix; to write elsewhere, upload from the script"
        )
    local = "://" not in text
    if local and type(provider).release is not Provider.release and keep_for <= 0:
        raise ConfigError(
            f"output_dir={text!r}: the {provider.name} machines end themselves soon after the "
            "run's end (within 30 s on a cloud; a pod, its idle_timeout after its last "
            "process); give keep_for=SECONDS (--keep-for) for them to wait that long for "
            "`skyward logs -f` or `skyward fetch` to bring the outputs back"
        )
    return str(Path(text).expanduser().resolve())


def launcher_plugins(plugins: Sequence[Plugin]) -> list[Plugin]:
    """`plugins` for a script that initializes its framework itself, as ``skyward run`` has
    them: every launcher's variables first, then each plugin as such a script needs it
    (`Plugin.for_script`: the JAX and torch plugins install their framework and leave its
    initialization to the script)."""
    chosen: list[Plugin] = [LauncherEnv()]
    for plugin in plugins:
        kept = plugin.for_script()
        if kept is not None:
            chosen.append(kept)
    return chosen


def script_args(args: str | Sequence[str]) -> list[str]:
    """The script's arguments as a list: a string is split as a shell would (``"--lr 0.1"``
    is two arguments), a sequence is taken as it is; anything else is a `ConfigError`."""
    if isinstance(args, str):
        import shlex

        try:
            return shlex.split(args)
        except ValueError as exc:
            raise ConfigError(f"args={args!r} cannot be split as a shell would: {exc}") from None
    if not isinstance(args, Sequence) or not all(isinstance(a, str) for a in args):
        raise ConfigError(
            f"args={args!r}: give the script's arguments as a list of strings "
            '(["--lr", "0.1"]) or as one string ("--lr 0.1")'
        )
    return list(args)


def submit(
    script: str,
    args: str | Sequence[str] = (),
    *,
    provider: Provider | None = None,
    nodes: int | None = None,
    processes_per_node: int | None = None,
    accelerator: str | None = None,
    image: Image | None = None,
    plugins: Sequence[Plugin] = (),
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    name: str | None = None,
    restarts: int = 0,
    grace: float = 10.0,
    max_cost: float | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    keep_for: float = 0.0,
) -> Run:
    """Start `script` with `args` in every rank of a new pool, detached: returns once every
    rank has started, and the run goes on without this process (see docs/detach.md). `args`
    is a list of strings, or one string split as a shell would. `processes_per_node`: the
    ranks on each node, each its own process with torchrun's variables, as for
    `sky.ComputePool` (default: one a node, or one per GPU with the torch plugin)."""
    name = record.check_name(name) if name is not None else record.new_name()
    with record.claim(name):
        return _submit(
            script,
            script_args(args),
            provider=provider,
            nodes=nodes,
            processes_per_node=processes_per_node,
            accelerator=accelerator,
            image=image,
            plugins=plugins,
            env=env,
            workdir=workdir,
            name=name,
            restarts=restarts,
            grace=grace,
            max_cost=max_cost,
            output_dir=output_dir,
            keep_for=keep_for,
        )


@dataclass(frozen=True)
class _Plan:
    """What a run starts with, checked: the same on every path to its nodes."""

    name: str
    kind: str  # how the client reaches the run (`Provider.detached_kind`)
    script: str
    target: Any  # the script as the nodes see it (`script_target`)
    cwd: Any
    args: list[str]
    restarts: int
    grace: float
    keep_for: float
    outputs: str | None  # where the outputs go (`_output_dir`)

    @property
    def bucket(self) -> str | None:
        """The object store the nodes upload their outputs to, if the outputs go to one."""
        return self.outputs if self.outputs and self.outputs.startswith("s3://") else None


def _submit(
    script: str,
    args: list[str],
    *,
    provider: Provider | None,
    nodes: int | None,
    processes_per_node: int | None,
    accelerator: str | None,
    image: Image | None,
    plugins: Sequence[Plugin],
    env: Mapping[str, str] | None,
    workdir: str | None,
    name: str,
    restarts: int,
    grace: float,
    max_cost: float | None,
    output_dir: str | os.PathLike[str] | None,
    keep_for: float,
) -> Run:
    """`submit` once `name` is this process's to start."""
    if provider is None:
        provider = registry.provider_class(registry.DEFAULT)()  # the embedded default
    run = _checked(
        provider, script, args, name, restarts, grace, keep_for, max_cost, output_dir, workdir
    )
    if run.kind == "tcp" and processes_per_node not in (None, 1):
        raise ConfigError(
            f"processes_per_node={processes_per_node}: a detached run on {provider.name} holds "
            "one rank per node; run it attached (without --detach) for several ranks a node"
        )
    batch_ranks = plan.processes_per_node(processes_per_node, accelerator) or 1
    pool = ComputePool(
        provider=provider,
        nodes=nodes,
        accelerator=accelerator,
        image=image,
        plugins=launcher_plugins(plugins),
        env=dict(env or {}),
        name="run",
        # An agent a rank, each with its rank's variables: each writes its rank's spec, the
        # supervisor then runs it. A batch job and a pod's door hold one rank a node.
        processes_per_node=1 if run.kind in ("slurm", "tcp") else processes_per_node,
    )
    pool.keeps_history = False  # the dashboard lists the run, not the pool that started it
    state = _through_pool(pool, run, processes_per_node or 1, batch_ranks)
    if "running_at" not in state:
        Run(run.name).stop()
        raise DetachError(
            f"run {run.name} did not start on every node: "
            f"{state.get('reason', state.get('state'))}; "
            f"`skyward logs {run.name}` shows what the ranks printed"
        )
    handle = Run(run.name)
    handle.started = dict(state)
    if run.outputs is not None:
        handle.record.output_dir = run.outputs
        record.save(handle.record)
    return handle


def _checked(
    provider: Provider,
    script: str,
    args: list[str],
    name: str,
    restarts: int,
    grace: float,
    keep_for: float,
    max_cost: float | None,
    output_dir: str | os.PathLike[str] | None,
    workdir: str | None,
) -> _Plan:
    """The run's settings checked, each a `ConfigError` naming it, before anything starts."""
    kind = provider.detached_kind()
    restarts = checks.whole(restarts, "restarts", minimum=0)
    grace = checks.seconds(grace, "grace", zero=True)
    keep_for = checks.seconds(keep_for, "keep_for", zero=True)
    outputs = _output_dir(output_dir, provider, keep_for)
    if max_cost is not None:
        raise ConfigError(
            "max_cost cannot be kept by a detached run: no client is there to stop it when it "
            "is spent; bound it with the provider's own limit (sky.Slurm(time_limit=...)) or "
            "run it attached"
        )
    target, cwd = script_target(script, workdir)
    return _Plan(
        name, kind, str(script), target, cwd, list(args), restarts, float(grace), keep_for, outputs
    )


def _through_pool(
    pool: ComputePool, run: _Plan, per_node: int, batch_ranks: int
) -> supervisor.RunState:
    """Start the pool, start the run on its nodes (or plan a batch job of `batch_ranks` ranks
    a node), end the pool (its nodes kept where the run holds them), then queue the batch
    job; the run's state once every rank has started."""
    # Local: the nodes are this machine's processes, and the leader's interpreter starts while
    # the pool does (it waits for its plan): not after, between the pool and "every rank started".
    # (Its directory is rank 0's: where the plugins' default makes several ranks a node, node
    # 0's agent starts the leader instead.)
    ahead = supervisor.leader_ahead(run.name, per_node) if run.kind == "local" else None
    try:
        pool.start()
    except BaseException:
        if ahead is not None:
            _end_planless(ahead[1])
        raise
    held = False  # whether the run holds the pool's nodes once the pool ends (a cloud's)
    try:
        if run.kind == "slurm":
            job = batch.prepare(
                pool,
                run.name,
                run.target,
                run.args,
                run.cwd,
                run.restarts,
                run.grace,
                run.bucket,
                batch_ranks,
            )
            price = pool.cost.price.per_hour
        else:
            state = _start_on_nodes(pool, run, ahead)
            held = launch.holds_nodes(pool) and "running_at" in state
    except BaseException:
        if ahead is not None and not (ahead[0] / supervisor.LEADER).exists():
            _end_planless(ahead[1])
        pool.close(graceful=False)
        raise
    pool.close(keep_nodes=held)
    if run.kind == "slurm":
        return _start_batch(job, pool.provider.name, run.name, run.script, run.args, price)
    return state


def _start_on_nodes(
    pool: ComputePool, run: _Plan, ahead: tuple[Path, subprocess.Popen[bytes]] | None = None
) -> supervisor.RunState:
    """While the pool is up: each node's spec, node 0's leader (started `ahead` here, for
    Local), the record; the run's state once every rank has started."""
    keys = launch.leader_keys(run.kind, pool.spec.nodes, pool.spec.processes_per_node)
    setups = _prepare_nodes(pool, run, keys)
    _keep_record(pool, run, setups)
    launchers = launch.launchers(run.kind, pool, setups)
    per_node = pool.spec.processes_per_node
    if ahead is not None and setups[0]["directory"] == str(ahead[0]):
        supervisor.write_plan(ahead[0], launchers, {}, "", run.restarts, run.grace, per_node)
        supervisor.plan_written(ahead[1])
        return supervisor.wait_started(ahead[0], ahead[1], START_TIMEOUT)
    if ahead is not None:  # node 0's agent sees another cache: it starts the leader itself
        _end_planless(ahead[1])
    start = compute(supervisor.start_leader)
    try:
        state = pool.run(
            start(
                run.name,
                launchers,
                keys.private,
                keys.known_hosts(pool),
                run.restarts,
                run.grace,
                START_TIMEOUT,
            ),
            node=0,
        )
    except BaseException:
        _abandon(pool, run.name)
        raise
    if "running_at" not in state:  # a node the leader could not reach runs its rank early
        _abandon(pool, run.name)
    return state


def _prepare_nodes(pool: ComputePool, run: _Plan, keys: launch.LeaderKeys) -> list[dict[str, Any]]:
    """Every rank's directory and spec, written by its agent (`supervisor.prepare_node`);
    what each said."""
    target, source = run.target, None
    if run.cwd is None and isinstance(target, Data):
        # A lone script travels in the call that prepares each node, into the run's own
        # directory: no data channel to open on each host for it (one is most of a detached
        # start's cost on SSH), and the run keeps its copy whatever the pool's cache does.
        source, target = Path(run.script).read_bytes(), Path(run.script).name
    prepare = compute(supervisor.prepare_node)
    asked = [
        pool.submit(
            prepare(
                run.name,
                target,
                run.args,
                run.cwd,
                run.grace,
                run.restarts,
                keys.login_key(i),
                run.keep_for,
                run.bucket,
                source,
                keys.door_secret(i),
            ),
            rank=i,
        )
        for i in range(pool.spec.nodes * pool.spec.processes_per_node)
    ]
    try:
        return [future.result() for future in asked]
    except BaseException:
        _abandon(pool, run.name)
        raise


def _keep_record(pool: ComputePool, run: _Plan, setups: list[dict[str, Any]]) -> None:
    """The client's record of the run (`record.RunRecord`), before its leader starts."""
    record.save(
        record.RunRecord(
            name=run.name,
            provider=pool.provider.name,
            kind=run.kind,
            nodes=pool.spec.nodes,
            script=run.script,
            args=run.args,
            created_at=time.time(),
            directories=[s["directory"] for s in setups],
            price_per_hour=pool.cost.price.per_hour,
            reach=launch.record_data(run.kind, pool, run.name),
            key_tags=[s["key_tag"] for s in setups],
            keep_for=run.keep_for,
            ranks_per_node=pool.spec.processes_per_node,
        )
    )


def _end_planless(leader: subprocess.Popen[bytes]) -> None:
    """End a leader started ahead that got no plan: nothing of the run is its yet."""
    leader.kill()
    leader.wait()


def _abandon(pool: ComputePool, name: str) -> None:
    """The run could not start on every node: each node that can still be reached stops what
    it started for it (an early follower's rank would otherwise wait for a leader a while),
    each rank's agent its own."""
    stop = compute(supervisor.abandon)
    asked = []
    for rank in range(pool.spec.nodes * pool.spec.processes_per_node):
        with contextlib.suppress(Exception):  # a node that is gone has nothing left to stop
            asked.append(pool.submit(stop(name), rank=rank))
    for future in asked:
        with contextlib.suppress(Exception):
            future.result(timeout=10)


def _start_batch(
    job: batch.BatchJob,
    provider: str,
    name: str,
    script: str,
    args: list[str],
    price: float | None,
) -> supervisor.RunState:
    """Queue the batch job, keep the record (`provider`: the provider's name), wait for every
    rank to start."""
    job_id = batch.submit(job)
    record.save(
        record.RunRecord(
            name=name,
            provider=provider,
            kind="slurm",
            nodes=job.nodes,
            script=script,
            args=args,
            created_at=time.time(),
            directories=batch.directories(job),
            price_per_hour=price,
            reach={"job_id": job_id},
            key_tags=[None] * job.nodes,
            ranks_per_node=job.per_node,
        )
    )
    return batch.wait_started(job, job_id, lambda line: print(f"[skyward] run {name}: {line}"))
