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
