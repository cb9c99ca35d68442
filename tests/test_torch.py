"""The PyTorch plugin: its image transform (fast unit tests) and real ``torch.distributed``
across Local nodes (slow: real child processes, gloo on the CPU; NCCL on a GPU machine)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward.hardware import Accelerator, ClusterSpec
from skyward.plugins.keras_plugin import TORCH_DATA_PARALLEL
from skyward.plugins.torch_plugin import TORCH_PACKAGES, TORCH_WHEELS
from tests.conftest import start_with_node_1_stuck
from tests.support.listeners import listeners

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def cluster(accelerator: str | None = None, cuda: str | None = None) -> ClusterSpec:
    return ClusterSpec(
        nodes=2,
        pool_id="pool-test",
        accelerator=Accelerator.parse(accelerator) if accelerator else None,
        cuda=cuda,
    )


def wheels(build: str) -> sky.Index:
    return sky.Index(f"{TORCH_WHEELS}/{build}", packages=TORCH_PACKAGES)


# -- the transform hook (no processes) -----------------------------------------------------------


def test_a_cpu_pool_gets_torch_from_the_cpu_index_scoped_to_the_torch_packages() -> None:
    image = sky.plugins.torch().transform(sky.Image(pip=["numpy"]), cluster())
    assert image.pip == ("numpy", "torch")
    assert image.indexes == (wheels("cpu"),)


@pytest.mark.parametrize(
    ("cuda", "build"),
    [(None, "cu126"), ("12.2", "cu126"), ("12.6", "cu126"), ("12.9", "cu128"), ("13.1", "cu130")],
)
def test_gpu_nodes_get_the_newest_cuda_build_their_driver_runs(
    cuda: str | None, build: str
) -> None:
    image = sky.plugins.torch().transform(sky.Image(), cluster("H100:8", cuda))
    assert image.indexes == (wheels(build),)


def test_a_driver_too_old_for_any_cuda_build_is_a_clear_error() -> None:
    with pytest.raises(sky.ConfigError, match=r"CUDA 11\.8; PyTorch's CUDA builds need 12\.0"):
        sky.plugins.torch().transform(sky.Image(), cluster("A100", "11.8"))


def test_an_image_whose_default_index_is_a_mirror_takes_torch_from_it() -> None:
    mirror = sky.Index("http://10.0.0.1:8000/simple/", default=True)
    image = sky.plugins.torch().transform(sky.Image(indexes=[mirror]), cluster("A100", "12.8"))
    assert image.indexes == (mirror,)
    assert image.pip == ("torch",)


def test_an_extra_index_for_every_package_keeps_the_cpu_build_on_cpu_nodes() -> None:
    """An extra index (a company's own packages, `--index`, `extra-index-url`) is asked before
    PyPI but does not replace it: torch still comes from PyTorch's CPU index, not as PyPI's
    3 GB CUDA build."""
    extra = sky.Index("http://10.0.0.1:8000/simple/")
    image = sky.plugins.torch().transform(sky.Image(indexes=[extra]), cluster())
    assert image.indexes == (extra, wheels("cpu"))
    gpu = sky.plugins.torch().transform(sky.Image(indexes=[extra]), cluster("A100", "12.8"))
    assert gpu.indexes == (extra, wheels("cu128"))


def test_version_pins_torch_and_the_images_own_requirement_is_kept_otherwise() -> None:
    mine = sky.Image(pip=["torch>=2.5,<3"])
    assert sky.plugins.torch().transform(mine, cluster()).pip == ("torch>=2.5,<3",)
    pinned = sky.plugins.torch(version="2.13.0").transform(mine, cluster())
    assert pinned.pip == ("torch==2.13.0",)


def test_an_unknown_backend_fails_at_construction() -> None:
    with pytest.raises(sky.ConfigError, match=r"backend='mpi'.*'gloo', 'nccl'"):
        sky.plugins.torch(backend="mpi")


# -- real process groups on Local nodes ----------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.ComputePool]:
    """Two Local nodes with torch and keras on its torch backend, shared by the module's calls
    (the client's interpreter has torch 2.13.0: no environment is built)."""
    plugins = [sky.plugins.torch(), sky.plugins.keras(backend="torch")]
    with sky.ComputePool(provider=sky.Local(), nodes=2, plugins=plugins) as pool:
        yield pool


@sky.compute
def group_and_env() -> dict[str, Any]:
    import torch.distributed as dist

    return {
        "initialized": dist.is_initialized(),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {name: os.environ[name] for name in (*TORCHRUN_VARS, "MASTER_PORT")},
    }


def test_node_0s_store_listens_only_on_the_pools_address(pool: sky.ComputePool) -> None:
    # Local nodes share one network: 127.0.0.1, never torch's default (every interface).
    store, listening = pool.run(listeners("torch"), node=0)
    assert store.startswith("127.0.0.1:") and listening == [store]


@sky.compute
def train_ddp(steps: int) -> list[bytes]:
    """`steps` DDP steps of a small model, each node on its own data; the parameters' bytes."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL: one GPU per rank
    torch.manual_seed(0)  # the same start; DDP also broadcasts rank 0's parameters
    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DistributedDataParallel(layers.to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + sky.instance_info().node)  # each node its own
    for _ in range(steps):
        x = torch.randn(32, 8, generator=data).to(device)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().cpu().numpy().tobytes() for p in model.parameters()]


@sky.compute
def local_step(seed: int) -> list[bytes]:
    """One plain (not DDP) step on this node's data: what the nodes would drift to alone."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed + sky.instance_info().node))
    torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad  # type: ignore[operator]
    return [p.detach().numpy().tobytes() for p in model.parameters()]


@pytest.mark.slow
def test_every_node_joins_one_gloo_group_with_torchruns_variables(pool: sky.ComputePool) -> None:
    seen = group_and_env() @ pool
    ports = {node["env"]["MASTER_PORT"] for node in seen}
    assert len(ports) == 1 and ports != {str(pool_head_port(pool))}
    for node, found in enumerate(seen):
        assert found["initialized"] and found["backend"] == "gloo"
        assert (found["rank"], found["world"]) == (node, 2)
        assert found["env"] == {
            "RANK": str(node),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": found["env"]["MASTER_PORT"],
        }


def pool_head_port(pool: sky.ComputePool) -> int:
    @sky.compute
    def head_port() -> int:
        return sky.instance_info().head_port

    return head_port() >> pool


@pytest.mark.slow
def test_ddp_on_each_nodes_own_data_ends_with_bit_identical_parameters(
    pool: sky.ComputePool,
) -> None:
    first, second = train_ddp(30) @ pool
    assert first == second
    # Without DDP the same kind of step on each node's own data drifts apart: the test can fail.
    alone = local_step(1000) @ pool
    assert alone[0] != alone[1]


@sky.compute
def keras_backend() -> tuple[str, str]:
    import keras

    return os.environ["KERAS_BACKEND"], keras.backend.backend()


@pytest.mark.slow
def test_keras_runs_on_the_torch_backend_on_every_node(pool: sky.ComputePool) -> None:
    assert keras_backend() @ pool == [("torch", "torch")] * 2
    assert TORCH_DATA_PARALLEL in pool.logs(0)
    assert TORCH_DATA_PARALLEL not in pool.logs(1)  # said once


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_node_that_never_joins_the_group_is_named(tmp_path: Path) -> None:
    message = str(start_with_node_1_stuck(tmp_path, sky.plugins.torch(timeout=3)))
    assert "plugin 'torch' failed in around_app on node 0" in message, message
    assert "node 1 never reached plugin 'torch': it was in plugin 'slow'" in message
    assert "node 1 is stuck in the slow plugin" in message


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_ddp_over_nccl_with_one_gpu_per_rank(nodes: int) -> None:
    from skyward.providers.local.provider import machine_gpus

    if len(machine_gpus().gpus) < nodes:
        pytest.skip(f"needs a machine with {nodes} NVIDIA GPUs (NCCL: one GPU per rank)")
    plugins = [sky.plugins.torch()]
    with sky.ComputePool(
        provider=sky.Local(), nodes=nodes, accelerator="GPU", plugins=plugins
    ) as p:
        seen = group_and_env() @ p
        assert [(n["backend"], n["rank"], n["world"]) for n in seen] == [
            ("nccl", rank, nodes) for rank in range(nodes)
        ]
        trained = train_ddp(30) @ p
        assert all(params == trained[0] for params in trained)
