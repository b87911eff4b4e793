"""DeepSpeed configs read into ZeroStrategy options: DeepSpeed's own example configs, explicit overrides,
refused and machinery-only keys, precision and Trainer checks, the optimizer and schedule formulas."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroStrategy, ops
from lightning_zero import fabric as zero_fabric
from lightning_zero.deepspeed_keys import KEYS
from lightning_zero.deepspeed_optim import DeepSpeedSchedule, build_optimizer

DATA = Path(__file__).parent.parent / "data" / "deepspeed_configs"
DOCS = Path(__file__).parent.parent.parent / "docs" / "deepspeed-config.md"

# file -> the strategy's zero stage and config attributes it must produce, or the ValueError it must raise
EXAMPLES = {
    "examples_autotuning_fp16_z2.json": {"stage": 2, "precision": "16-mixed"},
    "examples_autotuning_z3.json": {"stage": 3, "precision": None},
    "examples_bingbertsquad_bsz24.json": {"stage": 2, "precision": "16-mixed", "gradient_clipping": 1.0,
                                          "micro_batch_size": 3, "train_batch_size": 24},
    "examples_pipeline_parallelism.json": {"stage": 2, "micro_batch_size": 8, "train_batch_size": 256},
    "examples_bf16_master_weight_full.json": "bf16_master_weights_and_grads=True.*\n.*bf16_optimizer_states.*\n.*torch_autocast.enabled",
    "examples_bing_bert_lamb_seq128.json": "sparse_attention.*\n.*max_coeff.*\n.*min_coeff",
    "examples_compression_cifar.json": "stage=0: stage 0 is plain data parallelism",
    "examples_sglang_offload_cpu.json": "offload_parameters='cpu' needs offload_optimizer=True",
    "examples_sglang_offload_nvme_aio.json": "offload_parameters='nvme' needs offload_optimizer=True",
    "transformers_ds_config_zero2.json": "optimizer.params.lr=\"auto\"(.*\n)+.*warmup_num_steps=\"auto\"",
    "transformers_ds_config_zero3.json": "reduce_bucket_size=0",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_deepspeed_example_configs(name):
    expected = EXAMPLES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the machinery-only warning is tested below
        if isinstance(expected, str):
            with pytest.raises(ValueError, match=expected):
                ZeroStrategy(config=DATA / name)
            return
        strategy = ZeroStrategy(config=str(DATA / name))
    assert strategy.config.zero.stage == expected.pop("stage")
    for attribute, value in expected.items():
        assert getattr(strategy.deepspeed, attribute) == value, attribute


def test_every_example_file_is_tested():
    assert sorted(p.name for p in DATA.glob("*.json")) == sorted(EXAMPLES)


def test_mapping_and_explicit_override():
    config = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 5e5,
            "overlap_comm": False,
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 123,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/nv", "buffer_count": 5},
            "offload_param": {"device": "nvme", "nvme_path": "/tmp/nv", "buffer_count": 6, "pin_memory": False},
        },
        "aio": {"block_size": 262144, "queue_depth": 8, "intra_op_parallelism": 2},
        "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 100, "min_loss_scale": 2},
        "communication_data_type": "fp32",
    }
    s = ZeroStrategy(config=config)
    z, o = s.config.zero, s.config.offload
    assert (z.stage, z.reduce_bucket_size, z.overlap_comm, z.prefetch_bucket_size) == (3, 500_000, False, "auto")
    assert z.param_persistence_threshold == 123 and z.reduce_dtype == "fp32"
    assert (o.offload_optimizer, o.offload_parameters, o.pin_memory) == ("nvme", "nvme", False)
    nvme = o.nvme
    assert (nvme.path, nvme.buffer_count, nvme.param_buffer_count) == ("/tmp/nv", 5, 6)
    assert (nvme.block_size, nvme.queue_depth, nvme.threads) == (262144, 8, 2)
    assert (s._loss_scale.initial_scale, s._loss_scale.growth_interval, s._loss_scale.min_scale) == (4096.0, 100, 2.0)
    # an option given with a value other than its default wins; one at its default takes the config's
    s = ZeroStrategy(config=config, reduce_bucket_size=1000, overlap_comm=True)
    assert s.config.zero.reduce_bucket_size == 1000 and s.config.zero.overlap_comm is False
    assert ZeroStrategy(config={"zero_optimization": {"stage": 3}}, stage=1).config.zero.stage == 1


def test_unknown_and_refused_keys_are_listed_together():
    config = {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True, "no_such": 1}, "typo_key": 3}
    with pytest.raises(ValueError) as info:
        ZeroStrategy(config=config)
    message = str(info.value)
    for key in ("zero_optimization.zero_quantized_gradients=True", "zero_optimization.no_such", "typo_key"):
        assert key in message


def test_machinery_keys_warn_once_and_defaults_do_not():
    with pytest.warns(UserWarning, match="sub_group_size=1000(.*\n)+.*wall_clock_breakdown=True") as record:
        ZeroStrategy(config={"zero_optimization": {"sub_group_size": 1000}, "wall_clock_breakdown": True})
    assert len([r for r in record if "DeepSpeed config keys" in str(r.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroStrategy(config={"zero_optimization": {"contiguous_gradients": True}, "steps_per_print": 10})


def test_precision_must_match_the_trainer():
    config = {"bf16": {"enabled": True}}
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        pl.Trainer(strategy=ZeroStrategy(config=config), accelerator="cpu", devices=2, logger=False)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(config=config), precision="bf16-mixed", accelerator="cpu", devices=2, logger=False
    )
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


def test_fabric_takes_a_config_and_refuses_what_its_loop_owns():
    strategy = zero_fabric.ZeroStrategy(config={"zero_optimization": {"stage": 1}}, reduce_bucket_size=100)
    assert strategy.config.zero.stage == 1 and strategy.config.zero.reduce_bucket_size == 100
    with pytest.raises(ValueError, match="fabric.clip_gradients"):
        zero_fabric.ZeroStrategy(config={"gradient_clipping": 1.0})
    with pytest.raises(TypeError, match="no_such"):
        zero_fabric.ZeroStrategy(no_such=1)


def test_lightning_cli_yaml_takes_a_config(tmp_path):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    yaml = tmp_path / "config.yaml"
    yaml.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
        "    class_path: lightning_zero.ZeroStrategy\n"
        f"    init_args: {{config: {DATA / 'examples_autotuning_z3.json'}}}\n"
    )
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=["--config", str(yaml)])
    assert cli.trainer.strategy.config.zero.stage == 3


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def test_optimizers_as_deepspeed_builds_them():
    adam = build_optimizer({"type": "Adam", "params": {"lr": 0.1}}, _params())
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.0  # DeepSpeed's default
    plain = build_optimizer({"type": "Adam", "params": {"adam_w_mode": False}}, _params())
    assert type(plain) is torch.optim.Adam
    no_bias = build_optimizer({"type": "AdamW", "params": {"bias_correction": False}}, _params())
    assert type(no_bias) is ops.FusedAdam and no_bias.defaults["bias_correction"] is False
    assert type(build_optimizer({"type": "Lamb"}, _params())) is ops.FusedLamb


def _lrs(kind, params, steps, lr=0.5):
    opt = torch.optim.SGD(_params(), lr=lr)
    sched = DeepSpeedSchedule(opt, kind, params)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules_follow_deepspeeds_formulas():
    # DeepSpeed's step k (0-based) runs with the lr of its iteration k - 1 (the initial lr at k = 0).
    lrs = _lrs("warmuplr", {"warmup_min_lr": 0.1, "warmup_max_lr": 1.1, "warmup_num_steps": 4}, 7)
    assert lrs[0] == lrs[1] == 0.1
    assert lrs[2] == pytest.approx(0.1 + math.log(2) / math.log(4)) and lrs[5:] == [1.1, 1.1]
    lrs = _lrs("warmupdecaylr", {"warmup_max_lr": 1.0, "warmup_num_steps": 2, "total_num_steps": 6,
                                 "warmup_type": "linear"}, 8)  # fmt: skip
    assert lrs[:3] == [0.0, 0.0, 0.5] and lrs[3] == 1.0 and lrs[4] == pytest.approx(0.75) and lrs[7] == 0.0
    lrs = _lrs("warmupcosinelr", {"warmup_num_steps": 2, "total_num_steps": 4, "warmup_type": "linear"}, 6)
    assert lrs[:3] == [0.0, 0.0, 0.25] and lrs[3] == pytest.approx(0.5 * 0.50005) and lrs[5] == pytest.approx(0.5e-4)


def test_docs_page_lists_every_key():
    text = DOCS.read_text()
    missing = [key for key in KEYS if f"`{key}`" not in text]
    assert not missing, missing
