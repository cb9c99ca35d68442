"""The nodes' packages for `skyward run`: PEP 723 script metadata, requirements files, flags,
profile keys and the work directory's project (fast: parsing only), and on real Local pools an
unresolvable requirement and a module missing on a node, each a clear error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli import packages, profiles
from skyward.cli.main import main
from skyward.cli.packages import Packages
from tests.support import bareroots, wheels
from tests.test_cli_run import skyward_run

METADATA = '''\
#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#   "numpy>=1.26",
#   "rich",
# ]
#
# [tool.uv]
# extra-index-url = ["https://extra.example/simple/"]
# find-links = ["https://wheels.example/links.html"]
# index-url = "https://mirror.example/simple/"
#
# [[tool.uv.index]]
# name = "torch-cpu"
# url = "https://download.pytorch.org/whl/cpu"
# explicit = true
#
# [[tool.uv.index]]
# name = "unused"
# url = "https://unused.example/simple/"
# explicit = true
#
# [[tool.uv.index]]
# name = "first"
# url = "https://first.example/simple/"
#
# [tool.uv.sources]
# torch = { index = "torch-cpu" }
# ///
"""Not metadata: # /// script in a docstring."""
import numpy
'''


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# -- PEP 723 -------------------------------------------------------------------------------------


def test_script_metadata_is_read_as_uv_run_reads_it(tmp_path: Path) -> None:
    found = packages.script_metadata(write(tmp_path, "train.py", METADATA))
    assert found.pip == ("numpy>=1.26", "rich")
    assert found.indexes == (
        sky.Index("https://download.pytorch.org/whl/cpu", packages=("torch",)),
        sky.Index("https://first.example/simple/"),
        sky.Index("https://extra.example/simple/"),
        sky.Index("https://wheels.example/links.html", flat=True),
        sky.Index("https://mirror.example/simple/", default=True),  # in place of PyPI
    )
    assert found.sources == ("train.py's metadata",)


def test_a_script_without_metadata_asks_for_nothing(tmp_path: Path) -> None:
    assert packages.script_metadata(write(tmp_path, "plain.py", "import os\n")) == Packages()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("# /// script\n# dependencies = [\n# ///\n", r"bad\.py:1 .* is not valid TOML"),
        ("x = 1\n# /// script\n# dependencies = ['numpy'\n", "is not closed by a '# ///' line"),
        (
            "# /// script\n# dependencies = []\n# ///\nx = 1\n" * 2,
            "more than one '# /// script' metadata block",
        ),
        ("# /// script\n# dependencies = ['numpy>>1']\n# ///\n", "'numpy>>1' is not a valid req"),
        ("# /// script\n# dependencies = 'numpy'\n# ///\n", "dependencies must be a list"),
        ("# /// script\n# requires-python = '<3.0'\n# ///\n", "requires-python '<3.0', but the"),
    ],
)
def test_malformed_metadata_is_an_error_naming_the_script(
    tmp_path: Path, text: str, says: str
) -> None:
    with pytest.raises(sky.ConfigError, match=says):
        packages.script_metadata(write(tmp_path, "bad.py", text))


# -- requirements files, flags, profiles, the work directory -------------------------------------


def test_a_requirements_file_as_pip_reads_it(tmp_path: Path) -> None:
    write(tmp_path, "base.txt", "cloudpickle>=3  # the agent's too\n")
    path = write(
        tmp_path,
        "requirements.txt",
        """\
        # training
        -r base.txt
        --index-url https://mirror.example/simple/
        --extra-index-url=https://extra.example/simple/
        -f https://wheels.example/links.html

        numpy>=1.26 \\
            ; python_version >= "3.11"
        """,
    )
    found = packages.requirements_file(path)
    assert found.pip == ("cloudpickle>=3", 'numpy>=1.26 ; python_version >= "3.11"')
    assert found.indexes == (
        sky.Index("https://mirror.example/simple/", default=True),  # -i: in place of PyPI
        sky.Index("https://extra.example/simple/"),
        sky.Index("https://wheels.example/links.html", flat=True),
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("numpy\n-e .\n", r"requirements\.txt:2: -e is not supported"),
        ("numpy==\n", r"requirements\.txt:1: 'numpy==' is not a valid requirement"),
        ("-r requirements.txt\n", "includes itself"),
        ("-r missing.txt\n", "-r .*missing.txt: cannot be read"),
    ],
)
def test_a_bad_requirements_file_names_its_line(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(sky.ConfigError, match=says):
        packages.requirements_file(write(tmp_path, "requirements.txt", text))


def test_flags_and_profile_keys_add_up(tmp_path: Path) -> None:
    write(tmp_path, "req.txt", "rich\n")
    (tmp_path / "skyward.toml").write_text(
        textwrap.dedent(
            f"""
            [profile.default]
            pip = ["numpy"]
            requirements = ["{tmp_path / "req.txt"}"]
            indexes = ["https://mirror.example/simple/"]
            """
        )
    )
    profile = profiles.load_profile(None, tmp_path)
    flags = {"pip": ["optax"], "indexes": ["https://other.example/simple/"], "find_links": ["L"]}
    both = profiles.with_flags(profile, flags)
    assert (both.pip, both.indexes, both.find_links) == (
        ("numpy", "optax"),
        ("https://mirror.example/simple/", "https://other.example/simple/"),
        ("L",),
    )
    found = packages.from_flags(both.pip, both.requirements, both.indexes, both.find_links)
    assert found.image() == sky.Image(
        pip=["numpy", "optax", "rich"],
        indexes=[
            "https://mirror.example/simple/",
            "https://other.example/simple/",
            sky.Index("L", flat=True),
        ],
    )
    with pytest.raises(sky.ConfigError, match="pip must be a list of strings"):
        profiles.parse_profile("p", {"pip": [1]}, "skyward.toml")


def test_the_workdirs_project_dependencies(tmp_path: Path) -> None:
    assert packages.project_dependencies(tmp_path) == Packages()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["rich"]\n')
    assert packages.project_dependencies(tmp_path).pip == ("rich",)


def test_a_missing_module_says_whether_the_client_has_it_and_how_to_add_it() -> None:
    numpy = packages.missing_module_hint("numpy.linalg")
    assert numpy.startswith(f"this client has it (numpy {np_version()}), the nodes do not")
    assert "--pip numpy" in numpy and 'dependencies = ["numpy"]' in numpy
    assert "--plugin torch" in packages.missing_module_hint("torch")
    assert "does not have 'no_such_mod_xyz' either" in packages.missing_module_hint(
        "no_such_mod_xyz"
    )


def np_version() -> str:
    import numpy

    return numpy.__version__


def test_bad_package_input_is_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "bad.py", "# /// script\n# dependencies = [\n# ///\n")
    write(tmp_path, "ok.py", "")
    for argv, says in [
        (["run", "bad.py"], "bad.py:1 (its '# /// script' metadata) is not valid TOML"),
        (["run", "--pip", "numpy>>1", "ok.py"], "--pip: 'numpy>>1' is not a valid requirement"),
        (["run", "-r", "none.txt", "ok.py"], "-r none.txt: cannot be read"),
    ]:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


# -- on real Local pools -------------------------------------------------------------------------


@pytest.mark.slow
def test_an_unresolvable_requirement_fails_at_start_naming_it_and_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's interpreter lacks it, so the nodes' environment is built: from an index
    that serves the agent's own packages only (the default index too: nothing leaves here)."""
    house = wheels.wheelhouse(tmp_path / "wheels", ("cloudpickle", "packaging"))
    write(
        tmp_path,
        "train.py",
        """\
        # /// script
        # dependencies = ["skyward-no-such-package"]
        # ///
        open("ran", "w").close()
        """,
    )
    with bareroots.PackageIndex(house) as index:
        url = index.simple_url
        monkeypatch.setenv("UV_DEFAULT_INDEX", url)
        done = skyward_run("--index", url, "train.py", cwd=tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("skyward run: the nodes' packages cannot be installed: "), last
    assert "skyward-no-such-package was not found" in last
    assert f"Indexes asked: {url}, then the default index" in last
    assert not (tmp_path / "ran").exists(), "no rank may run"


@pytest.mark.slow
def test_a_rank_missing_a_module_says_how_to_add_it(tmp_path: Path) -> None:
    write(tmp_path, "train.py", "import skyward_surely_missing_module\n")
    done = skyward_run("train.py", cwd=tmp_path)
    assert done.returncode == 1
    assert "ModuleNotFoundError: No module named 'skyward_surely_missing_module'" in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("skyward run: rank 0 failed: ModuleNotFoundError: No module named")
    assert "this client does not have 'skyward_surely_missing_module' either" in last
