"""The engine's surface in one process (no process group: every collective is the identity), on odd
shapes: a step through ``ZeroEngine.step`` against torch's own AdamW, the gradient-state machine of a
flat buffer, a save/load round trip through ``local_pieces``/``load_pieces``, and the checks of the
composed config. The multi-rank parity of the same paths is in tests/distributed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.config import OffloadConfig, PipelineConfig, StrategyConfig, TensorParallelConfig, ZeroConfig
from lightning_zero.zero.build import BuildContext
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.flat import GradState
from lightning_zero.zero.surface import OptimizerPiece

CPU = torch.device("cpu")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(15, 7), nn.Tanh(), nn.Linear(7, 3))


def _engine(model: nn.Module, stage: int) -> tuple[torch.optim.Optimizer, ZeroEngine]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # Small buckets and threshold 0: several flat buffers, and under stage 3 every parameter sharded.
    zero = ZeroConfig(stage=stage, reduce_bucket_size=50, param_persistence_threshold=0)
    engine = ZeroEngine(model, [optimizer], config=StrategyConfig(zero=zero), precision="32-true", device=CPU)
    return optimizer, engine


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, engine: ZeroEngine | None, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        for _ in range(2):  # two micro-batches: gradients accumulate before the step
            model(torch.randn(5, 15)).square().mean().backward()
            if engine is not None:
                engine.backward_done()
        if engine is None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.step(optimizer)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_step_matches_torch(stage):
    reference = _model(0)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    _train(reference, ref_optimizer, None, steps=3)

    model = _model(0)
    optimizer, engine = _engine(model, stage)
    _train(model, optimizer, engine, steps=3)
    engine.close()
    # fp32 throughout; on CPU the engine may step with the compiled Adam kernel, whose operation
    # order differs from torch's: a few ulps per step, well under 1e-5 after 3 steps.
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_grad_state_transitions():
    params = [nn.Parameter(torch.randn(7, 15)), nn.Parameter(torch.randn(5))]
    ctx = BuildContext(
        config=ZeroConfig(), offload=OffloadConfig(), dtype=torch.float32, separate_master=False, group=None, device=CPU
    )
    buffer = ctx.buffer(params, 0, persistent=True)
    assert buffer.grad_state is GradState.EMPTY

    def new_bucket() -> torch.Tensor:
        return torch.zeros(buffer.layout.padded_numel)

    grads = [torch.randn(7, 15), torch.randn(5)]
    for index, grad in enumerate(grads):
        buffer.receive(index, grad, new_bucket)
    assert buffer.grad_state is GradState.COLLECTING and buffer.complete
    bucket, out = buffer.start_reduce(new_bucket)
    assert out is buffer.grad_shard  # nothing reduced yet: received straight into the slice
    out.copy_(bucket)  # one rank: the reduce-scatter is a copy
    assert buffer.finish_reduce(out, 1, to_host=True) is bucket  # returned for the pool
    assert buffer.grad_state is GradState.REDUCED  # no host copy: not offloaded
    buffer.end_backward()

    for index, grad in enumerate(grads):  # the next backward adds on top
        buffer.receive(index, grad, new_bucket)
    assert buffer.grad_state is GradState.ACCUMULATING
    bucket, out = buffer.start_reduce(new_bucket)
    assert out is not buffer.grad_shard and buffer.grad_state is GradState.REDUCING
    out.copy_(bucket)
    buffer.finish_reduce(out, 1, to_host=True)
    expected = torch.cat([g.reshape(-1) for g in grads]) * 2
    torch.testing.assert_close(buffer.grad_for_step(), expected, rtol=0, atol=0)

    buffer.drop_grads()
    assert buffer.grad_state is GradState.EMPTY and not buffer.grad_shard.any()


@pytest.mark.parametrize("stage", [2, 3])
def test_local_pieces_load_back(stage):
    source = _model(0)
    optimizer, engine = _engine(source, stage)
    _train(source, optimizer, engine, steps=2)
    held, pieces = engine.held_params(), engine.local_pieces()
    assert all(h.local is not None for h in held)  # one rank holds every piece
    names = {id(p): n for n, p in source.named_parameters()}
    by_name = {names[id(h.param)]: piece for h, piece in zip(held, pieces, strict=True)}

    target = _model(5)  # other weights and no optimizer state
    target_optimizer, target_engine = _engine(target, stage)
    target_names = {id(p): n for n, p in target.named_parameters()}
    target_engine.load_pieces(lambda h, offset, numel: by_name[target_names[id(h.param)]].master[:numel])
    groups = [{**g.hyper, "params": []} for g in engine.param_groups(optimizer)]

    def read(h, offset, numel):
        state = by_name[target_names[id(h.param)]].states[0]
        return OptimizerPiece(slices=state.slices, scalars=state.scalars)

    target_engine.load_optimizer_pieces(target_optimizer, groups, read)
    target_engine.publish()
    assert len(held) == len(target_engine.held_params())
    for h, piece in zip(target_engine.held_params(), target_engine.local_pieces(), strict=True):
        original = by_name[target_names[id(h.param)]]
        # Copies of the same fp32 values: exact.
        torch.testing.assert_close(piece.master, original.master, rtol=0, atol=0)
        assert set(piece.states) == set(original.states) == {0}  # one optimizer holds every parameter
        for key, value in original.states[0].slices.items():
            torch.testing.assert_close(piece.states[0].slices[key], value, rtol=0, atol=0)
    engine.close()
    target_engine.close()
    for (name, p), q in zip(target.named_parameters(), source.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_pieces_load_in_place_and_zero_the_rest(stage):
    """A load into an optimizer that already has states (a resume during or after fit) writes into
    its tensors (no new allocation), and every element no piece covers (a parameter the checkpoint
    lacks, the shard's padding) is zero, as in a zero-filled state: the target's states are filled
    with NaN first, so a missed element shows."""
    source = _model(0)
    optimizer, engine = _engine(source, stage)
    _train(source, optimizer, engine, steps=2)
    names = {id(p): n for n, p in source.named_parameters()}
    by_name = {names[id(h.param)]: piece for h, piece in zip(engine.held_params(), engine.local_pieces(), strict=True)}

    target = _model(5)
    target_optimizer, target_engine = _engine(target, stage)
    _train(target, target_optimizer, target_engine, steps=1)  # its own states exist now
    before = {}
    for param, state in target_optimizer.state.items():  # keyed by the engine's master slices
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 1:
                value.fill_(float("nan"))
                before[(id(param), key)] = value.data_ptr()
    assert before
    target_names = {id(p): n for n, p in target.named_parameters()}
    groups = [{**g.hyper, "params": []} for g in engine.param_groups(optimizer)]

    skipped = "2.weight"  # not in the checkpoint (strict=False): its states read back as zero

    def read(h, offset, numel):
        if target_names[id(h.param)] == skipped:
            return None
        state = by_name[target_names[id(h.param)]].states[0]
        return OptimizerPiece(slices=state.slices, scalars=state.scalars)

    target_engine.load_optimizer_pieces(target_optimizer, groups, read)
    after = {(id(state), key): value for state in target_optimizer.state.values() for key, value in state.items()}
    assert all(after[k].data_ptr() == ptr for k, ptr in before.items() if k in after)  # written in place
    for value in after.values():
        if torch.is_tensor(value) and value.dim() == 1:
            assert not value.isnan().any()  # every element written: a piece, or zero (padding)
    for h, piece in zip(target_engine.held_params(), target_engine.local_pieces(), strict=True):
        for key, value in by_name[target_names[id(h.param)]].states[0].slices.items():
            expected = torch.zeros_like(value) if target_names[id(h.param)] == skipped else value
            torch.testing.assert_close(piece.states[0].slices[key], expected, rtol=0, atol=0)  # copies: exact
    engine.close()
    target_engine.close()


@pytest.mark.parametrize(
    "sections,match",
    [
        (
            {"zero": ZeroConfig(stage=2), "offload": OffloadConfig(offload_optimizer=True, offload_parameters=True)},
            r"needs stage=3 \(got stage=2\)",
        ),
        ({"zero": ZeroConfig(stage=3), "tensor": TensorParallelConfig(size=2)}, "tensor_parallel_size=2 with stage=3"),
        ({"zero": ZeroConfig(stage=3), "pipeline": PipelineConfig(stages=4)}, "pipeline_parallel_size=4 with stage=3"),
    ],
)
def test_strategy_config_checks_across_sections(sections, match):
    # Each section alone was valid (built in the parameter list above): the check is the composed config's.
    with pytest.raises(ValueError, match=match):
        StrategyConfig(**sections)


def _shared_run(stage: int | None) -> nn.Module:
    """The last layer in two optimizers (AdamW over the whole model, SGD with momentum and weight
    decay over the last layer), stepped in the orders manual optimization allows; through the engine
    at ``stage`` or, with None, plain torch (one ``param.grad`` that both optimizers read)."""
    model = _model(0)
    first = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=5e-2, momentum=0.9, weight_decay=0.01)
    engine = None
    if stage is not None:
        zero = ZeroConfig(stage=stage, reduce_bucket_size=50, param_persistence_threshold=0)
        engine = ZeroEngine(model, [first, second], config=StrategyConfig(zero=zero), precision="32-true", device=CPU)
    torch.manual_seed(1)

    def backward(through_last: bool = True) -> None:
        hidden = model[1](model[0](torch.randn(5, 15)))
        loss = model[2](hidden).square().mean() if through_last else hidden.square().mean()
        loss.backward()
        if engine is not None:
            engine.backward_done()

    def step(optimizer: torch.optim.Optimizer) -> None:
        optimizer.step() if engine is None else engine.step(optimizer)

    for _ in range(2):
        # one backward, both step on the same gradient of the shared layer
        first.zero_grad(), second.zero_grad()
        backward(), step(first), step(second)
        # the second's window brings no gradient to the shared layer: it is skipped (no decay, no momentum)
        first.zero_grad(), backward(), step(first)
        second.zero_grad(), backward(through_last=False), step(second)
        # no zero_grad between: the second steps on both backwards' sum, as DDP's param.grad holds it
        first.zero_grad(), backward(), step(first), backward(), step(second)
    if engine is not None:
        engine.close()
    return model


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_in_two_optimizers_trains_as_torch(stage):
    reference, model = _shared_run(None), _shared_run(stage)
    # fp32 on one process: the compiled Adam kernel's operation order differs from torch's by a few
    # ulps per step (as in test_engine_step_matches_torch); 1e-5 after 12 steps of the two optimizers.
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def _finetune(engine_stage: int | None, threshold: int = 0) -> nn.Module:
    """Two steps with the last layer frozen, then (as BackboneFinetuning does) unfreeze it and
    add_param_group with its own lr, two more steps; through the engine at ``engine_stage`` or, with
    None, plain torch. Stage 3: frozen parameters above ``threshold`` elements are sharded."""
    model = _model(0)
    model[2].requires_grad_(False)
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-2, weight_decay=0.1)
    engine = None
    if engine_stage is not None:
        zero = ZeroConfig(stage=engine_stage, reduce_bucket_size=50, param_persistence_threshold=threshold)
        engine = ZeroEngine(model, [optimizer], config=StrategyConfig(zero=zero), precision="32-true", device=CPU)
    _train(model, optimizer, engine, steps=2)
    model[2].requires_grad_(True)
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.0})
    if engine is not None:
        engine.add_param_groups()  # what the strategy does before the next batch
    _train(model, optimizer, engine, steps=2)
    if engine is not None:
        engine.close()
    return model


# stage 3: threshold 0 shards the added layer's weight and bias (its frozen buffer becomes trainable
# in place); 5 keeps its 3-element bias whole (a persistent bucket is built for it)
@pytest.mark.parametrize(("stage", "threshold"), [(1, 0), (2, 0), (3, 0), (3, 5)])
def test_add_param_group_during_fit_trains_as_torch(stage, threshold):
    reference, model = _finetune(None), _finetune(stage, threshold)
    # fp32 on one process: the compiled Adam kernel's operation order differs from torch's by a few
    # ulps per step (as in test_engine_step_matches_torch); 1e-5 after 4 steps.
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(model[2].weight, _model(0)[2].weight)  # the added group did train


def test_add_param_group_of_part_of_a_frozen_module_under_stage3_is_refused_with_what_to_do():
    model = _model(0)
    model[2].requires_grad_(False)  # frozen at setup, as a fine-tuning callback leaves the backbone
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    zero = ZeroConfig(stage=3, param_persistence_threshold=0)
    engine = ZeroEngine(model, [optimizer], config=StrategyConfig(zero=zero), precision="32-true", device=CPU)
    model[2].weight.requires_grad_(True)  # the weight joins, the bias (sharded with it) does not
    optimizer.add_param_group({"params": [model[2].weight], "lr": 1e-3})
    with pytest.raises(ValueError, match=r"some parameters of a frozen module but not those of shapes \[\(3,\)\]"):
        engine.add_param_groups()
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_gradients_for_one_optimizer_leave_the_other_window_open(stage):
    """``full_gradients(module, optimizer=first)`` (the hooks around the first optimizer's step) must
    not end the second optimizer's window: its gradients of a later backward still reach its step."""

    def run(engine_stage: int | None) -> nn.Module:
        model = _model(0)
        first = torch.optim.SGD(model[0].parameters(), lr=0.1)
        second = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
        engine = None
        if engine_stage is not None:
            zero = ZeroConfig(stage=engine_stage, reduce_bucket_size=50, param_persistence_threshold=0)
            engine = ZeroEngine(
                model, [first, second], config=StrategyConfig(zero=zero), precision="32-true", device=CPU
            )
        torch.manual_seed(1)
        for _ in range(2):
            first.zero_grad(), second.zero_grad()
            model(torch.randn(5, 15)).square().mean().backward()
            if engine is None:
                first.step()
            else:
                engine.backward_done()
                with engine.full_gradients(model, optimizer=first):
                    assert model[0].weight.grad is not None and model[2].weight.grad is None
                engine.step(first)
            model(torch.randn(5, 15)).square().mean().backward()  # the second's window goes on
            if engine is None:
                second.step()
            else:
                engine.backward_done()
                engine.step(second)
        if engine is not None:
            engine.close()
        return model

    reference, model = run(None), run(stage)
    # fp32 SGD on one process: the same arithmetic up to summation order in the flat buffers
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("user_choice", [{}, {"foreach": False}, {"fused": False}])
def test_torch_adam_steps_fused_unless_the_user_chose(user_choice):
    """Where no compiled kernel steps the masters (here: "64-true"), torch's AdamW runs with
    ``fused=True`` (no temporaries of the shard's size) unless the user picked an implementation;
    either way it trains as torch's own AdamW does."""
    reference = _model(0).double()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, **user_choice)
    _train_double(reference, ref_optimizer, None)

    model = _model(0).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **user_choice)
    zero = ZeroConfig(stage=2, reduce_bucket_size=50)
    engine = ZeroEngine(model, [optimizer], config=StrategyConfig(zero=zero), precision="64-true", device=CPU)
    assert optimizer.param_groups[0]["fused"] is (True if not user_choice else user_choice.get("fused"))
    _train_double(model, optimizer, engine)
    engine.close()
    # float64: the fused and the single-tensor update differ by rounding only (~1e-16 per step)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def _train_double(model: nn.Module, optimizer: torch.optim.Optimizer, engine: ZeroEngine | None) -> None:
    torch.manual_seed(1)
    for _ in range(3):
        model(torch.randn(5, 15, dtype=torch.float64)).square().mean().backward()
        if engine is None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.backward_done()
            engine.step(optimizer)
