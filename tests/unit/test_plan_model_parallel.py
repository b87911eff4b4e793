"""The plan with tensor and pipeline parallelism at 1,024 ranks, and what it refuses.

GPT-2 small's widths (recipes' GPT: 8 blocks, 768 wide, vocabulary 50,304, tied embedding and LM head)
at D=64 x T=4 x P=4, stage 1: every stage's rank holds its share of the parameters (the TP split
divides the blocks' matrices by T, the pipeline keeps a stage's layers), its ZeRO states follow the
formulas' 1/D terms of that share, and its pipeline messages are what the schedule sends: per
micro-batch one activation forward and one gradient back across each stage boundary, each a header
and one tensor. Checked against real runs on 4 ranks in tests/distributed/test_plan_model_parallel.py."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig
from lightning_zero.plan import plan
from lightning_zero.plan.machine import known

MODEL = "tests.helpers.plan_models:PlannedGPT"
GPT2 = {"n_layer": 8, "vocab_size": 50304, "n_embd": 768, "n_head": 12, "seq": 64}
N, T, P, M = 1024, 4, 4, 4


@pytest.fixture(autouse=True)
def _no_process_group():
    """The planner makes its own fake process group; an earlier test may have left Lightning's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _gpt2():
    return plan(
        MODEL,
        N,
        model_kwargs=GPT2,
        zero=ZeroConfig(stage=1),
        inputs=[((16, 65), torch.int64)],  # one replica's batch: 16 rows of 64 tokens + the shifted label
        tensor=TensorParallelConfig(size=T),
        pipeline=PipelineConfig(stages=P, micro_batches=M),
    )


@pytest.fixture(scope="module")
def gpt2_plan():
    """One plan for the tests below (and its CPU seconds)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    start = time.process_time()
    p = _gpt2()
    return p, time.process_time() - start


def test_a_gpt2_plan_with_tensor_and_pipeline_parallelism_at_1024_ranks(gpt2_plan):
    p, seconds = gpt2_plan
    info = p.parallel
    assert (info.data, info.tensor, info.pipeline) == (N // (T * P), T, P)
    stages = {q.parallel.stage: q for q in info.stages}
    assert sorted(stages) == [0, 1, 3], "the two middle stages hold equal blocks: planned once"
    assert stages[1].parallel.represents == (1, 2)
    assert stages[0].parallel.group_sizes == {"data": 64, "tensor": T, "pipeline": P, "tied": 2}
    assert stages[1].parallel.group_sizes == {"data": 64, "tensor": T, "pipeline": P}
    d = info.data
    for s, q in stages.items():
        local = q.parallel.local_numel  # after the TP split: this rank's share of the stage
        dev = q.memory["device"]
        # bf16-mixed Adam at stage 1 over D ranks; the padding of each flat buffer to a multiple of D
        # is the only slack (at most one element per buffer in a slice)
        assert 4 * local / d <= dev["master_weights"] <= 4 * (local / d + q.flat_buffers)
        assert 8 * local / d <= dev["optimizer_states"] <= 8 * (local / d + q.flat_buffers)
        assert 2 * local <= dev["parameters"] <= 2 * (local + d * q.flat_buffers)
        # the blocks' matrices are split by T: well under a quarter of the whole model per stage
        assert local < p.numel / P
        calls = {(t.group, t.op): t.count for t in q.step}
        boundaries = (s > 0) + (s < P - 1)  # stage boundaries this stage sends and receives across
        # per micro-batch and boundary one message each way, each a header and one tensor
        assert calls[("pipeline", "send")] == calls[("pipeline", "recv")] == 2 * M * boundaries
        assert calls[("tensor", "all_reduce")] > 0 and ("data", "reduce_scatter") in calls
        assert q.parallel.in_flight == min(P - s, M)  # 1F1B: P - s micro-batches alive on stage s
    # the tied embedding/head: one all-reduce of its gradient between the first and last stage
    assert ("tied", "all_reduce") in {(t.group, t.op) for t in stages[0].step}
    assert ("tied", "all_reduce") not in {(t.group, t.op) for t in stages[1].step}
    assert seconds < 120, seconds  # a few seconds on a quiet machine: a bound that only catches a hang


def test_the_step_time_replays_the_schedule_across_the_stages(gpt2_plan):
    p, _ = gpt2_plan
    machine = known("H100", "ib-ndr400")
    t = p.step_time(machine)
    # each stage's plan alone: its own step with its own waits (a one-stage replay has no one to wait for)
    alone = {q.parallel.stage: q.step_time(machine) for q in p.parallel.stages}
    busy = max(a.seconds - a.bubble for a in alone.values())
    assert t.stage in alone and t.bubble > 0 and t.seconds == pytest.approx(busy + t.bubble, rel=0.05)
    # the equal-time bound: (P - 1) / m of the busiest stage's work idle at most
    assert t.bubble <= busy * (P - 1) / M
    assert 0 < t.exposed_communication <= t.communication
    assert t.seconds < p.step_time(known("H100", "ethernet-100g")).seconds  # a slower network, a slower step


@pytest.mark.parametrize(("name", "chunks"), [("1f1b", 1), ("gpipe", 1), ("1f1b", 2), ("gpipe", 2)])
def test_the_schedule_replay_gives_the_textbook_bubble_with_equal_times(name, chunks):
    from lightning_zero.parallel.schedules import schedule
    from lightning_zero.plan.pipeline_time import simulate

    stages, m = 4, 8
    f, b = 1.0 / chunks, 2.0 / chunks  # one micro-batch through one chunk: a stage's work split v ways
    durations = [
        {(a.kind, a.micro_batch, a.chunk): f if a.kind == "F" else b for a in schedule(name, s, stages, m, chunks)}
        for s in range(stages)
    ]
    ends = simulate(durations, [0.5] * stages, name, m, chunks)
    # (v m + P - 1) (f + b): the idle fraction (P - 1) / (v m + P - 1) of bubble_fraction, then the tail
    assert max(ends) == pytest.approx((chunks * m + stages - 1) * (f + b) + 0.5)
    # one stage twice as slow: between m times its work and the equal-time bound at its pace
    durations[2] = {a: 2 * d for a, d in durations[2].items()}
    slow = max(simulate(durations, [0.0] * stages, name, m, chunks))
    assert chunks * m * 2 * (f + b) <= slow <= (chunks * m + stages - 1) * 2 * (f + b)


def test_refusals():
    with pytest.raises(ValueError, match="stage=3 is not supported"):
        plan(MODEL, 4, zero=ZeroConfig(stage=3), tensor=TensorParallelConfig(size=2), inputs=[((2, 16), torch.int64)])
    with pytest.raises(ValueError, match="does not divide world_size"):
        plan(MODEL, 6, tensor=TensorParallelConfig(size=4), inputs=[((2, 16), torch.int64)])
    with pytest.raises(ValueError, match="needs a plan"):
        plan(
            "torch.nn:Linear",
            4,
            model_kwargs={"in_features": 4, "out_features": 4},
            tensor=TensorParallelConfig(size=2),
            inputs=[((2, 4), torch.float32)],
        )
    with pytest.raises(ValueError, match="configure_pipeline"):
        plan(
            "torch.nn:Linear",
            4,
            model_kwargs={"in_features": 4, "out_features": 4},
            pipeline=PipelineConfig(stages=2),
            inputs=[((2, 4), torch.float32)],
        )
    with pytest.raises(ValueError, match="exceed"):
        plan(MODEL, 8, pipeline=PipelineConfig(stages=8), inputs=[((8, 17), torch.int64)])
    with pytest.raises(ValueError, match="batch_keys"):
        plan(MODEL, 4, tensor=TensorParallelConfig(size=2), batch_keys=("input_ids",), inputs=[((2, 16), torch.int64)])


def test_the_command_plans_and_searches_tensor_and_pipeline_sizes(capsys):
    from lightning_zero.cli import main

    args = ["plan", MODEL, "--world-size", "8", "--stage", "1", "--input", "8,17:int64", "--machine", "H100"]
    parallel = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--pipeline-micro-batches", "4"]
    assert main([*args, *parallel]) == 0
    out = capsys.readouterr().out
    assert "8 ranks = data 2 x tensor 2 x pipeline 2" in out and "the pipeline's bubble" in out
    for group, op in (("tensor", "all_reduce"), ("pipeline", "send"), ("pipeline", "recv"), ("tied", "all_reduce")):
        assert any(line.split()[:2] == [group, op] for line in out.splitlines()), (group, op, out)
    # T=8 cannot split 4 heads: reported, the other sizes searched
    search = ["--search", "--tensor-sizes", "1,8", "--pipeline-sizes", "1,2", "--micro-batches", "8"]
    assert main([*args[:4], "--input", "8,17:int64", "--machine", "H100", *search]) == 0
    out = capsys.readouterr().out
    assert "tp=1 pp=2 stage=1" in out and "not planned: tp=8 pp=1" in out
    assert "tp=8 pp=2" not in out  # 16 ranks do not divide 8: not tried
    assert "stage=3" in out.split("tp=1 pp=2")[0] and "tp=1 pp=2 stage=3" not in out  # refused beside a pipeline
    assert main([*args, "--tensor-parallel-size", "2", "--stage", "3"]) == 2  # the strategy's refusal
    assert "stage=3 is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "send", "recv", "broadcast"])
@pytest.mark.parametrize("size", [2, 4, 64])
def test_each_call_is_costed_on_its_own_group_size(op, size):
    from lightning_zero.plan.machine import Link
    from lightning_zero.plan.pipeline_time import group_bytes

    link = Link(latency=1e-5, bandwidth=1e9)
    nbytes = 3 * 2**20
    # the replay runs every call as on 2 ranks: the stand-in bytes give the group's own ring cost
    assert link.seconds(op, group_bytes(op, nbytes, size), 2) == pytest.approx(link.seconds(op, nbytes, size))


def test_a_hugging_face_llama_split_by_a_plan_given_to_the_plan(tmp_path):
    import json

    import transformers  # noqa: F401  (the test extra installs it: missing is a failure, not a skip)

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 64}
        )
    )  # fmt: skip
    tp_plan = {
        "model.layers.*.self_attn.[qkv]_proj": "column",
        "model.layers.*.self_attn.o_proj": "row",
        "model.layers.*.mlp.gate_proj": "column",
        "model.layers.*.mlp.up_proj": "column",
        "model.layers.*.mlp.down_proj": "row",
        "lm_head": "column",
    }
    p = plan(str(config), N, zero=ZeroConfig(stage=2), tensor=TensorParallelConfig(size=2, plan=tp_plan), seq_len=16)
    calls = {(t.group, t.op): t.count for t in p.step}
    # Megatron's arithmetic per layer: forward one all-reduce after each row-parallel layer (2), backward
    # one for the input of each column-parallel layer (q, k, v, gate, up: 5); the LM head's input once in
    # backward, and the vocabulary-parallel cross entropy's three in forward
    assert calls[("tensor", "all_reduce")] == 2 * (2 + 5) + 1 + 3
    assert p.parallel.data == N // 2 and p.parallel.local_numel < p.numel
