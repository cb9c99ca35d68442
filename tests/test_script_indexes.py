"""How `skyward run` reads a script's indexes and sources, as ``uv run`` and pip read them: an
index-url replaces the default index (PyPI) rather than joining it, and every
``[tool.uv.sources]`` entry is honoured or refused by name, never left out.

The runs are real Local pools whose environments uv builds from indexes served on 127.0.0.1
(`tests.support.bareroots.PackageIndex`); the host's default index (``UV_DEFAULT_INDEX``) is
one of them too, playing PyPI, so nothing leaves this machine and a test can see whether it
was asked.
"""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli import packages
from skyward.cli.main import main
from tests.support import wheels
from tests.support.bareroots import PackageIndex
from tests.support.localhttp import LocalServer, Reply, Request
from tests.test_cli_run import skyward_run


def script(tmp_path: Path, uv_table: str, dependencies: str = '["skyward-alpha"]') -> Path:
    """``train.py`` with a PEP 723 block: `dependencies` and a ``[tool.uv]`` part, printing
    skyward_alpha's (or another module's) token."""
    lines = [f"dependencies = {dependencies}", "", *textwrap.dedent(uv_table).splitlines()]
    block = "\n".join(f"# {line}".rstrip() for line in lines)
    path = tmp_path / "train.py"
    path.write_text(
        f"# /// script\n{block}\n# ///\nimport skyward_alpha\nprint(skyward_alpha.TOKEN)\n"
    )
    return path


# -- reading (no processes) ----------------------------------------------------------------------


def test_each_index_form_is_read_as_uv_and_pip_read_it(tmp_path: Path) -> None:
    found = packages.script_metadata(
        script(
            tmp_path,
            """
            [tool.uv]
            extra-index-url = ["https://extra.example/simple/"]

            [[tool.uv.index]]
            name = "company"
            url = "https://company.example/simple/"
            default = true

            [[tool.uv.index]]
            name = "more"
            url = "https://more.example/simple/"

            [tool.uv.sources]
            skyward-alpha = { index = "more" }
            """,
        )
    )
    assert found.indexes == (
        sky.Index("https://company.example/simple/", default=True),  # replaces PyPI
        sky.Index("https://more.example/simple/", packages=["skyward-alpha"]),  # alpha: only there
        sky.Index("https://more.example/simple/"),  # and an extra index for everything else
        sky.Index("https://extra.example/simple/"),
    )
    assert found.image().default_index == sky.Index("https://company.example/simple/", default=True)
    req = tmp_path / "req.txt"
    req.write_text("-i https://mirror.example/simple/\n--extra-index-url https://x.example/\n")
    flags = packages.from_flags([], [str(req)], ["https://flag.example/simple/"], [])
    assert flags.indexes == (
        sky.Index("https://flag.example/simple/"),  # --index: extra
        sky.Index("https://mirror.example/simple/", default=True),  # -i: replaces PyPI
        sky.Index("https://x.example/"),  # --extra-index-url: extra
    )


def test_two_default_indexes_are_an_error_naming_both(tmp_path: Path) -> None:
    req = tmp_path / "req.txt"
    req.write_text("--index-url https://me:s3cret@mirror.example/simple/\n")
    path = script(tmp_path, '[tool.uv]\nindex-url = "https://company.example/simple/"\n')
    with pytest.raises(sky.ConfigError) as caught:
        packages.from_flags([], [str(req)], [], []) + packages.script_metadata(path)
    said = str(caught.value)
    assert said.startswith("more than one index replaces the default index")
    assert "https://***@mirror.example/simple/" in said and "s3cret" not in said
    assert "https://company.example/simple/" in said and "train.py's metadata" in said
    both = (
        '[tool.uv]\nindex-url = "https://a.example/"\n\n'
        '[[tool.uv.index]]\nurl = "https://b.example/"\ndefault = true\n'
    )
    with pytest.raises(sky.ConfigError, match=r"names more than one default index"):
        packages.script_metadata(script(tmp_path, both))


def test_git_and_url_sources_become_direct_references(tmp_path: Path) -> None:
    found = packages.script_metadata(
        script(
            tmp_path,
            """
            [tool.uv.sources]
            skyward-alpha = { git = "https://git.example/a.git", tag = "v1", subdirectory = "py" }
            Skyward_Beta = { url = "https://files.example/skyward_beta-2.0-py3-none-any.whl" }
            skyward-gamma = { git = "git+ssh://git@git.example/gamma.git" }
            """,
            dependencies='["skyward-alpha[fast]>=1 ; python_version >= \\"3.11\\"", '
            '"skyward-beta", "skyward-gamma", "rich"]',
        )
    )
    assert found.pip == (
        "skyward-alpha[fast] @ git+https://git.example/a.git@v1#subdirectory=py"
        ' ; python_version >= "3.11"',
        "skyward-beta @ https://files.example/skyward_beta-2.0-py3-none-any.whl",
        "skyward-gamma @ git+ssh://git@git.example/gamma.git",
        "rich",
    )
    assert sky.Image(pip=found.pip).pip == found.pip, "valid PEP 508 requirements"


@pytest.mark.parametrize(
    ("source", "says"),
    [
        (
            '{ path = "../alpha" }',
            r"skyward-alpha is path '\.\./alpha' on this machine, which the nodes cannot see: "
            r"publish the package to an index .* --workdir DIR",
        ),
        ("{ workspace = true }", r"skyward-alpha is a workspace member on this machine"),
        (
            '{ url = "file:///tmp/skyward_alpha-1.0-py3-none-any.whl" }',
            r"skyward-alpha: file:///tmp/skyward_alpha-1.0-py3-none-any\.whl is on this machine",
        ),
        ('{ git = "file:///srv/alpha.git" }', r"skyward-alpha: file:///srv/alpha\.git is on this"),
        (
            '[{ index = "a", marker = "sys_platform == \'linux\'" }, { index = "b" }]',
            r"skyward-alpha is a list of sources .* keep the one for the nodes",
        ),
        (
            '{ git = "https://git.example/a.git", marker = "sys_platform == \'linux\'" }',
            r"skyward-alpha: marker in a git source is not supported for the nodes",
        ),
        ('{ index = "nowhere" }', r"sends skyward-alpha to the index 'nowhere', which no"),
        ('{ git = "https://git.example/a.git", tag = "v1", branch = "main" }', "give one of rev"),
        ('{ registry = "x" }', r"skyward-alpha = \{'registry': 'x'\} is not a source the nodes"),
    ],
)
def test_a_source_the_nodes_cannot_follow_is_an_error_naming_the_package(
    tmp_path: Path, source: str, says: str
) -> None:
    path = script(tmp_path, f"[tool.uv.sources]\nskyward-alpha = {source}\n")
    with pytest.raises(sky.ConfigError, match=says) as caught:
        packages.script_metadata(path)
    assert str(caught.value).startswith(f"{path}:1 (its '# /// script' metadata): ")


def test_a_direct_source_for_no_dependency_is_an_error(tmp_path: Path) -> None:
    path = script(tmp_path, '[tool.uv.sources]\nother = { url = "https://f.example/o.whl" }\n')
    with pytest.raises(sky.ConfigError, match=r"source for other, which the dependencies do not"):
        packages.script_metadata(path)


def test_a_path_source_stops_skyward_run_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    script(tmp_path, '[tool.uv.sources]\nskyward-alpha = { path = "alpha", editable = true }\n')
    assert main(["run", "train.py"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[tool.uv.sources] skyward-alpha is path 'alpha'" in err


# -- real runs -----------------------------------------------------------------------------------


@pytest.fixture
def public(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PackageIndex]:
    """The host's default index (PyPI's part): skyward-alpha and the agent's packages."""
    folder = tmp_path / "public"
    wheels.make_wheel(
        folder, "skyward-alpha", "1.0", {"skyward_alpha/__init__.py": "TOKEN = 'public'\n"}
    )
    wheels.wheelhouse(folder, wheels.AGENT_PACKAGES)
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    with PackageIndex(folder) as served:
        monkeypatch.setenv("UV_DEFAULT_INDEX", served.simple_url)
        yield served


@pytest.fixture
def private(tmp_path: Path) -> Iterator[PackageIndex]:
    """A company's index: the agent's packages, but no skyward-alpha."""
    with PackageIndex(wheels.wheelhouse(tmp_path / "private", wheels.AGENT_PACKAGES)) as served:
        yield served


@pytest.mark.slow
@pytest.mark.parametrize("form", ["index-url", "-i", "default = true", "extra-index-url"])
def test_an_index_url_replaces_the_default_index(
    tmp_path: Path, public: PackageIndex, private: PackageIndex, form: str
) -> None:
    """The company's index lacks skyward-alpha, the default one has it: named as the index to
    use, the company's is the only one asked, and the run fails naming the package (no public
    package of that name stands in for the company's). As an extra index it is asked first,
    then the default one, which serves it."""
    url = private.simple_url
    args = ["train.py"]
    if form == "index-url":
        script(tmp_path, f'[tool.uv]\nindex-url = "{url}"\n')
    elif form == "default = true":
        script(tmp_path, f'[[tool.uv.index]]\nname = "company"\nurl = "{url}"\ndefault = true\n')
    elif form == "extra-index-url":
        script(tmp_path, f'[tool.uv]\nextra-index-url = ["{url}"]\n')
    else:
        script(tmp_path, "")
        (tmp_path / "requirements.txt").write_text(f"-i {url}\n")
        args = ["-r", "requirements.txt", *args]
    done = skyward_run(*args, cwd=tmp_path)
    assert "/simple/skyward-alpha/" in private.requests
    if form == "extra-index-url":
        assert done.returncode == 0, done.stderr
        assert "(node 0) public" in done.stdout
        return
    assert done.returncode == 1, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "skyward-alpha was not found in the package registry" in last, last
    assert f"Indexes asked: then the default index {url}, not PyPI" in last, last
    assert public.requests == [], "the host's default index is never asked"


def _alpha_at_git(tmp_path: Path) -> Path:
    """A bare git repository of skyward-alpha (token "git"), built by a backend of its own
    (standard library only: building it needs no index), ready for git's dumb HTTP."""
    source = tmp_path / "alpha-src"
    (source / "skyward_alpha").mkdir(parents=True)
    (source / "skyward_alpha" / "__init__.py").write_text("TOKEN = 'git'\n")
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n\n'
        '[project]\nname = "skyward-alpha"\nversion = "1.0"\n'
    )
    (source / "backend.py").write_text(
        textwrap.dedent(
            '''
            """A wheel of skyward_alpha/, with the standard library only."""
            import base64, hashlib, pathlib, zipfile

            DIST = "skyward_alpha-1.0.dist-info"


            def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
                code = pathlib.Path("skyward_alpha").glob("*.py")
                files = {p.as_posix(): p.read_bytes() for p in code}
                files[f"{DIST}/METADATA"] = b"Metadata-Version: 2.1\\nName: skyward-alpha\\n"
                files[f"{DIST}/METADATA"] += b"Version: 1.0\\n"
                files[f"{DIST}/WHEEL"] = b"Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\n"
                files[f"{DIST}/WHEEL"] += b"Tag: py3-none-any\\n"
                record = []
                for path, data in files.items():
                    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                    record.append(f"{path},sha256={digest.decode()},{len(data)}")
                record.append(f"{DIST}/RECORD,,")
                files[f"{DIST}/RECORD"] = ("\\n".join(record) + "\\n").encode()
                name = "skyward_alpha-1.0-py3-none-any.whl"
                with zipfile.ZipFile(pathlib.Path(wheel_directory) / name, "w") as archive:
                    for path, data in files.items():
                        archive.writestr(path, data)
                return name
            '''
        )
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-C"]
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    subprocess.run([*git, str(source), "add", "."], check=True)
    subprocess.run([*git, str(source), "commit", "-qm", "alpha 1.0"], check=True)
    subprocess.run([*git, str(source), "tag", "v1.0"], check=True)
    bare = tmp_path / "alpha.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(source), str(bare)], check=True)
    subprocess.run(["git", "-C", str(bare), "update-server-info"], check=True)
    return bare


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["git", "url"])
def test_a_git_or_url_source_is_installed_on_the_nodes(
    tmp_path: Path, public: PackageIndex, private: PackageIndex, kind: str
) -> None:
    """The default index lacks skyward-alpha (it is the company's, with the agent's packages
    only): it comes from the script's git repository or wheel URL, over HTTP."""
    bare = _alpha_at_git(tmp_path)
    wheel = wheels.make_wheel(
        tmp_path / "files", "skyward-alpha", "1.0", {"skyward_alpha/__init__.py": "TOKEN = 'url'\n"}
    )

    def answer(request: Request) -> Reply:  # git's dumb HTTP: the repository's files
        file = bare / request.path.removeprefix("/alpha.git/")
        if request.path.startswith("/alpha.git/") and file.is_file():
            return 200, {}, file.read_bytes()
        return 404, {}, b""

    with LocalServer(answer) as git_server, PackageIndex(wheel.parent) as web_server:
        source = (
            f'{{ git = "{git_server.url}/alpha.git", tag = "v1.0" }}'
            if kind == "git"
            else f'{{ url = "{web_server.url}/files/{wheel.name}" }}'
        )
        script(
            tmp_path,
            f'[tool.uv]\nindex-url = "{private.simple_url}"\n\n'
            f"[tool.uv.sources]\nskyward-alpha = {source}\n",
        )
        done = skyward_run("train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"(node 0) {kind}" in done.stdout
    assert public.requests == []
