"""Hugging Face GPT-2 and BERT checkpoints onto the recipes' own models, for ``--model.init_from DIR``.

``lightning_zero.load_pretrained(model, DIR, mapping=gpt2_mapping(config))`` reads a directory that
``GPT2LMHeadModel.save_pretrained`` wrote into ``recipes.gpt2.model.GPT`` (and ``bert_mapping`` a
``BertForMaskedLM`` one into ``recipes.bert.model.Bert``), tensor by tensor (sharded under stage 3).
What differs between the layouts:

- HF GPT-2's ``Conv1D`` stores weights as (in, out): transposed into ``nn.Linear``'s (out, in).
- HF's fused ``c_attn`` (GPT-2) has columns ``[q | k | v]``, and HF BERT has separate ``query``,
  ``key`` and ``value``; the recipes' fused projections lay rows out head by head, ``(q, k, v)``
  inside each head (so a tensor-parallel column split keeps whole heads): rows are regrouped.
- Names: ``transformer.h.{i}.ln_1`` -> ``h.{i}.ln_1``, ``bert.encoder.layer.{i}.attention.output.
  LayerNorm`` -> ``layer.{i}.ln_1``, and so on; the tied LM head / MLM decoder weight is the
  embedding's (HF does not save it separately).

The vocabulary must match the checkpoint's (``model.config.vocab_size: 50257`` for GPT-2's): a
padded vocabulary would add logits HF's model does not have.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

Combine = Callable[[list[torch.Tensor]], torch.Tensor]


def _first(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _transposed(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].t()


def _by_head(n_head: int, conv1d: bool) -> Combine:
    """``[q | k | v]`` (one fused tensor, or three) -> rows grouped per head as (q, k, v)."""

    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) == 1:  # GPT-2's fused c_attn: (in, 3 out) weight or (3 out,) bias
            fused = tensors[0].t() if conv1d and tensors[0].dim() == 2 else tensors[0]
            parts = fused.reshape(3, -1, *fused.shape[1:])
        else:  # BERT's query, key, value
            parts = torch.stack(tensors)
        per_head = parts.reshape(3, n_head, parts.shape[1] // n_head, *parts.shape[2:])
        return per_head.transpose(0, 1).reshape(-1, *parts.shape[2:])

    return combine


def gpt2_mapping(n_head: int) -> Callable[[str], tuple[list[str], Combine] | None]:
    """Keys of ``recipes.gpt2.model.GPT`` -> HF ``GPT2LMHeadModel`` keys and their conversion."""
    names = {"embed.wte.": "transformer.wte.", "embed.wpe.": "transformer.wpe.", "head.ln_f.": "transformer.ln_f."}

    def mapping(key: str) -> tuple[list[str], Combine] | None:
        if key == "head.lm_head.weight":
            return None  # tied to embed.wte.weight, which is loaded
        for ours, theirs in names.items():
            if key.startswith(ours):
                return [theirs + key[len(ours) :]], _first
        match = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", key)
        if match is None:
            return None
        layer, module, kind = match.groups()
        theirs = f"transformer.h.{layer}.{module}.{kind}"
        if module == "attn.c_attn":
            return [theirs], _by_head(n_head, conv1d=True)
        if module in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj") and kind == "weight":
            return [theirs], _transposed
        return [theirs], _first

    return mapping


_BERT_LAYER = {
    "attn.out": "attention.output.dense",
    "ln_1": "attention.output.LayerNorm",
    "ffn.fc_in": "intermediate.dense",
    "ffn.fc_out": "output.dense",
    "ln_2": "output.LayerNorm",
}
_BERT = {
    "embed.word.": "bert.embeddings.word_embeddings.",
    "embed.position.": "bert.embeddings.position_embeddings.",
    "embed.token_type.": "bert.embeddings.token_type_embeddings.",
    "embed.ln.": "bert.embeddings.LayerNorm.",
    "mlm_head.dense.": "cls.predictions.transform.dense.",
    "mlm_head.ln.": "cls.predictions.transform.LayerNorm.",
    "mlm_head.decoder.bias": "cls.predictions.bias",
    "nsp_head.pooler.": "bert.pooler.dense.",
    "nsp_head.classifier.": "cls.seq_relationship.",
}


def bert_mapping(n_head: int) -> Callable[[str], tuple[list[str], Combine] | None]:
    """Keys of ``recipes.bert.model.Bert`` -> HF ``BertForMaskedLM`` / ``BertForPreTraining`` keys."""

    def mapping(key: str) -> tuple[list[str], Combine] | None:
        if key == "mlm_head.decoder.weight":
            return None  # tied to embed.word.weight, which is loaded
        for ours, theirs in _BERT.items():
            if key.startswith(ours):
                return [theirs + key[len(ours) :]], _first
        match = re.fullmatch(r"layer\.(\d+)\.(.+)\.(weight|bias)", key)
        if match is None:
            return None
        layer, module, kind = match.groups()
        prefix = f"bert.encoder.layer.{layer}"
        if module == "attn.qkv":
            parts = [f"{prefix}.attention.self.{p}.{kind}" for p in ("query", "key", "value")]
            return parts, _by_head(n_head, conv1d=False)
        if module in _BERT_LAYER:
            return [f"{prefix}.{_BERT_LAYER[module]}.{kind}"], _first
        return None

    return mapping
