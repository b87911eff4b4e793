"""Tensor parallelism on CPU/gloo: the recipes' GPT-2 split by its plan against the whole model.

Tiny GPT-2 (2 layers, d=32, 2 heads, vocab 64, 16 positions): with tp=2 every rank holds one
attention head, half of the MLP and half of the vocabulary (the tied embedding / LM head, whose
logits stay sharded into the vocabulary-parallel cross entropy). References are plain
single-process PyTorch (no Lightning, no process group) on the unconverted model with the same
global batches, AdamW (or LAMB) and norm clipping.

Tolerances: fp32 throughout. Tensor parallelism changes only the order of summation: a row-parallel
Linear sums two partial products of 16 (attention) or 64 (MLP) terms across ranks instead of one
sum of 32 or 128, which is ~1e-7 relative per output; a few AdamW steps amplify that by ~10.
The vocabulary-parallel cross entropy sums exp() over two halves of the vocabulary (32 + 32 terms
instead of 64). So forward/gradients are compared at 1e-5 relative (with a 1e-7 absolute floor for
elements near zero), losses and gradient norms at 1e-5 relative. A missing or doubled all-reduce, a
wrong shard or a replica counted twice in the norm gives errors of order 1. LAMB's trust ratio is
||w|| / ||update|| per whole parameter: under tp its squared norms add up from pieces (over dp and tp
ranks) in another order, ~1e-7 relative, and the ratio scales every step of the parameter, so the
weights after four steps are compared at 1e-5 relative too (1e-6 absolute floor for elements near
zero). Measured: the weights differ from one process by at most 2.4e-7 (weights ~0.02); with the
ratio taken from each tensor-parallel shard's own norms they differ by 6e-5, 50x the tolerance
(halves of a random matrix have similar norms, so the error is small but well above rounding).
AdamW's weights are not compared: its per-element normalization m / (sqrt(v) + 1e-8) turns the
rounding of a near-zero gradient (a bias element) into a weight difference of up to 1.1e-6
(measured); LAMB's eps of 1e-6 damps that.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.gpt_reference import CLIP, LR, SEED, SEQ, VOCAB, reference_run, tokens
from tests.helpers.model_parallel import fit_tensor_parallel, gpt_optimizer
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed


def _gpt():
    from tests.helpers.gpt_reference import tiny_gpt

    return tiny_gpt(n_layer=2)


_tokens = tokens


def _reference(data_parallel: int, optimizer: str = "adamw") -> dict:
    """One process, whole model: per-step losses of each data-parallel half, gradient norms, final weights."""
    return reference_run(2, lambda params: gpt_optimizer(optimizer, params), data_parallel)


def _bert_check(groups) -> dict:
    """The BERT recipe split by its plan (vocabulary-parallel MLM decoder) vs the whole one."""
    from lightning_zero.parallel import apply_tensor_parallel
    from recipes.bert.model import TENSOR_PARALLEL_PLAN, Bert, BertConfig

    torch.manual_seed(2)
    whole = Bert(
        BertConfig(
            vocab_size=30, max_position=16, n_layer=1, n_head=2, hidden=16, intermediate=24, dropout=0.0, nsp=False
        )
    )
    split = copy.deepcopy(whole)
    plan = {k: v for k, v in TENSOR_PARALLEL_PLAN.items() if not k.startswith("nsp_head")}
    apply_tensor_parallel(split, plan, groups.tp)
    ids = torch.randint(0, 30, (3, 9), generator=torch.Generator().manual_seed(4))
    labels = torch.full_like(ids, -100)
    labels[:, 2], labels[1:, 5] = ids[:, 2], ids[1:, 5]  # 5 masked positions
    out = {"tied": split.mlm_head.decoder.weight is split.embed.word.weight}
    for name, model in (("whole", whole), ("split", split)):
        logits, _ = model(ids, labels)
        loss = model.mlm_loss(logits, labels[labels != -100])
        loss.backward()
        out[name] = {
            "loss": loss.detach(),
            "predictions": model.mlm_predictions(logits),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        }
    out["marked"] = sorted(n for n, p in split.named_parameters() if getattr(p, "tensor_parallel", False))
    return out


def _forward_backward(whole, split, rows) -> dict:
    """Logits, loss and gradients of the whole and the split model on ``rows``."""
    out = {}
    for name, model in (("whole", whole), ("split", split)):
        logits = model(rows[:, :-1])
        loss = model.loss(logits, rows[:, 1:])
        loss.backward()
        out[name] = {
            "logits": logits.detach(),
            "loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        }
    return out


def _function_worker(rank: int) -> dict:
    """Forward and gradients of the converted GPT-2 and BERT vs the whole ones; vocab-parallel pieces too."""
    import torch.distributed as dist

    from lightning_zero.layout import ParallelLayout, build_groups
    from lightning_zero.parallel import (
        ColumnParallelLinear,
        VocabParallelEmbedding,
        apply_tensor_parallel,
        vocab_parallel_argmax,
        vocab_parallel_cross_entropy,
    )
    from recipes.gpt2.model import TENSOR_PARALLEL_PLAN

    dist.init_process_group("gloo")
    groups = build_groups(ParallelLayout(1, tensor=2))
    whole = _gpt()
    split = copy.deepcopy(whole)
    converted = apply_tensor_parallel(split, TENSOR_PARALLEL_PLAN, groups.tp)
    # 2 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj), the token embedding and the LM head
    assert len(converted) == 10, converted
    rows = _tokens(3)
    out = {"tied": split.head.lm_head.weight is split.embed.wte.weight}
    out.update(_forward_backward(whole, split, rows))
    out["marked"] = sorted(n for n, p in split.named_parameters() if getattr(p, "tensor_parallel", False))
    out["bert"] = _bert_check(groups)

    # Vocabulary-parallel embedding + cross-entropy against nn.Embedding + F.cross_entropy (odd sizes).
    torch.manual_seed(1)
    embedding, head = torch.nn.Embedding(10, 7), torch.nn.Linear(7, 10, bias=False)
    ids, target = torch.randint(0, 10, (5,)), torch.tensor([3, -100, 9, 0, 5])
    ref_loss = torch.nn.functional.cross_entropy(head(embedding(ids)), target)
    ref_loss.backward()
    vocab = VocabParallelEmbedding.from_embedding(embedding, groups.tp)
    column_head = ColumnParallelLinear.from_linear(head, groups.tp)  # logits sharded over the vocabulary
    loss = vocab_parallel_cross_entropy(column_head(vocab(ids)), target, groups.tp)
    loss.backward()
    shard = slice(rank * 5, rank * 5 + 5)
    # argmax: a tie across the two shards (ids 2 and 7) must give the smaller id, as torch does
    full = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(6))
    full[0, 1, 2] = full[0, 1, 7] = full.max() + 1
    out["vocab"] = {
        "loss": (loss.item(), ref_loss.item()),
        "embedding_grad": (vocab.weight.grad, embedding.weight.grad[shard]),
        "head_grad": (column_head.weight.grad, head.weight.grad[shard]),
        "argmax": (vocab_parallel_argmax(full[..., shard], groups.tp), full.argmax(-1)),
    }
    out["fit"] = fit_tensor_parallel(tensor_parallel=2, data_parallel=1, stage=2)
    out["recipe"] = _recipe_fit(tensor_parallel=2)
    return out


def _recipe_batches(rows: torch.Tensor, batch: int, ignored: list[int]) -> list[dict]:
    """Batches of the GPT-2 recipe (input_ids, shifted labels); batch i ignores its first ``ignored[i]``
    labels, so the batches count different numbers of tokens (val_ppl must weight them by those)."""
    out = []
    for i in range(len(rows) // batch):
        part = rows[i * batch : (i + 1) * batch]
        labels = part[:, 1:].clone()
        labels.view(-1)[: ignored[i]] = -100
        out.append({"input_ids": part[:, :-1], "labels": labels})
    return out


def _recipe_fit(tensor_parallel: int) -> dict:
    """The GPT-2 recipe's LightningModule (vocabulary-parallel head under tp): logged metrics."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_zero import ZeroStrategy
    from recipes.common.optim import OptimizerConfig
    from recipes.gpt2.model import GPTConfig
    from recipes.gpt2.module import GPT2LM

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.train_loss: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.train_loss.append(float(trainer.callback_metrics["train_loss"]))

    pl.seed_everything(SEED, verbose=False)
    module = GPT2LM(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32), OptimizerConfig(lr=LR))
    record = Record()
    strategy = ZeroStrategy(stage=2, tensor_parallel_size=2) if tensor_parallel > 1 else "auto"
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=tensor_parallel,
        strategy=strategy,
        precision="32-true",
        max_steps=2,
        num_sanity_val_steps=0,
        callbacks=[record],
    )
    train = _recipe_batches(_tokens(8), 4, [0, 5])
    val = _recipe_batches(
        _tokens(6)[:, torch.randperm(SEQ + 1, generator=torch.Generator().manual_seed(8))], 2, [0, 20, 3]
    )
    loader = lambda batches: DataLoader(batches, batch_size=None)  # noqa: E731 (already batched)
    trainer.fit(module, train_dataloaders=loader(train), val_dataloaders=loader(val))
    metrics = {k: float(trainer.callback_metrics[k]) for k in ("val_loss", "val_ppl")}
    if tensor_parallel == 1:  # what torchmetrics' Perplexity says of the full logits
        from torchmetrics.text import Perplexity

        perplexity = Perplexity(ignore_index=-100)
        with torch.no_grad():
            for b in val:
                perplexity.update(module.model(b["input_ids"]), b["labels"])
        metrics["torchmetrics_ppl"] = float(perplexity.compute())
    return {"train_loss": record.train_loss, **metrics}


def _assert_close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _shard_of(full: torch.Tensor, got: torch.Tensor, rank: int) -> torch.Tensor:
    """The slice of ``full`` that a rank holding ``got`` (split along the dim where shapes differ) owns."""
    for dim, (a, b) in enumerate(zip(full.shape, got.shape, strict=True)):
        if a != b:
            return full.narrow(dim, rank * b, b)
    return full


def _check_split(res: dict, rank: int, what: str) -> None:
    """Gradients of a split model against the whole one's (this rank's shard of the split ones)."""
    assert res["tied"], f"{what}: the split embedding and head are no longer one Parameter"
    for name, want in res["whole"]["grads"].items():
        got = res["split"]["grads"][name]
        assert (got.shape == want.shape) == (name not in res["marked"]), name
        _assert_close(got, _shard_of(want, got, rank), f"{what} rank {rank} grad {name}")
    _assert_close(res["split"]["loss"], res["whole"]["loss"], f"{what} loss")


def test_tp2_gpt2_matches_whole_model_and_trains_like_one_process():
    results = run_ranks(_function_worker, world_size=2)
    reference = _reference(data_parallel=1)
    recipe = _recipe_fit(tensor_parallel=1)
    assert len(recipe["train_loss"]) == 2
    _assert_close(torch.tensor(recipe["val_ppl"]), torch.tensor(recipe["torchmetrics_ppl"]), "val_ppl")
    for rank, res in enumerate(results):
        # this rank's half of the vocabulary: the logits are never gathered
        logits = res["split"]["logits"]
        assert logits.shape[-1] == VOCAB // 2
        _assert_close(logits, _shard_of(res["whole"]["logits"], logits, rank), "logits")
        _check_split(res, rank, "gpt2")
        # weights and biases of the column-parallel Linears, weights of the row-parallel ones, and the
        # one token-embedding shard shared by embedding and head
        assert len(res["marked"]) == 2 * (2 + 2 + 2 + 2) - 4 + 1, res["marked"]
        assert "embed.wte.weight" in res["marked"]
        bert = res["bert"]
        _check_split(bert, rank, "bert")
        assert torch.equal(bert["split"]["predictions"], bert["whole"]["predictions"])
        # one layer: qkv and fc_in weight + bias, out and fc_out weight; the word embedding shard
        # (shared with the decoder) and the decoder's bias
        assert len(bert["marked"]) == 6 + 2, bert["marked"]
        vocab = res["vocab"]
        assert abs(vocab["loss"][0] - vocab["loss"][1]) <= 1e-6 * abs(vocab["loss"][1])
        for key in ("embedding_grad", "head_grad"):
            _assert_close(*vocab[key], f"rank {rank} vocab-parallel {key}")
        assert torch.equal(*vocab["argmax"])
        fit = res["fit"]
        assert fit["sampler"] == {"num_replicas": 1, "rank": 0}  # both ranks read the same batches
        _assert_close(torch.tensor(fit["losses"]), torch.tensor(reference["losses"][0]), "losses")
        # The clipping threshold is below every norm, so the norm is used every step. The norm is
        # checked directly: AdamW nearly cancels a uniform gradient scale, so a wrong norm moves the
        # losses by only ~2e-6 (measured with the tensor-parallel group left out of the norm, which
        # gives norms 3% off).
        assert min(reference["norms"]) > CLIP
        _assert_close(torch.tensor(fit["norms"]), torch.tensor(reference["norms"]), "grad norms")
        # The recipe's module logs the true losses and perplexity from vocabulary-sharded logits.
        for key in ("train_loss", "val_loss", "val_ppl"):
            _assert_close(torch.tensor(res["recipe"][key]), torch.tensor(recipe[key]), f"rank {rank} recipe {key}")


def _dp_tp_worker(rank: int) -> dict:
    # Two fits in the same four ranks (one spawn): AdamW under stage 1, LAMB under stage 2.
    return {
        "adamw": fit_tensor_parallel(tensor_parallel=2, data_parallel=2, stage=1),
        "lamb": fit_tensor_parallel(tensor_parallel=2, data_parallel=2, stage=2, optimizer="lamb"),
    }


def test_dp2_tp2_adamw_stage1_and_lamb_stage2_match_one_process():
    """LAMB's trust ratio needs whole-parameter norms: pieces over dp, shards over tp, replicas once."""
    results = run_ranks(_dp_tp_worker, world_size=4, timeout=300)
    for optimizer in ("adamw", "lamb"):
        reference = _reference(data_parallel=2, optimizer=optimizer)
        for rank, all_fits in enumerate(results):
            res, tp_rank, dp_rank = all_fits[optimizer], rank % 2, rank // 2  # tensor-parallel rank fastest
            what = f"{optimizer} rank {rank}"
            assert res["sampler"] == {"num_replicas": 2, "rank": dp_rank}
            for name, want in reference["params"].items():
                got = res["params"][name]
                assert (got.shape == want.shape) == (name not in res["marked"]), name
                if optimizer == "lamb":  # (AdamW: see below)
                    torch.testing.assert_close(
                        got,
                        _shard_of(want, got, tp_rank),
                        rtol=1e-5,
                        atol=1e-6,
                        msg=lambda m, what=what, name=name: f"{what} {name}: {m}",
                    )
            _assert_close(torch.tensor(res["losses"]), torch.tensor(reference["losses"][dp_rank]), f"{what} losses")
            _assert_close(torch.tensor(res["norms"]), torch.tensor(reference["norms"]), f"{what} grad norms")


def _sequence_parallel_worker(rank: int) -> dict:
    """GPT-2 under tp=2 with sequence parallelism vs the whole model: forward, gradients, training."""
    import torch.distributed as dist

    from lightning_zero.layout import ParallelLayout, build_groups
    from lightning_zero.parallel import apply_tensor_parallel
    from recipes.gpt2.model import TENSOR_PARALLEL_PLAN

    dist.init_process_group("gloo")
    groups = build_groups(ParallelLayout(1, tensor=2))
    whole = _gpt()
    split = copy.deepcopy(whole)
    apply_tensor_parallel(split, TENSOR_PARALLEL_PLAN, groups.tp, sequence_parallel=True)
    out = {"marked": sorted(n for n, p in split.named_parameters() if getattr(p, "tensor_parallel", False))}
    out["sequence"] = sorted(n for n, p in split.named_parameters() if getattr(p, "sequence_parallel", False))
    chunks = {}
    split.h[0].ln_1.register_forward_hook(lambda m, a, y: chunks.update(ln_1=tuple(y.shape)))
    rows = _tokens(3)
    out.update(_forward_backward(whole, split, rows))
    out["ln_1 output"] = chunks["ln_1"]
    out["tied"] = split.head.lm_head.weight is split.embed.wte.weight
    out["fit"] = fit_tensor_parallel(tensor_parallel=2, data_parallel=1, stage=2, sequence_parallel=True)
    return out


def test_tp2_sequence_parallel_matches_one_process():
    """Sequence parallelism changes the order of summation only where tensor parallelism already does
    (the reduce-scatter sums the same two partial products as the all-reduce), plus the LayerNorm and
    row-bias gradients, now sums of two sequence halves (8 + 8 positions x 3 rows instead of 16 x 3):
    the same 1e-5 tolerances. A missing gradient sum over the group halves those gradients (order 1)."""
    results = run_ranks(_sequence_parallel_worker, world_size=2)
    reference = _reference(data_parallel=1)
    for rank, res in enumerate(results):
        assert res["ln_1 output"] == (3, SEQ // 2, 32)  # the LayerNorms run on half of the sequence
        # 2 blocks x (ln_1, ln_2: weight + bias; attn.c_proj, mlp.c_proj: bias), ln_f weight + bias
        assert len(res["sequence"]) == 2 * (4 + 2) + 2, res["sequence"]
        logits = res["split"]["logits"]
        assert logits.shape == (3, SEQ, VOCAB // 2)  # the LM head gathered the whole sequence back
        _assert_close(logits, _shard_of(res["whole"]["logits"], logits, rank), "logits")
        _check_split(res, rank, "gpt2 sequence-parallel")
        fit = res["fit"]
        _assert_close(torch.tensor(fit["losses"]), torch.tensor(reference["losses"][0]), "losses")
        _assert_close(torch.tensor(fit["norms"]), torch.tensor(reference["norms"]), "grad norms")
