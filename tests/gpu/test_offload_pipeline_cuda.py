"""Pipelined ZeRO-Offload on a GPU: the 16-bit copy-back on a side stream.

Skipped (with the reason in the -ra summary) without a CUDA device. On a GPU the host kernel writes
each bucket's bf16 parameters into a pinned staging buffer; pipelined, its host-to-device copy runs
on a side stream and the bucket's all-gather waits for it on the device, while the host steps the
next bucket (lightning_zero/offload/copy_back.py). The results must equal the unpipelined path
bitwise (same kernels on the same slices; copies move bits). The forward and backward run with
deterministic algorithms so that the two runs' gradients are bitwise equal too.
"""

import pytest
import torch

from tests.helpers.cuda import fit_cuda

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)


def test_copy_back_copies_on_a_side_stream_and_orders_the_compute_stream():
    from lightning_zero.offload.copy_back import CopyBack

    copy_back = CopyBack()
    host = torch.arange(278011, dtype=torch.float32).to(torch.bfloat16).pin_memory()
    device_slice = torch.zeros(278011, dtype=torch.bfloat16, device="cuda")
    device_slice.add_(1)  # queued work on the compute stream that the copy must follow
    event = copy_back.copy(device_slice, host)
    assert event is not None
    assert copy_back.streams[device_slice.device] != torch.cuda.current_stream()
    copy_back.end()
    out = device_slice.float().cpu()  # on the compute stream: after the side stream's copy
    assert torch.equal(out, host.float())
    copy_back.before_write(host)  # the host may rewrite the staging buffer now
    assert event.query() and not copy_back.pending


def _fit(pipeline: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torch import nn

    from lightning_zero import ZeroStrategy

    def network() -> nn.Module:  # odd shapes: buckets of 40 elements cut through parameters
        return nn.Sequential(nn.Linear(15, 7), nn.Tanh(), nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))

    strategy = ZeroStrategy(
        stage=2, offload_optimizer=True, reduce_bucket_size=40, allgather_bucket_size=100, offload_pipeline=pipeline
    )
    return fit_cuda(network, strategy, "bf16-mixed", shape=(15, 3), seed=7, clip=None)


def test_pipelined_offload_is_bitwise_unpipelined_on_gpu():
    piped_losses, piped = _fit(pipeline=True)
    plain_losses, plain = _fit(pipeline=False)
    assert piped_losses == plain_losses  # bitwise: see the module docstring
    for key, value in plain.items():
        assert torch.equal(piped[key], value), key
