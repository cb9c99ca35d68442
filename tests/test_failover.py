"""A pool given several providers fails over: one with no room anywhere (`sky.NoCapacity`) is
passed for the next, in the order given or cheapest first (``prefer="price"``). Real Local pools
whose providers say they have no room or name a price; each cloud's own zone and region
failover is tested in tests/aws and tests/gcp."""

from __future__ import annotations

import pytest

import skyward as sky
from skyward.console.progress import Progress
from skyward.cost import Price
from skyward.hardware import ClusterSpec
from skyward.providers.base import Cluster


class Cloud(sky.Local):
    """Local processes standing in for a cloud: a name, a price, and maybe no room."""

    def __init__(self, name: str, per_hour: float | None, full: bool = False) -> None:
        super().__init__()
        self.name = name
        self._price = Price(per_hour, f"{name} price list") if per_hour is not None else None
        self.full = full
        self.launches = 0

    async def price(self, spec: ClusterSpec) -> Price:
        return self._price or Price.unknown(f"{self.name}: no price service")

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        self.launches += 1
        if self.full:
            raise sky.NoCapacity(
                f"no location could start 2 x big; nothing was left running:\n"
                f"  {self.name}-1a: no capacity\n  {self.name}-1b: no capacity",
                attempts=[(f"{self.name}-1a", "no capacity"), (f"{self.name}-1b", "no capacity")],
            )
        return await super().launch(spec, progress)


@sky.compute
def where() -> str:
    import os

    return os.environ.get("SKYWARD_PROVIDER_SEEN", "") or "ran"


def test_a_provider_without_room_is_passed_for_the_next(
    capfd: pytest.CaptureFixture[str],
) -> None:
    full, roomy = Cloud("alpha", 2.0, full=True), Cloud("beta", 3.0)
    with sky.ComputePool(provider=[full, roomy], nodes=2, stream_output=False) as pool:
        assert where() @ pool == ["ran", "ran"]
        assert pool.provider is roomy and pool.spec.provider == "beta"
        assert pool.cost.price.per_hour == 3.0  # the provider it runs on
    assert (full.launches, roomy.launches) == (1, 1)
    err = capfd.readouterr().err
    assert "alpha had no room for the pool; trying the next" in err, err
    assert "launching 2 node(s) on beta" in err
    assert err.index("alpha price list") < err.index("beta price list")


def test_when_every_provider_is_full_one_error_lists_every_location() -> None:
    with pytest.raises(sky.NoCapacity) as caught:
        with sky.ComputePool(
            provider=[Cloud("alpha", 1.0, full=True), Cloud("beta", 1.0, full=True)],
            nodes=2,
            stream_output=False,
        ):
            pass
    assert caught.value.attempts == [
        ("alpha alpha-1a", "no capacity"),
        ("alpha alpha-1b", "no capacity"),
        ("beta beta-1a", "no capacity"),
        ("beta beta-1b", "no capacity"),
    ]
    message = str(caught.value)
    assert "no provider could start the pool" in message
    assert "  alpha: alpha-1a: no capacity" in message and "  beta: beta-1b: no capacity" in message


def test_prefer_price_tries_the_cheapest_first_and_unknown_prices_last() -> None:
    dear, unknown, cheap = Cloud("dear", 9.0), Cloud("unknown", None), Cloud("cheap", 1.0)
    with sky.ComputePool(
        provider=[unknown, dear, cheap], nodes=1, prefer="price", stream_output=False
    ) as pool:
        assert pool.provider is cheap
    assert (dear.launches, unknown.launches, cheap.launches) == (0, 0, 1)
    full_cheap = Cloud("cheap", 1.0, full=True)
    with sky.ComputePool(
        provider=[unknown, dear, full_cheap], nodes=1, prefer="price", stream_output=False
    ) as pool:
        assert pool.provider is dear  # the next cheapest; the unknown one last


def test_a_bad_prefer_or_no_provider_is_refused() -> None:
    with pytest.raises(sky.ConfigError, match="prefer must be 'order' or 'price'"):
        sky.ComputePool(provider=[Cloud("a", 1.0)], prefer="cheap")  # type: ignore[arg-type]
    with pytest.raises(sky.ConfigError, match="provider=\\[\\] names no provider"):
        sky.ComputePool(provider=[])


def test_with_a_budget_a_provider_whose_price_cannot_keep_it_is_passed() -> None:
    unknown, dear, fits = Cloud("unknown", None), Cloud("dear", 600.0), Cloud("fits", 6.0)
    with sky.ComputePool(
        provider=[unknown, dear, fits], nodes=1, max_cost=5.0, stream_output=False
    ) as pool:
        assert pool.provider is fits
    assert (unknown.launches, dear.launches, fits.launches) == (0, 0, 1)
    with pytest.raises(sky.ConfigError, match="cannot be kept: this pool's price is unknown"):
        with sky.ComputePool(provider=[unknown, dear], nodes=1, max_cost=5.0):
            pass
