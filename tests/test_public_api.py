"""The public names of `import skyward as sky`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import skyward as sky
from tests.support.typecheck import MypyReport


def test_a_provider_whose_extra_is_missing_says_which_extra(tmp_path: Path) -> None:
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


def test_no_public_name_is_shadowed_by_a_submodule_of_the_same_name() -> None:
    """Importing a submodule binds it on the package: were `sky.compute` the name of a module
    too, a user's `from skyward.<module> import PendingCall` before the first `sky.compute`
    would make `@sky.compute` the module, and every decorated function a TypeError."""
    import pkgutil

    modules = {info.name for info in pkgutil.iter_modules(sky.__path__)}
    assert {name for name in sky.__all__ if name in modules} == {"plugins"}  # sky.plugins is one
    script = (
        "from skyward.calls import PendingCall\nimport skyward as sky\n"
        "@sky.compute\ndef f() -> int:\n    return 1\nprint(type(f).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "Compute"


def test_all_lists_exactly_the_lazy_exports() -> None:
    """`__all__` is what the root exports: its table, and skyward's own providers as their
    registry entries name them (each loads to that class)."""
    from skyward import _EXPORTS
    from skyward.providers import registry

    providers = {entry.attr: entry for entry in registry.own_entries()}
    assert sorted(sky.__all__) == sorted([*_EXPORTS, *providers])
    for name, entry in providers.items():
        assert getattr(sky, name) is entry.load()


def test_a_new_provider_folder_is_a_root_name_without_editing_the_root(tmp_path: Path) -> None:
    """The root's providers come from the registry: a folder under ``skyward/providers`` with
    an entry is ``sky.<Class>`` and in ``__all__``; a provider registered from outside is not
    a root name."""
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "entry.py").write_text(
        "from skyward.providers.registry import ProviderEntry\n"
        "ENTRY = ProviderEntry('fake', 'skyward.providers.fake.provider', 'Fake')\n"
    )
    (folder / "provider.py").write_text(
        "from skyward.providers.local.provider import Local\n"
        "class Fake(Local):\n    name = 'fake'\n"
    )
    script = (
        "import sys\nimport skyward.providers\n"
        "skyward.providers.__path__.append(sys.argv[1])\n"
        "import skyward as sky\nfrom skyward.providers import registry\n"
        "registry.register(registry.ProviderEntry('other', 'builtins', 'Other'))\n"
        "print(sky.Fake.name, 'Fake' in sky.__all__, 'Fake' in dir(sky))\n"
        "print(hasattr(sky, 'Other'), 'Other' in sky.__all__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["fake", "True", "True", "False", "False"], out


def test_a_users_script_type_checks_under_mypy_strict(mypy_report: MypyReport) -> None:
    assert mypy_report.errors["train.py"] == [], mypy_report.output


def test_gather_results_are_typed_per_call(mypy_report: MypyReport) -> None:
    (error,) = mypy_report.errors["wrong.py"]
    assert "tuple[str, str]" in error


def test_the_examples_type_check_under_mypy_strict(mypy_report: MypyReport) -> None:
    for example in ("jax_data_parallel.py", "keras_fit.py", "train_with_data.py"):
        assert mypy_report.errors[example] == [], mypy_report.errors[example]


def test_the_version_is_the_packages() -> None:
    """`skyward.version` is what the handshake compares; pyproject.toml's is what pip installs."""
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert sky.__version__ == project["project"]["version"]
