"""The plan's NVMe tiers (:mod:`lightning_zero.plan.disk`: the real disk tier on meta tensors, its
file I/O recorded) against the real engine on 2 gloo ranks writing real swap files: per rank, the
files (names and bytes on disk), ``memory_breakdown()``, the bytes read and written by one step and
the most host memory the tier held at once, counted here by wrappers around the real
:class:`~lightning_zero.offload.nvme.SwapStore` (not the plan's recorder). All must be equal: the
plan runs the same tier code on the same shapes."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.testing import run_ranks

pytestmark = pytest.mark.distributed

# (stage, offload_parameters, aio_engine, buffer_count, param_buffer_count, precision): the optimizer
# tier at stages 1, 2 and 3 (with the gradient tier from stage 2 on), its step reading 1 or 2
# sub-groups ahead (of 3 and 5), the parameter tier at stage 3 reading 2 shards ahead, fp32 (the
# parameter shard is the master: the tier splits them) and the Python engine, whose files are not
# padded to whole blocks
CASES = [
    (1, False, "auto", 3, 5, "bf16-mixed"),
    (2, False, "auto", 2, 5, "bf16-mixed"),
    (3, "nvme", "auto", 3, 2, "bf16-mixed"),
    (3, "nvme", "auto", 3, 2, "32-true"),
    (3, False, "python", 5, 5, "bf16-mixed"),
]
# Small buckets: several flat buffers (sub-groups); 4 KiB blocks, so some files are padded and
# some span several blocks.
ZERO = {"reduce_bucket_size": 1500, "param_persistence_threshold": 40, "overlap_comm": False}


class Wide(nn.Module):
    """Odd widths (padding in every buffer), one weight larger than a bucket, a small one kept
    whole under stage 3, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 37)
        self.mid = nn.Linear(37, 101)
        self.norm = nn.LayerNorm(101)
        self.out = nn.Linear(101, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.mid(torch.tanh(self.inp(x))))) * self.scale


def _offload(path: str, offload_parameters: object, engine: str, buffers: int, param_buffers: int):  # noqa: ANN202
    from lightning_zero.config import NvmeConfig, OffloadConfig

    nvme = NvmeConfig(
        path=path, block_size=4096, aio_engine=engine, buffer_count=buffers, param_buffer_count=param_buffers
    )
    return OffloadConfig(offload_optimizer="nvme", offload_parameters=offload_parameters, nvme=nvme)


@contextmanager
def _counting(traffic: dict[str, int]):  # noqa: ANN202 - a context manager
    """Count the bytes each SwapStore reads and writes, and the most host memory the storages it
    gave memory hold at once, from the store's own I/O submission and allocation."""
    from unittest import mock

    from lightning_zero.offload.nvme import SwapStore

    submit, allocate = SwapStore._submit, SwapStore.allocate
    held: dict[int, torch.Tensor] = {}

    def counted_submit(self, name, tensor, write):  # noqa: ANN001, ANN202
        traffic["written" if write else "read"] += tensor.numel() * tensor.element_size()
        return submit(self, name, tensor, write)

    def counted_allocate(self, tensor):  # noqa: ANN001, ANN202
        allocate(self, tensor)
        held[id(tensor)] = tensor
        traffic["staging"] = max(traffic["staging"], sum(t.untyped_storage().nbytes() for t in held.values()))

    with (
        mock.patch.object(SwapStore, "_submit", counted_submit),
        mock.patch.object(SwapStore, "allocate", counted_allocate),
    ):
        yield


def _real_worker(rank: int, root: str) -> list[tuple[dict, dict, dict]]:
    from lightning_zero.config import StrategyConfig, ZeroConfig
    from lightning_zero.memory import memory_breakdown
    from lightning_zero.zero.engine import ZeroEngine

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    out = []
    try:
        for index, (stage, params, engine_name, *counts, precision) in enumerate(CASES):
            torch.manual_seed(0)
            model = Wide()
            optimizer = torch.optim.AdamW(model.parameters())
            offload = _offload(os.path.join(root, str(index)), params, engine_name, *counts)
            config = StrategyConfig(zero=ZeroConfig(stage=stage, **ZERO), offload=offload)
            engine = ZeroEngine(model, [optimizer], config=config, precision=precision, device=cpu)
            dtype = torch.float32 if precision == "32-true" else torch.bfloat16
            traffic = {"read": 0, "written": 0, "staging": 0}
            for step in range(2):  # the second step is the one compared, as the plan reports it
                with _counting(traffic if step else {"read": 0, "written": 0, "staging": 0}):
                    loss = model(torch.randn(5, 7).to(dtype)).float().mean()
                    loss.backward()
                    engine.backward_done()
                    engine.step(optimizer)
            directory = engine.swap.store.directory
            files = {
                f[: -len(".swp")]: os.stat(directory / f).st_size for f in os.listdir(directory) if f.endswith(".swp")
            }
            out.append((memory_breakdown(model, engine, cpu), files, traffic))
            engine.close()
    finally:
        dist.destroy_process_group()
    return out


def test_planned_nvme_tiers_equal_a_real_run(tmp_path):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.plan import plan

    measured = run_ranks(_real_worker, str(tmp_path), world_size=2)[0]  # rank 0, as the plan
    for index, ((stage, params, engine_name, *counts, precision), (breakdown, files, traffic)) in enumerate(
        zip(CASES, measured, strict=True)
    ):
        planned = plan(
            f"{__name__}:Wide",
            2,
            zero=ZeroConfig(stage=stage, **ZERO),
            offload=_offload(str(tmp_path / "plan" / str(index)), params, engine_name, *counts),
            device="cpu",
            precision=precision,
            inputs=[((5, 7), torch.float32)],
        )
        case = (
            f"stage {stage}, offload_parameters {params}, {engine_name}, {precision}: {planned.nvme} {files} {traffic}"
        )
        assert planned.nvme is not None, case
        assert planned.memory == breakdown, case
        assert planned.nvme.files == files, case
        assert planned.nvme_bytes == sum(files.values()), case
        assert planned.nvme.read_per_step == traffic["read"] > 0, case
        assert planned.nvme.written_per_step == traffic["written"] > 0, case
        assert planned.nvme.staging_bytes == traffic["staging"] > 0, case
        # the compiled engines pad each file to whole 4 KiB blocks, the Python one does not
        padded = all(size % 4096 == 0 for size in files.values())
        assert padded == (engine_name != "python"), case
        assert len(files) > 3 and (params != "nvme" or any(n.startswith("param") for n in files)), case
        assert any(n.startswith("grad") for n in files) == (stage > 1), case  # stage 1 keeps its buckets in RAM
        # the trace holds each read and write of the step, and a wait for each
        io = [e for e in planned.trace if e[0] == "io"]
        assert sum(e[2] for e in io if e[1] == "read") == traffic["read"], case
        assert len([e for e in planned.trace if e[0] == "io_wait"]) == len(io), case
