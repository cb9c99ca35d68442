"""The public names of `import skyward as sky`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import skyward as sky


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


def test_all_lists_exactly_the_lazy_exports() -> None:
    from skyward import _EXPORTS

    assert sorted(sky.__all__) == sorted(_EXPORTS)


USER_SCRIPT = """\
import skyward as sky


@sky.compute
def square(x: int) -> int:
    return x * x


@sky.compute
def name(x: int) -> str:
    return str(x)


with sky.ComputePool(nodes=2, provider=sky.Local()) as pool:
    every: list[int] = square(3) @ pool
    one: int = square(2) >> pool
    both: tuple[int, str] = sky.gather(square(1), name(2)) >> pool
    three: tuple[int, str, int] = (square(1) & name(2) & square(3)) >> pool
    six: tuple[int, int, int, int, int, str] = (
        sky.gather(square(1), square(2), square(3), square(4), square(5), name(6)) >> pool
    )
    info: sky.InstanceInfo | None = None
    data = sky.Data("./dataset")
    report: sky.Report | None = None
{extra}"""


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """One `mypy --strict` run (each costs ~15 s) over a user's script, the same script with one
    element of a gather given the wrong type, and the examples; its error lines, by file.

    Some of JAX's own functions (PartitionSpec, make_array_from_process_local_data) are not
    annotated; calling them is what --allow-untyped-calls lets through. Everything else is
    --strict, skyward's API included."""
    pytest.importorskip("mypy")
    folder = tmp_path_factory.mktemp("typed")
    (folder / "train.py").write_text(USER_SCRIPT.format(extra=""))
    wrong = "    wrong: tuple[str, str] = sky.gather(square(1), name(2)) >> pool\n"
    (folder / "wrong.py").write_text(USER_SCRIPT.format(extra=wrong))
    examples = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))
    assert examples
    paths = [folder / "train.py", folder / "wrong.py", *examples]
    flags = ("--strict", "--no-incremental", "--allow-untyped-calls")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", *flags, *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode in (0, 1), checked.stdout + checked.stderr  # 2: mypy itself failed
    errors: dict[str, list[str]] = {path.name: [] for path in paths}
    for line in checked.stdout.splitlines():
        name = Path(line.split(":", 1)[0]).name
        if name in errors and ": error:" in line:
            errors[name].append(line)
    return errors


def test_a_users_script_type_checks_under_mypy_strict(mypy_report: dict[str, list[str]]) -> None:
    assert mypy_report["train.py"] == []


def test_gather_results_are_typed_per_call(mypy_report: dict[str, list[str]]) -> None:
    (error,) = mypy_report["wrong.py"]
    assert "tuple[str, str]" in error


def test_the_examples_type_check_under_mypy_strict(mypy_report: dict[str, list[str]]) -> None:
    for example in ("jax_data_parallel.py", "keras_fit.py", "train_with_data.py"):
        assert mypy_report[example] == [], mypy_report[example]
