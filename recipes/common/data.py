"""The part of the GPT-2 and BERT data modules that is the same: sources, token cache, loaders, checks."""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from recipes.common import cache, corpus
from recipes.common.tokenizer import get_tokenizer


class EpochIndexSampler(DistributedSampler):
    """A ``DistributedSampler`` that yields ``(index, epoch)``: a dataset drawing randomness per sample
    (BERT's dynamic masks) seeds it with both, so its draws are a function of seed, epoch and index,
    the same in a resumed run, whatever the worker processes and whatever was fetched ahead."""

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]  # pairs, not plain indices
        epoch = self.epoch
        return ((index, epoch) for index in super().__iter__())


class TokenDataModule(LightningDataModule, abc.ABC):
    """Tokenizes ``sources`` once (``prepare_data``, one process per machine) and serves fixed windows.

    Subclasses set ``tokenizer_name``, return the document separator from ``separator`` and build
    their datasets in ``make_dataset``. Bad paths raise ValueError at construction, an empty or too
    small corpus in ``setup``, both before the first training step.
    """

    tokenizer_name: str = ""
    sampler_class: type[DistributedSampler] = DistributedSampler
    """The train sampler (:class:`EpochIndexSampler` for datasets that take ``(index, epoch)``)."""

    def __init__(
        self,
        sources: list[str],
        seq_len: int,
        batch_size: int,
        val_fraction: float,
        num_workers: int,
        cache_dir: str | None,
    ) -> None:
        super().__init__()
        if not sources:
            raise ValueError("data.sources is empty; name at least one, e.g. [shakespeare]")
        if seq_len < 8 or batch_size < 1 or num_workers < 0:
            raise ValueError(
                f"data: seq_len({seq_len}) must be >= 8, batch_size({batch_size}) >= 1, num_workers({num_workers}) >= 0"
            )
        for source in sources:
            corpus.source_files(source)  # raises ValueError with the fix for a bad path or a missing package
        self.sources, self.seq_len, self.batch_size = list(sources), seq_len, batch_size
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    @property
    def tokenizer(self):
        """The recipe's tokenizer (vocabulary size asserted when built)."""
        return get_tokenizer(self.tokenizer_name)

    @abc.abstractmethod
    def separator(self) -> int:
        """The token id written between documents in the cache."""

    @abc.abstractmethod
    def make_dataset(self, tokens: np.ndarray, split: str) -> Dataset:
        """A dataset of windows over ``tokens`` of ``split`` ("train" or "val")."""

    def min_tokens(self) -> int:
        """Tokens one sample needs."""
        return self.seq_len

    def cache_folder(self) -> Path:
        """The cache entry of these sources (tokenized on the first call)."""
        return cache.build(self.sources, self.tokenizer, self.separator(), self.val_fraction, self.cache_dir)

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache unless it is already there (Lightning calls this on local rank 0)."""
        self.cache_folder()

    def setup(self, stage: str) -> None:
        """Memory-map the token files and build the datasets; ValueError when a split is too small for a sample."""
        folder = self.cache_folder()
        for split in ("train", "val"):
            tokens = cache.load(folder, split)
            if len(tokens) < self.min_tokens():
                raise ValueError(
                    f"the {split} split of {self.sources} has {len(tokens)} tokens, fewer than the "
                    f"{self.min_tokens()} one sample of seq_len {self.seq_len} needs: add text, lower "
                    f"data.seq_len, or {'raise' if split == 'val' else 'lower'} data.val_fraction ({self.val_fraction})"
                )
            setattr(self, f"{split}_set", self.make_dataset(tokens, split))

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        # A StatefulDataLoader (torchdata): Lightning saves its position in every checkpoint, so a run
        # resumed from a mid-epoch checkpoint goes on with the next batch (see docs/checkpoints.md, "Exact resume").
        return StatefulDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler(dataset) if train else None,
            drop_last=train,  # equal micro-batches: constant tokens/step and FLOPs per batch
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def _train_sampler(self, dataset: Dataset) -> DistributedSampler:
        """The shuffled order of the train windows over the data-parallel ranks: a function of the seed
        (``seed_everything``'s, as the sampler Lightning would add) and the epoch only, which a resumed
        run draws alike; with one process too (a shuffling sampler of its own would draw its
        permutation from the global random state, which differs at a resume)."""
        trainer = getattr(self, "trainer", None)
        ranks = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        ranks = ranks or {"num_replicas": 1, "rank": 0}
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return self.sampler_class(dataset, shuffle=True, seed=seed, drop_last=True, **ranks)

    def train_dataloader(self) -> DataLoader:
        """Shuffled windows of the train split, this data-parallel rank's share."""
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        """Windows of the validation split in order."""
        return self._loader(self.val_set, train=False)


def batch_size(batch: dict[str, torch.Tensor]) -> int:
    """Sequences in a recipe batch (for the ThroughputMonitor)."""
    return batch["input_ids"].shape[0]


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens in a recipe batch (for the ThroughputMonitor's items/s, i.e. tokens/s)."""
    return batch["input_ids"].numel()
