"""Sharded-checkpoint pieces that need no process group: path resolution, removal, the streaming
``torch.save`` writer, and the ``lightning-zero consolidate`` command's errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint.consolidate import _StorageRef, _TensorRef, stream_save
from lightning_zero.checkpoint.io import location
from lightning_zero.checkpoint.save import HostBuffer, remove_sharded
from lightning_zero.cli import main
from lightning_zero.zero.engine_checkpoint import exact_storage


def _fake_checkpoint(path):
    path.mkdir()
    (path / fmt.LIGHTNING_FILE).write_bytes(b"")
    (path / fmt.METADATA_FILE).write_text(json.dumps({"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION}))
    return path


def test_resolve(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "a.ckpt")
    assert fmt.resolve(ckpt) == location(ckpt)
    plain = tmp_path / "plain.ckpt"
    plain.write_bytes(b"x")
    assert fmt.resolve(plain) is None
    assert fmt.resolve(tmp_path / "nothing.ckpt") is None
    with pytest.raises(ValueError, match="file inside the sharded checkpoint directory"):
        fmt.resolve(ckpt / fmt.LIGHTNING_FILE)
    (ckpt / fmt.METADATA_FILE).rename(tmp_path / "moved.json")
    with pytest.raises(ValueError, match="not a complete lightning_zero checkpoint"):
        fmt.resolve(ckpt)


def test_resolve_finds_checkpoint_moved_aside_by_interrupted_save(tmp_path):
    target = tmp_path / "last.ckpt"
    aside = _fake_checkpoint(fmt.previous_path(target))
    assert "last" not in aside.name  # ModelCheckpoint looks for "last" in names
    with pytest.warns(UserWarning, match="interrupted"):
        assert fmt.resolve(target) == location(aside)


def test_remove_sharded(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "a.ckpt")
    link = tmp_path / "last.ckpt"
    link.symlink_to(ckpt)
    remove_sharded(link)  # only the link goes
    assert ckpt.is_dir() and not link.exists()
    remove_sharded(ckpt)
    assert list(tmp_path.iterdir()) == []
    other = tmp_path / "data"
    other.mkdir()
    with pytest.raises(ValueError, match="refusing to delete"):
        remove_sharded(other)


def test_stream_save_matches_torch_save(tmp_path):
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.BatchNorm1d(5))
    model[1].weight = model[0].weight  # tied, as an LM head
    reference = model.state_dict()
    big = torch.arange(20.0)
    entries, refs = {}, {}
    for key, value in reference.items():
        ptr = value.data_ptr()
        if ptr not in refs:  # tied entries share one storage, as in torch.save
            refs[ptr] = _StorageRef(str(len(refs)), value.dtype, value.numel(), lambda v=value: v)
        entries[key] = _TensorRef(refs[ptr], value.shape)
    # A view into a larger storage, cast on the way (bf16), and a non-tensor entry with a tensor.
    entries["view"] = _TensorRef(_StorageRef("view", torch.bfloat16, 4, lambda: big[10:14]), torch.Size([2, 2]))
    entries["extra"] = {"note": "kept", "t": torch.ones(2)}
    stream_save(entries, tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    for key, value in reference.items():
        assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype, key
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()
    assert torch.equal(loaded["view"], big[10:14].to(torch.bfloat16).view(2, 2))
    assert loaded["extra"]["note"] == "kept" and torch.equal(loaded["extra"]["t"], torch.ones(2))
    assert not list(tmp_path.glob(".*"))  # written to a temporary name, then renamed


def test_cli_reports_errors(tmp_path, capsys):
    plain = tmp_path / "plain.ckpt"
    plain.write_bytes(b"x")
    assert main(["consolidate", str(plain), str(tmp_path / "out.pt")]) == 2
    assert "not a lightning_zero sharded checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["consolidate", str(plain), str(tmp_path / "out.pt"), "--dtype", "int8"])


def test_host_buffer_copies_reuses_and_saves_the_same(tmp_path):
    """An async save's host copy: the same values, shapes and views (two pieces of one storage stay
    one storage), in memory reused by the next copy, and ``torch.save`` of it reads back the same."""
    flat = torch.arange(15, dtype=torch.float32)
    payload = {
        "params": {"a": flat[:7], "b": flat[7:].view(2, 4)},  # views of one storage, as local_pieces gives
        "optim": [{"a": {"slices": {"exp_avg": torch.ones(7)}, "scalars": {"step": torch.tensor(3.0)}}}],
        "rng": {"torch": torch.arange(5, dtype=torch.uint8), "python": (3, (1, 2), None)},
        "loader": None,
    }
    buffer = HostBuffer()
    copied = buffer.copy(payload)
    first = {dtype: t.data_ptr() for dtype, t in buffer._flat.items()}
    flat.add_(100)  # the training step goes on: the copy keeps the values it was given
    assert torch.equal(copied["params"]["a"], torch.arange(7.0))
    assert torch.equal(copied["params"]["b"], torch.arange(7.0, 15.0).view(2, 4))
    assert copied["params"]["a"].untyped_storage().data_ptr() == copied["params"]["b"].untyped_storage().data_ptr()
    assert copied["rng"]["python"] == (3, (1, 2), None) and torch.equal(copied["rng"]["torch"], torch.arange(5))
    torch.save(copied, tmp_path / "rank.pt")
    loaded = torch.load(tmp_path / "rank.pt", weights_only=True)
    assert torch.equal(loaded["params"]["b"], copied["params"]["b"])
    assert torch.equal(loaded["optim"][0]["a"]["slices"]["exp_avg"], torch.ones(7))
    again = buffer.copy(payload)
    assert {dtype: t.data_ptr() for dtype, t in buffer._flat.items()} == first  # reused, not reallocated
    assert torch.equal(again["params"]["a"], torch.arange(100.0, 107.0))
    assert torch.equal(copied["params"]["a"], again["params"]["a"])  # (the buffer is one: copies share it)


def test_host_buffer_copies_the_covered_range_into_reserved_memory(tmp_path):
    """A piece of a larger storage (a master slice of a flat buffer) costs the buffer its own bytes,
    not the storage's; memory reserved (and touched) ahead by a thread is what the copy writes into;
    and the file written from the copy holds the piece's elements only, with the same values."""
    flat = torch.arange(1000, dtype=torch.float32)
    payload = {"params": {"a": flat[100:107], "b": flat[110:113]}, "optim": [], "rng": {}, "loader": None}
    buffer = HostBuffer()
    buffer.reserve(payload)
    assert buffer.nbytes == 64  # elements 100..112 of one storage: 13 floats in one 64-byte aligned slot
    reserved = buffer._flat[torch.float32].data_ptr()
    copied = buffer.copy(payload)
    assert copied["params"]["a"].data_ptr() == reserved  # written into the reserved memory
    assert torch.equal(copied["params"]["a"], torch.arange(100.0, 107.0))
    assert torch.equal(copied["params"]["b"], torch.arange(110.0, 113.0))
    assert copied["params"]["a"].untyped_storage().nbytes() == 64  # the used part (one slot), what torch.save writes
    torch.save(copied, tmp_path / "copy.pt")
    torch.save({"params": {"a": flat[100:107].clone()}}, tmp_path / "one.pt")
    assert (tmp_path / "copy.pt").stat().st_size < (tmp_path / "one.pt").stat().st_size + 1024  # not 4000 bytes
    loaded = torch.load(tmp_path / "copy.pt", weights_only=True)
    assert torch.equal(loaded["params"]["b"], torch.arange(110.0, 113.0))
    bigger = {**payload, "params": {"a": flat[:500]}}
    assert torch.equal(buffer.copy(bigger)["params"]["a"], flat[:500])  # grown when a payload needs more


def test_exact_storage_is_the_same_memory_without_the_rest():
    """What a save hands torch.save for a view of a flat buffer: the same memory (no copy), in a
    storage of exactly its bytes, valid after the flat buffer's last reference is gone."""
    flat = torch.arange(100, dtype=torch.float32)
    piece = exact_storage(flat[10:30])
    assert piece.data_ptr() == flat[10:30].data_ptr() and piece.untyped_storage().nbytes() == 80
    half = exact_storage(torch.zeros(10, dtype=torch.bfloat16)[2:5])  # (NumPy has no bfloat16)
    assert half.dtype == torch.bfloat16 and half.untyped_storage().nbytes() == 6
    whole = torch.ones(4)
    assert exact_storage(whole) is whole
    del flat
    assert torch.equal(piece, torch.arange(10.0, 30.0))
