"""How a checkpoint path is resolved on one rank (lightning_zero.checkpoint.io) and the commit protocol
of a store without rename (lightning_zero.checkpoint.store) on fsspec's memory:// filesystem: no process group."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fsspec
import pytest

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint import store
from lightning_zero.checkpoint.io import location
from lightning_zero.checkpoint.save import remove_sharded


def test_location_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert location("ck/a.ckpt").as_path() == tmp_path / "ck" / "a.ckpt"
    assert location(Path("ck")).as_path() == tmp_path / "ck"
    assert location("~/a.ckpt").as_path() == tmp_path / "home" / "a.ckpt"
    assert location(f"file://{tmp_path}/a.ckpt").as_path() == tmp_path / "a.ckpt"
    assert location(os.fspath(tmp_path / "x")).as_path() == tmp_path / "x"
    remote = location("memory://bucket/run/a.ckpt")
    # str() is a URL that resolves to the same place (memory:// writes its root as a third slash)
    assert not remote.local and location(str(remote)) == remote
    assert remote.parent / "b.ckpt" == location("memory://bucket/run/b.ckpt") and remote.name == "a.ckpt"


def test_unknown_protocol_raises():
    with pytest.raises(ValueError, match="nosuchfs"):
        location("nosuchfs://bucket/a.ckpt")


def test_resolve_takes_file_urls(tmp_path):
    directory = tmp_path / "c.ckpt"
    directory.mkdir()
    fmt.write_metadata(directory, {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION})
    assert fmt.resolve(f"file://{directory}") == location(directory)
    assert fmt.resolve(f"file://{tmp_path}/missing.ckpt") is None


def _meta(files: str) -> dict:
    return {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "lightning_file": f"{files}/lightning.pt"}


def _put(where, data: bytes = b"x") -> None:
    with where.open("wb") as f:
        f.write(data)


def test_store_commit_protocol():
    """The order of writes and deletes on a store without rename: a prefix is a checkpoint only through
    its metadata.json, a committed save removes the files it replaced, a killed save's leftovers are
    removed by the next save into the same directory (whatever its name), and removal goes
    metadata.json first."""
    fs = fsspec.filesystem("memory")
    if fs.exists("/proto"):
        fs.rm("/proto", recursive=True)
    path = location("memory://proto/run/a.ckpt")

    # A save killed after writing its files: the prefix exists without metadata.json.
    store.begin(path, "killed")
    _put(store.files_dir(path, "killed") / "rank-00000.pt")
    with pytest.raises(ValueError, match=r"proto/run/a.ckpt is a directory but not a complete"):
        fmt.resolve("memory://proto/run/a.ckpt")

    # The next save (into another name) cleans it up, then commits.
    other = location("memory://proto/run/b.ckpt")
    marker = store.begin(other, "one")
    assert not path.exists() and marker.exists()
    _put(store.files_dir(other, "one") / "rank-00000.pt")
    with pytest.raises(ValueError, match="not a complete"):
        fmt.resolve(other)
    store.commit(other, marker, _meta("files-one"))
    assert fmt.resolve("memory://proto/run/b.ckpt") == other and not marker.exists()

    # Overwriting b.ckpt: the old files stay until the new metadata.json is written, then go.
    marker = store.begin(other, "two")
    _put(store.files_dir(other, "two") / "rank-00000.pt")
    assert json.loads(fs.cat("/proto/run/b.ckpt/metadata.json"))["lightning_file"] == "files-one/lightning.pt"
    store.commit(other, marker, _meta("files-two"))
    assert sorted(os.path.basename(p) for p in fs.ls("/proto/run/b.ckpt", detail=False)) == [
        "files-two",
        "metadata.json",
    ]
    assert not [p for p in fs.ls("/proto/run", detail=False) if ".zero-tmp-" in p]

    remove_sharded("memory://proto/run/b.ckpt")
    assert not other.exists()
    _put(location("memory://proto/run/notes"), b"mine")
    fs.mkdir("/proto/run/dir")
    _put(location("memory://proto/run/dir/x"))
    with pytest.raises(ValueError, match="refusing to delete"):
        remove_sharded("memory://proto/run/dir")
