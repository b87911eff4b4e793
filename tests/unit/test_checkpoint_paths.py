"""How a checkpoint path is resolved on one rank (lightning_zero.checkpoint.io): no process group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint.io import local_path


def test_local_path_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert local_path("ck/a.ckpt") == tmp_path / "ck" / "a.ckpt"
    assert local_path(Path("ck")) == tmp_path / "ck"
    assert local_path("~/a.ckpt") == tmp_path / "home" / "a.ckpt"
    assert local_path(f"file://{tmp_path}/a.ckpt") == tmp_path / "a.ckpt"
    assert local_path(os.fspath(tmp_path / "x")) == tmp_path / "x"


def test_other_filesystems_refused():
    # memory:// is built into fsspec (s3fs is not installed here): any non-local filesystem takes this path.
    with pytest.raises(ValueError, match="'memory'.*is not the local one"):
        local_path("memory://bucket/a.ckpt")


def test_resolve_takes_file_urls(tmp_path):
    directory = tmp_path / "c.ckpt"
    directory.mkdir()
    fmt.write_metadata(directory, {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION})
    assert fmt.resolve(f"file://{directory}") == directory
    assert fmt.resolve(f"file://{tmp_path}/missing.ckpt") is None
