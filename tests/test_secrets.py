"""Secrets in what skyward runs and prints: env values on stdin (`transport.stdinenv`), URLs with
their credentials hidden (`worker.redact`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli.profiles import parse_env
from skyward.errors import ConfigError
from skyward.providers.cloud.bootscript import first_boot_script
from skyward.transport.stdinenv import READ_ENV, env_line
from skyward.worker import envbuild
from skyward.worker.redact import redact_urls

PASSWORD = "s3cr3t-pw"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("https://user:tok@host/simple", "https://***@host/simple"),
        ("http://tok@10.0.0.1:8080/x?y=1", "http://***@10.0.0.1:8080/x?y=1"),
        ("git+https://u:p@ss@github.com/a/b.git", "git+https://***@github.com/a/b.git"),
        (
            "a https://u:p@h/ and file:///x@y and s3://k:s@b/k",
            "a https://***@h/ and file:///x@y and s3://***@b/k",
        ),
        ("https://host/simple/pkg@1.0", "https://host/simple/pkg@1.0"),
        ("no url at all: user@host", "no url at all: user@host"),
    ],
)
def test_redact_urls_hides_userinfo_only(text: str, shown: str) -> None:
    assert redact_urls(text) == shown


def test_an_index_repr_shows_no_password() -> None:
    image = sky.Image(indexes=[f"https://me:{PASSWORD}@pkgs.example/simple"])
    assert PASSWORD not in repr(image) and "https://***@pkgs.example/simple" in repr(image)


def test_a_failing_setup_command_prints_no_password(tmp_path: Path) -> None:
    url = f"https://me:{PASSWORD}@pkgs.example/simple"
    spec = envbuild.EnvSpec(hash="redact-test", setup=(f"echo fetching {url} >&2; exit 3",))
    lines: list[str] = []
    with pytest.raises(envbuild.BuildFailed) as failed:
        envbuild.run_setup_once(spec, tmp_path, lines.append)
    shown = "\n".join([str(failed.value), failed.value.output, *lines])
    assert PASSWORD not in shown
    assert "https://***@pkgs.example/simple" in failed.value.output


def test_env_values_reach_the_shell_through_stdin_exactly() -> None:
    """Quotes, newlines, `$`, backticks and blanks arrive as they were; what follows the line
    on stdin reaches the command untouched; nothing of the values is in the command line."""
    env = {
        "PLAIN": "plain-value",
        "TRICKY": "a'b\"c $HOME `id` \\n\n\nlast line \r",
        "EMPTY": "",
        "LEAD": "  blanks  ",
    }
    program = "import json, os, sys; print(json.dumps([os.environ[k] for k in sys.argv[1:]]))"
    argv = ["sh", "-c", READ_ENV + 'exec "$0" -c "$@"', sys.executable, program, *env]
    done = subprocess.run(argv, input=env_line(env) + b"rest", capture_output=True, check=True)
    assert json.loads(done.stdout) == [env[name] for name in env]
    assert not any(value in " ".join(argv) for value in env.values() if value.strip())
    # No line at all: the command says so rather than running without its environment.
    empty = subprocess.run(["sh", "-c", READ_ENV + "echo ran"], input=b"", capture_output=True)
    assert empty.returncode == 125 and b"did not arrive on stdin" in empty.stderr
    assert env_line({}) == b":\n"
    with pytest.raises(ConfigError, match="not valid in a shell"):
        env_line({"BAD-NAME": "x"})


def test_a_pool_name_cannot_leave_the_boot_scripts_comment() -> None:
    script = first_boot_script("p\ntouch /tmp/owned #-1", 60, "x", "true")
    assert "\ntouch /tmp/owned" not in script
    assert '# skyward x for pool "p\\ntouch /tmp/owned #-1"' in script


def test_env_flag_with_a_bare_name_takes_the_shells_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """``skyward run --env NAME``: the secret is read here, never typed on a command line."""
    monkeypatch.setenv("SKYWARD_TEST_TOKEN", PASSWORD)
    assert parse_env(["SKYWARD_TEST_TOKEN", "A=1"]) == {"SKYWARD_TEST_TOKEN": PASSWORD, "A": "1"}
    monkeypatch.delenv("SKYWARD_TEST_TOKEN")
    with pytest.raises(ConfigError, match="SKYWARD_TEST_TOKEN is not set in this shell"):
        parse_env(["SKYWARD_TEST_TOKEN"])
