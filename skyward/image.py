"""`Image`: the frozen description of a node's Python environment.

Plugins never mutate an image; they return a new one (`dataclasses.replace`, `with_pip`, ...).
The content hash names the environment directory on every node, so two pools with the same
image share one built environment.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from skyward import checks
from skyward.errors import ConfigError
from skyward.worker.redact import redact_urls


@dataclass(frozen=True)
class Index:
    """A package index for the environment build.

    `packages` scopes the index: only those distributions are taken from it (empty means all).
    `flat` marks a find-links page (a plain HTML list of wheels) rather than a PEP 503 index.
    `default` makes it the default index, in place of PyPI (uv's ``--default-index`` and
    ``[[tool.uv.index]] default = true``, pip's ``--index-url``): nothing is then asked of
    PyPI, so a package your index lacks fails the build rather than coming from the public
    one. Without it an index is an extra one, asked before the default (uv's ``--index``,
    pip's ``--extra-index-url``).
    """

    url: str
    packages: tuple[str, ...] = ()
    flat: bool = False
    default: bool = False

    def __post_init__(self) -> None:
        checks.text(self.url, "Index(url=)")
        checks.flag(self.flat, "Index(flat=)")
        checks.flag(self.default, "Index(default=)")
        packages = checks.texts(self.packages, "Index(packages=)")
        object.__setattr__(self, "packages", tuple(canonicalize_name(p) for p in packages))
        if self.default and (self.packages or self.flat):
            raise ConfigError(
                f"Index({redact_urls(self.url)!r}, default=True) replaces PyPI for every "
                "package, so it is a PEP 503 index for all of them: drop packages= and flat= "
                "(or default=True, to keep it an extra index)"
            )

    def __repr__(self) -> str:
        # An Image's repr (an error, a log) must not show an index's password.
        url = redact_urls(self.url)
        default = ", default=True" if self.default else ""
        return f"Index(url={url!r}, packages={self.packages!r}, flat={self.flat!r}{default})"


def _as_index(value: Index | str) -> Index:
    return value if isinstance(value, Index) else Index(checks.text(value, "Image(indexes=)"))


@dataclass(frozen=True, init=False)
class Image:
    """What every node's environment holds.

    Args:
        python: the nodes' Python version; None (the default) is the client's major.minor,
            which the nodes must run (cloudpickle'd functions do not cross minor versions), so
            a version given must be the client's minor: ``"3.11.9"`` pins a patch release.
        pip: requirement strings (PEP 508), installed with uv.
        indexes: package indexes (`Index` or a URL: an extra index, asked before the default
            one); at most one `Index(url, default=True)`, which replaces PyPI.
        apt: Debian packages the node must have.
        env: environment variables for the agent and the user's code.
        setup: shell commands run once per image on each node, after the packages.
    """

    python: str | None = None
    pip: tuple[str, ...] = ()
    indexes: tuple[Index, ...] = ()
    apt: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()

    def __init__(
        self,
        python: str | None = None,
        pip: Iterable[str] = (),
        indexes: Iterable[Index | str] = (),
        apt: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        setup: Iterable[str] = (),
    ) -> None:
        # Written out so that lists type-check too; stored as tuples (an image is hashable).
        lists = {"pip": pip, "apt": apt, "setup": setup}
        for name, value in lists.items():
            object.__setattr__(self, name, checks.texts(value, f"Image({name}=)"))
        object.__setattr__(self, "python", checks.optional_text(python, "Image(python=)"))
        if isinstance(indexes, str) or not isinstance(indexes, Iterable):
            raise ConfigError(
                f"Image(indexes=) must be a list of URLs or sky.Index, got {indexes!r}"
            )
        object.__setattr__(self, "indexes", tuple(_as_index(i) for i in indexes))
        defaults = list(dict.fromkeys(i.url for i in self.indexes if i.default))
        if len(defaults) > 1:
            raise ConfigError(
                "Image(indexes=): more than one index replaces the default index ("
                f"{redact_urls(', '.join(defaults))}); keep one, and make the others extra "
                "indexes (Index(url) without default=True)"
            )
        env_items = sorted(checks.environment(env, "Image(env=)").items())
        object.__setattr__(self, "env", MappingProxyType(dict(env_items)))
        for spec in self.pip:
            try:
                Requirement(spec)
            except InvalidRequirement as exc:
                raise ConfigError(
                    f"Image(pip=...): {spec!r} is not a valid requirement: {exc}"
                ) from None

    def __hash__(self) -> int:
        return hash(self.content_hash)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Image) and self.content_hash == other.content_hash

    def _canonical(self) -> dict[str, Any]:
        return {
            "python": self.python,
            "pip": list(self.pip),
            # `default` only where set: images without one keep the hash they always had.
            "indexes": [
                [i.url, list(i.packages), i.flat, *(["default"] if i.default else [])]
                for i in self.indexes
            ],
            "apt": list(self.apt),
            "env": dict(self.env),
            "setup": list(self.setup),
        }

    @property
    def content_hash(self) -> str:
        """A short stable hash of everything that shapes the environment."""
        blob = json.dumps(self._canonical(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def default_index(self) -> Index | None:
        """The index that replaces PyPI (`Index(default=True)`), or None: PyPI, or whatever
        the host's uv configuration names."""
        return next((i for i in self.indexes if i.default), None)

    def requirements(self) -> list[Requirement]:
        """The parsed pip requirements."""
        return [Requirement(spec) for spec in self.pip]

    def with_pip(self, *specs: str) -> Image:
        """A new image with `specs` added (a spec already present is not repeated)."""
        return replace(self, pip=self.pip + tuple(s for s in specs if s not in self.pip))

    def without_packages(self, names: Iterable[str]) -> Image:
        """A new image with every requirement on one of `names` removed."""
        drop = {canonicalize_name(n) for n in names}
        kept = tuple(s for s in self.pip if canonicalize_name(Requirement(s).name) not in drop)
        return replace(self, pip=kept)

    def with_indexes(self, *indexes: Index | str) -> Image:
        """A new image with `indexes` appended (an index already present is not repeated)."""
        new = tuple(i for i in map(_as_index, indexes) if i not in self.indexes)
        return replace(self, indexes=self.indexes + new)

    def with_env(self, env: Mapping[str, str]) -> Image:
        """A new image whose environment has `env` on top of its own."""
        return replace(self, env={**self.env, **env})

    def merge(self, other: Image) -> Image:
        """Combine two images: lists are concatenated without repeats, `other` wins on conflicts
        (its default index, if it has one, replaces this one's)."""
        own = self.indexes
        if other.default_index is not None:
            own = tuple(i for i in own if not i.default)
        image = replace(self, indexes=own).with_pip(*other.pip)
        image = image.with_indexes(*other.indexes).with_env(other.env)
        return replace(
            image,
            python=other.python or self.python,
            apt=self.apt + tuple(a for a in other.apt if a not in self.apt),
            setup=self.setup + tuple(s for s in other.setup if s not in self.setup),
        )
