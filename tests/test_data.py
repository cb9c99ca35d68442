"""`sky.Data` and `sky.output_dir()` on the Local provider: where a Data may sit in the
arguments, what is refused, and the errors (the provider contract covers the rest)."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky


@dataclasses.dataclass
class Config:
    train: sky.Data
    steps: int


@sky.compute
def paths(config: Config, extra: dict[str, list[sky.Data]]) -> list[str]:
    found: list[str] = [config.train, *extra["more"]]  # type: ignore[list-item]
    assert all(isinstance(p, str) for p in found)
    return [Path(p).read_text() for p in found]


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.ComputePool]:
    with sky.ComputePool(nodes=1, stream_output=False) as running:
        yield running


def test_data_is_found_inside_dataclasses_dicts_and_lists(
    pool: sky.ComputePool, tmp_path: Path
) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("A")
    b.write_text("B")
    config = Config(sky.Data(a), steps=3)
    assert paths(config, {"more": [sky.Data(b)]}) >> pool == ["A", "B"]


def test_data_captured_by_the_function_is_refused_on_the_client(tmp_path: Path) -> None:
    captured = sky.Data(tmp_path)

    @sky.compute
    def uses_global() -> str:
        return str(captured)

    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        with pytest.raises(sky.SerializationError, match="pass it as an argument"):
            uses_global() >> pool


def test_data_outside_a_call_does_not_pickle(tmp_path: Path) -> None:
    with pytest.raises(sky.SerializationError, match="outside a call's arguments"):
        pickle.dumps(sky.Data(tmp_path))


def test_data_paths_and_uris_are_checked() -> None:
    assert sky.Data("~/x").source == str(Path.home() / "x")
    assert isinstance(sky.Data("x"), str), "a Data type-checks where a path is taken"
    assert sky.Data("s3://bucket/prefix/").is_s3
    with pytest.raises(sky.ConfigError, match="no bucket"):
        sky.Data("s3:///prefix")
    with pytest.raises(sky.ConfigError, match="path or an s3"):
        sky.Data(3)  # type: ignore[arg-type]


def test_output_dir_off_a_node_and_bad_output_dirs() -> None:
    with pytest.raises(sky.NotOnNodeError):
        sky.output_dir()
    with pytest.raises(sky.ConfigError, match="names no bucket"):
        sky.ComputePool(output_dir="s3://")
    with pytest.raises(sky.ConfigError, match="output_dir takes a path or an s3"):
        sky.ComputePool(output_dir=7)  # type: ignore[arg-type]


def test_relative_output_dir_is_taken_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    pool = sky.ComputePool(output_dir="runs/x", stream_output=False)
    assert pool.spec.outputs == str(tmp_path / "runs" / "x")
