"""Tensor parallelism on CPU/gloo: the recipes' GPT-2 split by its plan against the whole model.

Tiny GPT-2 (2 layers, d=32, 2 heads, vocab 64, 16 positions): with tp=2 every rank holds one
attention head and half of the MLP. References are plain single-process PyTorch (no Lightning, no
process group) on the unconverted model with the same global batches, AdamW and norm clipping.

Tolerances: fp32 throughout. Tensor parallelism changes only the order of summation: a row-parallel
Linear sums two partial products of 16 (attention) or 64 (MLP) terms across ranks instead of one
sum of 32 or 128, which is ~1e-7 relative per output; a few AdamW steps amplify that by ~10.
So forward/gradients are compared at 1e-5 relative (with a 1e-7 absolute floor for elements near
zero), losses and gradient norms at 1e-5 relative. A missing or doubled all-reduce, a wrong shard
or a replica counted twice in the norm gives errors of order 1.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.distributed

VOCAB, SEQ, BATCH, STEPS, LR, CLIP, SEED = 64, 16, 4, 4, 1e-2, 0.05, 3


def _gpt():
    from recipes.gpt2.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(5))


class _TinyGPT2:
    """Built lazily inside a rank (Lightning is imported there)."""

    @staticmethod
    def make():
        import lightning.pytorch as pl

        from recipes.gpt2.model import GPT, TENSOR_PARALLEL_PLAN

        class TinyGPT2(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = _gpt()
                self.losses: list[float] = []
                self.norms: list[float] = []

            def tensor_parallel_plan(self) -> dict[str, str]:
                return {f"model.{k}": v for k, v in TENSOR_PARALLEL_PLAN.items()}

            def training_step(self, batch, batch_idx):
                (rows,) = batch
                loss = GPT.loss_fn(self.model(rows[:, :-1]), rows[:, 1:])
                self.losses.append(loss.item())
                return loss

            def on_before_optimizer_step(self, optimizer) -> None:
                self.norms.append(float(self.trainer.strategy.grad_norm(optimizer)))

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

        return TinyGPT2()


def _reference(data_parallel: int) -> dict:
    """One process, whole model: per-step losses of each data-parallel half, and gradient norms."""
    from torch.utils.data import DistributedSampler

    from recipes.gpt2.model import GPT

    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    rows = _tokens(BATCH * STEPS * data_parallel)
    # Lightning gives a training loader DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED) with the
    # strategy's num_replicas/rank: data-parallel rank r reads these rows.
    shards = [
        rows[list(DistributedSampler(range(len(rows)), num_replicas=data_parallel, rank=r, shuffle=True, seed=SEED))]
        for r in range(data_parallel)
    ]
    losses, norms = [[] for _ in range(data_parallel)], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for r in range(data_parallel):
            batch = shards[r][step * BATCH : (step + 1) * BATCH]
            loss = GPT.loss_fn(model(batch[:, :-1]), batch[:, 1:])
            losses[r].append(loss.item())
            total = total + loss / data_parallel  # equal halves: the mean over the global batch
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {"losses": losses, "norms": norms}


def _fit(tensor_parallel: int, data_parallel: int, stage: int) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy

    pl.seed_everything(SEED, verbose=False)  # the sampler's shuffling seed
    model = _TinyGPT2.make()
    strategy = ZeroStrategy(stage=stage, tensor_parallel_size=tensor_parallel, reduce_bucket_size=3000)
    trainer = pl.Trainer(
        accelerator="cpu", devices=tensor_parallel * data_parallel, strategy=strategy, precision="32-true",
        max_steps=STEPS, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    loader = DataLoader(TensorDataset(_tokens(BATCH * STEPS * data_parallel)), batch_size=BATCH, shuffle=False)
    trainer.fit(model, train_dataloaders=loader)
    return {"losses": model.losses, "norms": model.norms, "sampler": strategy.distributed_sampler_kwargs}


def _function_worker(rank: int) -> dict:
    """Forward and gradients of the converted GPT-2 vs the whole one; vocab-parallel pieces too."""
    import torch.distributed as dist

    from lightning_zero.layout import ParallelLayout, build_groups
    from lightning_zero.parallel import (
        ColumnParallelLinear,
        VocabParallelEmbedding,
        apply_tensor_parallel,
        vocab_parallel_cross_entropy,
    )
    from recipes.gpt2.model import GPT, TENSOR_PARALLEL_PLAN

    dist.init_process_group("gloo")
    groups = build_groups(ParallelLayout(1, tensor=2))
    whole = _gpt()
    split = copy.deepcopy(whole)
    converted = apply_tensor_parallel(split, TENSOR_PARALLEL_PLAN, groups.tp)
    assert len(converted) == 8, converted  # 2 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj)
    rows = _tokens(3)
    out = {}
    for name, model in (("whole", whole), ("split", split)):
        logits = model(rows[:, :-1])
        GPT.loss_fn(logits, rows[:, 1:]).backward()
        out[name] = {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    out["marked"] = sorted(n for n, p in split.named_parameters() if getattr(p, "tensor_parallel", False))

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
    out["vocab"] = {
        "loss": (loss.item(), ref_loss.item()),
        "embedding_grad": (vocab.weight.grad, embedding.weight.grad[shard]),
        "head_grad": (column_head.weight.grad, head.weight.grad[shard]),
    }
    out["fit"] = _fit(tensor_parallel=2, data_parallel=1, stage=2)
    return out


def _assert_close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _shard_of(full: torch.Tensor, got: torch.Tensor, rank: int) -> torch.Tensor:
    """The slice of ``full`` that a rank holding ``got`` (split along the dim where shapes differ) owns."""
    for dim, (a, b) in enumerate(zip(full.shape, got.shape)):
        if a != b:
            return full.narrow(dim, rank * b, b)
    return full


def test_tp2_gpt2_matches_whole_model_and_trains_like_one_process():
    results = run_ranks(_function_worker, world_size=2)
    reference = _reference(data_parallel=1)
    for rank, res in enumerate(results):
        _assert_close(res["split"]["logits"], res["whole"]["logits"], "logits")
        for name, want in res["whole"]["grads"].items():
            got = res["split"]["grads"][name]
            assert (got.shape == want.shape) == (name not in res["marked"]), name
            _assert_close(got, _shard_of(want, got, rank), f"rank {rank} grad {name}")
        # weights and biases of the column-parallel Linears, weights of the row-parallel ones
        assert len(res["marked"]) == 2 * (2 + 2 + 2 + 2) - 4, res["marked"]
        vocab = res["vocab"]
        assert abs(vocab["loss"][0] - vocab["loss"][1]) <= 1e-6 * abs(vocab["loss"][1])
        for key in ("embedding_grad", "head_grad"):
            _assert_close(*vocab[key], f"rank {rank} vocab-parallel {key}")
        fit = res["fit"]
        assert fit["sampler"] == {"num_replicas": 1, "rank": 0}  # both ranks read the same batches
        _assert_close(torch.tensor(fit["losses"]), torch.tensor(reference["losses"][0]), "losses")
        # The clipping threshold is below every norm, so the norm is used every step. The norm is
        # checked directly: AdamW nearly cancels a uniform gradient scale, so a wrong norm moves the
        # losses by only ~2e-6 (measured with the tensor-parallel group left out of the norm, which
        # gives norms 3% off).
        assert min(reference["norms"]) > CLIP
        _assert_close(torch.tensor(fit["norms"]), torch.tensor(reference["norms"]), "grad norms")


def _dp_tp_worker(rank: int) -> dict:
    return _fit(tensor_parallel=2, data_parallel=2, stage=1)


def test_dp2_tp2_stage1_matches_one_process():
    results = run_ranks(_dp_tp_worker, world_size=4, timeout=300)
    reference = _reference(data_parallel=2)
    for rank, res in enumerate(results):
        dp_rank = rank // 2  # tensor-parallel rank fastest
        assert res["sampler"] == {"num_replicas": 2, "rank": dp_rank}
        _assert_close(torch.tensor(res["losses"]), torch.tensor(reference["losses"][dp_rank]), f"rank {rank} losses")
        _assert_close(torch.tensor(res["norms"]), torch.tensor(reference["norms"]), f"rank {rank} grad norms")
