"""Several ranks on a node (`processes_per_node`, `skyward run --nproc-per-node`): a process
each, torchrun's variables in each, one torch.distributed group and one JAX world over every
rank of every node, results in global rank order, output lines and directories per rank, a
lost node replaced with all its ranks, and bad values refused before anything starts (real
child processes on Local; the GPU test needs a real GPU)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward.client.handshake import identities
from skyward.client.plan import ranks_per_node
from skyward.console.rendering import Prefixes, who
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.base import Node
from skyward.transport.base import AgentStream
from tests.conftest import worker_children
from tests.test_cli_run import skyward_run, write

TORCHRUN = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def spec(accelerator: str | None = None, nodes: int = 2, ranks: int = 1) -> ClusterSpec:
    return ClusterSpec(
        nodes=nodes,
        pool_id="pool-test",
        accelerator=Accelerator.parse(accelerator) if accelerator else None,
        processes_per_node=ranks,
    )


# -- the default and the identities (no processes) -----------------------------------------------


@pytest.mark.parametrize(
    ("plugins", "accelerator", "expected"),
    [
        ([sky.plugins.torch()], "H100:8", 8),
        ([sky.plugins.keras(backend="torch")], "A100:4", 4),
        ([sky.plugins.torch()], None, 1),  # CPU nodes: one rank each
        ([sky.plugins.torch()], "TPU-V5E:4", 1),
        ([sky.plugins.torch(initialize=False)], "H100:8", 1),  # torchrun's own default
        ([sky.plugins.torch(initialize=False, per_gpu=True)], "H100:8", 8),  # skyward run's
        ([sky.plugins.torch(per_gpu=False)], "H100:8", 1),
        ([sky.plugins.jax()], "H100:8", 1),  # JAX: one process sees every device of a node
        ([sky.plugins.keras(backend="jax")], "H100:8", 1),
        ([], "H100:8", 1),
    ],
)
def test_the_default_is_a_rank_per_gpu_for_pytorch_and_one_per_node_otherwise(
    plugins: list[sky.Plugin], accelerator: str | None, expected: int
) -> None:
    assert ranks_per_node(None, plugins, spec(accelerator)) == expected
    assert ranks_per_node(3, plugins, spec(accelerator)) == 3  # what is asked wins


class _Slot(Node):
    """A node that only has an index and an address: what the identities read of it."""

    async def start_agent(self, env: Any) -> AgentStream:
        raise NotImplementedError


def test_every_rank_knows_its_node_and_its_rank_in_global_order() -> None:
    nodes = [_Slot(0, "10.0.0.1", "h0"), _Slot(1, "10.0.0.2", "h1")]
    infos = identities(nodes, spec(ranks=3), {"head": 5000}, ["outputs/p/node-0", "/o/node-1"])
    assert [(i.node, i.rank, i.local_rank) for i in infos] == [
        (0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 3, 0), (1, 4, 1), (1, 5, 2)
    ]  # fmt: skip
    assert {(i.total_nodes, i.processes_per_node, i.world_size) for i in infos} == {(2, 3, 6)}
    assert [i.is_head for i in infos] == [True] + [False] * 5
    assert infos[4].output_dir == "/o/node-1/rank-4"
    assert infos[1].output_dir == "outputs/p/node-0/rank-1"
    # One rank a node: the rank is the node, and its directory the node's, as it always was.
    alone = identities(nodes, spec(), {"head": 5000}, ["outputs/p/node-0", "/o/node-1"])
    assert [(i.rank, i.world_size, i.output_dir) for i in alone] == [
        (0, 2, "outputs/p/node-0"),
        (1, 2, "/o/node-1"),
    ]


def test_lines_name_the_node_alone_with_one_rank_a_node_and_the_rank_beside_it() -> None:
    assert who(3, 1) == "node 3"
    assert who(3, 2) == "node 1 rank 3"
    prefixes = Prefixes(open(os.devnull, "w"))  # noqa: SIM115 (not a terminal: plain text)
    assert prefixes[1] == "(node 1) "
    assert prefixes.rank(3, 2) == "(node 1 rank 3) "


# -- bad values, before anything starts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "accelerator"),
    [(0, None), (-1, None), (1.5, None), ("2", None), (True, None), (3, "GPU:2")],
    ids=["zero", "negative", "float", "string", "bool", "beyond-gpus"],
)
def test_a_bad_processes_per_node_is_a_config_error_naming_it_before_anything_starts(
    value: object, accelerator: str | None
) -> None:
    before = set(worker_children())
    began = time.monotonic()
    with pytest.raises(sky.ConfigError, match="processes_per_node") as caught:
        sky.ComputePool(
            nodes=2,
            accelerator=accelerator,
            processes_per_node=value,  # type: ignore[arg-type]
            plugins=[sky.plugins.torch()],
            stream_output=False,
        )
    assert time.monotonic() - began < 5
    assert set(worker_children()) == before  # nothing started
    if accelerator is not None:  # what to do instead, whether or not this machine has GPUs
        assert "2 GPU(s) each node has" in str(caught.value) and "'GPU:3'" in str(caught.value)


def test_a_bad_per_gpu_is_a_config_error_naming_it() -> None:
    with pytest.raises(sky.ConfigError, match=r"torch\(per_gpu=\) must be True or False"):
        sky.plugins.torch(per_gpu="yes")  # type: ignore[arg-type]


def test_skyward_run_refuses_a_bad_nproc_per_node(tmp_path: Path) -> None:
    # (a detached run's: tests/test_detached_ranks.py)
    write(tmp_path, "noop.py", "print('never run')\n")
    zero = skyward_run("--nproc-per-node", "0", "noop.py", cwd=tmp_path, timeout=30)
    assert zero.returncode != 0 and "--nproc-per-node (processes_per_node)" in zero.stderr


# -- PyTorch: 2 nodes x 2 ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_pool() -> Iterator[sky.ComputePool]:
    plugins = [sky.plugins.torch()]
    with sky.ComputePool(nodes=2, processes_per_node=2, plugins=plugins) as pool:
        yield pool


@sky.compute
def torchrun_view() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    info = sky.instance_info()
    return {
        "env": tuple(int(os.environ[name]) for name in TORCHRUN),
        "group": (dist.get_rank(), dist.get_world_size()),
        "sum": total.item(),
        "info": (info.node, info.rank, info.local_rank, info.processes_per_node, info.world_size),
        "pid": os.getpid(),
    }


@sky.compute
def ddp_on_rank_data(steps: int) -> list[bytes]:
    """`steps` DDP steps, each rank on its own data; the parameters' bytes."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = DistributedDataParallel(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + sky.instance_info().rank)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().numpy().tobytes() for p in model.parameters()]


@sky.compute
def rank_of_a_plain_step(seed: int) -> list[bytes]:
    """A plain step on this rank's own data (`local_step`, seeded by rank here)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed + sky.instance_info().rank))
    torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
    return [p.grad.numpy().tobytes() for p in model.parameters() if p.grad is not None]


@pytest.mark.slow
def test_two_nodes_of_two_ranks_are_four_torchrun_ranks_in_one_group(
    torch_pool: sky.ComputePool,
) -> None:
    seen = torchrun_view() @ torch_pool
    assert [r["env"] for r in seen] == [
        (0, 0, 0, 4, 2),
        (1, 1, 0, 4, 2),
        (2, 0, 1, 4, 2),
        (3, 1, 1, 4, 2),
    ]
    assert [r["group"] for r in seen] == [(rank, 4) for rank in range(4)]
    assert [r["sum"] for r in seen] == [6.0] * 4  # 0 + 1 + 2 + 3 in every rank
    assert [r["info"] for r in seen] == [(r // 2, r, r % 2, 2, 4) for r in range(4)]
    assert len({r["pid"] for r in seen}) == 4  # a process a rank
    assert torch_pool.spec.processes_per_node == 2 and len(torch_pool.nodes) == 2
    assert [(i.node, i.rank) for i in torch_pool.infos] == [(0, 0), (0, 1), (1, 2), (1, 3)]


@pytest.mark.slow
def test_ddp_over_four_ranks_ends_bit_identical_in_all_four(torch_pool: sky.ComputePool) -> None:
    trained = ddp_on_rank_data(30) @ torch_pool
    assert len(trained) == 4 and all(params == trained[0] for params in trained)
    # Each rank's own data gives its own gradients: without DDP they would drift apart.
    alone = rank_of_a_plain_step(1000) @ torch_pool
    assert len({b"".join(grads) for grads in alone}) == 4


@sky.compute
def rank_line() -> int:
    print(f"this is rank {sky.instance_info().rank}", flush=True)
    return sky.instance_info().rank


@pytest.mark.slow
def test_one_rank_and_every_ranks_lines_named_by_node_and_rank(
    torch_pool: sky.ComputePool, capfd: pytest.CaptureFixture[str]
) -> None:
    assert torch_pool.run(rank_line(), rank=3) == 3
    assert torch_pool.run(rank_line(), node=1) == 2  # a node's first rank
    assert rank_line() >> torch_pool in range(4)
    rank_line() @ torch_pool
    # A node's output travels apart from its replies (docs/concepts.md): on a loaded machine
    # the broadcast's lines may land a moment after its results.
    deadline = time.monotonic() + 10
    while "(node 0 rank 1) this is rank 1" not in torch_pool.logs():
        assert time.monotonic() < deadline, torch_pool.logs()
        time.sleep(0.05)
    out = capfd.readouterr().out
    assert "(node 1 rank 3) this is rank 3" in out and "(node 0 rank 1) this is rank 1" in out
    assert "(node 1 rank 3) this is rank 3" in torch_pool.logs()
    assert "(node 1 rank 2) this is rank 2" in torch_pool.logs(1)
    assert not any("rank 0" in line for line in torch_pool.logs(1))
    assert set(torch_pool.stacks()) == {0, 1, 2, 3}
    with pytest.raises(sky.ConfigError, match=r"rank must be in 0\.\.3, got 4"):
        torch_pool.run(rank_line(), rank=4)
    with pytest.raises(sky.ConfigError, match=r"node must be in 0\.\.1, got 2"):
        torch_pool.run(rank_line(), node=2)


# -- JAX: 2 nodes x 2 processes ------------------------------------------------------------------


@sky.compute
def jax_world() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices(), ("i",))
    ones = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("i")), jnp.ones(len(jax.local_devices()))
    )
    psum = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    )(ones)
    return {
        "count": jax.process_count(),
        "index": jax.process_index(),
        "local": len(jax.local_devices()),
        "devices": len(jax.devices()),
        "psum": float(psum[0]),
    }


@pytest.mark.slow
def test_jax_has_a_process_a_rank_each_with_its_own_device() -> None:
    with sky.ComputePool(nodes=2, processes_per_node=2, plugins=[sky.plugins.jax()]) as pool:
        seen = jax_world() @ pool
    assert [r["index"] for r in seen] == [0, 1, 2, 3]
    assert {(r["count"], r["local"], r["devices"]) for r in seen} == {(4, 1, 4)}
    assert [r["psum"] for r in seen] == [4.0] * 4  # the device count, in every process


# -- outputs, failures and recovery per node -----------------------------------------------------


@sky.compute
def write_output() -> str:
    info = sky.instance_info()
    (Path(sky.output_dir()) / "mine.txt").write_text(f"rank {info.rank}")
    return sky.output_dir()


@sky.compute
def agent_pid() -> int:
    return os.getpid()


@sky.compute
def rank_3_dies_once(marker: str) -> int:
    info = sky.instance_info()
    if info.rank == 3 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    return info.rank


@pytest.mark.slow
def test_outputs_per_rank_and_a_lost_node_replaced_with_all_its_ranks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = str(tmp_path / "died")
    with sky.ComputePool(
        nodes=2, processes_per_node=2, restarts=1, output_dir=tmp_path / "out"
    ) as pool:
        dirs = write_output() @ pool
        first, second, pids = pool.nodes[0], pool.nodes[1], agent_pid() @ pool
        ranks = rank_3_dies_once(marker) @ pool
        kept, replaced = pool.nodes[0] is first, pool.nodes[1] is not second
        after = agent_pid() @ pool
    assert os.path.exists(marker), "rank 3 never died: nothing was tested"
    assert ranks == [0, 1, 2, 3]
    assert kept and replaced  # the node of the lost rank, not the other
    assert not set(pids) & set(after) and len(set(after)) == 4  # every rank started again
    err = capfd.readouterr().err
    assert "replacing node(s) [1]" in err and "the agent of node 1 rank 3 died" in err, err
    for rank, where in enumerate(dirs):
        kept_at = tmp_path / "out" / f"node-{rank // 2}" / f"rank-{rank}"
        assert where == str(kept_at)
        assert (kept_at / "mine.txt").read_text() == f"rank {rank}"


@sky.compute
def rank_2_raises() -> int:
    if sky.instance_info().rank == 2:
        raise ValueError("rank 2 gives up")
    time.sleep(60)
    return 0


@pytest.mark.slow
def test_a_rank_that_fails_stops_every_other_rank_on_every_node() -> None:
    with sky.ComputePool(
        nodes=2, processes_per_node=2, broadcast_grace=0.5, stream_output=False
    ) as pool:
        began = time.monotonic()
        with pytest.raises(ValueError, match="rank 2 gives up") as caught:
            rank_2_raises() @ pool
        assert time.monotonic() - began < 30
        assert "(raised on node 1 rank 2)" in (caught.value.__notes__ or [])
        with pytest.raises(sky.PoolClosedError, match="node 1 rank 2 failed"):
            rank_line() >> pool


# -- skyward run ---------------------------------------------------------------------------------

TORCHRUN_SCRIPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 0.0])
dist.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
print("rank", *(os.environ[n] for n in names), "sum", int(total.item()), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_skyward_run_starts_nproc_per_node_ranks_on_every_node(tmp_path: Path) -> None:
    write(tmp_path, "train.py", TORCHRUN_SCRIPT)
    done = skyward_run("--nodes", "2", "--nproc-per-node", "2", "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in range(4):
        node, local = divmod(rank, 2)
        line = f"(node {node} rank {rank}) rank {rank} {local} {node} 4 2 sum 6"
        assert line in done.stdout, done.stdout


# -- GPUs ----------------------------------------------------------------------------------------


@sky.compute
def nccl_rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())], device="cuda")
    dist.all_reduce(total)
    return {
        "backend": dist.get_backend(),
        "device": torch.cuda.current_device(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "sum": total.item(),
    }


@pytest.mark.gpu
@pytest.mark.slow
def test_a_gpu_node_holds_a_rank_per_gpu_each_on_its_own_with_nccl() -> None:
    from skyward.providers.local.provider import machine_gpus

    count = len(machine_gpus().usable)
    with sky.ComputePool(nodes=1, accelerator=f"GPU:{count}", plugins=[sky.plugins.torch()]) as p:
        seen = nccl_rank() @ p
    assert len(seen) == count  # the default: one rank per GPU
    for rank, found in enumerate(seen):
        assert found["backend"] == "nccl"
        assert found["device"] == found["local_rank"] == rank  # cuda:LOCAL_RANK
        assert found["sum"] == count * (count - 1) / 2
