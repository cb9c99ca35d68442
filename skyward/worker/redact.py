"""Hide the credentials of every URL in text skyward prints: ``https://user:token@host/simple``
becomes ``https://***@host/simple``.

An index URL may carry a password or a token in its userinfo (a private index, a proxy in
``build_env``); it must never reach an error message, a console line or a log. Used where a URL
or a command's output is echoed, on the client and on the hosts, so standard library only
(Python 3.8+): `uvinstall` and `envbuild` run with a host's own python3.
"""

from __future__ import annotations

import re

# A scheme, then the userinfo: everything up to the last "@" before the host's end (a "/", "?",
# "#" or a blank). Greedy, so a password with an unescaped "@" in it is hidden whole.
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#]*@")


def redact_urls(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by ``***``."""
    return _USERINFO.sub(r"\1***@", text)
