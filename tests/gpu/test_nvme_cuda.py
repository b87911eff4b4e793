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

from tests.helpers.cuda import fit_cuda, odd_network

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)


def _fit(spec: dict, precision: str) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    from lightning_zero import ZeroStrategy

    # odd shapes: buckets and 4096-byte blocks cut through parameters
    network = lambda: odd_network(33, 47, 129, 5)  # noqa: E731 - built after fit_cuda seeds
    losses, state = fit_cuda(network, ZeroStrategy(**spec), precision, shape=(33, 5))
    left = sorted(os.listdir(spec["nvme_path"])) if "nvme_path" in spec and os.path.exists(spec["nvme_path"]) else []
    return losses, state, left


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
