"""`skyward run`, `skyward status`, profiles, and scripts written for other JAX launchers running
unchanged, inside `@sky.compute` and through `skyward run` (real processes on Local)."""

from __future__ import annotations

import asyncio
import os
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli import profiles
from skyward.cli.main import main
from skyward.providers.local.processes import local_pools
from tests.conftest import alive, sigint_default, wait_gone

ROOT = Path(__file__).resolve().parent.parent

# JAX's multi-process example, as its documentation gives it.
JAX_DOCS = """\
import jax

jax.distributed.initialize()  # On GPU, see above for the necessary arguments.
print(jax.device_count())  # total number of accelerator devices in the cluster
print(jax.local_device_count())  # number of accelerator devices attached to this host
# The psum is performed over all mapped devices across the pod slice
xs = jax.numpy.ones(jax.local_device_count())
print(jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(xs))
"""

# What a script written for Kubeflow Trainer's JAX runtime does: the launcher sets the variables.
KUBEFLOW = """\
import os
import sys

import jax
import jax.numpy as jnp

jax.distributed.initialize(
    coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
    num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
    process_id=int(os.environ["JAX_PROCESS_ID"]),
)
total = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(jnp.ones(1))
print(f"process {jax.process_index()}/{jax.process_count()} argv={sys.argv[1:]} psum={total}")
jax.distributed.shutdown()
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def skyward_run(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`skyward run ...` as a user types it, in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "skyward.cli", "run", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )


@sky.compute
def run_as_main(path: str) -> None:
    runpy.run_path(path, run_name="__main__")


@sky.compute
def initialize_with(*args: object) -> bool:
    import jax

    jax.distributed.initialize(*args)  # type: ignore[arg-type]
    return jax.distributed.is_initialized()


# -- scripts for other launchers, unchanged, inside @sky.compute ---------------------------------


@pytest.mark.slow
def test_launcher_scripts_run_unchanged_inside_a_jax_pool(tmp_path: Path) -> None:
    docs, kubeflow = write(tmp_path, "docs.py", JAX_DOCS), write(tmp_path, "kf.py", KUBEFLOW)
    with sky.ComputePool(nodes=2, plugins=[sky.plugins.jax()], stream_output=False) as pool:
        # The plugin initialized JAX already: the scripts' own initialize() (bare, and with
        # the pool's own arguments) returns quietly and their shutdown() leaves it up.
        run_as_main(str(docs)) @ pool
        run_as_main(str(kubeflow)) @ pool
        run_as_main(str(docs)) @ pool  # still initialized after the script's shutdown()
        assert initialize_with() @ pool == [True, True]
        for node in (0, 1):
            # output travels apart from results: wait for the last script's line (`printed`)
            assert printed(pool, node, f"process {node}/2 argv=[] psum=[2.]"), pool.logs(node)
            deadline = time.monotonic() + 10
            while pool.logs(node).count("[2.]") < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert pool.logs(node).count("[2.]") == 2, pool.logs(node)


def printed(pool: sky.ComputePool, node: int, line: str, timeout: float = 10.0) -> bool:
    """Whether `node` printed `line`: output travels apart from results, so what a call printed
    just before it returned may reach `pool.logs()` a moment after its result."""
    deadline = time.monotonic() + timeout
    while line not in pool.logs(node):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.slow
def test_conflicting_initialize_says_what_conflicts_and_what_to_do() -> None:
    with (
        sky.ComputePool(nodes=2, plugins=[sky.plugins.jax()], stream_output=False) as pool,
        pytest.raises(sky.ConfigError) as caught,
    ):
        initialize_with("10.1.2.3:1234", 2) @ pool
    message = str(caught.value)
    assert "coordinator_address='10.1.2.3:1234' (the pool's: '127.0.0.1:" in message
    assert "num_processes" not in message  # that one matched
    assert "use sky.plugins.jax(initialize=False)" in message


@pytest.mark.slow
def test_launcher_scripts_run_unchanged_when_the_plugin_leaves_initialize_to_them(
    tmp_path: Path,
) -> None:
    docs, kubeflow = write(tmp_path, "docs.py", JAX_DOCS), write(tmp_path, "kf.py", KUBEFLOW)
    plugin = sky.plugins.jax(initialize=False)
    with sky.ComputePool(nodes=2, plugins=[plugin], stream_output=False) as pool:
        run_as_main(str(kubeflow)) @ pool  # initializes, then shuts down: a new runtime next
        assert printed(pool, 1, "process 1/2 argv=[] psum=[2.]")
    with sky.ComputePool(nodes=2, plugins=[plugin], stream_output=False) as pool:
        run_as_main(str(docs)) @ pool
        assert printed(pool, 0, "[2.]") and printed(pool, 1, "[2.]")


# -- skyward run ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("script", ["docs", "kubeflow"])
def test_skyward_run_runs_launcher_scripts_unchanged(tmp_path: Path, script: str) -> None:
    path = write(tmp_path, f"{script}.py", JAX_DOCS if script == "docs" else KUBEFLOW)
    done = skyward_run("--nodes", "2", path.name, "--lr", "0.1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    if script == "docs":
        assert out.count("(node 0) [2.]") == 1 and out.count("(node 1) [2.]") == 1, out
    else:  # the script's own arguments reach it, and nothing of the command line
        for node in (0, 1):
            assert f"(node {node}) process {node}/2 argv=['--lr', '0.1'] psum=[2.]" in out, out


@pytest.mark.slow
def test_skyward_run_with_the_jax_plugin_and_env(tmp_path: Path) -> None:
    write(
        tmp_path,
        "show.py",
        """
        import os, sys
        print("seen", os.environ["GREETING"], os.environ["JAX_PROCESS_ID"],
              os.environ["JAX_NUM_PROCESSES"], os.getcwd() == sys.argv[1],
              os.environ["RANK"], os.environ["WORLD_SIZE"])
        """,
    )
    done = skyward_run(
        "--nodes", "2", "--plugin", "jax", "--env", "GREETING=hi", "show.py", str(tmp_path),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # torchrun's variables are there for every script too, beside JAX's
    assert "(node 0) seen hi 0 2 True 0 2" in done.stdout
    assert "(node 1) seen hi 1 2 True 1 2" in done.stdout


# A plain torchrun-style script: the launcher's variables, and init_process_group with no
# arguments but the backend.
TORCHRUN = """import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
seen = [os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
where = f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) > 0}"
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print("rank", *seen, where, "sum", int(total.item()), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_skyward_run_with_the_torch_plugin_runs_a_torchrun_script(tmp_path: Path) -> None:
    write(tmp_path, "train.py", TORCHRUN)
    done = skyward_run("--nodes", "2", "--plugin", "torch", "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"(node {rank}) rank {rank} 2 0 1 127.0.0.1:True sum 3" in done.stdout, done.stdout


PID_SCRIPT = """\
import os, sys, time
rank = os.environ["JAX_PROCESS_ID"]
with open(os.path.join(sys.argv[1], f"rank{rank}.pids"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}")
print(f"rank {rank} started", flush=True)
if rank == sys.argv[2]:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(120)
"""


def pids_of(tmp_path: Path, nodes: int, timeout: float = 60) -> list[int]:
    """The script's and its agent's pid on every node, once every rank wrote them."""
    deadline = time.monotonic() + timeout
    files = [tmp_path / f"rank{rank}.pids" for rank in range(nodes)]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    return [int(pid) for f in files for pid in f.read_text().split()]


@pytest.mark.slow
def test_the_first_failing_rank_ends_the_run_with_its_status(tmp_path: Path) -> None:
    write(tmp_path, "fail.py", PID_SCRIPT)
    started = time.monotonic()
    done = skyward_run("--nodes", "2", "fail.py", str(tmp_path), "1", cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "skyward run: rank 1 exited with status 3"
    assert elapsed < 30, f"rank 0 was not stopped: {elapsed:.1f} s"
    assert wait_gone(pids_of(tmp_path, 2)) == [], "a script or an agent was left behind"


@pytest.mark.slow
def test_ctrl_c_tears_everything_down(tmp_path: Path) -> None:
    write(tmp_path, "sleep.py", PID_SCRIPT)
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "skyward.cli",
            "run",
            "--nodes",
            "2",
            "sleep.py",
            str(tmp_path),
            "-",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=sigint_default,
    )
    try:
        pids = pids_of(tmp_path, 2)
        assert all(alive(pid) for pid in pids)
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130, err
    assert err.strip().splitlines()[-1] == "skyward run: interrupted; every node was stopped"
    assert "Traceback" not in err
    assert wait_gone(pids) == [], "a script or an agent was left behind"


def test_cli_errors_are_one_line_and_debug_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for argv, says in [
        (["run", "missing.py"], "skyward run: missing.py: no such script"),
        (["run", "--env", "=x", "x.py"], "--env takes KEY=VALUE or KEY, got '=x'"),
        (["run", "--env", "SKYWARD_UNSET_VAR", "x.py"], "SKYWARD_UNSET_VAR is not set in this"),
        (["run", "--plugin", "mxnet", "x.py"], "unknown plugin 'mxnet'; use jax, torch"),
        (["run", "--profile", "gpu", "x.py"], "no profile 'gpu' in skyward.toml"),
        (["run", "--nodes", "0", "x.py"], "--nodes must be at least 1"),
        (["run", "--provider", "ssh", "x.py"], "needs hosts: pass --hosts or set hosts"),
        (["status", "--profile", "nope"], "no profile 'nope'"),
    ]:
        Path("x.py").write_text("")
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err
    assert main(["--debug", "run", "missing.py"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("missing.py: no such script")


# -- profiles ------------------------------------------------------------------------------------


def test_profiles_from_skyward_toml_and_pyproject(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [project]
            name = "x"
            [tool.skyward.profile.default]
            provider = "local"
            nodes = 3
            [tool.skyward.profile.cloud]
            provider = "aws"
            region = "eu-west-1"
            spot = true
            accelerator = "A100:8"
            plugins = ["jax"]
            """
        )
    )
    assert profiles.load_profile(None, tmp_path).nodes == 3
    cloud = profiles.load_profile("cloud", tmp_path)
    assert (cloud.provider, cloud.options, cloud.accelerator, cloud.plugins) == (
        "aws", {"region": "eu-west-1", "spot": True}, "A100:8", ("jax",),
    )  # fmt: skip
    assert cloud.source == "pyproject.toml"
    # The file that chose the hosts is named, in full.
    said = capsys.readouterr().err
    assert f"profile 'cloud' from {(tmp_path / 'pyproject.toml').resolve()}" in said
    (tmp_path / "skyward.toml").write_text(
        textwrap.dedent(
            """
            [profile.default]
            provider = "ssh"
            hosts = ["10.0.0.1", "10.0.0.2"]
            user = "ubuntu"
            env = { WANDB_MODE = "offline" }
            """
        )
    )
    default = profiles.load_profile(None, tmp_path)  # skyward.toml wins
    assert default.provider == "ssh" and default.env == {"WANDB_MODE": "offline"}
    assert default.options == {"hosts": ["10.0.0.1", "10.0.0.2"], "user": "ubuntu"}
    assert [p.name for p in profiles.all_profiles(tmp_path)] == ["default", "cloud"]

    # Flags win; naming another provider drops the file's provider options.
    flags = {"nodes": 2, "env": {"A": "1"}, "options": {"user": "root", "key": None}}
    over = profiles.with_flags(default, flags)
    assert over.nodes == 2 and over.options["user"] == "root" and "key" not in over.options
    assert over.env == {"WANDB_MODE": "offline", "A": "1"}
    local = profiles.with_flags(default, {"provider": "local"})
    assert local.provider == "local" and local.options == {}
    assert isinstance(local.build_provider(), sky.Local)


def test_a_bad_profile_is_named(tmp_path: Path) -> None:
    (tmp_path / "skyward.toml").write_text('[profile.default]\nprovider = "local"\nregion = "x"\n')
    profile = profiles.load_profile(None, tmp_path)
    with pytest.raises(sky.ConfigError, match=r"profile 'default' \(skyward.toml\): region is not"):
        profile.build_provider()
    (tmp_path / "skyward.toml").write_text('[profile.default]\nprovider = "azure"\n')
    with pytest.raises(sky.ConfigError, match="unknown provider 'azure'; use local, ssh, aws, gcp"):
        profiles.load_profile(None, tmp_path)
    (tmp_path / "skyward.toml").write_text("[profile.default\n")
    with pytest.raises(sky.ConfigError, match=r"skyward\.toml cannot be read"):
        profiles.load_profile(None, tmp_path)


def test_a_budget_from_a_profile_or_max_cost_reaches_the_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "skyward.toml").write_text(
        textwrap.dedent(
            """
            [profile.default]
            provider = "ssh"
            hosts = ["10.0.0.1"]
            price_per_hour = 2.5
            max_cost = 10
            """
        )
    )
    profile = profiles.load_profile(None, tmp_path)
    assert profile.max_cost == 10.0
    assert profiles.with_flags(profile, {"max_cost": 4.0}).max_cost == 4.0
    provider = profile.build_provider()
    price = asyncio.run(provider.price(sky.ClusterSpec(nodes=1, pool_id="p")))
    assert (price.per_hour, price.minimum_seconds) == (2.5, 0.0)
    assert price.source == "as given by sky.SSH(price_per_hour=)"
    # --max-cost reaches ComputePool: a budget of nothing is refused there, in one line
    script = write(tmp_path, "noop.py", "print('hi')\n")
    assert main(["run", "--max-cost", "0", str(script)]) == 1
    err = capsys.readouterr().err
    assert "skyward run: --max-cost must be a positive number of US dollars" in err, err


# -- skyward status ------------------------------------------------------------------------------


def test_status_lists_this_users_local_pools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with sky.ComputePool(nodes=2, stream_output=False) as pool:
        agents = tuple(sorted(s.stream.pid for s in pool._dispatch.sessions))  # type: ignore[attr-defined]
        mine = [p for p in local_pools() if p.client == os.getpid()]
        assert [p.agents for p in mine] == [agents]
        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert f"here   client pid {os.getpid()} (" in out and "2 agent(s)" in out
    assert [p for p in local_pools() if p.client == os.getpid()] == []
