"""One `mypy --strict` run (each costs ~20 s on 2 cores) over the package, a user's script, the same
script with one element of a gather given the wrong type, and the examples.

The package and the scripts share one run: they are checked under the same settings
(pyproject.toml's [tool.mypy]: --strict, with calls into JAX's unannotated functions such as
PartitionSpec allowed), and a second run would only check skyward again."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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
    both: tuple[int, str] = sky.gather(square(1), name(2)) >> pool
    three: tuple[int, str, int] = (square(1) & name(2) & square(3)) >> pool
    six: tuple[int, int, int, int, int, str] = (
        sky.gather(square(1), square(2), square(3), square(4), square(5), name(6)) >> pool
    )
    info: sky.InstanceInfo | None = None
    data = sky.Data("./dataset")
    report: sky.Report | None = None
{extra}"""

WRONG_LINE = "    wrong: tuple[str, str] = sky.gather(square(1), name(2)) >> pool\n"


@dataclass(frozen=True)
class MypyReport:
    """mypy's error lines by file name ("skyward" for every file of the package), and its output."""

    errors: dict[str, list[str]]
    output: str


def check(folder: Path) -> MypyReport:
    """Write the user's scripts into `folder`; run mypy once over them, the examples, skyward."""
    (folder / "train.py").write_text(USER_SCRIPT.format(extra=""))
    (folder / "wrong.py").write_text(USER_SCRIPT.format(extra=WRONG_LINE))
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert examples
    paths = [folder / "train.py", folder / "wrong.py", *examples]
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "skyward", *map(str, paths)],
        cwd=ROOT,  # pyproject.toml's settings
        capture_output=True,
        text=True,
        check=False,
    )
    output = checked.stdout + checked.stderr
    assert checked.returncode in (0, 1), output  # 2: mypy itself failed
    errors: dict[str, list[str]] = {path.name: [] for path in paths} | {"skyward": []}
    for line in checked.stdout.splitlines():
        if ": error:" not in line:
            continue
        where = Path(line.split(":", 1)[0])
        key = "skyward" if where.parts[:1] == ("skyward",) else where.name
        errors.setdefault(key, []).append(line)
    return MypyReport(errors, output)
