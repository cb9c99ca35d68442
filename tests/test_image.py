"""Image: frozen, hashable, content-hashed; and the helpers plugins use to derive new images."""

from __future__ import annotations

import dataclasses

import pytest

import skyward as sky
from skyward.hardware import Accelerator


def test_image_is_frozen_hashable_and_content_addressed() -> None:
    a = sky.Image(pip=["numpy>=1.26", "optax"], env={"B": "2", "A": "1"})
    b = sky.Image(pip=("numpy>=1.26", "optax"), env={"A": "1", "B": "2"})
    assert a == b and hash(a) == hash(b) and a.content_hash == b.content_hash
    assert len({a, b}) == 1
    assert sky.Image(pip=["numpy"]).content_hash != sky.Image(pip=["numpy<2"]).content_hash
    assert sky.Image(setup=["echo 1"]).content_hash != sky.Image(setup=["echo 2"]).content_hash
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.pip = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.env["C"] = "3"  # type: ignore[index]


def test_image_rejects_bad_input() -> None:
    with pytest.raises(sky.ConfigError, match="not a valid requirement"):
        sky.Image(pip=["numpy>>>1"])
    with pytest.raises(sky.ConfigError, match="list of strings"):
        sky.Image(pip="numpy")  # type: ignore[arg-type]


def test_derived_images_leave_the_original_untouched() -> None:
    base = sky.Image(
        pip=["jax==0.4.1", "jaxlib", "optax"], indexes=["https://example.invalid/simple"]
    )
    derived = base.without_packages(["JAX", "jaxlib"]).with_pip("jax[cpu]").with_env({"X": "1"})
    assert base.pip == ("jax==0.4.1", "jaxlib", "optax")
    assert derived.pip == ("optax", "jax[cpu]")
    assert derived.env == {"X": "1"} and base.env == {}
    scoped = sky.Index("https://example.invalid/flat", packages=("JAX",), flat=True)
    assert derived.with_indexes(scoped).indexes[-1].packages == ("jax",)
    merged = base.merge(sky.Image(pip=["optax", "chex"], apt=["git"], python="3.12"))
    assert merged.pip == ("jax==0.4.1", "jaxlib", "optax", "chex")
    assert (merged.apt, merged.python) == (("git",), "3.12")


@pytest.mark.parametrize(
    ("text", "name", "count"),
    [("A100", "A100", 1), ("a100:8", "A100", 8), ("TPU-v5e:4", "TPU-V5E", 4)],
)
def test_accelerator_spelling(text: str, name: str, count: int) -> None:
    acc = Accelerator.parse(text)
    assert (acc.name, acc.count) == (name, count)


@pytest.mark.parametrize("text", ["", "A100:0", "A100:x", ":8", "A100:8:1"])
def test_bad_accelerator_spelling(text: str) -> None:
    with pytest.raises(sky.ConfigError):
        Accelerator.parse(text)
