"""BERT data: windows of the token cache as ``[CLS] A [SEP] (B [SEP])``, 15% of word pieces masked.

Masking follows BERT: of the chosen positions, 80% become [MASK], 10% a random word piece, 10% stay.
Training windows come from :class:`~recipes.common.data.EpochIndexSampler` as ``(index, epoch)`` and
draw their masks from a generator seeded by ``seed_everything``'s seed, the epoch and the index, so
each epoch masks differently (RoBERTa's dynamic masking) and a run resumed mid-epoch draws the masks
the uninterrupted run drew (the global generator would not do: Lightning fetches a batch ahead).
A plain integer index draws from torch's global generator. Validation windows use a generator seeded
by the window's index, so every validation sees the same masks and ``val_loss`` is comparable.

With ``nsp``, a window is cut at a random point into A and B; half of the time B is replaced by as
many tokens from a random place of the corpus (label 1, "not next"), as in BERT (label 0: B follows A).
Segments are cut at token, not sentence, boundaries: simpler, and NSP is optional for that reason.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.common.data import EpochIndexSampler, TokenDataModule
from recipes.common.tokenizer import BertTokenizer


class MaskedWindows(Dataset):
    """Window ``i`` covers ``tokens[i*body : (i+1)*body]`` with ``body = seq_len - 2`` (``- 3`` with NSP).

    Items: ``input_ids``, ``labels`` (-100 where not masked), ``token_type_ids``: (seq_len,) int64;
    with NSP also ``next_sentence_label``: () int64.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, tok: BertTokenizer, mask_prob: float, nsp: bool, seed: int | None
    ) -> None:
        self.tokens, self.seq_len, self.tok = tokens, seq_len, tok
        self.mask_prob, self.nsp, self.seed = mask_prob, nsp, seed
        self.body = seq_len - (3 if nsp else 2)
        self.train_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's, for (index, epoch) items

    def __len__(self) -> int:
        return len(self.tokens) // self.body

    def _slice(self, start: int, length: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[start : start + length].astype(np.int64))

    def __getitem__(self, index: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        if isinstance(index, tuple):  # (index, epoch) from EpochIndexSampler: this epoch's masks of the window
            index, epoch = index
            mixed = ((self.train_seed * 1_000_003 + epoch) * 1_000_000_007 + index) % (1 << 63)
            gen: torch.Generator | None = torch.Generator().manual_seed(mixed)
        else:
            gen = None if self.seed is None else torch.Generator().manual_seed(self.seed + index)
        cls, sep = torch.tensor([self.tok.cls_id]), torch.tensor([self.tok.sep_id])
        body = self._slice(index * self.body, self.body)
        item = {}
        if self.nsp:
            cut = int(torch.randint(1, self.body, (), generator=gen))
            a, b = body[:cut], body[cut:]
            is_random = bool(torch.rand((), generator=gen) < 0.5)
            if is_random:
                start = int(torch.randint(0, len(self.tokens) - len(b) + 1, (), generator=gen))
                b = self._slice(start, len(b))
            input_ids = torch.cat([cls, a, sep, b, sep])
            token_type = torch.cat(
                [torch.zeros(len(a) + 2, dtype=torch.long), torch.ones(len(b) + 1, dtype=torch.long)]
            )
            item["next_sentence_label"] = torch.tensor(int(is_random))
        else:
            input_ids = torch.cat([cls, body, sep])
            token_type = torch.zeros(self.seq_len, dtype=torch.long)
        input_ids, labels = self._mask(input_ids, gen)
        return {"input_ids": input_ids, "labels": labels, "token_type_ids": token_type, **item}

    def _mask(self, ids: torch.Tensor, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        special = (ids == self.tok.cls_id) | (ids == self.tok.sep_id) | (ids == self.tok.pad_id)
        scores = torch.rand(ids.shape, generator=gen).masked_fill(special, 2.0)  # specials are never chosen
        n_mask = max(1, round(self.mask_prob * int((~special).sum())))
        chosen = scores.argsort()[:n_mask]
        labels = torch.full_like(ids, -100)
        labels[chosen] = ids[chosen]
        action = torch.rand(n_mask, generator=gen)
        masked = ids.clone()
        masked[chosen[action < 0.8]] = self.tok.mask_id
        swap = chosen[(action >= 0.8) & (action < 0.9)]
        masked[swap] = torch.randint(self.tok.first_normal_id, self.tok.vocab_size, (len(swap),), generator=gen)
        return masked, labels


class BertDataModule(TokenDataModule):
    """Masked-LM batches from text, tokenized once with BERT's uncased WordPiece and cached as uint16.

    Args:
        sources: corpora to read (see ``recipes.common.corpus``): "wikipedia", "shakespeare", files,
            directories, or a saved Hugging Face dataset.
        seq_len: tokens per sequence including [CLS]/[SEP]; at most the model's ``max_position``.
        batch_size: sequences per micro-batch on each device.
        mask_prob: share of word pieces to predict (BERT: 0.15).
        nsp: also make next-sentence-prediction pairs (must match ``model.config.nsp``).
        val_fraction: share of the text held out for validation.
        num_workers: DataLoader worker processes.
        cache_dir: where tokenized corpora are kept.
        val_seed: seed of the fixed validation masks.
    """

    tokenizer_name = "bert-uncased"
    sampler_class = EpochIndexSampler

    def __init__(
        self,
        sources: list[str] = ["wikipedia", "shakespeare"],  # noqa: B006 (read by jsonargparse, never mutated)
        seq_len: int = 128,
        batch_size: int = 32,
        mask_prob: float = 0.15,
        nsp: bool = False,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        cache_dir: str | None = None,
        val_seed: int = 1234,
    ) -> None:
        super().__init__(sources, seq_len, batch_size, val_fraction, num_workers, cache_dir)
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"data.mask_prob is {mask_prob}; it must lie strictly between 0 and 1 (BERT: 0.15)")
        self.mask_prob, self.nsp, self.val_seed = mask_prob, nsp, val_seed

    def separator(self) -> int:
        """[SEP] separates documents in the cache (RoBERTa's full-sentences packing)."""
        return self.tokenizer.sep_id

    def min_tokens(self) -> int:
        """The body of one window: ``seq_len`` minus the special tokens."""
        return self.seq_len - (3 if self.nsp else 2)

    def make_dataset(self, tokens: np.ndarray, split: str) -> MaskedWindows:
        """Masked windows over ``tokens``; fixed masks for validation."""
        seed = self.val_seed if split == "val" else None
        return MaskedWindows(tokens, self.seq_len, self.tokenizer, self.mask_prob, self.nsp, seed)
