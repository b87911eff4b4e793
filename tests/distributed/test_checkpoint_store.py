"""Sharded checkpoints on an object store, on 2 spawned CPU/gloo ranks: save, resume,
ModelCheckpoint's save_top_k removal and `lightning-zero consolidate` through s3fs against a local S3
server (moto's server mode, on 127.0.0.1, started and stopped by a fixture: no network), with the
saves during fit asynchronous. The checkpoints must be bit for bit those a local save writes, and
resume the same.
"""

from __future__ import annotations

import logging
import os
import urllib.request

import pytest
import torch
from torch import nn

from lightning_zero.testing import free_port, run_ranks
from tests.helpers.checkpoint import check_frozen_buffers, fit_dropout, frozen_buffers_worker, opened_files
from tests.helpers.models import ParityModel, state
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed
ZERO2 = {"stage": 2, "reduce_bucket_size": 50}
ZERO3 = {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0}
BUCKET = "ckpts"


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on a free local port, with one bucket; s3fs reaches it through the standard
    AWS environment variables, which the spawned ranks inherit. Yields the s3fs filesystem."""
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    # moto's state lives in this process, shared by every server it starts: empty it for each test
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")).close()
    S3FileSystem.clear_instance_cache()  # an instance made before would keep the old endpoint
    fs = S3FileSystem()
    fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        S3FileSystem.clear_instance_cache()
        server.stop()


def _listing(fs, path: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(os.path.basename(p) for p in fs.ls(path, detail=False)) if fs.exists(path) else []


def _worker(rank: int, root: str, tmp: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from s3fs import S3FileSystem

    every_epoch = ModelCheckpoint(dirpath=f"{root}/epochs", every_n_epochs=1, save_top_k=-1)
    top_k = ModelCheckpoint(dirpath=f"{root}/topk", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    # ModelCheckpoint's saves during fit are asynchronous (background threads streaming to the store)
    trainer, full = fit_dropout({**ZERO2, "async_save": True}, 2, rank, 8, callbacks=[every_epoch, top_k])
    trainer.save_checkpoint(f"{root}/final.ckpt")
    trainer.save_checkpoint(f"{tmp}/final.ckpt")  # the same state on local disk, for the byte comparison
    trainer.save_checkpoint(f"{root}/final.ckpt")  # overwriting a checkpoint on the store
    _, resumed = fit_dropout(ZERO2, 2, rank, 8, ckpt_path=f"{root}/epochs/epoch=0-step=4.ckpt")
    _, resharded = fit_dropout(ZERO3, 2, rank, 8, ckpt_path=f"{root}/epochs/epoch=0-step=4.ckpt")
    fs = S3FileSystem()
    return {
        "full": full.losses,
        "resumed": resumed.losses,
        "resharded": resharded.losses,
        "final_state": state(full),
        "resumed_state": state(resumed),
        "topk": _listing(fs, f"{BUCKET}/run/topk"),
        "epochs": _listing(fs, f"{BUCKET}/run/epochs"),
        "run": _listing(fs, f"{BUCKET}/run"),
        "final": _listing(fs, f"{BUCKET}/run/final.ckpt"),
    }


def test_save_resume_topk_consolidate_on_s3(s3, tmp_path):
    from lightning_zero.checkpoint import format as fmt
    from lightning_zero.cli import main

    root = f"s3://{BUCKET}/run"
    # What a killed save left in the top-k directory: a pending marker and a prefix without metadata.json.
    s3.pipe(f"{BUCKET}/run/topk/.zero-tmp-0123456789abcdef", b'{"checkpoint": "killed.ckpt"}')
    s3.pipe(f"{BUCKET}/run/topk/killed.ckpt/files-dead/rank-00000.pt", b"partial")
    with pytest.raises(ValueError, match=r"s3://ckpts/run/topk/killed.ckpt is a directory but not a complete"):
        fmt.resolve(f"{root}/topk/killed.ckpt")

    results = run_ranks(_worker, root, str(tmp_path), timeout=600)
    for res in results:
        # Resumed at step 4 from the store (an async save): the same steps 5..8 with the same arithmetic as the
        # uninterrupted run, so the losses and the final weights are equal bit for bit.
        assert res["resumed"] == res["full"][4:]
        for key, value in res["resumed_state"].items():
            assert torch.equal(value, res["final_state"][key]), key
        # Resharded into stage 3: another reduction order (buckets cut elsewhere), so float32
        # rounding differences of a few ulp per step; 1e-5 relative, as in test_checkpoint.py.
        torch.testing.assert_close(torch.tensor(res["resharded"]), torch.tensor(res["full"][4:]), rtol=1e-5, atol=0)
    listing = results[0]
    # save_top_k=2: Lightning removed the older ones through strategy.remove_checkpoint; the killed save's
    # leftovers were removed by the first save into that directory.
    assert listing["topk"] == ["epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt"], listing["topk"]
    assert listing["epochs"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"], listing["epochs"]
    assert not [name for name in listing["run"] if name.startswith(".zero-tmp-")], listing["run"]
    # Overwritten once: only the files of the second save are left beside metadata.json.
    assert len(listing["final"]) == 2 and listing["final"][1] == "metadata.json", listing["final"]

    # The rank files are byte for byte those of the local save (CRC-32s in metadata.json).
    remote, local = fmt.read_metadata(f"{root}/final.ckpt"), fmt.read_metadata(tmp_path / "final.ckpt")
    assert remote["rank_file_crc32"] == local["rank_file_crc32"] and remote["params"] == local["params"]
    assert remote["rank_files"][1].endswith("/rank-00001.pt") and local["rank_files"][1] == "rank-00001.pt"

    # consolidate from the store, to the store and to local disk; checked against the trained model.
    assert main(["consolidate", f"{root}/final.ckpt", f"{root}/final.pt", "--dtype", "saved"]) == 0
    assert main(["consolidate", f"{root}/final.ckpt", str(tmp_path / "final.pt"), "--dtype", "saved"]) == 0
    s3.get(f"{BUCKET}/run/final.pt", str(tmp_path / "from_s3.pt"))
    for name in ("final.pt", "from_s3.pt"):
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert loaded.keys() == listing["final_state"].keys()
        assert all(torch.equal(loaded[k].float(), listing["final_state"][k]) for k in loaded), name

    # A damaged rank file on the store is caught by its CRC-32 when read.
    name = remote["rank_files"][0]
    data = bytearray(s3.cat(f"{BUCKET}/run/final.ckpt/{name}"))
    data[len(data) // 2] ^= 0xFF
    s3.pipe(f"{BUCKET}/run/final.ckpt/{name}", bytes(data))
    assert main(["consolidate", f"{root}/final.ckpt", str(tmp_path / "bad.pt")]) == 2
    with pytest.raises(ValueError, match="is corrupted: its CRC-32"):
        from lightning_zero.checkpoint import consolidate

        consolidate(f"{root}/final.ckpt", tmp_path / "bad.pt")


class AllTrainable(ParityModel):
    """ParityModel without its frozen layer: every tensor is partitioned (no whole tensor that only
    rank 0's file holds), so a resume into the same layout needs no other rank's file."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Identity()


def _own_file_worker(rank: int, path: str) -> dict:
    trainer, saved = fit(ZERO2, max_steps=4, model_cls=AllTrainable)
    trainer.save_checkpoint(path)
    with opened_files() as opened:
        _, resumed = fit(ZERO2, max_steps=4, model_cls=AllTrainable, ckpt_path=path)  # restores, trains no further
    return {"opened": opened, "saved": state(saved), "resumed": state(resumed)}


def test_resume_downloads_only_its_own_rank_file(s3):
    from lightning_zero.checkpoint import format as fmt

    path = f"s3://{BUCKET}/own/last.ckpt"
    results = run_ranks(_own_file_worker, path, timeout=600)
    # The case that matters: a parameter across the ranks' boundary (pieces in both files). Its optimizer
    # entry once made rank 1 open rank 0's file too: on a store, a download of a whole second shard.
    meta = fmt.read_metadata(path)
    assert any({piece[0] for piece in entry["pieces"]} == {0, 1} for entry in meta["params"].values())
    for rank, res in enumerate(results):
        assert sorted(res["opened"]) == ["lightning.pt", f"rank-{rank:05d}.pt"], (rank, res["opened"])
        # loaded bit for bit: the fp32 masters of the same layout, nothing recomputed
        for key, value in res["saved"].items():
            assert torch.equal(res["resumed"][key], value), key


def test_resume_reads_frozen_parameters_and_buffers_once(s3):
    # ParityModel's frozen layer and two buffers that training changes, at stage 2: saved whole in rank
    # 0's file only. A resume once read them on every rank, so each rank downloaded rank 0's whole file
    # (its optimizer shard included); now data-parallel rank 0 reads and broadcasts them.
    results = run_ranks(frozen_buffers_worker, f"s3://{BUCKET}/frozen", [ZERO2], timeout=600)
    check_frozen_buffers(results)
