"""Tokenize a corpus once into memory-mapped token files, split deterministically into train and val.

Layout of one cache entry, a folder named ``<tokenizer>-<key>`` under ``cache_root()``::

    train.bin   token ids, uint16 when the vocabulary fits (GPT-2's 50,257 and BERT's 30,522 do), else uint32
    val.bin     the same for the validation pieces
    meta.json   dtype, token counts, sources; written last, so its presence marks a complete entry

The key hashes the tokenizer's vocabulary files, the sources' files (names, sizes, modification
times), the validation fraction and ``CACHE_VERSION``: change any of them and a new entry is built.

The split is by piece (see ``corpus``): a piece goes to validation when the hash of its text is
among the lowest ``ceil(val_fraction * pieces)`` hashes. That is deterministic, independent of the
order of the sources, and puts duplicated text on one side only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from recipes.common import corpus

CACHE_VERSION = 1
_BATCH = 256  # pieces per tokenizer call: large enough for tiktoken/tokenizers' threads, small for memory


def cache_root() -> Path:
    """``$LIGHTNING_ZERO_CACHE/tokens`` when set, else ``.cache/tokens`` in the repository (gitignored)."""
    base = os.environ.get("LIGHTNING_ZERO_CACHE")
    return Path(base) / "tokens" if base else Path(__file__).resolve().parents[2] / ".cache" / "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary of ``vocab_size`` tokens."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _piece_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def choose_val(hashes: list[int], val_fraction: float) -> set[int]:
    """Indices of the pieces that go to validation: the ``ceil(val_fraction * n)`` lowest hashes, 1..n-1 of them."""
    n = len(hashes)
    if n < 2:
        raise ValueError(
            f"the corpus has {n} piece(s) of text (a piece is ~{corpus.PIECE_CHARS} characters); "
            "a train/val split needs at least 2: give more text"
        )
    n_val = min(max(1, math.ceil(val_fraction * n)), n - 1)
    order = sorted(range(n), key=lambda i: (hashes[i], i))
    return set(order[:n_val])


def _batches(items: Iterable, size: int) -> Iterable[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write(tmp: Path, sources: list[str], tokenizer, separator: int, val: set[int], n: int) -> dict:
    from tqdm.auto import tqdm

    dtype = token_dtype(tokenizer.vocab_size)
    # an ExitStack closes both files when tokenizing raises, too
    with contextlib.ExitStack() as stack:
        outs = {
            split: stack.enter_context(open(tmp / f"{split}.bin", "wb"))  # noqa: SIM115 (the ExitStack closes it)
            for split in ("train", "val")
        }
        counts, last_doc = {"train": 0, "val": 0}, {"train": None, "val": None}
        index = 0
        with tqdm(total=n, desc=f"tokenizing with {tokenizer.name}", unit="piece") as bar:
            for batch in _batches(corpus.pieces(sources), _BATCH):
                for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch]), strict=True):
                    split = "val" if index in val else "train"
                    index += 1
                    # a document separator only between documents: pieces of one document rejoin seamlessly
                    if last_doc[split] is not None and last_doc[split] != piece.doc:
                        ids = [separator, *ids]
                    last_doc[split] = piece.doc
                    outs[split].write(np.asarray(ids, dtype=dtype).tobytes())
                    counts[split] += len(ids)
                bar.update(len(batch))
    return {"dtype": dtype.name, "train_tokens": counts["train"], "val_tokens": counts["val"], "pieces": n}


def build(sources: list[str], tokenizer, separator: int, val_fraction: float, root: Path | None = None) -> Path:
    """The cache folder for ``sources`` tokenized by ``tokenizer``; tokenizes only when it is not there yet.

    ``separator`` is the token put between documents (GPT-2's <|endoftext|>, BERT's [SEP]). Call on
    one process per machine (Lightning's ``prepare_data``); others call ``load`` afterwards.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction is {val_fraction}; it must lie strictly between 0 and 1, e.g. 0.05")
    spec = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer.name,
        "vocab": tokenizer.fingerprint,
        "sources": sources,
        "files": corpus.fingerprint(sources),
        "val_fraction": val_fraction,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    folder = (root or cache_root()) / f"{tokenizer.name}-{key}"
    if (folder / "meta.json").is_file():
        return folder
    hashes = [_piece_hash(p.text) for p in corpus.pieces(sources)]
    val = choose_val(hashes, val_fraction)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {**spec, **_write(tmp, sources, tokenizer, separator, val, len(hashes))}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished the same entry first: theirs is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load(folder: Path, split: str) -> np.memmap:
    """The token ids of ``split`` ("train" or "val") in a built cache folder, memory-mapped read-only."""
    meta = json.loads((folder / "meta.json").read_text())
    if meta[f"{split}_tokens"] == 0:
        return np.zeros(0, dtype=meta["dtype"])  # np.memmap refuses an empty file
    return np.memmap(folder / f"{split}.bin", dtype=meta["dtype"], mode="r")
