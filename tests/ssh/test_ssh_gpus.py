"""SSH hosts report their GPUs, and a pool that names an accelerator checks every host for it.

The test hosts are real sshd servers on 127.0.0.1 without a GPU. A host "has" GPUs through a
fake ``nvidia-smi`` first on its login PATH (sshd's ``SetEnv PATH=...``): a script printing an
output recorded in the exact format of a real machine's (``tests/data/gpus``). The recorded
nvidia-smi output stands in for the GPU; everything else (SSH, the host check, the bootstrap,
the agent, `instance_info`) is real. On a machine with a real GPU and ``pynvml``, NVML would
answer the hosts' check before the fake nvidia-smi: the hosts' logins get a ``pynvml`` that
cannot be imported first on their PYTHONPATH (the agent's own PYTHONPATH replaces it).

The JAX wheel the pool chose is seen on the nodes themselves: `WheelSeen` (after the JAX
plugin) swaps the image's jax requirement for a variable naming it, so nothing is built.
"""

from __future__ import annotations

import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import cloudpickle
import pytest

import skyward as sky
import tests.support.gpus
from tests.ssh.conftest import BUILD_ENV, Server
from tests.support import sshd
from tests.support.gpus import WheelSeen, fake_nvidia_smi, recorded, wheel

pytestmark = pytest.mark.ssh

# What sshd gives root when nothing else says (OpenSSH's default for uid 0).
_ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

GpuHost = Callable[[str], Server]
# The tests use `local_sshd` as the host without a GPU.
no_gpu_here = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi"
)


@sky.compute
def gpus_seen() -> tuple[str | None, int, tuple[int, ...]]:
    info = sky.instance_info()
    return info.accelerator, info.accelerator_count, info.devices


@pytest.fixture
def gpu_host(keys: sshd.KeyPair, tmp_path: Path) -> Iterator[GpuHost]:
    """Start an sshd whose logins find `machine`'s recorded nvidia-smi first on PATH."""
    servers: list[sshd.SshdServer] = []

    hidden = tmp_path / "no-nvml"
    hidden.mkdir()
    (hidden / "pynvml.py").write_text('raise ImportError("hidden: nvidia-smi is recorded")\n')

    def make(machine: str) -> Server:
        fake = fake_nvidia_smi(machine, tmp_path / machine / "bin")
        server = sshd.SshdServer(
            authorized_keys=[keys],
            extra_config=[f"SetEnv PATH={fake}:{_ROOT_PATH} PYTHONPATH={hidden}"],
        )
        servers.append(server)
        server.start()
        known = server.write_known_hosts(tmp_path / machine / "known_hosts")
        return Server(server, keys, known)

    try:
        yield make
    finally:
        for server in servers:
            server.close()


def pool(hosts: list[Server], tmp_path: Path, **kwargs: object) -> sky.ComputePool:
    known = tmp_path / "known_hosts_all"
    known.write_text("".join(h.known_hosts.read_text() for h in hosts))
    provider = sky.SSH(
        [h.host() for h in hosts],
        key=str(hosts[0].key.private_path),
        known_hosts=str(known),
        python=sys.executable,
        build_env=BUILD_ENV,
    )
    return sky.ComputePool(provider=provider, stream_output=False, **kwargs)  # type: ignore[arg-type]


@no_gpu_here
def test_each_host_reports_its_own_gpus(
    gpu_host: GpuHost, local_sshd: Server, tmp_path: Path
) -> None:
    """Node 0's host replays a recorded 1 x H100 nvidia-smi, node 1's host has no nvidia-smi:
    with no accelerator named, each node reports what its host has."""
    with pool([gpu_host("h100-driver580"), local_sshd], tmp_path) as p:
        assert gpus_seen() @ p == [("H100", 1, (0,)), (None, 0, ())]


def test_a_pool_gets_the_gpus_it_names(gpu_host: GpuHost, tmp_path: Path) -> None:
    """A host replaying a recorded 8 x A100-SXM4-80GB nvidia-smi serves accelerator="A100:8"
    (any A100 size); its 8 GPUs are the node's."""
    with pool([gpu_host("a100x8-driver550")], tmp_path, accelerator="A100:8") as p:
        assert gpus_seen() @ p == [("A100-80GB", 8, tuple(range(8)))]


@sky.compute
def visible_devices() -> tuple[str | None, str | None]:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER")


def test_a_node_owns_and_sees_only_as_many_gpus_as_named(gpu_host: GpuHost, tmp_path: Path) -> None:
    """On the recorded 8 x A100-SXM4-80GB host, accelerator="A100:2" gives the node the first
    two, and its processes see exactly those (by UUID)."""
    recorded_uuids = [
        line.split(", ")[3] for line in recorded("a100x8-driver550", "query.txt").splitlines()
    ]
    with pool([gpu_host("a100x8-driver550")], tmp_path, accelerator="A100:2") as p:
        assert gpus_seen() >> p == ("A100-80GB", 2, (0, 1))
        assert visible_devices() >> p == (",".join(recorded_uuids[:2]), "PCI_BUS_ID")


def test_a_host_without_the_gpus_asked_for_fails_the_start_before_anything_is_built(
    gpu_host: GpuHost, tmp_path: Path
) -> None:
    """A host replaying a recorded 1 x H100 nvidia-smi, asked for H100:8. The image's apt
    package does not exist: had anything been built before the GPU check, apt would fail first."""
    host = gpu_host("h100-driver580")
    image = sky.Image(apt=[f"skyward-no-such-deb-{uuid.uuid4().hex[:6]}"])
    with (
        pytest.raises(sky.BootstrapError) as caught,
        pool([host], tmp_path, accelerator="H100:8", image=image),
    ):
        pass
    assert (
        f"host root@127.0.0.1:{host.port} has 1 x H100 (driver 580.159.04, CUDA 13.0); "
        "the pool asked for H100:8" in str(caught.value)
    )
    assert caught.value.node == 0


@no_gpu_here
def test_mig_gpus_do_not_count_and_a_host_without_a_gpu_says_why(
    gpu_host: GpuHost, local_sshd: Server, tmp_path: Path
) -> None:
    """A host replaying a recorded nvidia-smi of 2 x A100-40GB, one in MIG mode, has one usable
    A100; a host without nvidia-smi has none, and the error says nvidia-smi is missing."""
    mig = gpu_host("a100-mig-driver535")
    with pytest.raises(sky.BootstrapError, match=re.escape("1 x A100 in MIG mode, 1 x A100")):
        with pool([mig], tmp_path, accelerator="A100:2"):
            pass
    with pool([mig], tmp_path, accelerator="A100") as p:
        assert gpus_seen() @ p == [("A100", 1, (1,))]
    expected = "has no NVIDIA GPU (nvidia-smi was not found on PATH); the pool asked for GPU"
    with pytest.raises(sky.BootstrapError, match=re.escape(expected)):
        with pool([local_sshd], tmp_path, accelerator="GPU"):
            pass


# -- the JAX wheel follows what the hosts have ----------------------------------------------------


@pytest.fixture(autouse=True)
def _wheel_seen_by_value() -> None:
    # The hosts cannot import the tests' support modules: `WheelSeen` travels by value.
    cloudpickle.register_pickle_by_value(tests.support.gpus)


def jax_pool(
    hosts: list[Server], tmp_path: Path, cuda: str | None = None, **kwargs: object
) -> sky.ComputePool:
    plugins = [sky.plugins.jax(cuda, initialize=False), WheelSeen()]
    return pool(hosts, tmp_path, plugins=plugins, **kwargs)


@pytest.mark.parametrize(
    ("machines", "accelerator", "expected"),
    [
        (["h100-driver580"], "H100", "jax[cuda13]"),  # driver 580: CUDA 13.0
        (["a100x8-driver550"], "A100:8", "jax[cuda12]"),  # driver 550: CUDA 12.4
        (["h100-driver580", "a100x8-driver550"], "GPU", "jax[cuda12]"),  # the lowest wins
    ],
)
def test_the_jax_wheel_follows_the_hosts_drivers(
    gpu_host: GpuHost, tmp_path: Path, machines: list[str], accelerator: str, expected: str
) -> None:
    """No `cuda=`: every node gets the wheel that the oldest driver among the hosts runs."""
    hosts = [gpu_host(machine) for machine in machines]
    with jax_pool(hosts, tmp_path, accelerator=accelerator) as p:
        assert wheel() @ p == [expected] * len(hosts)
        assert p.spec.cuda == ("12.4" if "a100x8-driver550" in machines else "13.0")


def test_gpu_hosts_with_no_accelerator_named_get_a_cuda_wheel_and_report_their_gpus(
    gpu_host: GpuHost, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No `accelerator=` on a host replaying a recorded 1 x H100 (CUDA 13.0): the pool runs on
    its GPU, says so, and the plugins see it; the plan made before launch (the CPU wheel) was
    checked on the host, then the CUDA one: two check commands."""
    caplog.set_level("DEBUG", logger="skyward")
    seen = WheelSeen()
    hosts = [gpu_host("h100-driver580")]
    plugins = [sky.plugins.jax(initialize=False), seen]
    with pool(hosts, tmp_path, plugins=plugins) as p:
        assert wheel() @ p == ["jax[cuda13]"]
        assert gpus_seen() @ p == [("H100", 1, (0,))]
        assert (str(p.spec.accelerator), p.spec.cuda) == ("H100", "13.0")
    assert [(s.accelerator, s.cuda) for s in seen.specs] == [
        (None, None),
        (p.spec.accelerator, "13.0"),
    ]
    assert "no accelerator named; every node has 1 x H100 (CUDA 13.0)" in caplog.text
    assert checks(caplog) == 2


@no_gpu_here
def test_hosts_without_a_gpu_get_the_cpu_wheel_with_one_check_each(
    gpu_host: GpuHost, local_sshd: Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a host that has no GPU, the pool is a CPU pool, as planned before launch: the
    survey's check is the one the host is prepared by. A GPU host beside it still owns its
    GPU, but the wheel is the one every node runs."""
    caplog.set_level("DEBUG", logger="skyward")
    with jax_pool([local_sshd], tmp_path) as p:
        assert wheel() @ p == ["jax[cpu]"]
        assert p.spec.accelerator is None and p.spec.cuda is None
    assert checks(caplog) == 1
    with jax_pool([gpu_host("h100-driver580"), local_sshd], tmp_path) as p:
        assert wheel() @ p == ["jax[cpu]", "jax[cpu]"]
        assert gpus_seen() @ p == [("H100", 1, (0,)), (None, 0, ())]


def test_an_explicit_cuda_wins_over_the_hosts_driver(gpu_host: GpuHost, tmp_path: Path) -> None:
    """`cuda="cuda12"` on a host whose driver supports CUDA 13 (with or without a name)."""
    host = gpu_host("h100-driver580")
    with jax_pool([host], tmp_path, cuda="cuda12", accelerator="H100") as p:
        assert wheel() @ p == ["jax[cuda12]"]
    with jax_pool([host], tmp_path, cuda="cuda12") as p:
        assert wheel() @ p == ["jax[cuda12]"]


def checks(caplog: pytest.LogCaptureFixture) -> int:
    """How many host check commands the pool ran (each is logged as a step of its node)."""
    return sum(r.getMessage().endswith(": checking the host") for r in caplog.records)
