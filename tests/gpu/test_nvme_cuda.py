"""ZeRO-Infinity's disk tier on a CUDA device: bit-identical to CPU offload (issue 18).

Skipped without a CUDA device. One GPU (world size 1 over NCCL): every step takes the disk tier's
path from a device (the fp32 masters and moments, and with ``offload_parameters="nvme"`` the
parameter shards, stream through pinned, 4096-aligned host buffers to files under ``tmp_path``;
gradients come off the device into them, the updated parameters go back). The model and Trainer
are test_stages_cuda.py's (odd shapes, a tied weight, clipping). The reference is the same run with
``offload_optimizer=True, offload_parameters=True``: the same CPU kernel on the same inputs, only
the resting place of the states differs, so losses and weights must be equal bit for bit, in fp32
and bf16-mixed, as on the CPU (tests/distributed/test_nvme.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none found"),
]

#: small buckets and persistence threshold: buffers and 4096-byte blocks cut through parameters
SMALL = {"param_persistence_threshold": 10, "reduce_bucket_size": 40}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("params", ["host", "disk"], ids=["optimizer_on_disk", "params_on_disk"])
def test_nvme_tier_on_gpu_is_bitwise_cpu_offload(tmp_path, precision, params):
    from test_stages_cuda import _fit

    from lightning_zero import ZeroStrategy

    swap = tmp_path / "swap"
    knobs: dict = {"block_size": 4096}
    if params == "disk":
        knobs["restore_after_fit"] = True  # the comparison reads the whole model after fit
    nvme = ZeroStrategy(
        stage=3,
        offload_optimizer="nvme",
        offload_parameters="nvme" if params == "disk" else True,
        nvme_path=str(swap),
        nvme_config=knobs,
        **SMALL,
    )
    ref_losses, ref_state = _fit(
        ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True, **SMALL), precision
    )
    losses, state = _fit(nvme, precision)
    assert losses == ref_losses  # exact: the same kernels on the same inputs, the states rest elsewhere
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key
    assert not swap.exists() or os.listdir(swap) == []  # the rank directory is removed at the end of fit
