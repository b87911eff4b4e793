"""ZeRO-Infinity's disk tier on a CUDA device: bit-identical to CPU offload.

Skipped without a CUDA device. One GPU (world size 1 over NCCL): every step takes the disk tier's
path from a device (the fp32 masters and moments, and with ``offload_parameters="nvme"`` the
parameter shards, stream through pinned, 4096-aligned host buffers to files under ``tmp_path``;
gradients come off the device into them, the updated 16-bit parameters go back). The reference is
the same run with ``offload_optimizer=True`` (and ``offload_parameters=True``): the same CPU kernel on
the same inputs, only the resting place of the states differs, so losses and weights must be equal
bit for bit, in fp32 and bf16-mixed, as on the CPU (tests/distributed/test_nvme.py).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (set before CUDA starts)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none found"),
]


def _fit(spec: dict, precision: str) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # odd shapes (buckets and 4096-byte blocks cut through parameters) and a tied weight
            self.enc = nn.Linear(33, 47)
            self.net = nn.Sequential(nn.Linear(47, 129), nn.LayerNorm(129), nn.GELU(), nn.Linear(129, 47, bias=False))
            self.dec = nn.Linear(47, 33, bias=False)
            self.head = nn.Linear(33, 5)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.head(self.dec(self.net(self.enc(x)))).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    pl.seed_everything(11, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 33, generator=g), torch.randn(24, 5, generator=g))
    model = Model()
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=ZeroStrategy(**spec),
        precision=precision,
        max_steps=6,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    left = sorted(os.listdir(spec["nvme_path"])) if "nvme_path" in spec and os.path.exists(spec["nvme_path"]) else []
    return model.losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}, left


SMALL = {"param_persistence_threshold": 10, "reduce_bucket_size": 500}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("params", ["host", "disk"], ids=["optimizer_on_disk", "params_on_disk"])
def test_nvme_tier_on_gpu_is_bitwise_cpu_offload(tmp_path, precision, params):
    knobs = {"block_size": 4096}
    if params == "disk":
        knobs["restore_after_fit"] = True  # the comparison reads the whole model after fit
    nvme = {
        "stage": 3,
        "offload_optimizer": "nvme",
        "offload_parameters": "nvme" if params == "disk" else True,
        "nvme_path": str(tmp_path / "swap"),
        "nvme_config": knobs,
        **SMALL,
    }
    cpu = {"stage": 3, "offload_optimizer": True, "offload_parameters": True, **SMALL}
    ref_losses, ref_state, _ = _fit(cpu, precision)
    losses, state, left = _fit(nvme, precision)
    assert losses == ref_losses  # exact: the same kernels on the same inputs, the states rest elsewhere
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key
    assert left == []  # the rank directory is removed at the end of fit
