"""The provider registry: a provider living outside skyward is found by name, through
`registry.register` or a ``skyward.providers`` entry point, and runs a pool; an unknown name
lists the known ones."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli import profiles
from skyward.errors import ConfigError
from skyward.providers import registry
from tests.example_provider.provider import ENTRY, Example


@pytest.fixture
def registered() -> Iterator[None]:
    registry.register(ENTRY)
    yield
    registry.unregister(ENTRY.name)


@sky.compute
def where() -> str:
    return sky.instance_info().provider


def test_a_registered_provider_runs_a_pool_from_a_profile(registered: None) -> None:
    profile = profiles.with_flags(profiles.Profile(), {"provider": "example", "options": {}})
    provider = profile.build_provider()
    assert isinstance(provider, Example)
    with sky.ComputePool(provider=provider, nodes=1) as pool:
        assert (where() >> pool) == "example"


def test_an_entry_point_makes_a_provider_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tiny installed distribution whose entry point names the example's entry.
    dist = tmp_path / "skyward_example-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: skyward-example\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\nexample = tests.example_provider.provider:ENTRY\n"
    )
    assert "example" not in registry.names()
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert registry.provider_class("example") is Example


def test_an_unknown_provider_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown provider 'nope'; use one of local, ssh"):
        registry.entry("nope")
    with pytest.raises(ConfigError, match="unknown provider 'nope'"):
        profiles.Profile(provider="nope").build_provider()


class _Plain(Example):
    """A provider that declares no capability."""

    capabilities = frozenset()


@pytest.mark.parametrize(
    ("feature", "needs"), [({"restarts": 1}, "replace"), ({"stall_timeout": 5}, "signals")]
)
def test_a_feature_its_provider_lacks_is_refused(feature: dict[str, float], needs: str) -> None:
    with pytest.raises(ConfigError, match=f"needs a provider that can .*{needs}"):
        sky.ComputePool(provider=_Plain(), nodes=1, **feature)  # type: ignore[arg-type]
