"""The suite's worker groups hold (tests/conftest.py `pytest_itemcollected`): under pytest-xdist a
test's id carries its group, so a folder's stand-ins live in one worker. A pytest or xdist
release that stops grouping fails here, by name, instead of as stand-ins fighting over a subnet."""

from __future__ import annotations

import os

import pytest


def test_a_test_under_xdist_runs_in_its_modules_group(request: pytest.FixtureRequest) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("not under pytest-xdist (-n0): there are no groups")
    assert request.node.nodeid.endswith("@test_worker_groups"), (
        f"{request.node.nodeid}: pytest-xdist did not group this test (see the pytest pin in"
        " pyproject.toml)"
    )
