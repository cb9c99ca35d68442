"""`skyward status` and `skyward run --provider gcp` see GCP profiles (the fake Compute API)."""

from __future__ import annotations

from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials

from skyward.cli import main as cli
from skyward.cli import profiles, runner
from skyward.cli.profiles import Profile
from skyward.cluster import ClusterSpec
from skyward.providers.gcp import teardown
from skyward.providers.gcp.settings import Placement
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
    assert runner.print_gcp_pools(profile) == 0
    assert capsys.readouterr().out == ""
    spec = ClusterSpec(nodes=2, pool_id="pool-status1", provider="gcp")
    placement = Placement(use_private_ips=True)
    clients, _, made = launch(api_fake, spec, placement, None)
    try:
        assert runner.print_gcp_pools(profile) == 1
        out = capsys.readouterr().out
        assert f"gcp    {PROJECT}  pool-status1  created " in out
        assert out.count("instance ") == 2 and "firewall rule skyward-pool-status1-ssh" in out
    finally:
        teardown.remove_pool(clients, PROJECT, spec.pool_id, made, timeout=20, poll=0.05)
    assert runner.print_gcp_pools(profile) == 0


def test_the_cli_knows_every_provider() -> None:
    assert set(cli.PROVIDER_NAMES) == set(profiles.PROVIDERS)
    assert profiles.provider_class("gcp").__name__ == "GCP"
