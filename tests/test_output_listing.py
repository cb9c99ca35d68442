"""A node's output listing cannot make the client write outside the pool's output_dir."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from skyward.errors import DataError
from skyward.providers.remote import files
from skyward.providers.remote.treepull import check_listing
from skyward.worker.treemanifest import DIR, FILE, LINK, Entry


def _file(path: str) -> Entry:
    return Entry(path, FILE, 0o600, 0, 1)


@pytest.mark.parametrize(
    "bad",
    [
        [_file("../x")],
        [_file("/etc/x")],
        [_file("a/../../x")],
        [_file("a//x")],
        [Entry("up", LINK, 0o777, 0, target="/etc"), _file("up/x")],
    ],
)
def test_a_path_leading_out_is_named(tmp_path: Path, bad: list[Entry]) -> None:
    assert check_listing(tmp_path / "out", [_file("fine"), *bad]) == bad[-1].path


def test_a_symlink_already_on_the_client_cannot_lead_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "up").symlink_to(tmp_path)
    assert check_listing(out, [_file("up/x")]) == "up/x"


def test_paths_inside_pass(tmp_path: Path) -> None:
    listing = [
        Entry(".", DIR, 0o700, 0),
        Entry("a", DIR, 0o700, 0),
        _file("a/b.txt"),
        Entry("link", LINK, 0o777, 0, target="/etc/hostname"),  # made, never written through
    ]
    assert check_listing(tmp_path, listing) is None


class _Node:
    index = 3
    host = "node-3.example"


class _Peer:
    """Stands in for the node's ``treestore send`` process: it lists a path outside."""

    what = "pulling data"
    node = _Node()

    async def reply(self) -> dict[str, object]:
        return {"missing": False, "entries": [["../../escaped", FILE, 0o600, 0, 1, ""]]}

    def error(self, message: str, path: str = "") -> DataError:
        return DataError(f"{self.what} on node 3 (node-3.example) failed: {message}", path=path)

    async def close(self) -> None:
        pass


def test_pull_refuses_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def start(*_args: object) -> _Peer:
        return _Peer()

    monkeypatch.setattr(files.Peer, "start", start)
    out = tmp_path / "a" / "out"
    with pytest.raises(DataError) as caught:
        asyncio.run(files.pull_tree(_Node(), "outputs", out))  # type: ignore[arg-type]
    message = str(caught.value)
    assert "node 3" in message and "'../../escaped'" in message and "outside" in message
    assert sorted(p.name for p in tmp_path.rglob("*")) == []
