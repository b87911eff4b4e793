"""ParallelLayout validation and rank arithmetic, strategy argument checks, plan checks (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.layout import ParallelLayout
from lightning_zero.parallel import apply_tensor_parallel


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ParallelLayout(2, 3, 1).check_world(4), r"dp\(2\) \* tp\(3\) \* pp\(1\) != world_size\(4\)"),
        (lambda: ParallelLayout(2, 2, 2).check_world(4), r"dp\(2\) \* tp\(2\) \* pp\(2\) != world_size\(4\)"),
        (lambda: ParallelLayout.for_world(4, tensor=3), r"tp\(3\) \* pp\(1\) = 3 does not divide world_size\(4\)"),
        (
            lambda: ParallelLayout.for_world(6, tensor=2, pipeline=2),
            r"tp\(2\) \* pp\(2\) = 4 does not divide world_size\(6\)",
        ),
        (lambda: ParallelLayout.for_world(4, tensor=0), r"tensor_parallel_size is 0"),
        (lambda: ParallelLayout(0), r"ParallelLayout.data is 0"),
        (lambda: ParallelLayout(2, tensor=1.5), r"ParallelLayout.tensor is 1.5"),
        (lambda: ParallelLayout(1, 2).coordinates(2), r"global rank 2 is outside this layout's world_size\(2\)"),
    ],
)
def test_invalid_layouts_name_the_numbers(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_megatron_rank_order():
    layout = ParallelLayout.for_world(8, tensor=2, pipeline=2)  # dp = 2
    assert layout.data == 2
    # tensor fastest, then data, then pipeline
    assert [(c.pp, c.dp, c.tp) for c in map(layout.coordinates, range(8))] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]
    assert layout.group_ranks("tp", 5) == [4, 5]
    assert layout.group_ranks("dp", 5) == [5, 7]
    assert layout.group_ranks("pp", 5) == [1, 5]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipeline_parallel_size": 2, "stage": 3}, "pipeline_parallel_size=2 with stage=3 is not supported"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size=0 must be an integer of at least 1"),
        ({"sequence_parallel": True}, "sequence_parallel=True splits the sequence over the tensor-parallel ranks"),
        ({"pipeline_parallel_size": 2, "pipeline_chunks": 2, "pipeline_micro_batches": 3}, "must be a multiple of 2"),
        ({"pipeline_parallel_size": 2, "pipeline_micro_batches": -1}, "pipeline_micro_batches=-1"),
        ({"tensor_parallel_size": 2, "stage": 3}, "tensor_parallel_size=2 with stage=3 is not supported"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size is 0"),
    ],
)
def test_strategy_rejects(kwargs, message):
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.up = nn.Linear(4, 8)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"up": "diagonal"}, r"styles are"),
        ({"model.up": "column"}, r"'model.up' matches no module"),
        ({"embed": "column"}, r"plan asks 'column' for embed, a Embedding"),
    ],
)
def test_plan_errors_before_any_communication(plan, message):
    with pytest.raises(ValueError, match=message):
        apply_tensor_parallel(_Net(), plan, None)


@pytest.mark.parametrize(
    "plan",
    [{"head": "column"}, {"embed": "vocab"}, {"embed": "vocab", "head": "row"}],
)
def test_tied_weights_split_one_way_only_are_refused(monkeypatch, plan):
    from lightning_zero import comm

    # Pretend to be rank 0 of 2 (the tie check runs before any split).
    monkeypatch.setattr(comm, "world_size", lambda group: 2)
    monkeypatch.setattr(comm, "rank", lambda group: 0)
    with pytest.raises(ValueError, match=r"embed.weight .*, head.weight .* are one Parameter \(tied weights\)"):
        apply_tensor_parallel(_Net(), plan, None)


def test_tied_embedding_and_head_split_by_vocabulary_stay_one_parameter(monkeypatch):
    from lightning_zero import comm

    monkeypatch.setattr(comm, "world_size", lambda group: 2)
    monkeypatch.setattr(comm, "rank", lambda group: 1)
    net = _Net()
    rows = net.embed.weight.detach()[3:].clone()  # rank 1 of 2: vocabulary ids 3..5
    assert apply_tensor_parallel(net, {"embed": "vocab", "head": "column", "up": "column"}, None) == [
        "embed",
        "up",
        "head",
    ]
    assert net.head.weight is net.embed.weight  # the tie is kept: one shard Parameter
    assert torch.equal(net.embed.weight, rows) and net.embed.vocab_start == 3
    assert net.embed.weight.tensor_parallel and net.embed.weight.partition_dim == 0
    assert len(list(net.parameters())) == 3  # the shared shard, up.weight, up.bias
    net = _Net()
    rows = net.up.weight.detach()[4:].clone()
    assert apply_tensor_parallel(net, {"up": "column"}, None) == ["up"]  # the tied pair stays whole
    assert torch.equal(net.up.weight, rows)  # rank 1 keeps the second half of the output features
    assert net.up.weight.shape == (4, 4) and net.up.weight.tensor_parallel and net.up.weight.partition_dim == 0
    assert net.up.bias.shape == (4,) and net.up.bias.tensor_parallel
    assert net.head.weight is net.embed.weight and net.embed.weight.shape == (6, 4)


def test_gpt2_recipe_plan_matches_its_modules():
    from recipes.gpt2.model import GPTConfig
    from recipes.gpt2.module import GPT2LM

    module = GPT2LM(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32))
    module.configure_model()
    # A one-rank group changes nothing but still checks every pattern against the module names.
    assert apply_tensor_parallel(module, module.tensor_parallel_plan(), None) == []


@pytest.mark.parametrize("nsp", [False, True])
def test_bert_recipe_plan_matches_its_modules(nsp):
    from recipes.bert.model import BertConfig
    from recipes.bert.module import BertMLM

    module = BertMLM(
        BertConfig(vocab_size=64, max_position=8, n_layer=2, n_head=2, hidden=32, intermediate=48, nsp=nsp)
    )
    module.configure_model()
    assert apply_tensor_parallel(module, module.tensor_parallel_plan(), None) == []
