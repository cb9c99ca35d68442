"""The Local provider passes the provider contract."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import skyward as sky
from tests.contract import ProviderContract


class TestLocalContract(ProviderContract):
    @pytest.fixture
    def make_provider(self) -> Callable[[], object]:
        return sky.Local
