"""Models, data and rank workers of the checkpoint tests that several test files share.

:class:`DropoutModel` and :func:`replay_loader` make a resume exact only if the random states and the
data position are restored; :class:`BufferModel` adds buffers that training changes;
:func:`frozen_buffers_worker` / :func:`check_frozen_buffers` run and check a save and resume to a
directory or an object store.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.models import WIDTH, ParityModel, make_loader, state
from tests.helpers.trainer import build_strategy, fit, quiet_trainer


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


def replay_loader(rank: int, world_size: int) -> DataLoader:
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


def fit_dropout(
    spec, world_size, rank, max_steps, ckpt_path=None, callbacks=(), model_kwargs=None, precision="32-true"
):
    """Train a seeded :class:`DropoutModel` on :func:`replay_loader`'s data (no distributed sampler);
    checkpointing is on only when ``callbacks`` are given. Returns the trainer and the model."""
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
    trainer.fit(model, train_dataloaders=replay_loader(rank, world_size), ckpt_path=ckpt_path)
    return trainer, model


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
    """Asserts that :func:`frozen_buffers_worker`'s resumes read only their own rank's file and
    continued the uninterrupted runs bit for bit."""
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


def error_text(fn) -> str:
    """``"Type: message"`` of the RuntimeError or ValueError that ``fn()`` raises, ``"no error"`` otherwise
    (a rank reports its error to the test instead of failing the spawn)."""
    try:
        fn()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
