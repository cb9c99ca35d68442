"""Local's GPU rules: what a pool asks for against what this machine has.

The inventories here are parsed from the nvidia-smi outputs in tests/data/gpus (one H100; eight
A100-SXM4-80GB; two A100s, one in MIG mode; none), written in the exact format those drivers
print (see its README). This is the one place where a recorded answer stands in for hardware:
CI has no GPU. The `gpu`-marked tests at the end run the same
rules on a real GPU, and are skipped where there is none.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.hardware import Accelerator
from skyward.providers.local import devices
from skyward.providers.local.provider import machine_gpus
from skyward.worker.gpus import Inventory, parse_smi
from tests.support.gpus import WheelSeen, fake_nvidia_smi, recorded, wheel


def machine(name: str) -> Inventory:
    """A real machine's inventory, from its recorded nvidia-smi outputs (tests/data/gpus)."""
    return parse_smi(recorded(name, "query.txt"), recorded(name, "nvidia-smi.txt"))


H100 = machine("h100-driver580")  # one H100 80GB HBM3, driver 580.159.04, CUDA 13.0
EIGHT_A100 = machine("a100x8-driver550")  # eight A100-SXM4-80GB, driver 550, CUDA 12.4
MIG = machine("a100-mig-driver535")  # two A100-SXM4-40GB, GPU 0 in MIG mode
NONE = Inventory(problem="nvidia-smi was not found on PATH")


def assign(
    inventory: Inventory, accelerator: str | None, nodes: int, visible: str | None = None
) -> list[tuple[int, ...]]:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    wanted = Accelerator.parse(accelerator) if accelerator else None
    owned = devices.assign(inventory, wanted, nodes, environ)
    return [tuple(gpu.index for gpu in node) for node in owned]


def test_a_cpu_pool_owns_no_gpu_and_its_nodes_see_none() -> None:
    assert assign(H100, None, 2) == [(), ()]
    assert devices.device_env(()) == {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}


def test_one_gpu_goes_to_one_node_by_any_name_it_answers_to() -> None:
    for name in ("GPU", "H100", "h100", "H100:1", "GPU:1"):
        assert assign(H100, name, 1) == [(0,)], name
    env = devices.device_env(H100.gpus)
    assert env["CUDA_VISIBLE_DEVICES"] == H100.gpus[0].uuid


def test_two_nodes_never_share_one_gpu() -> None:
    with pytest.raises(sky.ConfigError) as caught:
        assign(H100, "GPU", 2)
    message = str(caught.value)
    assert "needs 2 GPU(s)" in message and "1 x H100 (driver 580.159.04, CUDA 13.0)" in message
    assert "NCCL" in message


def test_gpus_are_dealt_out_disjoint_and_in_order() -> None:
    assert assign(EIGHT_A100, "A100:2", 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert assign(EIGHT_A100, "A100-80GB:8", 1) == [tuple(range(8))]
    assert assign(EIGHT_A100, "GPU", 3) == [(0,), (1,), (2,)]


def test_a_name_the_machine_does_not_have_says_what_it_has() -> None:
    with pytest.raises(sky.ConfigError, match=r"8 x A100-80GB \(driver 550"):
        assign(EIGHT_A100, "H100", 1)
    with pytest.raises(sky.ConfigError, match="needs 9 GPU"):
        assign(EIGHT_A100, "GPU:9", 1)


def test_gpus_in_mig_mode_are_not_handed_out_whole() -> None:
    assert assign(MIG, "GPU", 1) == [(1,)]  # GPU 0 is split into MIG instances
    with pytest.raises(sky.ConfigError, match="1 x A100 in MIG mode"):
        assign(MIG, "GPU", 2)


def test_no_gpu_at_all_is_named_as_such() -> None:
    with pytest.raises(sky.ConfigError, match="no NVIDIA GPU was found on this machine") as caught:
        assign(NONE, "GPU", 1)
    assert "nvidia-smi was not found on PATH" in str(caught.value)


def test_the_clients_own_cuda_visible_devices_limits_what_is_dealt() -> None:
    third = EIGHT_A100.gpus[2].uuid
    assert assign(EIGHT_A100, "GPU", 2, visible=f"5,{third}") == [(2,), (5,)]
    with pytest.raises(sky.ConfigError, match="hidden by CUDA_VISIBLE_DEVICES"):
        assign(EIGHT_A100, "GPU", 1, visible="")


def test_tpus_are_not_local() -> None:
    with pytest.raises(sky.ConfigError, match="TPU"):
        assign(EIGHT_A100, "TPU-V5E", 1)


# -- on this machine --------------------------------------------------------------------------


@sky.compute
def devices_seen() -> tuple[str | None, str | None, tuple[int, ...], str | None]:
    info = sky.instance_info()
    return (
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        os.environ.get("JAX_PLATFORMS"),
        info.devices,
        info.accelerator,
    )


def test_a_cpu_pool_here_hides_every_gpu_from_its_nodes() -> None:
    with sky.ComputePool(nodes=2, stream_output=False) as pool:
        assert devices_seen() @ pool == [("", "cpu", (), None)] * 2


@pytest.mark.skipif(bool(machine_gpus().gpus), reason="this machine has a GPU")
def test_asking_for_a_gpu_where_there_is_none_fails_at_once() -> None:
    began = time.monotonic()
    with pytest.raises(sky.ConfigError, match="no NVIDIA GPU was found"):
        sky.ComputePool(accelerator="GPU")
    assert time.monotonic() - began < 30  # generous: it must not wait for anything


@pytest.fixture
def recorded_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """This machine answers as the recorded 8 x A100-80GB one (driver 550, CUDA 12.4) does:
    its nvidia-smi first on PATH, a real ``pynvml`` hidden, the inventory asked anew."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv(
        "PATH", f"{fake_nvidia_smi('a100x8-driver550', tmp_path)}:{os.environ['PATH']}"
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    machine_gpus.cache_clear()
    yield
    machine_gpus.cache_clear()


@pytest.mark.usefixtures("recorded_machine")
def test_a_local_gpu_pool_gets_the_wheel_of_this_machines_driver() -> None:
    """The JAX plugin's wheel follows the driver's CUDA (12.4 here); a CPU pool's is jax[cpu]."""
    plugins = [sky.plugins.jax(initialize=False), WheelSeen()]
    with sky.ComputePool(nodes=2, accelerator="A100", plugins=plugins, stream_output=False) as p:
        assert wheel() @ p == ["jax[cuda12]"] * 2
        assert p.spec.cuda == "12.4"
        assert [d[2:] for d in devices_seen() @ p] == [((0,), "A100-80GB"), ((1,), "A100-80GB")]
    plugins = [sky.plugins.jax(initialize=False), WheelSeen()]
    with sky.ComputePool(nodes=1, plugins=plugins, stream_output=False) as p:
        assert wheel() >> p == "jax[cpu]"
        assert (p.spec.accelerator, p.spec.cuda) == (None, None)


# -- on a real GPU (skipped without one) -----------------------------------------------------


@sky.compute
def jitted_step() -> tuple[str, float]:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1024, 1024), jnp.float32)
    value = float(jax.jit(lambda a: (a @ a).sum())(x))
    return str(jax.devices()[0]), value


@pytest.mark.gpu
def test_one_node_with_the_gpu_runs_a_jitted_step_on_it() -> None:
    with sky.ComputePool(nodes=1, accelerator="GPU", stream_output=False) as pool:
        device, value = jitted_step() >> pool
        assert device.startswith("cuda:0"), device
        assert value == 1024.0 * 1024 * 1024
        assert (devices_seen() >> pool)[2] == (machine_gpus().gpus[0].index,)


@pytest.mark.gpu
def test_more_nodes_than_gpus_is_a_config_error_before_anything_starts() -> None:
    count = len(machine_gpus().gpus)
    with pytest.raises(sky.ConfigError, match=f"needs {count + 1} GPU"):
        sky.ComputePool(nodes=count + 1, accelerator="GPU")


@sky.compute
def interpreter_and_devices() -> tuple[str, list[str]]:
    import sys

    import jax

    return sys.executable, [str(device) for device in jax.devices()]


@pytest.mark.gpu
def test_a_cuda_jax_already_here_serves_a_gpu_pool_without_a_build() -> None:
    """The JAX plugin asks for jax[cuda13] (or cuda12) on a GPU node; this interpreter's jax,
    which runs on the GPU, satisfies it: the node runs this interpreter, no environment is
    built (where there is no package index, a build could not even start)."""
    import sys

    plugins = [sky.plugins.jax()]
    with sky.ComputePool(nodes=1, accelerator="GPU", plugins=plugins, stream_output=False) as p:
        python, devices = interpreter_and_devices() >> p
    assert python == sys.executable
    assert devices == ["cuda:0"]
    cuda = machine_gpus().cuda_major or 0
    assert p.spec.cuda == machine_gpus().cuda
    assert f"jax[{'cuda13' if cuda >= 13 else 'cuda12'}]" in p.image.pip
