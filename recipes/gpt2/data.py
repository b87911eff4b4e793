"""GPT-2 data: the token cache cut into non-overlapping windows of ``seq_len + 1`` tokens."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.common.data import TokenDataModule


class NextTokenWindows(Dataset):
    """Window ``i`` is ``tokens[i*seq : i*seq + seq + 1]``: ``input_ids`` its first ``seq``, ``labels`` its last ``seq``.

    Items: ``{"input_ids": (seq,) int64, "labels": (seq,) int64}``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class GPT2DataModule(TokenDataModule):
    """Causal-LM batches from text, tokenized once with GPT-2's BPE and cached as uint16.

    Args:
        sources: corpora to read, each "shakespeare", "wikipedia", a text file, a directory of
            .txt/.md files, or a Hugging Face dataset saved with ``save_to_disk`` (column "text").
        seq_len: tokens per sequence; at most the model's ``block_size``.
        batch_size: sequences per micro-batch on each device.
        val_fraction: share of the text held out for validation (by ~4,000-character pieces).
        num_workers: DataLoader worker processes (0: load in the training process).
        cache_dir: where tokenized corpora are kept (default ``$LIGHTNING_ZERO_CACHE/tokens`` or ``.cache/tokens``).
    """

    tokenizer_name = "gpt2"

    def __init__(
        self,
        sources: list[str] = ["shakespeare"],  # noqa: B006 (jsonargparse reads the default; never mutated)
        seq_len: int = 1024,
        batch_size: int = 12,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__(sources, seq_len, batch_size, val_fraction, num_workers, cache_dir)

    def separator(self) -> int:
        """GPT-2's <|endoftext|> (50256) ends each document."""
        return self.tokenizer.eot_id

    def min_tokens(self) -> int:
        """One window of ``seq_len`` inputs plus the shifted label."""
        return self.seq_len + 1

    def make_dataset(self, tokens: np.ndarray, split: str) -> NextTokenWindows:
        """Non-overlapping next-token windows over ``tokens``."""
        return NextTokenWindows(tokens, self.seq_len)
