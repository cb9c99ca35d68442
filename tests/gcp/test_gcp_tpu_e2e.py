"""TPU slices end to end: the real google-cloud-tpu client against the fake TPU API, each host
of a slice a fresh Debian machine (python3 without venv or pip, reaching nothing but the package
index the test serves) that runs the node's startup-script (its own host key, published as a
guest attribute) with the login key from the node's metadata (the boot simulator of the VMs).
The hosts are CPUs: JAX runs with its CPU wheel (``sky.plugins.jax(cuda="cpu")``) from the
served index; libtpu and real TPU chips are only exercised on GCP."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward.errors import ProvisionError
from tests.contract import ProviderContract
from tests.gcp.conftest import TPU_SUBNET, GceHosts, gce_for
from tests.gcp.test_gcp_e2e import nothing_left, probe_image

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

# The contract's one-node tests get a one-host slice (nodes= must match the slice).
_ONE_NODE_TESTS = (
    "test_user_exception_comes_back_as_itself",
    "test_terminate_leaves_nothing",
    "test_client_side_plugin_failure_is_named_before_anything_launches",
    "test_outputs_are_collected_on_ctrl_c",
    "test_outputs_without_output_dir_go_with_the_pool",
    "test_signals_reach_every_agent_or_stall_timeout_is_refused",
    "test_a_dead_node_is_replaced_or_restarts_are_refused",
    "test_a_live_pool_is_found_and_a_closed_one_is_not_or_listing_is_refused",
)


def tpu_for(sim: GceHosts, accelerator: str, **kwargs: Any) -> sky.GCP:
    """The provider with its pools fixed to one TPU slice type (``machine_type=``)."""
    return gce_for(sim, machine_type=accelerator, ssh_cidr=TPU_SUBNET, **kwargs)


class TestTPUSliceContract(ProviderContract):
    """The contract on TPU slices: a 2-host v4-16 (a 1-host v4-8 where a test asks for 1 node)."""

    @pytest.fixture
    def make_provider(
        self, tpu_hosts: Callable[..., GceHosts], request: pytest.FixtureRequest
    ) -> Callable[[], object]:
        self.sim = tpu_hosts()
        one = request.node.originalname in _ONE_NODE_TESTS
        return lambda: tpu_for(self.sim, "v4-8" if one else "v4-16")

    @pytest.fixture
    def make_broken_provider(self, tpu_hosts: Callable[..., GceHosts]) -> Callable[[], object]:
        """A v4-16 slice whose second host never answers SSH."""
        self.sim = tpu_hosts(boot_at_most=1)
        return lambda: tpu_for(self.sim, "v4-16", boot_timeout=3.0)

    def probe_image(self, directory: Path, token: str) -> sky.Image:
        return probe_image(self.sim, token)

    def discard_environment(self, prefix: str) -> None:
        """The environments live on the hosts' disks, which go with the test's hosts."""

    @pytest.fixture(autouse=True)
    def _nothing_left(self, make_provider: Callable[[], object]) -> Iterator[None]:
        yield
        nothing_left(self.sim)

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        nothing_left(self.sim)

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        assert self.sim.fake is not None
        before = dict(self.sim.fake.calls)
        yield
        after = self.sim.fake.calls
        for call in ("tpu.nodes.create", "tpu.queuedResources.create", "firewalls.insert"):
            assert after[call] == before.get(call, 0), call
        assert self.sim.fake.labelled() == []
        assert self.sim.booted == {}

    def assert_outputs_removed(self, where: str) -> None:
        """A host's disk goes with the slice (the simulated disks stay until the test's hosts
        go)."""
        nothing_left(self.sim)

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        nothing_left(self.sim)


@sky.compute
def psum_over_hosts() -> tuple[int, int, int, float]:
    """Each host adds node + 1 across the slice: 1 + 2 + 3 + 4 on four hosts."""
    import jax
    import jax.numpy as jnp

    info = sky.instance_info()
    local = jnp.full((jax.local_device_count(),), float(info.node + 1))
    total = jax.pmap(lambda v: jax.lax.psum(v, "hosts"), axis_name="hosts")(local)
    return info.node, jax.process_count(), jax.device_count(), float(total[0])


def test_jax_psum_across_the_four_hosts_of_a_v5litepod_16(
    tpu_hosts: Callable[..., GceHosts],
) -> None:
    sim = tpu_hosts()
    # As on a private network: the image names the one index the hosts reach (a mirror with
    # JAX's CPU wheels); the provider adds none, and neither does the plugin.
    with sky.ComputePool(
        provider=tpu_for(sim, "v5litepod-16", build_env={}),
        accelerator="tpu-v5litepod-16",  # 4 hosts: nodes=4 without saying so
        image=sky.Image(indexes=[sky.Index(sim.index.simple_url)]),
        plugins=[sky.plugins.jax(cuda="cpu")],  # the hosts are CPUs, not TPU chips
        stream_output=False,
    ) as pool:
        assert len(pool.nodes) == 4
        results = psum_over_hosts() @ pool
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert all(r[1] == 4 and r[2] == 4 and r[3] == 10.0 for r in results), results
    assert sim.fake is not None
    assert sim.fake.calls["tpu.nodes.create"] == 1  # one slice, not four VMs
    assert sim.fake.calls["instances.bulkInsert"] == 0
    wheels = [r.rsplit("/", 1)[-1] for r in sim.index.requests if r.endswith(".whl")]
    served = {name.split("-", 1)[0] for name in wheels}
    assert {"jax", "jaxlib"} <= served, f"JAX did not come from the served index: {served}"
    nothing_left(sim)


def test_nodes_follow_the_apis_worker_order(
    tpu_hosts: Callable[..., GceHosts], caplog: pytest.LogCaptureFixture
) -> None:
    sim = tpu_hosts()
    with (
        caplog.at_level(logging.INFO, logger="skyward"),
        sky.ComputePool(provider=tpu_for(sim, "v5litepod-16"), stream_output=False) as pool,
    ):
        assert sim.fake is not None
        (node,) = sim.fake.tpu_nodes.values()
        workers = [e["ipAddress"] for e in node["networkEndpoints"]]
        assert [n.private_addr for n in pool.nodes] == workers
    nothing_left(sim)
    last = [r.getMessage() for r in caplog.records if r.name == "skyward"][-1]
    assert last.startswith(f"{pool.pool_id}: removed TPU slice v5litepod-16 (4 hosts) in "), last


def test_one_host_never_reachable_fails_the_whole_slice(
    tpu_hosts: Callable[..., GceHosts],
) -> None:
    sim = tpu_hosts(boot_at_most=3)  # the 4th host of the slice never answers SSH
    with pytest.raises(ProvisionError, match="did not publish its SSH host key"):
        with sky.ComputePool(
            provider=tpu_for(sim, "v5litepod-16", boot_timeout=3.0), stream_output=False
        ):
            pytest.fail("a slice with a dead host must not start")
    assert sim.fake is not None and sim.fake.calls["tpu.nodes.delete"] >= 1
    nothing_left(sim)


def test_a_capacity_error_at_create_leaves_nothing(tpu_hosts: Callable[..., GceHosts]) -> None:
    sim = tpu_hosts()
    assert sim.fake is not None
    sim.fake.capacity = False
    with pytest.raises(ProvisionError, match="RESOURCE_EXHAUSTED"):
        with sky.ComputePool(provider=tpu_for(sim, "v5litepod-16"), stream_output=False):
            pytest.fail("must not start")
    nothing_left(sim)


def test_a_spot_v5e_slice_through_a_queued_resource_runs(
    tpu_hosts: Callable[..., GceHosts],
) -> None:
    sim = tpu_hosts()
    with sky.ComputePool(
        provider=tpu_for(sim, "v5litepod-16", spot=True), stream_output=False
    ) as pool:
        assert sim.fake is not None and len(sim.fake.queued) == 1
        assert len(pool.nodes) == 4
    nothing_left(sim)


@sky.compute
def wait_then_node() -> int:
    import time

    time.sleep(30)
    return sky.instance_info().node


def test_a_preempted_spot_slice_is_named_as_preempted(tpu_hosts: Callable[..., GceHosts]) -> None:
    sim = tpu_hosts()
    fake = sim.fake
    assert fake is not None
    with sky.ComputePool(provider=tpu_for(sim, "v4-16", spot=True), stream_output=False) as pool:
        (name,) = [n.rsplit("/", 1)[-1] for n in fake.tpu_nodes]
        timer = threading.Timer(1.0, fake.preempt_tpu, [name])
        timer.start()
        with pytest.raises(sky.WorkerError) as caught:
            wait_then_node() @ pool
        timer.join()
        assert caught.value.preempted, str(caught.value)
        assert f"TPU {name}" in str(caught.value) and "preempted" in str(caught.value)
        with pytest.raises(sky.ConfigError, match="cannot be replaced one by one"):
            pool.replace(caught.value.node)
    nothing_left(sim)
