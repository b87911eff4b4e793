"""Memory pools on 2 CPU/gloo ranks: the memory that lives and dies every step comes from one pool that
stops allocating after the first step, gradient buckets are bounded even when reductions lag behind
backward, stage 3's released parameters hold no memory, bf16-mixed gradients stay 16-bit (or fp32
with ``reduce_dtype="fp32"``, which then trains as Lightning's bf16-mixed DDP); the losses stay DDP's."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import comm
from lightning_zero.testing import run_ranks
from lightning_zero.zero.flat import ParamState
from lightning_zero.zero.reduce import GradReducer
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed

WIDTH, DEPTH = 7, 6  # odd width: every flat buffer is padded; 6 equal layers = 6 equal buckets


class Stack(pl.LightningModule):
    """DEPTH equal Linear layers; records the losses."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layers(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Residual(Stack):
    """The same layers on a residual stream (x = x + layer(x)), as in a transformer: the backward of
    every layer is reached through the stream."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        for layer in self.layers:
            x = x + layer(x)
        loss = nn.functional.mse_loss(x.float(), y)
        self.losses.append(loss.item())
        return loss


class Probe(pl.Callback):
    """Pool allocations after every step; at stage 3, the bytes held by released buffers before
    backward (autograd holds views of them then); the gradient dtypes after backward."""

    def __init__(self) -> None:
        self.allocations: list[int] = []
        self.released_bytes: list[int] = []
        self.grad_dtypes: set[torch.dtype] = set()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        engine = trainer.strategy._engine
        self.released_bytes.append(
            sum(
                b.flat_param.untyped_storage().nbytes()
                for b in engine._buffers
                if not b.persistent and b.state is ParamState.RELEASED and b.flat_param is not None
            )
        )

    def on_after_backward(self, trainer, pl_module) -> None:
        engine = trainer.strategy._engine
        self.grad_dtypes |= {b.grad_shard.dtype for b in engine._buffers if b.grad_shard is not None}
        self.grad_dtypes |= {t.dtype for t in engine._ctx.pool.free}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pool = trainer.strategy._engine._ctx.pool
        self.allocations.append(pool.allocations)
        self.peak_in_use = pool.peak_in_use_bytes
        self.blocks = sorted(t.numel() for t in pool.free)


def _loader(rows: int = 48) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, rows, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def _fit(strategy, precision: str = "32-true", callbacks=(), steps: int = 5, model_class=Stack, loader=None) -> Stack:
    import lightning_zero  # noqa: F401 - registers the strategy names

    pl.seed_everything(11, verbose=False)
    model = model_class()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=2,
        callbacks=list(callbacks),
    )
    trainer.fit(model, train_dataloaders=loader if loader is not None else _loader())
    return model


def _zero(stage: int, **extra):
    from lightning_zero import ZeroStrategy

    # one bucket per layer (56 elements each), stage 3 shards every layer and prefetches one ahead
    options = {"reduce_bucket_size": 56, "param_persistence_threshold": 0, "prefetch_bucket_size": 56, **extra}
    return ZeroStrategy(stage=stage, **options)


def _pool_worker(rank: int) -> dict:
    out: dict = {"ddp": _fit("ddp").losses}
    for stage in (2, 3):
        probe = Probe()
        out[stage] = {"losses": _fit(_zero(stage), callbacks=[probe]).losses, "probe": vars(probe)}
    # Reductions that never finish on their own (a slow network): without the bound every bucket of
    # a backward would be alive at once (6 here); with it, at most GradReducer.MAX_BUCKETS.
    original = comm.Handle.is_completed
    comm.Handle.is_completed = lambda self: False  # type: ignore[method-assign]
    try:
        probe = Probe()
        out["slow"] = {"losses": _fit(_zero(2), callbacks=[probe]).losses, "probe": vars(probe)}
    finally:
        comm.Handle.is_completed = original  # type: ignore[method-assign]
    probe = Probe()
    _fit(_zero(3), precision="bf16-mixed", callbacks=[probe], steps=2)
    out["bf16"] = vars(probe)
    # Stage 3 prefetch window on a residual stream: two layers ahead (112 elements), in backward too
    out["ddp_residual"] = _fit("ddp", model_class=Residual).losses
    probe = Probe()
    out["residual"] = {
        "losses": _fit(_zero(3, prefetch_bucket_size=112), model_class=Residual, callbacks=[probe]).losses,
        "probe": vars(probe),
    }
    # reduce_dtype="fp32": the bf16 gradients summed over ranks and micro-steps in fp32, as Lightning's
    # bf16-mixed DDP does (autocast: fp32 weights cast to bf16 per op, fp32 .grad)
    out["ddp_bf16"] = _fit("ddp", precision="bf16-mixed").losses
    probe = Probe()
    out["fp32_reduce"] = {
        "losses": _fit(_zero(2, reduce_dtype="fp32"), precision="bf16-mixed", callbacks=[probe]).losses,
        "probe": vars(probe),
    }
    return out


def test_pools_buckets_and_released_memory():
    for res in run_ranks(_pool_worker):
        ref = torch.tensor(res["ddp"])
        for key in (2, 3, "slow"):
            # fp32 on CPU; the same bound and reason as test_parity.test_fp32_matches_ddp (ZeRO sums
            # the two ranks' gradients in another order than DDP's bucketed all-reduce)
            torch.testing.assert_close(torch.tensor(res[key]["losses"]), ref, rtol=1e-5, atol=0)
            allocations = res[key]["probe"]["allocations"]
            # every block the step needs is allocated during the first optimizer step (2 micro-batches)
            assert allocations[1:] == [allocations[1]] * (len(allocations) - 1), allocations
        assert res["slow"]["probe"]["allocations"][-1] <= GradReducer.MAX_BUCKETS
        # stage 3: released buffers hold 0 bytes while autograd still keeps views of their parameters
        assert res[3]["probe"]["released_bytes"] and set(res[3]["probe"]["released_bytes"]) == {0}
        assert res["bf16"]["grad_dtypes"] == {torch.bfloat16}
        # same reason and bound as above
        torch.testing.assert_close(
            torch.tensor(res["residual"]["losses"]), torch.tensor(res["ddp_residual"]), rtol=1e-5, atol=0
        )
        # At most, in 56-element fp32 blocks: the layer in backward, the two-layer prefetch window
        # (112 elements) and GradReducer.MAX_BUCKETS gradient buckets. Before the window counted the
        # layers already gathered, each layer's backward prefetched two more and 6 were in use.
        assert res["residual"]["probe"]["peak_in_use"] <= (1 + 2 + GradReducer.MAX_BUCKETS) * 56 * 4
        # Buckets and reduced slices in fp32 (stage 2: the pool holds only buckets).
        assert res["fp32_reduce"]["probe"]["grad_dtypes"] == {torch.float32}
        # Same bf16 forward values (autocast rounds the fp32 weights as ZeRO rounds its fp32 master),
        # the same bf16 per-rank gradients, summed in fp32 in another order (over ranks per
        # micro-step, DDP over micro-steps first): the sums of four bf16 values differ in the last
        # fp32 bit at most, which AdamW keeps at ~1e-6 relative over 5 steps.
        torch.testing.assert_close(
            torch.tensor(res["fp32_reduce"]["losses"]), torch.tensor(res["ddp_bf16"]), rtol=1e-5, atol=0
        )


BIG = 10  # Linear(10, 10): a 100-element weight (even: no padding on 2 ranks) larger than the buckets


class Wide(Stack):
    """Layers whose weight alone is larger than ``reduce_bucket_size``: each weight is a flat buffer of
    its own, whose bucket is autograd's gradient itself (FlatBuffer.adopts), not a block of the pool."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(BIG, BIG), nn.Tanh()) for _ in range(3)))
        self.losses = []


def _wide_loader(rows: int = 48) -> DataLoader:
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, rows, BIG, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def _adopt_worker(rank: int) -> dict:
    from lightning_zero import ZeroStrategy

    out: dict = {"ddp": {"losses": _fit("ddp", steps=4, model_class=Wide, loader=_wide_loader()).losses}}
    for stage, extra in ((2, {}), (3, {"param_persistence_threshold": 0, "prefetch_bucket_size": 16})):
        probe = Probe()
        model = _fit(
            ZeroStrategy(stage=stage, reduce_bucket_size=16, **extra),
            callbacks=[probe],
            steps=4,
            model_class=Wide,
            loader=_wide_loader(),
        )
        out[stage] = {"losses": model.losses, "allocations": probe.allocations, "blocks": probe.blocks}
    return out


def test_a_parameter_larger_than_a_bucket_is_reduced_from_its_own_gradient():
    for res in run_ranks(_adopt_worker):
        for stage in (2, 3):
            # fp32 on CPU; the same bound and reason as test_pools_buckets_and_released_memory
            torch.testing.assert_close(
                torch.tensor(res[stage]["losses"]), torch.tensor(res["ddp"]["losses"]), rtol=1e-5, atol=0
            )
            allocations = res[stage]["allocations"]
            assert allocations[1:] == [allocations[1]] * (len(allocations) - 1), allocations
        # stage 2: the pool holds buckets only, and none of a weight's 100 elements (the weights' own
        # gradients were their buckets); the biases' buckets are the pool's
        assert max(res[2]["blocks"], default=0) < BIG * BIG, res[2]["blocks"]
