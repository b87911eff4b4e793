"""Checkpoint metadata under tensor and pipeline parallelism, without a process group: merging the
ranks' reports, splitting along a partition dim, and reading any tensor-parallel part of a
hand-written tp=2 checkpoint (the values are integers: every comparison is exact)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint.merge import Placement, Split, keep_copies, merge_reports
from lightning_zero.checkpoint.reader import ShardedReader
from lightning_zero.layout import ParallelLayout


def _entry(names, piece, shape=(4, 6), dim=None, size=1, optimizer=0):
    return {
        "names": list(names),
        "shape": list(shape),
        "dtype": "float32",
        "saved_dtype": "float32",
        "optimizer": optimizer,
        "partition_dim": dim,
        "tensor_parallel_size": size,
        "piece": piece,
    }


def _report(rank, pp_rank, params, keys=(), optimizer_names=None):
    return {
        "rank": rank,
        "pp_rank": pp_rank,
        "state_dict_keys": list(keys),
        "params": params,
        "optimizer_names": [optimizer_names],
    }


def test_merge_tied_weight_across_stages_keeps_first_stage():
    # Stage 0 (ranks 0, 1: dp2) holds wte; stage 1 (ranks 2, 3) its tied copy lm_head, naming wte.
    reports = [
        _report(0, 0, {"wte": _entry(["wte", "lm_head"], [0, 0, 0, 12])}, ["wte", "h0"], [["wte"]]),
        _report(1, 0, {"wte": _entry(["wte", "lm_head"], [1, 0, 12, 12])}, ["wte", "h0"], [["wte"]]),
        _report(2, 1, {"lm_head": _entry(["lm_head", "wte"], [2, 0, 0, 12])}, ["h1", "lm_head"], [["h1", "lm_head"]]),
        _report(3, 1, {"lm_head": _entry(["lm_head", "wte"], [3, 0, 12, 12])}, ["h1", "lm_head"], [["h1", "lm_head"]]),
    ]
    merged = merge_reports(reports[::-1])  # any arrival order
    assert list(merged["params"]) == ["wte"]
    assert merged["params"]["wte"]["aliases"] == ["lm_head"]
    assert merged["params"]["wte"]["pieces"] == [[0, 0, 0, 12], [1, 0, 12, 12]]
    assert merged["alias_of"] == {"wte": "wte", "lm_head": "wte"}
    assert merged["state_dict_keys"] == ["wte", "h0", "h1", "lm_head"]
    assert merged["optimizer_names"] == [[["wte", "h1"]]]


def test_merge_tensor_parallel_parts():
    # tp2: each tp rank holds a (2, 6) part of a (4, 6) weight split along dim 0, cut over dp2.
    reports = [_report(r, 0, {"w": _entry(["w"], [r, r % 2, 6 * (r // 2), 6], dim=0, size=2)}) for r in range(4)]
    merged = merge_reports(reports)
    assert merged["params"]["w"]["pieces"] == [[0, 0, 0, 6], [1, 1, 0, 6], [2, 0, 6, 6], [3, 1, 6, 6]]


def test_merge_rejects_disagreeing_or_incomplete_ranks():
    with pytest.raises(ValueError, match=r"w: shape \[4, 6\] on an earlier rank but \[4, 7\] on rank 1"):
        merge_reports(
            [
                _report(0, 0, {"w": _entry(["w"], [0, 0, 0, 12])}),
                _report(1, 0, {"w": _entry(["w"], [1, 0, 12, 12], shape=(4, 7))}),
            ]
        )
    with pytest.raises(ValueError, match=r"cover \[\(0, 12\)\] of its 24 elements"):
        merge_reports([_report(0, 0, {"w": _entry(["w"], [0, 0, 0, 12])})])
    with pytest.raises(ValueError, match="part 1"):  # tp rank 1 never reported its part
        merge_reports([_report(0, 0, {"w": _entry(["w"], [0, 0, 0, 12], dim=0, size=2)})])


def test_node_local_copies_one_per_node():
    # 4 data-parallel ranks on 2 nodes (ranks 0, 1 on node 0; 2, 3 on node 1): a buffer "b" that data-parallel
    # rank 0 writes, offered again by ranks 1-3 (node-local storage), is copied once, onto node 1 (rank 2).
    reports = [_report(0, 0, {"b": _entry(["b"], [0, 0, 0, 24], optimizer=None)})]
    reports += [{**_report(r, 0, {}), "copies": {"b": [r, 0, 0, 24]}} for r in (1, 2, 3)]
    merged = merge_reports(reports)
    assert merged["params"]["b"]["pieces"] == [[0, 0, 0, 24]] and len(merged["params"]["b"]["copies"]) == 3
    keep_copies(merged, [0, 0, 1, 1])
    assert merged["params"]["b"]["copies"] == [[2, 0, 0, 24]]
    merged = merge_reports(reports)
    keep_copies(merged, [0, 0, 0, 0])  # one node: rank 0's piece is there already
    assert "copies" not in merged["params"]["b"]


def test_split_and_placement():
    assert Split(1, 2, 3).block([4, 6]) == (4, 2)
    with pytest.raises(
        ValueError, match=r"full shape \(4, 6\); dim 0 of size 4 is not divisible by the tensor-parallel size 3"
    ):
        Split(0, 0, 3).block([4, 6], "w")
    place = Placement(5, ParallelLayout(2, tensor=2, pipeline=2))  # tp fastest: tp 1, dp 0, pp 1
    assert (place.coords.tp, place.coords.dp, place.coords.pp) == (1, 0, 1)
    assert place.split(1) == Split(1, 1, 2) and place.split(None) is None
    assert place.full_shape([4, 3], 1) == [4, 6]
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) \* pp\(1\) != world_size\(2\)"):
        Placement.of(0, 2, ParallelLayout(2, tensor=2))


def _tp2_checkpoint(path, full):
    """(4, 6) weight ``w`` split along dim 1 over tp2 (parts (4, 3)), each part cut over dp2; global
    ranks as the layout orders them (tp fastest)."""
    path.mkdir()
    parts = full.chunk(2, dim=1)
    pieces, files = [], {r: {"params": {}, "optim": [], "rng": {}} for r in range(4)}
    for rank in range(4):
        tp, dp = rank % 2, rank // 2
        flat = parts[tp].reshape(-1)[dp * 6 : (dp + 1) * 6].clone()
        files[rank]["params"]["w"] = flat
        pieces.append([rank, tp, dp * 6, 6])
    sizes = []
    for rank, data in files.items():
        torch.save(data, path / fmt.rank_file(rank))
        sizes.append((path / fmt.rank_file(rank)).stat().st_size)
    meta = {
        "format": fmt.FORMAT_NAME,
        "version": 2,
        "world_size": 4,
        "rank_files": [fmt.rank_file(r) for r in range(4)],
        "rank_file_bytes": sizes,
        "params": {
            "w": {
                "shape": [4, 6],
                "dtype": "float32",
                "saved_dtype": "float32",
                "aliases": ["v"],
                "optimizer": None,
                "partition_dim": 1,
                "tensor_parallel_size": 2,
                "pieces": pieces,
            }
        },
    }
    (path / fmt.METADATA_FILE).write_text(json.dumps(meta))


def test_reader_resplits_for_any_tensor_parallel_size(tmp_path):
    full = torch.arange(24.0).view(4, 6)
    _tp2_checkpoint(tmp_path / "c", full)
    reader = ShardedReader(tmp_path / "c", {})
    assert torch.equal(reader.full("v"), full)  # tp2 -> whole (tp1), through the tied name
    for size in (1, 2, 3, 6):  # along the saved dim, parts of other sizes
        for rank in range(size):
            split = Split(1, rank, size)
            part = full.narrow(1, *split.block(full.shape))
            assert torch.equal(reader.full("w", split), part), (size, rank)
            assert torch.equal(reader.read("w", 1, 5, split=split), part.reshape(-1)[1:6]), (size, rank)
    for rank in range(2):  # along another dim
        assert torch.equal(reader.full("w", Split(0, rank, 2)), full[2 * rank : 2 * rank + 2])
    with pytest.raises(ValueError, match="dim 1 of size 6 is not divisible by the tensor-parallel size 4"):
        reader.full("w", Split(1, 0, 4))


def test_version_1_metadata_reads_as_one_whole_part():
    meta = {"version": 1, "params": {"w": {"shape": [3], "pieces": [[0, 0, 2], [1, 2, 1]]}}}
    entry = fmt.upgrade_metadata(meta)["params"]["w"]
    assert entry["pieces"] == [[0, 0, 0, 2], [1, 0, 2, 1]]
    assert (entry["partition_dim"], entry["tensor_parallel_size"]) == (None, 1)
