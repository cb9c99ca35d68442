"""The worked minimal provider in `skyward.providers.base`'s docstring runs a pool as written:
the docstring is the code a provider's author starts from, so it must not rot."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers import base


def example_namespace() -> dict[str, object]:
    """The docstring's example, executed as a module would be."""
    doc = base.__doc__ or ""
    found = re.search(r"A worked minimal provider:.*?::\n\n(.*?)\n\n(?=\S)", doc, re.S)
    assert found, "providers/base.py lost its worked minimal provider"
    lines = found.group(1).splitlines()
    code = "\n".join(line[4:] for line in lines)
    namespace: dict[str, object] = {"__name__": "provider_example"}
    exec(compile(code, "providers/base.py docstring", "exec"), namespace)
    return namespace


@sky.compute
def whoami() -> tuple[int, int, str]:
    info = sky.instance_info()
    return info.node, os.getpid(), info.provider


def test_the_docstrings_minimal_provider_runs_a_pool() -> None:
    processes = example_namespace()["Processes"]
    assert isinstance(processes, type) and issubclass(processes, base.Provider)
    with sky.ComputePool(provider=processes(), nodes=2) as pool:
        answers = whoami() @ pool
    assert [node for node, _, _ in answers] == [0, 1]
    assert len({pid for _, pid, _ in answers} | {os.getpid()}) == 3  # two processes of its own
    assert {name for _, _, name in answers} == {"processes"}


def test_a_provider_that_does_not_say_how_a_detached_run_reaches_its_nodes_refuses_one(
    tmp_path: Path,
) -> None:
    """`Provider.detached_kind` is not part of the minimal provider: `sky.submit` on it says
    the provider cannot run detached, before any pool starts."""
    processes = example_namespace()["Processes"]
    assert isinstance(processes, type) and issubclass(processes, base.Provider)
    script = tmp_path / "job.py"
    script.write_text("print('never')\n")
    with pytest.raises(sky.ConfigError, match="processes provider cannot run detached"):
        sky.submit(str(script), provider=processes(), nodes=1)
