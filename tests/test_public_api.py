"""The public names of `import skyward as sky`."""

from __future__ import annotations

from pathlib import Path

import skyward as sky


def test_a_provider_whose_extra_is_missing_says_which_extra(tmp_path: Path) -> None:
    import subprocess
    import sys

    # a stand-in asyncssh that cannot be imported, as on an install without the [ssh] extra
    (tmp_path / "asyncssh.py").write_text("raise ModuleNotFoundError(name='asyncssh')\n")
    script = (
        "import skyward as sky\ntry:\n    sky.SSH\nexcept ModuleNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout
    assert "pip install 'skyward[ssh]'" in out


def test_every_public_name_resolves() -> None:
    for name in sky.__all__:
        assert getattr(sky, name) is not None, name
    assert issubclass(sky.WorkerError, sky.SkywardError)
    assert issubclass(sky.ConfigError, ValueError)


def test_all_lists_exactly_the_lazy_exports() -> None:
    from skyward import _EXPORTS

    assert sorted(sky.__all__) == sorted(_EXPORTS)


def test_a_users_script_type_checks_under_mypy_strict(tmp_path: Path) -> None:
    import subprocess
    import sys

    import pytest

    pytest.importorskip("mypy")
    script = tmp_path / "train.py"
    script.write_text(
        "import skyward as sky\n\n\n"
        "@sky.compute\n"
        "def square(x: int) -> int:\n"
        "    return x * x\n\n\n"
        "with sky.ComputePool(nodes=2, provider=sky.Local()) as pool:\n"
        "    every: list[int] = square(3) @ pool\n"
        "    one: int = square(2) >> pool\n"
        "    both = sky.gather(square(1), square(2)) >> pool\n"
        "    info: sky.InstanceInfo | None = None\n"
    )
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(script)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
