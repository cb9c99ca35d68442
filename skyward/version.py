"""skyward's version: what a client and its agents compare in the handshake.

A module of its own, so that the agent, the handshake and the CLI read it without importing the
package root, whose names (pool, providers) load lazily and must not be imported back. It must
match ``version`` in pyproject.toml (`tests/test_public_api.py` checks).
"""

__version__ = "0.1.0"
