"""``--model.init_from DIR``: the recipes' own GPT-2 and BERT start from an HF checkpoint directory
(``save_pretrained`` of a randomly initialized HF model: nothing is downloaded) and compute the same
loss as the HF model itself, unsharded and replayed as stage 3 does."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.zero.deferred import Recorder

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 101, 12


def _gpt2_pair(tmp_path):
    from recipes.gpt2.model import GPTConfig
    from recipes.gpt2.module import GPT2LM

    torch.manual_seed(4)
    hf_config = transformers.GPT2Config(
        n_layer=2,
        n_embd=24,
        n_head=3,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    hf.save_pretrained(tmp_path)
    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=3, n_embd=24)
    return hf, GPT2LM(config=config, init_from=str(tmp_path))


def _bert_pair(tmp_path):
    from recipes.bert.model import BertConfig
    from recipes.bert.module import BertMLM

    torch.manual_seed(5)
    hf_config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=24,
        num_attention_heads=3,
        intermediate_size=40,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = transformers.BertForMaskedLM(hf_config).eval()
    hf.save_pretrained(tmp_path)
    config = BertConfig(
        vocab_size=VOCAB, max_position=SEQ, n_layer=2, n_head=3, hidden=24, intermediate=40, dropout=0.0
    )
    return hf, BertMLM(config=config, init_from=str(tmp_path))


def _losses(kind: str, hf, module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if kind == "gpt2":
            ours = module.model.loss_fn(module.model(ids)[:, :-1], ids[:, 1:])
            return ours, hf(ids, labels=ids).loss
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]  # every third position masked (the ids stay: the loss is what matters)
        logits, _ = module.model(ids, labels)
        return module.model.mlm_loss(logits, ids[labels != -100]), hf(ids, labels=labels).loss


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "stage3-replay"])
def test_recipe_starts_from_hf_checkpoint(tmp_path, kind, sharded):
    hf, module = (_gpt2_pair if kind == "gpt2" else _bert_pair)(tmp_path)
    if sharded:  # what stage 3 does: record configure_model on meta, replay each tensor from the file
        with Recorder(torch.device("cpu")) as recording:
            module.configure_model()
        for tensor in list(module.model.parameters()):
            if tensor.is_meta:
                real = torch.nn.Parameter(recording.materialize(tensor))
                torch.utils.swap_tensors(tensor, real)
        assert not any(t.is_meta for t in module.model.parameters())
    else:
        module.configure_model()
    module.model.eval()
    ours, theirs = _losses(kind, hf, module)
    # the same fp32 weights and ops; only the fused q/k/v projection sums in another order: ~1e-7
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
