"""End to end over network-namespace hosts: JAX across 3 nodes, Keras on 2, env reuse."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers.source import source_hash
from skyward.transport.sshhost import SSHHost
from tests.contract import offline_image, probe_environment
from tests.ssh.conftest import Hosts, Server
from tests.support import sshd
from tests.test_private_cache import open_to_others

pytestmark = [pytest.mark.ssh]


@sky.compute
def sharded_sum(n: int) -> tuple[int, int, float, str]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    info = sky.instance_info()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    x = jax.make_array_from_callback(
        (n,), sharding, lambda idx: np.arange(n, dtype=np.float32)[idx]
    )
    total = jax.jit(jnp.sum)(x)
    return info.node, jax.process_count(), float(total), info.head_addr


@sky.compute
def keras_fit() -> tuple[list[float], list[list[float]]]:
    """Each node fits on its own rows; data parallelism must end with one shared model."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(7)
    # Each node already feeds its own rows (see tests/test_keras.py for the plugin bug).
    keras.distribution.distribution().auto_shard_dataset = False
    rng = np.random.default_rng(sky.instance_info().node)
    x = rng.normal(size=(128, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    weights = [np.asarray(w).ravel().tolist() for w in model.get_weights()]
    return [float(v) for v in history.history["loss"]], weights


@sky.compute
def where() -> str:
    return sky.instance_info().head_addr


@pytest.mark.slow
def test_jax_sharded_sum_across_three_namespace_hosts(netns_hosts: Hosts) -> None:
    with sky.ComputePool(
        provider=netns_hosts.provider(3), nodes=3, plugins=[sky.plugins.jax()]
    ) as pool:
        results = sharded_sum(3 * 1024) @ pool
    head = netns_hosts.net.addresses[0]
    expected = float(sum(range(3 * 1024)))
    assert [r[0] for r in results] == [0, 1, 2]
    assert all(r[1] == 3 and r[2] == expected and r[3] == head for r in results)


@pytest.mark.slow
def test_keras_data_parallel_fit_on_two_namespace_hosts(netns_hosts: Hosts) -> None:
    with sky.ComputePool(
        provider=netns_hosts.provider(2),
        nodes=2,
        plugins=[sky.plugins.jax(), sky.plugins.keras(backend="jax")],
    ) as pool:
        (loss_a, weights_a), (loss_b, weights_b) = keras_fit() @ pool
    assert weights_a == weights_b and loss_a == loss_b  # one model, one global loss
    assert loss_a[-1] < 0.5 * loss_a[0], loss_a


def test_head_addr_is_the_first_hosts_address(netns_hosts: Hosts) -> None:
    with sky.ComputePool(provider=netns_hosts.provider(3), nodes=3, stream_output=False) as pool:
        assert where() @ pool == [netns_hosts.net.addresses[0]] * 3


def test_second_pool_builds_nothing(
    netns_hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Setup commands append to a file: they must run once per image, whatever the pools.
    marker = tmp_path / f"setup-{uuid.uuid4().hex[:8]}"
    image = sky.Image(setup=[f"echo ran >> {marker}"])
    commands: list[str] = []
    real_run = SSHHost.run

    async def counting_run(self: SSHHost, command: str, *args: object, **kw: object) -> object:
        commands.append(f"{self} {command[:40]}")
        return await real_run(self, command, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(SSHHost, "run", counting_run)
    for _ in range(2):
        commands.clear()
        with sky.ComputePool(
            provider=netns_hosts.provider(3), nodes=3, image=image, stream_output=False
        ) as pool:
            assert len(where() @ pool) == 3
    # The hosts share this machine's disk, so the first pool's hosts race to build; one wins.
    assert marker.read_text() == "ran\n"
    # Per host: one check to start; nothing else runs as a command of its own (the removal of
    # the pool's output directory rides in the command that ends the pool's processes).
    assert len(commands) == 3, f"second pool ran more than one command per host: {commands}"


def test_a_pool_ends_with_one_command_a_host_that_kills_every_agent(
    netns_hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kill is a channel and a shell on the host (about 0.1 s of a small host's time):
    the agents that finished on their own are killed in the command that ends the rest of the
    host's processes and removes the pool's outputs, one a host, and none of them is left."""
    kills: list[tuple[str, list[int], str]] = []
    real_kill = SSHHost._kill

    async def counting_kill(self: SSHHost, pids: list[int], then: str = "") -> None:
        kills.append((str(self), list(pids), then))
        await real_kill(self, pids, then)

    monkeypatch.setattr(SSHHost, "_kill", counting_kill)
    with sky.ComputePool(provider=netns_hosts.provider(2), nodes=2, stream_output=False) as pool:
        assert len(where() @ pool) == 2
        agents = {str(s.stream.host): s.stream.pid for s in pool._sessions}  # type: ignore[attr-defined]
    assert sorted(host for host, _, _ in kills) == sorted(agents), kills
    for host, pids, then in kills:
        assert agents[host] in pids and "rm -rf" in then, kills
    for pid in agents.values():  # the hosts share this machine's process table
        assert not Path(f"/proc/{pid}").exists(), f"agent {pid} outlived its pool"


@pytest.mark.slow
def test_uv_environment_is_built_once_and_reused(local_sshd: Server) -> None:
    """As skyward-test with the system python3: the agent's pins are not there, so uv builds."""
    image = sky.Image(env={"SKYWARD_E2E": "1"}, pip=["six"])
    for _ in range(2):
        provider = local_sshd.provider(user="skyward-test")
        with sky.ComputePool(provider=provider, nodes=1, image=image, stream_output=False) as pool:
            python = interpreter() >> pool
    assert "/.cache/skyward/envs/" in python and python != sys.executable


@sky.compute
def interpreter() -> str:
    import six  # noqa: F401  (installed by the image)

    return sys.executable


@sky.compute
def first_line(data: str) -> tuple[str, str]:
    return data, (Path(data) / "a.txt").read_text()


def test_the_hosts_skyward_cache_dir_holds_what_skyward_keeps_there(
    keys: sshd.KeyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$SKYWARD_CACHE_DIR in a host's environment (here from sshd's SetEnv, as /etc/environment
    would give it) is where skyward's copy of itself and the sky.Data store go, and where the
    next pool's check finds them; all of it private."""
    cache = tmp_path / "host-cache"
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "a.txt").write_text("hello")
    commands: list[str] = []
    real_run = SSHHost.run

    async def counting_run(self: SSHHost, command: str, *args: object, **kw: object) -> object:
        commands.append(command)
        return await real_run(self, command, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(SSHHost, "run", counting_run)
    server = sshd.SshdServer(
        authorized_keys=[keys], extra_config=[f"SetEnv SKYWARD_CACHE_DIR={cache}"]
    )
    with server:
        host = Server(server, keys, server.write_known_hosts(tmp_path / "known_hosts"))
        for _ in range(2):
            commands.clear()
            with sky.ComputePool(provider=host.provider(), nodes=1, stream_output=False) as pool:
                where, text = first_line(sky.Data(str(dataset))) >> pool
    assert (cache / "src" / source_hash() / "skyward" / "__init__.py").is_file()
    assert where.startswith(f"{cache}/data/") and text == "hello", where
    # The second pool found skyward's copy where the first left it: it shipped nothing.
    assert not [c for c in commands if "-xzf - -C" in c], commands
    # A fresh cache on the host: nothing in it open to group or others (.skyward-ready holds
    # the environment's env= values; data and outputs are the user's).
    assert open_to_others(cache) == []


def test_a_local_and_an_ssh_pool_that_build_an_environment_keep_every_cache_private(
    netns_hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh caches on the client and on a host, each pool building an environment: the
    client's (Local's) and the host's get skyward's copy of itself, an environment built with
    uv (its locks, uv's files, `.skyward-ready` with the image's env=) and its agents'
    bytecode; the host also the client's uv, under bootstrap/ with its lock. Nothing in either
    cache is open to group or others, though both sides start with umask 022."""
    client, host = tmp_path / "client-cache", tmp_path / "host-cache"
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(client))
    monkeypatch.setenv("UV_OFFLINE", "1")  # every requirement is a local wheel
    # Bytecode as most machines write it: the agents' imports make __pycache__ in the cache.
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    built = offline_image(tmp_path / "wheels", "private")
    image = sky.Image(pip=built.pip, env={"SKYWARD_CANARY": "a secret"})
    on_host = {"SKYWARD_CACHE_DIR": str(host)}
    # A PATH with no uv on it: the host must take the client's (bootstrap/ and its lock).
    build_env = {**on_host, "UV_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    pools = [
        sky.ComputePool(provider=sky.Local(), nodes=2, image=image, stream_output=False),
        sky.ComputePool(
            provider=netns_hosts.provider(1, build_env=build_env),
            image=image,
            env=on_host,
            stream_output=False,
        ),
    ]
    previous = os.umask(0o022)  # the client's, and the host's login shell's (sshd's child)
    try:
        for pool in pools:
            with pool:
                assert {r[3] for r in probe_environment() @ pool} == {"private"}
    finally:
        os.umask(previous)
    for cache in (client, host):
        assert list(cache.glob("envs/*/.skyward-ready")), f"{cache} has no environment"
        assert list(cache.glob("envs/*/lib/*/site-packages/*/__pycache__/*.pyc")), cache
    assert list(host.glob("bootstrap/uv-*/bin/uv")), "the client's uv was sent to the host"
    assert open_to_others(client) == []
    assert open_to_others(host) == []


@sky.compute
def cache_seen() -> tuple[str, str]:
    return os.environ.get("SKYWARD_CACHE_DIR", ""), sys.executable


def test_the_suite_keeps_its_own_caches_on_the_client_and_on_hosts_sharing_this_machine(
    local_sshd: Server,
) -> None:
    """What earlier runs left in ~/.cache/skyward must not change a result: the client's cache
    and root's on the test sshd servers (which share this machine's filesystem) are the
    suite's own, made empty when it started (tests/conftest.py)."""
    home_cache = str(Path.home() / ".cache" / "skyward")
    client = os.environ["SKYWARD_CACHE_DIR"]
    assert not client.startswith(home_cache)
    image = sky.Image(env={"SKYWARD_HERMETIC": uuid.uuid4().hex})
    with sky.ComputePool(provider=local_sshd.provider(), image=image, stream_output=False) as p:
        cache, python = cache_seen() >> p
    assert cache == os.environ["SKYWARD_TEST_HOST_CACHE"] and not cache.startswith(home_cache)
    assert python == sys.executable, "root's interpreter satisfies the image: it runs as it is"
