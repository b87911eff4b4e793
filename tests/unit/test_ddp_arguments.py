"""DDP's arguments and DeepSpeed-style sizes, without processes: DDPStrategy's and torch DDP's keyword
arguments are accepted with their ZeRO meaning or refused with a ValueError that says what to use
(both strategies, and from a LightningCLI YAML); integral floats (5e8) are accepted for every size."""

from __future__ import annotations

import pytest
import torch

import lightning_zero
from lightning_zero import ZeroStrategy
from lightning_zero.config import NvmeConfig, StrategyConfig
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from lightning_zero.zero.engine import ZeroEngine

STRATEGIES = [ZeroStrategy, FabricZeroStrategy]

ACCEPTED = [
    {"find_unused_parameters": True},
    {"static_graph": True},
    {"gradient_as_bucket_view": True},
    {"broadcast_buffers": False},
    {"bucket_cap_mb": 25},
    {"check_reduction": True},
    {"skip_all_reduce_unused_params": True},
    {"batched_grad_copy": True},
    {"forward_sync_buffers": False},
    {"dim": 0, "device_ids": None, "output_device": None, "init_sync": True, "mixed_precision": None},
    {"process_group_backend": "gloo", "timeout": 60, "start_method": "popen"},
]

REFUSED = [
    ({"ddp_comm_hook": lambda state, bucket: None}, "ddp_comm_hook=.* reduce_dtype='bf16'"),
    ({"ddp_comm_state": object()}, "ddp_comm_state=.*DDP communication hooks"),
    ({"ddp_comm_wrapper": print}, "ddp_comm_wrapper=.*DDP communication hooks"),
    ({"model_averaging_period": 4}, "model_averaging_period=4 .*DDPStrategy for local SGD"),
    ({"device_ids": [0]}, r"device_ids=\[0\].*Trainer\(devices=...\)"),
    ({"output_device": 0}, "output_device=0"),
    ({"dim": 1}, "dim=1 .*sampler"),
    ({"init_sync": False}, "init_sync=False .*rank 0's parameters"),
    ({"process_group": object()}, "process_group=.*tensor_parallel_size"),
    ({"mixed_precision": object()}, "mixed_precision=.*Trainer\\(precision=...\\)"),
    ({"device_mesh": object()}, "device_mesh="),
    ({"delay_all_reduce_named_params": []}, "delay_all_reduce_named_params="),
    ({"param_to_hook_all_reduce": object()}, "param_to_hook_all_reduce="),
    ({"bucket_cap_mb_list": [25]}, r"bucket_cap_mb_list=\[25\].*reduce_bucket_size"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb=0 must be a positive number of MiB"),
    ({"bucket_cap_mb": 25, "reduce_bucket_size": 1000}, "give one of them"),
    ({"find_unused_parameters": "yes"}, "find_unused_parameters='yes' must be True or False"),
    ({"broadcast_buffers": 1}, "broadcast_buffers=1 must be True or False"),
]


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("kwargs", ACCEPTED, ids=[repr(k) for k in ACCEPTED])
def test_ddp_arguments_accepted(cls, kwargs):
    cls(**kwargs)


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("kwargs,match", REFUSED, ids=[repr(k) for k, _ in REFUSED])
def test_ddp_arguments_refused_with_the_alternative(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_unknown_argument_is_a_type_error(cls):
    with pytest.raises(TypeError, match="unexpected keyword argument 'find_unused_params'"):
        cls(find_unused_parameters=True, find_unused_params=True)


def test_forward_sync_buffers_is_broadcast_buffers():
    assert ZeroStrategy().config.data_parallel.broadcast_buffers is True  # DDP's default
    assert ZeroStrategy(broadcast_buffers=False).config.data_parallel.broadcast_buffers is False
    assert ZeroStrategy(forward_sync_buffers=False).config.data_parallel.broadcast_buffers is False


@pytest.mark.parametrize("precision,itemsize", [("32-true", 4), ("bf16-mixed", 2)])
def test_bucket_cap_mb_is_reduce_bucket_size_in_gradient_elements(precision, itemsize):
    model = torch.nn.Linear(3, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ZeroStrategy(stage=2, bucket_cap_mb=1.5).config
    engine = ZeroEngine(model, [optimizer], config=config, precision=precision, device=torch.device("cpu"))
    assert engine.config.zero.reduce_bucket_size == int(1.5 * (1 << 20)) // itemsize
    engine.close(unshard=False)


SIZES = [
    "reduce_bucket_size",
    "allgather_bucket_size",
    "prefetch_bucket_size",
    "max_live_parameters",
    "param_persistence_threshold",
    "host_mmap_threshold",
]


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("name", SIZES)
def test_integral_floats_are_element_counts(cls, name):
    """DeepSpeed configs and YAML files write sizes as 5e8: taken as the integer; 2.5 elements is not one."""
    zero = cls(**{name: 5e5}).config.zero
    assert getattr(zero, name) == 500_000 and type(getattr(zero, name)) is int
    with pytest.raises(ValueError, match=f"{name}=2.5"):
        cls(**{name: 2.5})


def test_nvme_knobs_take_integral_floats(tmp_path):
    assert NvmeConfig(path=str(tmp_path), block_size=1.048576e6, threads=4.0).block_size == 1 << 20
    with pytest.raises(ValueError, match="threads=4.5"):
        NvmeConfig(path=str(tmp_path), threads=4.5)


def test_lightning_cli_yaml_with_deepspeed_sizes_and_ddp_arguments(tmp_path):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  logger: false\n"
        "  strategy:\n"
        "    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args:\n"
        "      stage: 3\n"
        "      reduce_bucket_size: 5e8\n"  # YAML 1.1 reads this as a string; jsonargparse as a float
        "      allgather_bucket_size: 5.0e+8\n"
        "      prefetch_bucket_size: 5e7\n"
        "      param_persistence_threshold: 1e5\n"
        "      find_unused_parameters: true\n"
        "      broadcast_buffers: false\n"
    )
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, lightning_zero.ZeroStrategy)
    zero = strategy.config.zero
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (500_000_000, 500_000_000)
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold) == (50_000_000, 100_000)
    assert strategy.config.data_parallel.broadcast_buffers is False


def test_strategy_config_carries_the_ddp_section():
    assert isinstance(ZeroStrategy(find_unused_parameters=True).config, StrategyConfig)
    assert ZeroStrategy(find_unused_parameters=True).config.data_parallel.find_unused_parameters


def test_param_dtype_fp32_runs_the_engine_as_32_true():
    from lightning_zero import OffloadPrecision
    from lightning_zero.fabric import FabricOffloadPrecision
    from lightning_zero.options import as_offload_precision

    plugin = OffloadPrecision("bf16-mixed", param_dtype="fp32")
    assert plugin.engine_precision == "32-true" and plugin.compute_dtype == torch.bfloat16  # autocast dtype
    assert OffloadPrecision("bf16-mixed").engine_precision == "bf16-mixed"
    fabric = as_offload_precision(plugin, FabricZeroStrategy().config, None, FabricOffloadPrecision)
    assert fabric is not None and fabric.engine_precision == "32-true"  # kept through Fabric's conversion
    with pytest.raises(ValueError, match="param_dtype='fp16'"):
        OffloadPrecision("bf16-mixed", param_dtype="fp16")
    for precision in ("bf16-true", "16-mixed", "32-true"):
        with pytest.raises(ValueError, match=f"precision='{precision}'"):
            OffloadPrecision(precision, param_dtype="fp32")
