"""TPU slices at the API level: the real google-cloud-tpu client against the fake TPU API,
whose addresses are unreachable (nothing here connects over SSH)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import skyward as sky
from skyward.cli import main as cli
from skyward.errors import ConfigError, ProvisionError
from skyward.providers.gcp import tpu_types
from skyward.providers.gcp.settings import MachineSettings
from tests.gcp.conftest import PROJECT, ZONE, gcp_for
from tests.support.fakegcp import FakeGCP


@pytest.mark.parametrize(
    ("name", "api", "hosts"),
    [
        ("tpu-v5litepod-8", "v5litepod-8", 1),
        ("tpu-v6e-8", "v6e-8", 1),
        ("v4-32", "v4-32", 4),
        ("v5litepod-16", "v5litepod-16", 4),
        ("tpu-v4-16", "v4-16", 2),
        ("v6e-16", "v6e-16", 4),
    ],
)
def test_both_spellings_normalise_and_fix_the_node_count(
    api_fake: FakeGCP, name: str, api: str, hosts: int
) -> None:
    assert tpu_types.parse(name).accelerator_type == api
    pool = sky.ComputePool(provider=gcp_for(api_fake), accelerator=name, stream_output=False)
    assert pool.spec.nodes == hosts
    assert pool.spec.accelerator is not None and pool.spec.accelerator.is_tpu


def test_nodes_that_disagree_with_the_slice_is_a_config_error(api_fake: FakeGCP) -> None:
    with pytest.raises(ConfigError, match=r"v5litepod-16 slice has 4 host\(s\).*nodes=4"):
        sky.ComputePool(provider=gcp_for(api_fake), accelerator="tpu-v5litepod-16", nodes=2)
    with pytest.raises(ConfigError, match="there is no TPU v4-12"):
        sky.ComputePool(provider=gcp_for(api_fake), accelerator="v4-12")
    assert api_fake.calls == {}


def test_the_jax_plugin_sees_a_tpu_in_either_spelling(api_fake: FakeGCP) -> None:
    for name in ("v4-16", "tpu-v5litepod-16"):
        pool = sky.ComputePool(
            provider=gcp_for(api_fake), accelerator=name, plugins=[sky.plugins.jax()]
        )
        assert sky.plugins.jax().flavour(pool.spec) == "tpu"


def _start(fake: FakeGCP, accelerator: str, **options: Any) -> None:
    with sky.ComputePool(
        provider=gcp_for(fake, boot_timeout=1.5, **options),
        accelerator=accelerator,
        stream_output=False,
    ):
        pytest.fail("the fake's addresses are unreachable: no pool can start")


def test_spot_v5e_goes_through_a_queued_resource(api_fake: FakeGCP) -> None:
    with pytest.raises(ProvisionError):
        _start(api_fake, "tpu-v5litepod-16", spot=True)
    assert api_fake.calls["tpu.queuedResources.create"] == 1
    assert api_fake.calls["tpu.nodes.create"] == 0
    assert api_fake.calls["tpu.queuedResources.delete"] >= 1
    assert api_fake.labelled() == []


def test_spot_v4_is_the_nodes_own_scheduling(api_fake: FakeGCP) -> None:
    with pytest.raises(ProvisionError):
        _start(api_fake, "v4-16", spot=True, runtime_version="tpu-vm-v4-base")
    assert api_fake.calls["tpu.nodes.create"] == 1
    assert api_fake.calls["tpu.queuedResources.create"] == 0
    assert api_fake.labelled() == []


def test_a_capacity_error_at_create_leaves_nothing(api_fake: FakeGCP) -> None:
    api_fake.capacity = False
    with pytest.raises(sky.NoCapacity, match="RESOURCE_EXHAUSTED") as caught:
        _start(api_fake, "v5litepod-16")
    assert "Try more zones" in str(caught.value)
    assert [where for where, _ in caught.value.attempts] == [f"{ZONE} (on-demand)"]
    assert api_fake.calls["firewalls.insert"] == 2  # made, then removed
    assert api_fake.labelled() == []


def test_a_failed_queued_resource_leaves_nothing(api_fake: FakeGCP) -> None:
    api_fake.capacity = False
    with pytest.raises(ProvisionError, match="RESOURCE_EXHAUSTED"):
        _start(api_fake, "v6e-16", spot=True)
    assert api_fake.labelled() == []


def test_skyward_ls_and_down_include_tpu_nodes(
    api_fake: FakeGCP, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from skyward.providers.gcp import startup, teardown, tpus

    gcp = gcp_for(api_fake)
    access, clients = gcp.access(), gcp.clients()
    tpu = tpu_types.parse("v4-16")
    metadata = startup.metadata("left-1", 60, "root", "ssh-ed25519 AAAA")
    body = tpus.node_body(access, MachineSettings(), "left-1", tpu, metadata, None)
    made = teardown.Made()
    tpus.create(clients, access, "left-1", body, tpu, False, made.add)
    tpus.create(clients, access, "left-2", body, tpu_types.parse("v6e-8"), True, made.add)
    elsewhere = dataclasses.replace(access, zone="us-east5-a")  # ls and down cover every zone
    body3 = tpus.node_body(elsewhere, MachineSettings(), "left-3", tpu, metadata, None)
    tpus.create(clients, elsewhere, "left-3", body3, tpu, False, made.add)
    import google.auth
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.setattr(google.auth, "default", lambda **_: (AnonymousCredentials(), PROJECT))
    monkeypatch.setenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE", api_fake.url + "/compute/v1/")
    monkeypatch.setenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU", api_fake.url + "/")
    monkeypatch.setenv("CLOUDSDK_COMPUTE_ZONE", ZONE)
    assert cli.main(["ls", "--provider", "gcp"]) == 0
    out = capsys.readouterr().out
    assert "TPU skyward-left-1-tpu v4-16" in out and "queued resource skyward-left-2-tpu" in out
    assert "TPU skyward-left-3-tpu v4-16" in out
    assert cli.main(["down", "--all", "--provider", "gcp"]) == 0
    assert "removed" in capsys.readouterr().out
    assert api_fake.labelled() == []
