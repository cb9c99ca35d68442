"""The `skyward` command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyward import __version__
from skyward.cli.main import main
from skyward.providers.source import source_hash


def test_cache_list_and_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path))
    assert main(["cache", "list"]) == 0
    assert "no environments" in capsys.readouterr().out
    env = tmp_path / "envs" / "0123456789abcdef"
    env.mkdir(parents=True)
    (env / "blob").write_bytes(b"x" * 2_000_000)
    (env / ".skyward-ready").write_text("{}")
    assert main(["cache", "list"]) == 0
    listed = capsys.readouterr().out
    assert "0123456789abcdef" in listed and "2.0 MB" in listed and "ready" in listed
    old_copy = tmp_path / "src" / "feedfacefeedface" / "skyward"
    old_copy.mkdir(parents=True)
    current = tmp_path / "src" / source_hash() / "skyward"  # this client's own: kept
    current.mkdir(parents=True)
    objects = tmp_path / "data" / "objects"
    objects.mkdir(parents=True)
    (objects / "ab12").write_bytes(b"y" * 3_000_000)
    tree = tmp_path / "data" / "trees" / "cd34" / "tree"
    tree.mkdir(parents=True)
    (tree / "weights.bin").hardlink_to(objects / "ab12")  # one content, counted once
    assert main(["cache", "list"]) == 0
    assert "sky.Data on this machine: 3.0 MB" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert not env.exists()
    assert not old_copy.parent.exists() and current.exists()
    assert not (tmp_path / "data").exists()
    out = capsys.readouterr().out
    assert "removed 1 old copy(ies) of skyward" in out and "sky.Data store" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_down_needs_a_pool_or_all(capsys: pytest.CaptureFixture[str]) -> None:
    # Refused before any AWS call: a bare `skyward down` must never mean "everything".
    assert main(["down"]) == 2
    assert "--all" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ls", "--bogus"])


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}, "no AWS region"),
        ({"AWS_DEFAULT_REGION": "us-east-1"}, "no AWS credentials found"),
    ],
)
def test_ls_without_a_region_or_credentials_says_so_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    environ: dict[str, str],
    says: str,
) -> None:
    for name in (
        "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    ):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to look for
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["ls", "--provider", "aws"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("skyward ls: ") and says in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_help_reads_as_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "skyward down POOL" in out and "``" not in out
