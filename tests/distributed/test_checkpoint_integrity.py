"""Checkpoint integrity: every file of a sharded checkpoint carries a CRC-32 recorded at
save, checked by whoever reads it (resume, consolidate); a damaged or truncated file raises a
ValueError naming the file and the rank that wrote it, instead of consolidating into garbage or a
raw traceback. Hyperparameters that need full unpickling (a ``pathlib.Path``) consolidate only when
told to trust the checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.checkpoint import consolidate, load_from_checkpoint
from lightning_zero.cli import main
from lightning_zero.testing import run_ranks
from tests.helpers.models import ParityModel, make_loader
from tests.helpers.trainer import build_strategy, quiet_trainer

pytestmark = pytest.mark.distributed


class WithPathHyperparameters(ParityModel):
    def __init__(self, data_dir: Path = Path("/data/corpus")) -> None:
        super().__init__()
        self.save_hyperparameters()


def _save_worker(rank: int, tmp: str) -> None:
    import lightning_zero  # noqa: F401 - registers the strategy names

    for name, cls in (("plain", ParityModel), ("hparams", WithPathHyperparameters)):
        pl.seed_everything(7, verbose=False)
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=build_strategy({"stage": 2, "reduce_bucket_size": 40}),
            max_steps=2,
        )
        trainer.fit(cls(), make_loader(n=12))
        trainer.save_checkpoint(f"{tmp}/{name}.ckpt")


def _resume_worker(rank: int, path: str) -> str:
    import lightning_zero  # noqa: F401

    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        strategy=build_strategy({"stage": 2}),
        max_steps=4,
    )
    try:
        trainer.fit(ParityModel(), make_loader(n=12), ckpt_path=path)
    except ValueError as error:
        return str(error)
    return "no error"


def _damaged(source: Path, name: str, edit: Any) -> Path:
    copy = source.with_name(f"{source.stem}-{name}.ckpt")
    shutil.copytree(source, copy)
    edit(copy)
    return copy


def _flip_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_damaged_files_are_named_and_pickles_need_trust(tmp_path, capsys):
    run_ranks(_save_worker, str(tmp_path))
    plain = tmp_path / "plain.ckpt"
    consolidate(plain, tmp_path / "ok.pt")  # the intact checkpoint consolidates (and its CRCs match)
    # Model.load_from_checkpoint(dir) raises IsADirectoryError in Lightning; ours takes the directory
    model = load_from_checkpoint(ParityModel, plain)
    expected = torch.load(tmp_path / "ok.pt", weights_only=True)
    torch.testing.assert_close(model.state_dict(), expected, rtol=0, atol=0)  # the same values, bit for bit

    flipped = _damaged(plain, "flipped", lambda d: _flip_bytes(d / "rank-00001.pt"))
    with pytest.raises(ValueError, match=r"rank-00001\.pt \(rank 1's shards\) is corrupted: its CRC-32"):
        consolidate(flipped, tmp_path / "out.pt")
    # Before: the flipped bytes consolidated silently into values like 3.4e38. A resume reads only
    # its own rank's file here (one rank) and the files it needs; rank 1's shards are needed too.
    (message,) = run_ranks(_resume_worker, str(flipped), world_size=1)
    assert "rank-00001.pt (rank 1's shards) is corrupted" in message, message

    truncated = _damaged(plain, "truncated", lambda d: _truncate(d / "lightning.pt"))
    with pytest.raises(ValueError, match=r"lightning\.pt \(Lightning's state\) is corrupted"):
        consolidate(truncated, tmp_path / "out.pt")
    meta = _damaged(plain, "meta", lambda d: _truncate(d / "metadata.json"))
    with pytest.raises(ValueError, match=r"metadata\.json is damaged"):
        consolidate(meta, tmp_path / "out.pt")

    hparams = tmp_path / "hparams.ckpt"
    assert main(["consolidate", str(hparams), str(tmp_path / "h.pt"), "--lightning"]) == 2
    assert "--trust-pickles" in capsys.readouterr().err  # says what to do, no raw traceback
    assert main(["consolidate", str(hparams), str(tmp_path / "h.pt"), "--lightning", "--trust-pickles"]) == 0
    restored = torch.load(tmp_path / "h.pt", weights_only=False)
    assert restored["hyper_parameters"]["data_dir"] == Path("/data/corpus")
