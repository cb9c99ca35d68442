"""Environment values for a remote command, sent on its stdin: never on a command line.

A command line is public on its machine: any user there reads it (``ps``, /proc/PID/cmdline),
and a Slurm site's accounting may keep an ``srun``'s for good. So the values of a pool's ``env=``
and of a provider's ``build_env`` (credentials, often) never go into one. A command that needs
them starts with `READ_ENV`: shell builtins only (no process, so no argv of its own) that read
ONE line from stdin and ``eval`` it; `env_line` is that line, ``export NAME='value' ...``, and the
caller writes it before anything else the command reads there (a tarball, a JSON spec, the
agent's wire). The values then live in the shell's environment and that of whatever it
``exec``s, which only the user and root may read (/proc/PID/environ).

Why stdin rather than a file created 0600: every such command is one exec whose stdin the client
owns from end to end (an SSH channel, or the pipe srun forwards to the step on its node), so the
values need no name on any disk (a Slurm cluster's shared home), nothing to remove afterwards,
and nothing to clean up when the command is killed. A shell's ``read`` takes a pipe or a socket a
byte at a time (it must not swallow what follows its line), so the rest of stdin reaches the
command untouched.

A value's newlines cannot travel in one line as themselves: each one is written as a reference
to a variable that `READ_ENV` sets to a newline.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from skyward.errors import ConfigError

_NEWLINE = "_skyward_nl"
_LINE = "_skyward_env"

# Run by the remote shell before the command proper: read the line, export what it says, forget
# the line. A command whose stdin ended before the line says so instead of running without it.
READ_ENV = (
    f"{_NEWLINE}='\n'; IFS= read -r {_LINE} || "
    "{ echo 'skyward: the environment line did not arrive on stdin' >&2; exit 125; }; "
    f'eval "${_LINE}"; unset {_LINE} {_NEWLINE}; '
)

_SPLICED_NEWLINE = f"'\"${_NEWLINE}\"'"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_line(env: Mapping[str, str]) -> bytes:
    """The line `READ_ENV` reads: every variable of `env` exported, each value quoted for the
    shell (``:`` for none: a bare ``export`` would print the whole environment)."""
    for name in env:
        if not _NAME.fullmatch(name):
            raise ConfigError(
                f"environment variable name {name!r} is not valid in a shell: use letters, "
                "digits and underscores, not starting with a digit"
            )
    if not env:
        return b":\n"
    words = " ".join(f"{name}={_quoted(value)}" for name, value in env.items())
    return f"export {words}\n".encode("utf-8", "surrogateescape")


def _quoted(value: str) -> str:
    # shlex.quote puts every newline inside single quotes: close them there, splice the newline
    # variable in, and open them again.
    return shlex.quote(value).replace("\n", _SPLICED_NEWLINE)
