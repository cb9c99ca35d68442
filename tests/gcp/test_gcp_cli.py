"""`skyward status` and `skyward run --provider gcp` see GCP profiles (the fake Compute API)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials

from skyward.cli import profiles, runner
from skyward.cli.profiles import Profile
from skyward.hardware import ClusterSpec
from skyward.providers import registry
from skyward.providers.cloud import pricecache
from skyward.providers.gcp import teardown
from skyward.providers.gcp.settings import MachineSettings
from tests.gcp.conftest import PROJECT, ZONE
from tests.gcp.test_gcp_api import launch
from tests.support.fakegcp import FakeGCP


def profile_for(fake: FakeGCP) -> Profile:
    options: dict[str, Any] = {
        "project": PROJECT,
        "zone": ZONE,
        "credentials": AnonymousCredentials(),
        "api_endpoint": fake.url,
    }
    return Profile(provider="gcp", options=options)


def test_status_lists_this_users_gcp_pools(
    api_fake: FakeGCP, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = profile_for(api_fake)
    assert runner.print_live_pools(profile.build_provider()) == 0
    assert capsys.readouterr().out == ""
    spec = ClusterSpec(nodes=2, pool_id="pool-status1", provider="gcp")
    settings = MachineSettings(use_private_ips=True)
    clients, _, made = launch(api_fake, spec, settings, None)
    try:
        assert runner.print_live_pools(profile.build_provider()) == 1
        out = capsys.readouterr().out
        assert f"gcp    {PROJECT}  pool-status1  created " in out
        assert out.count("instance ") == 2 and "firewall rule skyward-pool-status1-ssh" in out
        # No SKU in the catalog: the price is unknown, and said so.
        assert "cost: price unknown (" in out, out
        # e2-standard-2: 2 vCPUs x $0.021811 + 8 GiB x $0.002923 = $0.067006/hour a VM
        api_fake.add_machine_type("e2-standard-2", 2, 8 * 1024)
        core, ram = "E2 Instance Core running in Americas", "E2 Instance Ram running in Americas"
        api_fake.billing.add_sku(core, "0.021811", group="CPU", regions=["us-central1"])
        api_fake.billing.add_sku(
            ram, "0.002923", group="RAM", regions=["us-central1"], unit="GiBy.h"
        )
        # The catalog read a moment ago (no SKU then) is kept on disk: read it afresh.
        shutil.rmtree(pricecache.folder(), ignore_errors=True)
        assert runner.print_live_pools(profile.build_provider()) == 1
        out = capsys.readouterr().out
        # two VMs just started, each billed its first minute: $0.0022
        assert "cost: $0.134/hour, about $0.0022 so far" in out, out
    finally:
        teardown.remove_pool(clients, PROJECT, spec.pool_id, made, timeout=20, poll=0.05)
    assert runner.print_live_pools(profile.build_provider()) == 0


def test_the_cli_knows_every_provider() -> None:
    assert "gcp" in registry.names()
    assert profiles.provider_class("gcp").__name__ == "GCP"
