"""Sharded checkpoints on spawned CPU/gloo ranks: exact resume (random states included), resharding
to another world size and stage, consolidation without a process group, atomic saves under a kill,
ModelCheckpoint top-k, and the errors a user meets. Several checks share one spawn to keep it short.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_zero.testing import free_port, run_ranks
from tests.helpers.checkpoint import (
    BufferModel,
    DropoutModel,
    check_frozen_buffers,
    fit_dropout,
    frozen_buffers_worker,
)
from tests.helpers.models import state
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
# Every parameter sharded (none kept whole by the persistence threshold), buckets cutting through them.
ZERO3 = {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0}


def _two_rank_worker(rank: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    every_epoch = ModelCheckpoint(dirpath=f"{tmp}/epochs", every_n_epochs=1, save_top_k=-1)
    top_k = ModelCheckpoint(
        dirpath=f"{tmp}/topk", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    zero2 = {"stage": 2, "reduce_bucket_size": 50}
    trainer, full = fit_dropout(zero2, 2, rank, 8, callbacks=[every_epoch, top_k])
    trainer.save_checkpoint(f"{tmp}/final.ckpt")
    path = f"{tmp}/epochs/epoch=0-step=4.ckpt"
    _, same = fit_dropout(zero2, 2, rank, 8, ckpt_path=path)
    _, stage1 = fit_dropout({"stage": 1}, 2, rank, 8, ckpt_path=path)
    _, stage3 = fit_dropout(ZERO3, 2, rank, 8, ckpt_path=path)
    return {
        "full": full.losses,
        "same": same.losses,
        "stage1": stage1.losses,
        "stage3": stage3.losses,
        "final_state": state(full),
        "topk": sorted(os.listdir(f"{tmp}/topk")),
    }


def _reshard_worker(rank: int, tmp: str, source: str, spec: dict, world_size: int, out: str) -> dict:
    """Resume ``source`` on ``world_size`` ranks without training (max_steps is the saved step), save again."""
    trainer, model = fit_dropout(spec, world_size, rank, 4, ckpt_path=source, model_kwargs={"dropout": 0.0})
    trainer.save_checkpoint(out)
    return {"global_step": trainer.global_step, "state": state(model)}


def _one_rank_worker(rank: int, tmp: str, source: str, out: str) -> dict:
    """2 ranks -> 1 rank, then each error a user can meet (the same spawn, to save a start-up)."""
    resharded = _reshard_worker(rank, tmp, source, {"stage": 1}, 1, out)
    _, continued = fit_dropout({"stage": 1}, 1, rank, 8, ckpt_path=out, model_kwargs={"dropout": 0.0})
    return {**resharded, "continued": continued.losses, "errors": _errors(rank, Path(source))}


def _from_one_rank_worker(rank: int, tmp: str, source: str, out: str) -> dict:
    """1 rank -> 2 ranks under zero3: reshard and save again; and train on from the 1-rank checkpoint."""
    resharded = _reshard_worker(rank, tmp, source, ZERO3, 2, out)
    _, continued = fit_dropout({"stage": 2}, 2, rank, 8, ckpt_path=source, model_kwargs={"dropout": 0.0})
    return {**resharded, "continued": continued.losses}


def _errors(rank: int, source: Path) -> dict:
    tmp = source.parent.parent
    missing, unfinished = tmp / "missing.ckpt", tmp / "unfinished.ckpt"
    shutil.copytree(source, missing)
    (missing / "rank-00001.pt").unlink()
    shutil.copytree(source, unfinished)
    (unfinished / "metadata.json").unlink()
    cases = {
        "file_inside": (str(source / "rank-00000.pt"), {}),
        "incompatible": (str(source), {"hidden": 8}),
        "missing_rank": (str(missing), {}),
        "unfinished": (str(unfinished), {}),
    }
    messages = {}
    for name, (path, kwargs) in cases.items():
        try:
            fit_dropout({"stage": 2}, 1, rank, 8, ckpt_path=path, model_kwargs=kwargs)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


def test_resume_frozen_parameters_and_buffers(tmp_path):
    specs = [{"stage": 1}, {"stage": 2, "reduce_bucket_size": 50}, ZERO3]
    check_frozen_buffers(run_ranks(frozen_buffers_worker, str(tmp_path), specs))


class RejectingModel(BufferModel):
    """Its state-dict hook rejects a saved ``decay``: only the rank that loads it (data-parallel rank 0)
    meets the error, the other ranks wait for its broadcast."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_load_state_dict_pre_hook(self._reject)

    @staticmethod
    def _reject(module, state_dict, prefix, *args) -> None:
        if prefix + "decay" in state_dict:
            raise ValueError("decay rejected")


def _rejected_worker(rank: int, root: str) -> str:
    trainer, _ = fit({"stage": 2}, max_steps=2, model_cls=BufferModel)
    trainer.save_checkpoint(f"{root}/last.ckpt")
    try:
        fit({"stage": 2}, max_steps=2, model_cls=RejectingModel, ckpt_path=f"{root}/last.ckpt")
    except (ValueError, RuntimeError) as error:  # the two errors the test expects; anything else fails it
        return f"{type(error).__name__}: {error}"
    return "loaded"


def test_a_failed_load_of_the_shared_tensors_raises_on_every_rank(tmp_path):
    # The ranks waiting for the broadcast learn of rank 0's error and raise it, named (without the
    # agreement they waited until rank 0's process ended and then reported only a lost rank 0).
    first, second = run_ranks(_rejected_worker, str(tmp_path), timeout=120)
    assert first == "ValueError: decay rejected"
    assert second.startswith("RuntimeError: loading the frozen parameters and buffers failed on other ranks")
    assert "data-parallel rank 0: ValueError: decay rejected" in second


def _exported(path: Path) -> dict:
    from lightning_zero.checkpoint import to_lightning_checkpoint

    out = path.with_name(path.name + ".export")
    to_lightning_checkpoint(path, out)
    return torch.load(out, weights_only=True)


def _assert_same_training_state(a: dict, b: dict) -> None:
    # Resharding only moves elements between files: bit-exact.
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        assert opt_a["param_groups"] == opt_b["param_groups"]
        assert opt_a["state"].keys() == opt_b["state"].keys()
        for index, entry in opt_a["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, opt_b["state"][index][key]), (index, key)
    assert a["global_step"] == b["global_step"] and a["lr_schedulers"] == b["lr_schedulers"]


def test_sharded_checkpoints_resume_reshard_consolidate(tmp_path):
    tmp = str(tmp_path)
    results = run_ranks(_two_rank_worker, tmp)
    for res in results:
        # Same layout, zero2 -> zero1, zero2 -> zero3: the resumed run replays steps 5..8 of the
        # uninterrupted one with the same dropout masks (restored random states); same arithmetic
        # (with 2 ranks a reduce-scatter and an all-reduce add the same two numbers), so 1e-6 relative.
        for resumed in ("same", "stage1", "stage3"):
            torch.testing.assert_close(torch.tensor(res[resumed]), torch.tensor(res["full"][4:]), rtol=1e-6, atol=0)
    # top-k 2 by step, plus last: older step directories were deleted; no temporary ones remain.
    assert results[0]["topk"] == ["epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]

    # Consolidation, no process group: the model's exact final weights, strict=True.
    from lightning_zero.checkpoint import consolidate
    from lightning_zero.cli import main

    consolidate(tmp_path / "final.ckpt", tmp_path / "final.pt")
    loaded = torch.load(tmp_path / "final.pt", weights_only=True)
    model = DropoutModel()
    model.load_state_dict(loaded, strict=True)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()  # tied weight still tied
    for key, value in state(model).items():
        assert torch.equal(value, results[0]["final_state"][key]), key
    assert main(["consolidate", str(tmp_path / "final.ckpt"), str(tmp_path / "bf16.pt"), "--dtype", "bf16"]) == 0
    bf16 = torch.load(tmp_path / "bf16.pt", weights_only=True)
    assert all(torch.equal(bf16[k], v.to(torch.bfloat16)) for k, v in loaded.items())

    # 2 ranks (zero2) -> 1 rank (zero1) -> 2 ranks (zero3, other buckets), saved again each time:
    # same weights, fp32 masters, optimizer states, step and schedulers, bit for bit.
    source = tmp_path / "epochs" / "epoch=0-step=4.ckpt"
    one, two = tmp_path / "one.ckpt", tmp_path / "two.ckpt"
    (single,) = run_ranks(_one_rank_worker, tmp, str(source), str(one), world_size=1)
    assert single["global_step"] == 4
    pair = run_ranks(_from_one_rank_worker, tmp, str(one), str(two))
    assert [res["global_step"] for res in pair] == [4, 4]
    # Training on from the 1-rank checkpoint on 1 and on 2 ranks: each 1-rank batch holds both
    # ranks' rows, so its loss is the mean of the 2 ranks' losses. Only the summation order of the
    # gradients differs (~1e-7 relative in fp32), which 4 Adam steps keep well below 1e-5.
    mean = (torch.tensor(pair[0]["continued"]) + torch.tensor(pair[1]["continued"])) / 2
    torch.testing.assert_close(mean, torch.tensor(single["continued"]), rtol=1e-5, atol=0)
    reference = _exported(source)
    for resaved in (one, two):
        _assert_same_training_state(reference, _exported(resaved))

    messages = single["errors"]
    assert "is a file inside the sharded checkpoint directory" in messages["file_inside"]
    assert "up.weight: checkpoint (7, 15) vs model (8, 15)" in messages["incompatible"]
    assert "rank-00001.pt (rank 1) is missing" in messages["missing_rank"]
    assert "not a complete lightning_zero checkpoint" in messages["unfinished"]


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})  # the repository root, for tests.helpers
    import torch
    from tests.helpers.checkpoint import fit_dropout
    from lightning_zero.checkpoint import save

    path, where = sys.argv[1], sys.argv[2]
    trainer, model = fit_dropout({{"stage": 2, "reduce_bucket_size": 50}}, 1, 0, 2)
    trainer.save_checkpoint(path)
    torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, path + ".expected")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the second save must differ from the first

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "write":  # half-way through writing this rank's file
        real = save._write
        def _write(obj, file):
            with open(file, "wb") as f:
                f.write(b"partial")
                f.flush()
            die()
        save._write = _write
    else:  # after the old checkpoint was moved aside, before the new one is renamed into place
        real_rename = os.rename
        def rename(a, b):
            real_rename(a, b)
            if os.path.basename(str(b)).startswith(".zero-old"):
                die()
        save.os.rename = rename
    trainer.save_checkpoint(path)
    """
)


@pytest.mark.parametrize("where", ["write", "rename"])
def test_kill_during_save_leaves_previous_checkpoint(tmp_path, where):
    from lightning_zero.checkpoint import consolidate, is_sharded_checkpoint

    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT.format(root=str(ROOT)))
    path = tmp_path / "model.ckpt"
    # One rank that looks like torchrun's, as in lightning_zero.testing.
    env = dict(
        os.environ,
        WORLD_SIZE="1",
        RANK="0",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK="0",
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        TORCHELASTIC_RUN_ID="kill_test",
        OMP_NUM_THREADS="1",
    )
    command = [sys.executable, str(script), str(path), where]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    if where == "write":
        assert is_sharded_checkpoint(path)
        (tmp_dir,) = tmp_path.glob(".zero-tmp-*")  # the half-written one
        assert (tmp_dir / "rank-00000.pt").read_bytes() == b"partial" and not is_sharded_checkpoint(tmp_dir)
    else:
        assert not path.exists()  # killed between the two renames: the previous one is aside
    with pytest.warns(UserWarning, match="interrupted") if where == "rename" else _nothing():
        consolidate(path, tmp_path / "out.pt", dtype=None)
    expected = torch.load(str(path) + ".expected", weights_only=True)
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False
