"""Sharded checkpoints on spawned CPU/gloo ranks: exact resume (random states included), resharding
to another world size and stage, consolidation without a process group, atomic saves under a kill,
ModelCheckpoint top-k, and the errors a user meets. Several checks share one spawn to keep it short.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import free_port, run_ranks
from tests.helpers.models import WIDTH, ParityModel, make_loader, state
from tests.helpers.trainer import build_strategy, fit, quiet_trainer

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent
# Every parameter sharded (none kept whole by the persistence threshold), buckets cutting through them.
ZERO3 = {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0}


class DropoutModel(ParityModel):
    """ParityModel with dropout: a resume is exact only if the random states are restored too."""

    def __init__(self, dropout: float = 0.2, hidden: int = 7) -> None:
        super().__init__()
        if hidden != self.up.out_features:  # an incompatible model, for the error test
            self.up, self.down = nn.Linear(self.up.in_features, hidden), nn.Linear(hidden, self.down.out_features)
        self.dropout = dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(tokens))
        x = x + self.down(F.dropout(torch.tanh(self.up(x)), self.dropout, self.training))
        return self.head(self.norm(x))


def _loader(rank: int, world_size: int) -> DataLoader:
    """4 steps per epoch. Every batch of a rank is the same, so batches replay identically wherever
    Lightning resumes (it restarts a plain DataLoader's epoch): 2 ranks see 3 copies per batch of a
    row of its own; 1 rank sees both rows, 3 copies each, so its mean loss is the mean of the 2 ranks'.

    The loader has a generator of its own: creating an iterator then draws its seed from that one,
    not from the global random state. (A resumed run finishes the interrupted epoch with one batch and
    starts a new iterator where the uninterrupted run did not; the dropout masks would shift.)"""
    rows = [make_loader(n=1, seed=1000 + r).dataset.tensors[0][0] for r in range(2)]
    generator = torch.Generator().manual_seed(0)
    if world_size == 2:
        return DataLoader(TensorDataset(rows[rank].repeat(12, 1)), batch_size=3, generator=generator)
    return DataLoader(TensorDataset(torch.stack(rows).repeat(12, 1)), batch_size=6, generator=generator)


def _fit(spec, world_size, rank, max_steps, ckpt_path=None, callbacks=(), model_kwargs=None, precision="32-true"):
    import lightning_zero  # noqa: F401 - registers the strategy names

    pl.seed_everything(7, verbose=False)
    model = DropoutModel(**(model_kwargs or {}))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=build_strategy(spec),
        precision=precision,
        max_steps=max_steps,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        deterministic=True,
    )
    trainer.fit(model, train_dataloaders=_loader(rank, world_size), ckpt_path=ckpt_path)
    return trainer, model


def _two_rank_worker(rank: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    every_epoch = ModelCheckpoint(dirpath=f"{tmp}/epochs", every_n_epochs=1, save_top_k=-1)
    top_k = ModelCheckpoint(
        dirpath=f"{tmp}/topk", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    zero2 = {"stage": 2, "reduce_bucket_size": 50}
    trainer, full = _fit(zero2, 2, rank, 8, callbacks=[every_epoch, top_k])
    trainer.save_checkpoint(f"{tmp}/final.ckpt")
    path = f"{tmp}/epochs/epoch=0-step=4.ckpt"
    _, same = _fit(zero2, 2, rank, 8, ckpt_path=path)
    _, stage1 = _fit({"stage": 1}, 2, rank, 8, ckpt_path=path)
    _, stage3 = _fit(ZERO3, 2, rank, 8, ckpt_path=path)
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
    trainer, model = _fit(spec, world_size, rank, 4, ckpt_path=source, model_kwargs={"dropout": 0.0})
    trainer.save_checkpoint(out)
    return {"global_step": trainer.global_step, "state": state(model)}


def _one_rank_worker(rank: int, tmp: str, source: str, out: str) -> dict:
    """2 ranks -> 1 rank, then each error a user can meet (the same spawn, to save a start-up)."""
    resharded = _reshard_worker(rank, tmp, source, {"stage": 1}, 1, out)
    _, continued = _fit({"stage": 1}, 1, rank, 8, ckpt_path=out, model_kwargs={"dropout": 0.0})
    return {**resharded, "continued": continued.losses, "errors": _errors(rank, Path(source))}


def _from_one_rank_worker(rank: int, tmp: str, source: str, out: str) -> dict:
    """1 rank -> 2 ranks under zero3: reshard and save again; and train on from the 1-rank checkpoint."""
    resharded = _reshard_worker(rank, tmp, source, ZERO3, 2, out)
    _, continued = _fit({"stage": 2}, 2, rank, 8, ckpt_path=source, model_kwargs={"dropout": 0.0})
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
            _fit({"stage": 2}, 1, rank, 8, ckpt_path=path, model_kwargs=kwargs)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


class BufferModel(ParityModel):
    """ParityModel (its frozen layer: a non-partitioned parameter at stages 1/2) with buffers that
    training changes the same way on every rank: a float factor on the frozen layer's output (it
    enters the loss) and an int64 count of training forwards. Both are saved whole by rank 0 only.
    ``scrambled``: every parameter and buffer off its initial value, so that a resumed model matches
    the saved one only where the checkpoint was loaded."""

    def __init__(self, scrambled: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("decay", torch.ones(WIDTH))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        if scrambled:  # not a different seed: the seed also orders Lightning's distributed sampler
            with torch.no_grad():
                for tensor in (*self.parameters(), *self.buffers()):
                    tensor.add_(3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.decay.mul_(torch.linspace(0.95, 0.99, WIDTH))
            self.calls += 1
        x = self.frozen(self.embed(tokens)) * self.decay
        for _ in range(2):
            x = x + self.down(torch.tanh(self.up(x)))
        return self.head(self.norm(x))


@contextlib.contextmanager
def opened_files() -> Iterator[list[str]]:
    """The names of the checkpoint files this process reads meanwhile (from a store: downloads)."""
    from lightning_zero.checkpoint import format as fmt

    opened: list[str] = []
    load_file = fmt.load_file

    def recording(file, *args, **kwargs):
        opened.append(os.path.basename(str(file)))
        return load_file(file, *args, **kwargs)

    fmt.load_file = recording
    try:
        yield opened
    finally:
        fmt.load_file = load_file


def frozen_buffers_worker(rank: int, root: str, specs: list[dict]) -> list[dict]:
    """For each ZeRO spec: 8 steps with a checkpoint at step 4 (to ``root``: a directory or a store
    prefix), then a resume from it to step 8 into a scrambled model (see :class:`BufferModel`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    results = []
    for index, spec in enumerate(specs):
        every = ModelCheckpoint(dirpath=f"{root}/{index}", every_n_train_steps=4, save_top_k=-1)
        callbacks = {"callbacks": [every], "enable_checkpointing": True}
        _, full = fit(spec, max_steps=8, model_cls=BufferModel, trainer_kwargs=callbacks)
        with opened_files() as opened:
            path = f"{root}/{index}/epoch=0-step=4.ckpt"
            _, resumed = fit(spec, max_steps=8, model_cls=BufferModel, model_kwargs={"scrambled": True}, ckpt_path=path)
        results.append(
            {
                "full": full.losses,
                "resumed": resumed.losses,
                "full_state": state(full),
                "resumed_state": state(resumed),
                "opened": opened,
            }
        )
    return results


def check_frozen_buffers(results: list[list[dict]]) -> None:
    for rank, per_spec in enumerate(results):
        for res in per_spec:
            # Only this rank's own file besides Lightning's: the frozen layer and the buffers come from
            # data-parallel rank 0, which read them from its own file and broadcast them.
            assert sorted(res["opened"]) == ["lightning.pt", f"rank-{rank:05d}.pt"], (rank, res["opened"])
            # The same layout and arithmetic as the uninterrupted run: equal bit for bit, the frozen layer
            # (never stepped: what was loaded) and the buffers (loaded, then changed the same way) included.
            assert res["resumed"] == res["full"][8:]  # a loss per micro-batch, 2 per step
            assert res["resumed_state"].keys() == res["full_state"].keys()
            for key, value in res["full_state"].items():
                assert torch.equal(res["resumed_state"][key], value), key
            assert res["resumed_state"]["calls"] == 16  # 8 steps of 2 micro-batches: the count was loaded


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
    sys.path.insert(0, {here!r})
    import torch
    from test_checkpoint import _fit
    from lightning_zero.checkpoint import save

    path, where = sys.argv[1], sys.argv[2]
    trainer, model = _fit({{"stage": 2, "reduce_bucket_size": 50}}, 1, 0, 2)
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
    script.write_text(_KILL_SCRIPT.format(here=str(HERE)))
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
