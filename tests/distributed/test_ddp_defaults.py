"""What DDP does by default, ZeRO does too, on 2 gloo ranks: rank 0's buffers broadcast before each
synchronizing forward (``broadcast_buffers``, Trainer and Fabric), ``Trainer(sync_batchnorm=True)``,
and parameters that keep their own dtype under "32-true" (a float64 head beside float32 layers).

Every case runs under zero1/2/3 (stage 3 with every parameter sharded) and the offload layouts, against
Lightning's DDP on the same data, each rank compared with the same rank of DDP.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import run_ranks
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed

LAYOUTS: dict[str, Any] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2, "reduce_bucket_size": 40},
    "zero3": {"stage": 3, "param_persistence_threshold": 0, "reduce_bucket_size": 40},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3_offload": {
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
        "param_persistence_threshold": 0,
    },
}
# fp32 on 2 ranks: ZeRO sums the same gradients in buckets of another shape than DDP's (the order of
# float additions differs), a few ulps per step; 4 steps of SGD stay far inside 1e-5 relative.
RTOL, ATOL = 1e-5, 1e-6


class BatchNormModel(pl.LightningModule):
    """Odd widths; BatchNorm between two Linear layers; ``double_head``: the last layer in float64."""

    def __init__(self, double_head: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7, bias=False)  # (BatchNorm cancels a bias: its gradient would be rounding noise)
        self.bn = nn.BatchNorm1d(7)
        self.head = nn.Linear(7, 3)
        self.head_dtype = torch.float64 if double_head else torch.float32  # (not read off a stage-3 shard)
        self.head.to(self.head_dtype)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.inp(x)))
        return self.head(h.to(self.head_dtype)).float()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # eval-mode BatchNorm reads the running statistics: the logged mean differs if ranks' do
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD: Adam would scale rounding-level gradients up to full steps
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(batch_size: int = 4, rows: slice = slice(None)) -> DataLoader:
    """Rows of different scales, so every rank's (and every micro-batch's) statistics differ."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 5, generator=g) * torch.linspace(0.5, 3.0, 32).unsqueeze(1)
    y = torch.randn(32, 3, generator=g)
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=batch_size, shuffle=False)


def fit(
    strategy: Any,
    devices: int = 2,
    batch_size: int = 4,
    rows: slice = slice(None),
    validate: bool = False,
    **kwargs: Any,
) -> tuple[BatchNormModel, dict]:
    import lightning_zero  # noqa: F401 - the strategy names

    pl.seed_everything(11, verbose=False)
    model = BatchNormModel(double_head=kwargs.pop("double_head", False))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=kwargs.pop("max_steps", 4),
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        **kwargs,
    )
    # validation at the end of the first epoch (2 optimizer steps), between training forwards
    trainer.fit(model, loader(batch_size, rows), loader(batch_size, rows) if validate else None)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if validate:
        state["val_loss"] = trainer.callback_metrics["val_loss"].detach().clone()
    return model, state


def _zero(name: str, **options: Any) -> Any:
    from lightning_zero import ZeroStrategy

    return ZeroStrategy(**LAYOUTS[name], **options)


def _buffers_worker(rank: int) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    off = DDPStrategy(broadcast_buffers=False)
    out: dict[str, Any] = {"ddp": fit(DDPStrategy(), validate=True)[1], "ddp_off": fit(off, validate=True)[1]}
    for name in LAYOUTS:
        out[name] = fit(_zero(name), validate=True)[1]
    out["zero2_off"] = fit(_zero("zero2", broadcast_buffers=False), validate=True)[1]
    return out


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=f"{what} {key}")


def test_buffers_are_rank_zeros_before_each_synchronizing_forward():
    results = run_ranks(_buffers_worker, timeout=600)
    for rank, res in enumerate(results):
        for name in LAYOUTS:
            _close(res[name], res["ddp"], f"rank {rank} {name}")
        _close(res["zero2_off"], res["ddp_off"], f"rank {rank} broadcast_buffers=False")
    # without the broadcast the ranks' running statistics differ (the test sees the broadcast)
    assert not torch.allclose(results[1]["ddp_off"]["bn.running_mean"], results[1]["ddp"]["bn.running_mean"])


def _sync_batchnorm_worker(rank: int) -> dict:
    from lightning_zero import SyncBatchNorm

    out: dict[str, Any] = {}
    for name in LAYOUTS:
        # rank r: rows r, r + 2, ...: its batch i and the other rank's are the reference's batch i
        model, out[name] = fit(
            _zero(name), sync_batchnorm=True, rows=slice(rank, None, 2), use_distributed_sampler=False
        )
        assert type(model.bn).__name__ == "_BatchNormXd", type(model.bn)  # reverted at the end of fit, as DDP
    seen: list[type] = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            seen.append(type(module.bn))

    fit(_zero("zero2"), sync_batchnorm=True, callbacks=[Probe()], max_steps=1)
    assert set(seen) == {SyncBatchNorm}, seen
    return out


def test_sync_batchnorm_matches_one_process_on_the_whole_batch():
    """SyncBatchNorm over 2 ranks of 4 rows each is BatchNorm over the 8 rows; DDP averages the two
    ranks' mean losses, the mean over the 8 rows: one process with batches of 8 is the reference
    (torch's SyncBatchNorm refuses CPU tensors, so DDP cannot be run here)."""
    _, reference = fit("auto", devices=1, batch_size=8)
    for rank, res in enumerate(run_ranks(_sync_batchnorm_worker, timeout=600)):
        for name in LAYOUTS:
            _close(res[name], reference, f"rank {rank} {name} sync_batchnorm")


def _float64_worker(rank: int) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    out: dict[str, Any] = {"ddp": fit(DDPStrategy(), double_head=True)}
    for name in LAYOUTS:
        out[name] = fit(_zero(name), double_head=True)
    return {k: (next(model.head.parameters()).dtype, model.losses, state) for k, (model, state) in out.items()}


def test_a_float64_module_keeps_its_dtype_and_trains_as_under_ddp():
    for rank, res in enumerate(run_ranks(_float64_worker, timeout=600)):
        dtype, losses, state = res["ddp"]
        assert dtype == torch.float64
        for name in LAYOUTS:
            got_dtype, got_losses, got_state = res[name]
            assert got_dtype == torch.float64, name
            assert state["head.weight"].dtype == got_state["head.weight"].dtype == torch.float64
            torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=RTOL, atol=ATOL)
            _close(got_state, state, f"rank {rank} {name} float64 head")


def _fabric_fit(strategy: Any) -> dict:
    """Fabric's loop: 4 steps of 2 micro-batches (the first under no_backward_sync), then one
    evaluation forward and one more training micro-batch (after which DDP does not broadcast)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(11)
    model = BatchNormModel()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    data = fabric.setup_dataloaders(loader())
    for index, (x, y) in enumerate(data):
        with fabric.no_backward_sync(model, enabled=index % 2 == 0):
            fabric.backward(F.mse_loss(model(x), y) / 2)
        if index % 2:
            optimizer.step()
            optimizer.zero_grad()
        if index == 7:
            break
    with torch.no_grad():
        model(x)
    fabric.backward(F.mse_loss(model(x), y))
    gathered = getattr(fabric.strategy, "gathered_parameters", None)
    with gathered(model) if gathered is not None else torch.enable_grad():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fabric_worker(rank: int) -> dict:
    from lightning_zero.fabric import ZeroStrategy

    out = {"ddp": _fabric_fit("ddp")}
    for name in ("zero1", "zero3", "zero2_offload"):
        out[name] = _fabric_fit(ZeroStrategy(**LAYOUTS[name]))
    return out


def test_fabric_broadcasts_buffers_as_ddp():
    for rank, res in enumerate(run_ranks(_fabric_worker, timeout=600)):
        for name in ("zero1", "zero3", "zero2_offload"):
            _close(res[name], res["ddp"], f"fabric rank {rank} {name}")


def _fp32_params_worker(rank: int) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import OffloadPrecision, ZeroStrategy

    out = {"ddp": fit(DDPStrategy(), precision="bf16-mixed")[1]}
    for name, spec in LAYOUTS.items():
        offload = {k: spec[k] for k in ("offload_optimizer", "offload_parameters") if k in spec}
        plugin = OffloadPrecision("bf16-mixed", param_dtype="fp32", **offload)
        out[name] = fit(ZeroStrategy(**spec), plugins=[plugin])[1]
        out[f"default {name}"] = fit(ZeroStrategy(**spec), precision="bf16-mixed")[1]
    return out


def test_bf16_mixed_with_fp32_parameters_is_lightnings_ddp():
    """OffloadPrecision("bf16-mixed", param_dtype="fp32"): fp32 parameters under bf16 autocast, as
    Lightning's DDP: the 16-bit matmuls see the same operands, so ZeRO and DDP agree as in fp32.
    The default (bf16 parameters, fp32 masters, as DeepSpeed) keeps BatchNorm's weights in fp32 beside
    its fp32 running statistics (torch's kernels refuse bf16 weights there) and agrees to bf16 rounding."""
    for rank, res in enumerate(run_ranks(_fp32_params_worker, timeout=600)):
        for name in LAYOUTS:
            _close(res[name], res["ddp"], f"rank {rank} {name} bf16-mixed fp32 parameters")
            _close_bf16(res[f"default {name}"], res["ddp"], f"rank {rank} {name} bf16-mixed")


def _close_bf16(got: dict, want: dict, what: str) -> None:
    # ZeRO's default bf16-mixed holds bf16 weights (fp32 masters): the model's weights read after fit
    # are the masters rounded to bf16 (half an ulp, 2^-9 relative), and the 4 updates came from
    # gradients averaged in bf16 rather than DDP's fp32 (another ulp at most at this size). Two bf16
    # ulps of the tensor's largest value (2^-7) bound both; measured: at most 2.8e-3.
    assert got.keys() == want.keys(), what
    for key in want:
        diff = (got[key].double() - want[key].double()).abs().max()
        scale = want[key].double().abs().max().clamp_min(1e-12)
        assert diff <= 2**-7 * scale, f"{what} {key}: {diff.item():.3g} of {scale.item():.3g}"
