"""The plan (:mod:`lightning_zero.plan`, the engine on the meta device in a fake world) against the
real engine on 1, 2 and 4 gloo ranks: model-state bytes by category equal ``memory_breakdown()``, and
one training step's collectives, counted by a wrapper around :mod:`lightning_zero.comm` here (not
the plan's own recorder), equal the plan's in calls and bytes per operation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.testing import run_ranks

pytestmark = pytest.mark.distributed

# (stage, offload_optimizer, overlap_comm): every stage, with and without the host-offloaded
# optimizer; without overlap the reductions wait in a fixed order, so even the buckets alive at once
# do not depend on gloo's speed
CASES = [
    (1, False, True),
    (2, False, False),
    (2, False, True),
    (3, False, False),
    (3, False, True),
    (1, True, True),
    (2, True, False),
    (3, True, True),
]
# Small buckets and threshold: several flat buffers; under stage 3 small parameters stay whole.
ZERO = {"reduce_bucket_size": 700, "param_persistence_threshold": 40}


class OddModel(nn.Module):
    """Odd widths (padding in every flat buffer), a parameter larger than a bucket, a small one
    kept whole under stage 3, and a buffer."""

    def __init__(self, width: int = 15) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.mid = nn.Linear(width, 61)
        self.norm = nn.LayerNorm(61)
        self.out = nn.Linear(61, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.mid(torch.tanh(self.inp(x))))) * self.scale


def _counting(calls: list[tuple[str, int]]):  # noqa: ANN202 - a context manager
    """Patch the collectives of lightning_zero.comm to count calls and whole-buffer bytes."""
    from unittest import mock

    from lightning_zero import comm

    full = {"reduce_scatter": 1, "all_gather": 0, "all_reduce": 0, "broadcast": 0}
    patches = []
    for op, index in full.items():
        original = getattr(comm, op)

        def counted(*args, _op=op, _i=index, _orig=original, **kwargs):
            group = kwargs.get("group", args[2] if _op in ("reduce_scatter", "all_gather", "broadcast") else args[1])
            if comm.world_size(group) > 1:
                t = args[_i]
                calls.append((_op, t.numel() * t.element_size()))
            return _orig(*args, **kwargs)

        patches.append(mock.patch.object(comm, op, counted))
    stack = __import__("contextlib").ExitStack()
    for p in patches:
        stack.enter_context(p)
    return stack


def _real_worker(rank: int) -> list[tuple[dict, Counter]]:
    from lightning_zero.config import OffloadConfig, StrategyConfig, ZeroConfig
    from lightning_zero.memory import ActivationMeter, memory_breakdown
    from lightning_zero.zero.engine import ZeroEngine

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    out = []
    try:
        for stage, offload, overlap in CASES:
            torch.manual_seed(0)
            model = OddModel()
            optimizer = torch.optim.AdamW(model.parameters())
            config = StrategyConfig(
                zero=ZeroConfig(stage=stage, overlap_comm=overlap, **ZERO),
                offload=OffloadConfig(offload_optimizer=offload),
            )
            engine = ZeroEngine(model, [optimizer], config=config, precision="bf16-mixed", device=cpu)
            calls: list[tuple[str, int]] = []
            meter = ActivationMeter()
            for step in range(2):  # the second step is the one compared (stage 3 prefetches from the first)
                with _counting(calls if step else []):
                    meter.start()
                    loss = model(torch.randn(5, 7).to(torch.bfloat16)).float().mean()
                    meter.stop(model)
                    loss.backward()
                    engine.backward_done()
                    engine.step(optimizer)
            out.append((memory_breakdown(model, engine, cpu), Counter(calls), meter.last))
            engine.close()
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plan_equals_the_real_engine(world_size):
    from lightning_zero.config import OffloadConfig, ZeroConfig
    from lightning_zero.plan import plan

    measured = run_ranks(_real_worker, world_size=world_size)[0]  # rank 0, as the plan
    for (stage, offload, overlap), (breakdown, calls, activations) in zip(CASES, measured, strict=True):
        planned = plan(
            f"{__name__}:OddModel",
            world_size,
            zero=ZeroConfig(stage=stage, overlap_comm=overlap, **ZERO),
            offload=OffloadConfig(offload_optimizer=offload),
            device="cpu",
            inputs=[((5, 7), torch.float32)],
        )
        case = f"stage {stage}, offload {offload}, overlap {overlap}, {world_size} ranks: {planned.memory} {breakdown}"
        for where in ("device", "host"):
            for category, nbytes in breakdown[where].items():
                if world_size > 1 and overlap and category == "communication_buckets" and stage > 1:
                    # Which blocks the pool keeps depends on when gloo completes each reduction (the
                    # plan's not_modeled says so); measured here between 1x and 1.5x the plan. The
                    # overlap_comm=False cases check the same quantity exactly.
                    assert (planned.memory[where][category] > 0) == (nbytes > 0) == (where == "device"), case
                    assert nbytes <= 2 * planned.memory[where][category], case
                    continue
                # within 2% (the feature's promise); on these sizes the counts agree exactly
                assert planned.memory[where][category] == pytest.approx(nbytes, rel=0.02, abs=0), (case, category)
        assert sum(planned.memory["device"].values()) > 0
        # the same ops on meta tensors save tensors of the same shapes, but a meta function and its
        # CPU kernel may differ in a small saved tensor: measured 1,492 planned against 1,472 bytes
        # here (1.4%, not traced to one op); 2% is the plan's promise
        assert activations > 0 and planned.activations == pytest.approx(activations, rel=0.02), case
        plan_calls = Counter()
        for total in planned.step:
            assert total.group == "data"
            plan_calls[total.op] += total.count
        got = Counter()
        for (op, _), n in calls.items():
            got[op] += n
        assert plan_calls == got, case
        plan_bytes = {t.op: t.nbytes for t in planned.step}
        real_bytes = Counter()
        for (op, nbytes), n in calls.items():
            real_bytes[op] += nbytes * n
        assert plan_bytes == dict(real_bytes), case
        if world_size > 1:
            assert got["reduce_scatter"] > 1 and got["all_gather"] > 1, case  # several buckets each step


class Checkpointed(nn.Module):
    """Three blocks that widen, apply GELU and narrow (odd widths): checkpointing them keeps their
    inputs only, and the recompute runs inside backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 39), nn.GELU(), nn.Linear(39, 13)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _checkpointed_worker(rank: int) -> list[tuple[int, int]]:
    from lightning_zero.activations import apply_activation_checkpointing
    from lightning_zero.config import ActivationCheckpointConfig, StrategyConfig, ZeroConfig
    from lightning_zero.memory import ActivationMeter
    from lightning_zero.plan.peak import LiveBytes
    from lightning_zero.zero.engine import ZeroEngine

    dist.init_process_group("gloo")
    out = []
    try:
        for checkpoint in (False, True):
            torch.manual_seed(0)
            model = Checkpointed()
            optimizer = torch.optim.AdamW(model.parameters())
            activations = ActivationCheckpointConfig(policy=nn.Sequential if checkpoint else None)
            apply_activation_checkpointing(model, activations, None, False)
            config = StrategyConfig(zero=ZeroConfig(stage=2, overlap_comm=False), activations=activations)
            engine = ZeroEngine(model, [optimizer], config=config, precision="32-true", device=torch.device("cpu"))
            meter = ActivationMeter()
            for _ in range(2):  # the second step is compared, as the plan reports it
                live = LiveBytes()
                with live:
                    meter.start()
                    loss = model(torch.randn(57, 13)).float().mean()
                    meter.stop(model)
                    loss.backward()
                    engine.backward_done()
                    engine.step(optimizer)
            out.append((meter.last, live.peak))
            engine.close()
    finally:
        dist.destroy_process_group()
    return out


def test_planned_activations_and_transient_peak_equal_a_real_run():
    """Saved activations (ActivationMeter) and the step's transient peak (the plan's LiveBytes counter,
    here on real CPU tensors) of a real 2-rank run, with and without activation checkpointing, equal
    the plan's from meta tensors."""
    from lightning_zero.config import ActivationCheckpointConfig, ZeroConfig
    from lightning_zero.plan import plan

    measured = run_ranks(_checkpointed_worker, world_size=2)[0]
    for checkpoint, (saved, peak) in zip((False, True), measured, strict=True):
        planned = plan(
            f"{__name__}:Checkpointed",
            2,
            zero=ZeroConfig(stage=2, overlap_comm=False),
            device="cpu",
            precision="32-true",
            inputs=[((57, 13), torch.float32)],
            activations=ActivationCheckpointConfig(policy=nn.Sequential if checkpoint else None),
        )
        # the same ops on meta tensors save and allocate tensors of the same shapes; 2% as for the
        # activations above (a meta function and its CPU kernel may differ in a small saved tensor)
        assert planned.activations == pytest.approx(saved, rel=0.02), (checkpoint, planned.activations, saved)
        assert planned.transient_peak == pytest.approx(peak, rel=0.02), (checkpoint, planned.transient_peak, peak)
    assert measured[1][0] < measured[0][0]  # checkpointing saved less


def test_calibration_measures_every_rate_the_model_uses():
    """Structure only (no timing is asserted): every rate present and positive, every collective the
    engine issues on gloo measured, the overlap a fraction, and the plan timed with it."""
    from lightning_zero.plan import plan
    from lightning_zero.plan.machine import calibrate

    machine = calibrate(2, seconds=0.5)
    assert set(machine.flops) == {"float32", "bfloat16"} and min(machine.flops.values()) > 0
    assert set(machine.elementwise) == {"float32", "float32 in place", "bfloat16", "bfloat16 in place"}
    assert all(rate > 0 for curve in machine.elementwise.values() for _, rate in curve)
    assert machine.fresh_bandwidth > 0 and machine.op_overhead > 0 and machine.serial_overhead
    assert "gelu bfloat16" in machine.op_elements and machine.threads == 1
    assert set(machine.collectives) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    assert all(link.bandwidth > 0 and link.latency >= 0 for link in machine.collectives.values())
    assert 0 <= machine.overlap <= 1 and machine.source == "calibrated on 2 ranks"
    t = plan(f"{__name__}:OddModel", 2, device="cpu", inputs=[((5, 7), torch.float32)]).step_time(machine)
    assert t.seconds > 0 and 0 <= t.exposed_communication <= t.communication
    with pytest.raises(ValueError, match="positive"):
        calibrate(0)
