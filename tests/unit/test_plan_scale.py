"""The plan at 1,024 ranks of a GPT-2-sized model (124M parameters, built on the meta device): one
rank's bytes follow the ZeRO formulas' 1/N terms (bf16-mixed Adam: stage 1 4Ψ + 12Ψ/N, stage 2
2Ψ + 14Ψ/N, stage 3 16Ψ/N) plus the terms the plan names separately (communication buckets, module
buffers). Padding is the only slack: each of the plan's flat buffers is
padded to a multiple of N, at most N - 1 elements, so at most one element per buffer in a slice."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.plan import plan
from lightning_zero.plan.model import parse_input

N = 1024
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


@pytest.fixture(autouse=True)
def _no_process_group():
    """The planner refuses to run in a process that holds a process group (it makes its own fake
    one). An earlier test of this pytest process may have left Lightning's: a one-device Trainer
    under a DDP-derived strategy initializes a group of one rank and does not destroy it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _within(value: int, low: float, high: float) -> bool:
    return low <= value <= high


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_gpt2_plan_at_1024_ranks_follows_the_zero_formulas(tmp_path, stage):
    import transformers  # noqa: F401  (the test extra installs it: missing is a failure, not a skip)

    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT2))
    # threshold 0: every parameter sharded under stage 3, so the formula has no persistent term
    p = plan(str(config), N, zero=ZeroConfig(stage=stage, param_persistence_threshold=0), seq_len=16)
    psi, buffers, dev = p.numel, p.flat_buffers, p.memory["device"]
    assert 120e6 < psi < 130e6
    shard_low, shard_high = psi / N, psi / N + buffers  # elements in one rank's slices
    full_low, full_high = psi, psi + N * buffers
    assert _within(dev["master_weights"], 4 * shard_low, 4 * shard_high)
    assert _within(dev["optimizer_states"], 8 * shard_low, 8 * shard_high)  # Adam's two fp32 moments
    if stage == 1:  # the full bucket, kept across micro-steps; the reduced slice is a view of it
        assert _within(dev["gradients"], 2 * full_low, 2 * full_high)
    else:
        assert _within(dev["gradients"], 2 * shard_low, 2 * shard_high)
    if stage < 3:
        assert _within(dev["parameters"], 2 * full_low, 2 * full_high)
    else:
        assert _within(dev["parameters"], 2 * shard_low, 2 * shard_high)
    formula = {1: 4 * psi + 12 * psi / N, 2: 2 * psi + 14 * psi / N, 3: 16 * psi / N}[stage]
    # the terms named apart from the formula: communication buckets (pool blocks) and module buffers
    states = sum(dev.values()) - dev["communication_buckets"] - dev["buffers"]
    assert states == pytest.approx(formula, rel=0.01)
    assert p.memory["host"]["master_weights"] == 0 and p.pinned_host_bytes == 0
    ops = {t.op: t for t in p.step}
    assert ops["reduce_scatter"].count == buffers  # one reduction per flat buffer


def test_parse_input_refuses_a_shape_without_numbers():
    assert parse_input("8,128:int64")[0] == (8, 128)
    with pytest.raises(ValueError, match="give a shape"):
        parse_input("eight:int64")


def test_plan_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="16-mixed"):
        plan("torch.nn:Linear", 2, precision="16-mixed", model_kwargs={"in_features": 3, "out_features": 5})
    with pytest.raises(ValueError, match="example_input_array"):
        plan("torch.nn:Linear", 2, model_kwargs={"in_features": 3, "out_features": 5})
    with pytest.raises(ValueError, match=r"forward failed on meta inputs \[\(\(2, 4\), 'torch.float32'\)\]"):
        plan("torch.nn:Linear", 2, model_kwargs={"in_features": 3, "out_features": 5}, inputs=[((2, 4), torch.float32)])
    with pytest.raises(ValueError, match="cannot import"):
        plan("torch.nn:NoSuchModule", 2)


def test_the_plan_command(capsys):
    from lightning_zero.cli import main

    args = ["plan", "torch.nn:Linear", "--kwargs", '{"in_features": 7, "out_features": 5}', "--world-size", "4"]
    assert main([*args, "--stage", "3", "--param-persistence-threshold", "0", "--input", "3,7"]) == 0
    out = capsys.readouterr().out
    # a 7x5 Linear and its bias: 40 parameters, sharded into one flat buffer reduced once per step
    assert "40 parameters, 4 data-parallel ranks, stage 3" in out and "reduce_scatter" in out
    assert "not modeled:" in out
    assert main([*args[:3], "{not json", *args[4:], "--input", "3,7"]) == 2
    assert "lightning-zero plan: error" in capsys.readouterr().err


def test_offloaded_states_are_host_memory_on_a_gpu_machine(tmp_path):
    """No GPU is needed: the plan places what the engine allocates through lightning_zero.offload.host
    (masters; the host copy of the reduced gradient slice) and the optimizer states beside the masters."""
    import transformers  # noqa: F401  (the test extra installs it: missing is a failure, not a skip)

    from lightning_zero.config import OffloadConfig

    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT2))
    zero = ZeroConfig(stage=2, param_persistence_threshold=0)
    p = plan(str(config), N, zero=zero, offload=OffloadConfig(offload_optimizer=True), seq_len=16)
    psi, buffers = p.numel, p.flat_buffers
    dev, host = p.memory["device"], p.memory["host"]
    assert dev["master_weights"] == dev["optimizer_states"] == 0
    assert _within(host["master_weights"], 4 * psi / N, 4 * (psi / N + buffers))
    assert _within(host["optimizer_states"], 8 * psi / N, 8 * (psi / N + buffers) + 4 * buffers)  # + step counts
    assert _within(dev["parameters"], 2 * psi, 2 * (psi + N * buffers))
    # the kernel's host staging copy of each updated bf16 slice, copied to the device after the step
    assert _within(host["parameters"], 2 * psi / N, 2 * (psi / N + buffers))
    # pinned: the fp32 masters, the bf16 host copies of the gradient slices (the plan's meta tensors
    # keep them out of memory_breakdown's gradients) and the bf16 staging copies
    assert _within(p.pinned_host_bytes, 8 * psi / N, 8 * (psi / N + buffers))
    unpinned = plan(
        str(config), N, zero=zero, offload=OffloadConfig(offload_optimizer=True, pin_memory=False), seq_len=16
    )
    assert unpinned.pinned_host_bytes == 0 and unpinned.memory == p.memory
