"""Pipeline parallelism without communication: schedules, stage balancing, the split, micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.config import PipelineConfig
from lightning_zero.parallel.pipeline import (
    PipelineSpec,
    RemoteLayer,
    balance,
    layer_weights,
    plan_stages,
    resolve_spec,
    split_stages,
)
from lightning_zero.parallel.runner import split_batch
from lightning_zero.parallel.schedules import (
    Action,
    bubble_fraction,
    forward_only,
    gpipe,
    max_in_flight,
    one_f_one_b,
    schedule,
    simulate,
)


def _names(actions):
    return [repr(a) for a in actions]


# -- schedules ---------------------------------------------------------------------------------


def test_1f1b_order_for_four_stages():
    # P=4, m=6: stage s warms up with P-1-s forwards, alternates, then cools down.
    assert _names(one_f_one_b(0, 4, 6)) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert _names(one_f_one_b(2, 4, 6)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "B5"]
    assert _names(one_f_one_b(3, 4, 6)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 8), (5, 3)])
def test_1f1b_runs_each_micro_batch_once_and_bounds_activations(stages, micro_batches):
    for stage in range(stages):
        actions = one_f_one_b(stage, stages, micro_batches)
        forwards = [a.micro_batch for a in actions if a.kind == "F"]
        backwards = [a.micro_batch for a in actions if a.kind == "B"]
        assert forwards == backwards == list(range(micro_batches))
        # every backward after its own forward
        assert all(actions.index(a) > _names(actions).index(f"F{a.micro_batch}") for a in actions if a.kind == "B")
        # 1F1B's point: at most P - s micro-batches alive, whatever m is; GPipe keeps all m
        assert max_in_flight(actions) == min(stages - stage, micro_batches)
        assert max_in_flight(gpipe(stage, stages, micro_batches)) == micro_batches


def test_interleaved_order_for_two_stages_two_chunks():
    # Megatron-LM's interleaved 1F1B: groups of P micro-batches through chunk 0, then chunk 1;
    # backwards start with the last chunk. Stage 0 warms up with 2 (P-1) + (v-1) P = 4 forwards.
    assert _names(one_f_one_b(0, 2, 4, 2)) == [
        "F0",
        "F1",
        "F0.1",
        "F1.1",
        "F2",
        "B0.1",
        "F3",
        "B1.1",
        "F2.1",
        "B0",
        "F3.1",
        "B1",
        "B2.1",
        "B3.1",
        "B2",
        "B3",
    ]
    assert _names(one_f_one_b(1, 2, 4, 2)) == [
        "F0",
        "F1",
        "F0.1",
        "B0.1",
        "F1.1",
        "B1.1",
        "F2",
        "B0",
        "F3",
        "B1",
        "F2.1",
        "B2.1",
        "F3.1",
        "B3.1",
        "B2",
        "B3",
    ]
    # a micro-batch passes every stage v times: the bubble shrinks by v
    assert bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 6, 8, 12])
def test_every_schedule_runs_to_the_end_with_matching_messages(stages, chunks, micro_batches):
    # simulate() plays all stages against each other as the runner does (sends never wait, receives
    # wait, one FIFO per kind and pair) and fails on a deadlock or on a mismatched message.
    if chunks > 1 and micro_batches % stages:
        with pytest.raises(ValueError, match="groups of the"):
            one_f_one_b(0, stages, micro_batches, chunks)
        # what the runner falls back to for such a (short) batch
        simulate([gpipe(s, stages, micro_batches, chunks) for s in range(stages)], chunks)
        simulate([forward_only(s, stages, micro_batches, chunks) for s in range(stages)], chunks)
        return
    for name in ("1f1b", "gpipe"):
        actions = [schedule(name, s, stages, micro_batches, chunks) for s in range(stages)]
        for stage_actions in actions:  # every (micro-batch, chunk) forwarded and backwarded once
            assert sorted(_names(stage_actions)) == sorted(
                _names([Action(k, i, c) for k in "FB" for i in range(micro_batches) for c in range(chunks)])
            )
        simulate(actions, chunks)
    simulate([forward_only(s, stages, micro_batches, chunks) for s in range(stages)], chunks)


def test_simulate_catches_deadlocks_and_mixed_up_messages():
    # stage 0 waits for B0's gradient before sending F0's activation: nobody can move
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]])
    # stage 1 takes micro-batch 1 first: it would compute on micro-batch 0's activation
    bad = [one_f_one_b(0, 2, 2), [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    with pytest.raises(RuntimeError, match=r"would receive \(0, 0\) instead of \(1, 0\)"):
        simulate(bad)


def test_schedule_names_and_bad_arguments():
    assert schedule("gpipe", 0, 2, 2) == gpipe(0, 2, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'interleaved'"):
        schedule("interleaved", 0, 2, 2)
    with pytest.raises(ValueError, match="stage 2 is outside a pipeline of 2 stages"):
        one_f_one_b(2, 2, 4)
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        one_f_one_b(0, 2, 0)


def test_bubble_fraction_formula():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)


# -- balance ------------------------------------------------------------------------------------


def test_balance_minimizes_the_largest_stage():
    assert balance([(5,), (1,), (1,), (1,), (5,)], 2) == [0, 2, 5]  # 6 | 7
    assert balance([(5,), (1,), (1,), (1,), (5,)], 3) == [0, 1, 4, 5]  # 5 | 3 | 5
    bounds = balance([(1,)] * 7, 3)
    assert max(b - a for a, b in zip(bounds, bounds[1:], strict=False)) == 3 and len(bounds) == 4
    assert balance([(0,), (0,), (9,)], 3) == [0, 1, 2, 3]  # every stage non-empty
    # the embedding and the head fix the largest stage; the blocks between still split evenly
    # (GPT-2 cpu-tiny on 4 stages: [embed] [h0 h1] [h2 h3] [head], not [embed] [h0] [h1 h2 h3] [head])
    assert balance([(10,), (1,), (1,), (1,), (1,), (10,)], 4) == [0, 1, 3, 5, 6]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 non-empty stages"):
        balance([(1,), (1,)], 3)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(x)


class _Model(nn.Module):
    """embed -> 4 blocks -> head, head tied to the embedding; 9 inputs, width 6 (odd sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.blocks = nn.ModuleList(_Block(6) for _ in range(4))
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.embed.weight

    def layers(self):
        return [self.embed, *self.blocks, self.head]


def test_layer_weights_by_type_and_uniform():
    layers = _Model().layers()
    assert [w[0] for w in layer_weights(layers, "type:_Block")] == [0, 1, 1, 1, 1, 0]
    assert [w[0] for w in layer_weights(layers, "uniform")] == [1] * 6
    assert [w[0] for w in layer_weights(layers, "parameters")] == [54, 42, 42, 42, 42, 54]
    with pytest.raises(ValueError, match=r"matches none of the layer classes \['Embedding', 'Linear', '_Block'\]"):
        layer_weights(layers, "type:Attention")
    # by type: two blocks per stage; the parameter counts then split embed/head evenly
    assert balance(layer_weights(layers, "type:_Block"), 2) == [0, 3, 6]


# -- plan and split -----------------------------------------------------------------------------


def test_plan_finds_the_tie_and_split_keeps_only_the_stage():
    model = _Model()
    spec = PipelineSpec(layers=model.layers(), loss=lambda out, batch: out.sum())
    plans = [plan_stages(model, spec, 2, s, "parameters") for s in range(2)]
    assert plans[0].bounds == plans[1].bounds == [0, 3, 6]
    assert plans[0].layer_names == ["embed", "blocks.0", "blocks.1"]
    assert [t.names for t in plans[1].tied] == [{0: "embed.weight", 1: "head.weight"}]
    split_stages(model, spec, plans[1])
    assert sorted(n for n, _ in model.named_parameters()) == [
        "blocks.2.fc.bias",
        "blocks.2.fc.weight",
        "blocks.3.fc.bias",
        "blocks.3.fc.weight",
        "head.weight",
    ]
    assert isinstance(model.embed, RemoteLayer) and isinstance(model.blocks[0], RemoteLayer)
    with pytest.raises(RuntimeError, match="embed runs on pipeline stage 0, not on this rank \\(stage 1\\)"):
        model.embed(torch.zeros(1, dtype=torch.long))


def test_plan_rejects_parameters_outside_the_layers_and_foreign_layers():
    model = _Model()
    model.extra = nn.Linear(2, 2)
    spec = PipelineSpec(layers=model.layers(), loss=lambda out, batch: out.sum())
    with pytest.raises(
        ValueError, match=r"trainable parameters \['extra.weight', 'extra.bias'\] belong to no pipeline layer"
    ):
        plan_stages(model, spec, 2, 0, "parameters")
    foreign = PipelineSpec(layers=[*_Model().layers()], loss=lambda out, batch: out.sum())
    with pytest.raises(ValueError, match=r"pipeline layers \[0, 1, 2, 3, 4, 5\] are not submodules"):
        plan_stages(_Model(), foreign, 2, 0, "parameters")


def test_resolve_spec_checks_the_hook_and_the_stage_count():
    class NoHook(nn.Module):
        pass

    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 needs NoHook.configure_pipeline\(\)"):
        resolve_spec(NoHook(), 2)

    class Hooked(_Model):
        def configure_pipeline(self):
            return PipelineSpec(layers=self.layers(), loss=lambda out, batch: out.sum())

    assert len(resolve_spec(Hooked(), 6).layers) == 6
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=7 x pipeline_chunks=1 = 7 virtual stages exceed the model's 6"
    ):
        resolve_spec(Hooked(), 7)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 x pipeline_chunks=4 = 8 virtual stages"):
        resolve_spec(Hooked(), 2, chunks=4)
    with pytest.raises(ValueError, match="lists the same module twice"):
        m = _Model()
        PipelineSpec(layers=[m.embed, m.embed], loss=lambda out, batch: out.sum())


def test_chunks_are_dealt_round_robin():
    model = _Model()
    spec = PipelineSpec(layers=model.layers(), loss=lambda out, batch: out.sum())
    plan = plan_stages(model, spec, 2, 0, "uniform", chunks=2)  # 6 layers, 4 virtual stages
    # at most 2 layers per virtual stage; among those splits the largest parameter count is smallest
    assert plan.bounds == [0, 1, 3, 5, 6]
    assert [[type(layer).__name__ for layer in chunk] for chunk in plan.chunks] == [["Embedding"], ["_Block", "_Block"]]
    # the embedding (virtual stage 0) and the head (virtual stage 3) sit on stages 0 and 1
    assert [t.names for t in plan.tied] == [{0: "embed.weight", 1: "head.weight"}]
    split_stages(model, spec, plan)
    kept = [
        n
        for n in ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")
        if not isinstance(model.get_submodule(n), RemoteLayer)
    ]
    assert kept == plan.layer_names


def test_pipeline_config_validation():
    assert PipelineConfig(stages=4).num_micro_batches == 4
    assert PipelineConfig(stages=4, micro_batches=16).num_micro_batches == 16
    with pytest.raises(ValueError, match="pipeline_micro_batches=0 must be a positive integer"):
        PipelineConfig(stages=2, micro_batches=0)
    with pytest.raises(ValueError, match="pipeline_schedule='zb'"):
        PipelineConfig(stages=2, schedule="zb")
    with pytest.raises(ValueError, match="pipeline_partition='balanced'"):
        PipelineConfig(stages=2, partition="balanced")
    with pytest.raises(ValueError, match="pipeline_chunks=2 interleaves the chunks of a pipeline"):
        PipelineConfig(stages=1, chunks=2)
    with pytest.raises(ValueError, match="pipeline_micro_batches=3 must be a multiple of 2"):
        PipelineConfig(stages=2, chunks=2, micro_batches=3)


# -- micro-batches ------------------------------------------------------------------------------


def test_split_batch_cuts_every_tensor_along_dim_0():
    batch = {"input_ids": torch.arange(12).view(6, 2), "labels": [torch.arange(6)], "name": "x"}
    pieces, weights = split_batch(batch, 3)
    assert [p["input_ids"].tolist() for p in pieces] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert [p["labels"][0].tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["name"] == "x" for p in pieces) and weights == [1 / 3] * 3
    # a short last batch: sizes differ by at most one, weights are the shares of the rows
    pieces, weights = split_batch(batch, 4)
    assert [len(p["labels"][0]) for p in pieces] == [1, 2, 1, 2] and weights == [1 / 6, 2 / 6, 1 / 6, 2 / 6]
    pieces, weights = split_batch(torch.arange(2), 4)  # fewer rows than micro-batches
    assert [p.tolist() for p in pieces] == [[0], [1]] and weights == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"their sizes there are \[5, 6\]"):
        split_batch({"a": torch.zeros(6), "b": torch.zeros(5)}, 2)
