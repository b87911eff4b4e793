"""The plan's step-time model (:mod:`lightning_zero.plan.timing`): its structure, not a machine's speed.

The replay of a recorded step on a machine's rates must be monotonic in FLOPs and bytes, bounded
between the larger and the sum of compute and communication, add back exactly the communication a
CPU rank cannot overlap, follow the engine's own waits (a synchronous collective blocks, an
asynchronous one runs under the ops before its wait), and put the offloaded step on the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_zero.config import OffloadConfig, ZeroConfig
from lightning_zero.plan import plan
from lightning_zero.plan.machine import Link, Machine, known, ring_bytes
from lightning_zero.plan.timing import step_time

# A made-up machine with round rates, so the expected seconds below are exact.
SLOW = Machine(
    name="test",
    flops={"float32": 1e9, "bfloat16": 2e9},
    memory_bandwidth=1e9,
    collectives={"all_reduce": Link(latency=0.0, bandwidth=1e6)},
    op_overhead=0.0,
    host_bandwidth=1e8,
    host_link=1e7,
)


class Layer(nn.Module):
    """Widen three times, tanh, narrow: saves its input and the wide tanh output for backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.wide = nn.Linear(width, 3 * width)
        self.narrow = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.narrow(torch.tanh(self.wide(x)))


class Stack(nn.Module):
    """Odd widths, four layers: several buckets and stage-3 units."""

    def __init__(self, width: int = 67, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _plan(stage: int = 2, rows: int = 9, world_size: int = 4, device: str = "cpu", **zero):  # noqa: ANN003, ANN202
    zero = {"reduce_bucket_size": 5000, "param_persistence_threshold": 10, **zero}
    offload = OffloadConfig(offload_optimizer=zero.pop("offload", False))
    return plan(
        f"{__name__}:Stack",
        world_size,
        zero=ZeroConfig(stage=stage, **zero),
        offload=offload,
        device=device,
        precision="32-true",
        inputs=[((rows, 67), torch.float32)],
    )


def test_synthetic_trace_follows_the_waits():
    # one op of 1 s (1e9 FLOPs at 1e9 FLOP/s) and one all-reduce of 2 s (a 2e6-byte buffer on 2
    # ranks: each sends 2 * 1/2 * 2e6 bytes at 1e6 B/s)
    op = ("op", "device", "float32", 10**9, 0)
    calls = [("all_reduce", 2_000_000)]
    assert ring_bytes("all_reduce", 2_000_000, 2) == 2_000_000
    overlapped = step_time([("issue", 0, False), op, ("wait", 0)], calls, 2, SLOW)
    assert overlapped.seconds == pytest.approx(2.0) and overlapped.exposed_communication == pytest.approx(1.0)
    blocking = step_time([("issue", 0, True), op], calls, 2, SLOW)
    assert blocking.seconds == pytest.approx(3.0) and blocking.exposed_communication == pytest.approx(2.0)
    # a CPU rank whose collectives need the cores hides nothing
    serial = step_time([("issue", 0, False), op, ("wait", 0)], calls, 2, dataclasses.replace(SLOW, overlap=0.0))
    assert serial.seconds == pytest.approx(3.0)
    # host ops run at the host's bandwidth, copies at the link's
    host = step_time([("op", "host", "float32", 0, 10**8), ("op", "link", "float32", 0, 10**7)], [], 1, SLOW)
    assert host.seconds == pytest.approx(2.0) and host.host == pytest.approx(2.0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bounded_by_compute_and_communication(stage):
    p = _plan(stage)
    assert any(e[0] == "issue" for e in p.trace) and sum(e[3] for e in p.trace if e[0] == "op") > 0
    for overlap in (0.0, 0.5, 1.0):
        t = p.step_time(dataclasses.replace(SLOW, overlap=overlap))
        compute = t.forward + t.backward + t.optimizer
        assert 0 <= t.exposed_communication <= t.communication
        assert max(compute, t.communication) <= t.seconds * (1 + 1e-9)
        assert t.seconds <= (compute + t.communication) * (1 + 1e-9)
        if overlap == 0.0:
            assert t.seconds == pytest.approx(compute + t.communication)


def test_monotonic_in_flops_bytes_and_rates():
    small, large = _plan(rows=9), _plan(rows=90)
    assert large.step_time(SLOW).forward > small.step_time(SLOW).forward
    assert large.step_time(SLOW).backward > small.step_time(SLOW).backward
    base = small.step_time(SLOW)
    faster = small.step_time(dataclasses.replace(SLOW, flops={"float32": 1e10}, memory_bandwidth=1e10))
    assert faster.forward < base.forward and faster.optimizer < base.optimizer
    network = small.step_time(dataclasses.replace(SLOW, collectives={"all_reduce": Link(0.0, 1e8)}))
    assert network.communication < base.communication and network.seconds <= base.seconds
    # more ranks: each sends more of every buffer ((N-1)/N), the optimizer steps a smaller slice
    wide = _plan(world_size=64).step_time(SLOW)
    assert wide.communication > base.communication and wide.optimizer < base.optimizer


def test_the_engine_overlaps_reductions_with_backward():
    # gradient buckets reduce asynchronously under the rest of the backward with overlap_comm, and
    # block the backward without it; on a machine where the network is as fast as the compute
    fair = dataclasses.replace(SLOW, collectives={"all_reduce": Link(0.0, 1e9)})
    with_overlap = _plan(stage=2, overlap_comm=True).step_time(fair)
    without = _plan(stage=2, overlap_comm=False).step_time(fair)
    assert with_overlap.communication == pytest.approx(without.communication)
    assert with_overlap.exposed_communication < without.exposed_communication
    # stage 3 prefetches the next units' all-gathers: some of them hide under compute
    stage3 = _plan(stage=3).step_time(fair)
    assert stage3.exposed_communication < stage3.communication


def test_offloaded_step_runs_on_the_host():
    h100 = known("H100")
    on_device = _plan(stage=2, device="cuda").step_time(h100)
    offloaded = _plan(stage=2, device="cuda", offload=True).step_time(h100)
    assert on_device.host == 0 and offloaded.host > 0
    assert offloaded.optimizer > on_device.optimizer  # host memory and PCIe are slower than HBM


def test_machine_table_and_validation():
    assert known("H200").memory_bandwidth > known("H100").memory_bandwidth
    assert known("A100", "ib-hdr200").link("reduce_scatter").bandwidth == 25e9
    with pytest.raises(ValueError, match="not in the table"):
        known("TPU")
    with pytest.raises(ValueError, match="interconnect"):
        known("H100", "carrier-pigeon")
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(SLOW, memory_bandwidth=0.0)
    with pytest.raises(ValueError, match="overlap"):
        dataclasses.replace(SLOW, overlap=1.5)
    # one rank: a collective moves nothing, only its latency counts
    assert SLOW.link("all_gather").seconds("all_gather", 10**9, 1) == 0.0


def test_transient_peak_follows_batch_and_checkpointing():
    from lightning_zero.config import ActivationCheckpointConfig

    # 900 rows: the activations (not the step's fp32 temporaries of these small layers) make the peak
    small, large = _plan(rows=9), _plan(rows=900, reduce_bucket_size=262144)
    assert large.transient_peak > small.transient_peak > 0 and large.activations > small.activations
    assert large.peak == large.total("device") + large.untracked + large.transient_peak + large.resident
    checkpointed = plan(
        f"{__name__}:Stack",
        4,
        zero=ZeroConfig(stage=2),
        device="cpu",
        precision="32-true",
        inputs=[((900, 67), torch.float32)],
        activations=ActivationCheckpointConfig(policy=Layer),
    )
    assert len(checkpointed.activation_checkpointing) == 4
    # only the checkpointed layers' inputs are saved (not their wide tanh outputs); the recompute costs
    # another forward's FLOPs
    assert checkpointed.activations < large.activations and checkpointed.transient_peak < large.transient_peak
    flops = [sum(e[3] for e in p.trace if e[0] == "op") for p in (large, checkpointed)]
    assert flops[1] > flops[0]
    with pytest.raises(ValueError, match="selects no module"):
        plan(
            f"{__name__}:Stack",
            2,
            device="cpu",
            inputs=[((3, 67), torch.float32)],
            activations=ActivationCheckpointConfig(policy=nn.Conv2d),
        )


def test_search_ranks_what_fits_by_throughput(capsys):
    from lightning_zero.plan.search import format_search, search

    inputs = lambda mb: [((mb, 67), torch.float32)]  # noqa: E731
    fits_all = search(
        f"{__name__}:Stack", 4, SLOW, device_memory=2**30, host_memory=2**30, micro_batches=(1, 8),
        make_inputs=inputs, device="cpu", precision="32-true",
    )  # fmt: skip
    assert len(fits_all) == 12 and all(c.fits for c in fits_all)  # 6 layouts x 2 micro-batches
    speeds = [c.samples_per_second for c in fits_all]
    assert speeds == sorted(speeds, reverse=True)
    # a budget between the smallest and the largest peak: the fitting ones first, the best recommended
    peaks = sorted(c.plan.peak for c in fits_all)
    tight = search(
        f"{__name__}:Stack", 4, SLOW, device_memory=(peaks[0] + peaks[-1]) // 2, host_memory=2**30,
        micro_batches=(1, 8), make_inputs=inputs, device="cpu", precision="32-true",
    )  # fmt: skip
    flags = [c.fits for c in tight]
    assert flags == sorted(flags, reverse=True) and True in flags and False in flags
    assert all(c.plan.peak <= (peaks[0] + peaks[-1]) // 2 for c in tight if c.fits)
    assert format_search(tight).startswith("  layout") and "\n* " in format_search(tight)
    with pytest.raises(ValueError, match="positive"):
        search(f"{__name__}:Stack", 4, SLOW, device_memory=0, host_memory=1)


def test_the_plan_command_times_and_searches(capsys):
    from lightning_zero.cli import main

    args = ["plan", f"{__name__}:Stack", "--world-size", "4", "--input", "3,67", "--precision", "32-true"]
    assert main([*args, "--machine", "A100", "--interconnect", "ib-hdr200"]) == 0
    out = capsys.readouterr().out
    assert "step time on A100 over ib-hdr200" in out and "peak of a step on the device" in out
    assert main([*args, "--search", "--machine", "H200", "--micro-batches", "1,2"]) == 0
    assert "\n* stage=" in capsys.readouterr().out
    assert main([*args, "--machine", "TPU"]) == 2
    assert "not in the table" in capsys.readouterr().err
    assert main([*args, "--machine", "calibrate"]) == 2  # a CPU measurement for a cuda plan
    assert "--device cpu" in capsys.readouterr().err


def test_elementwise_curves_fresh_pages_and_measured_ops():
    from lightning_zero.plan.machine import interpolate
    from lightning_zero.plan.timing import fresh_threshold, op_seconds

    # a curve's time per unit is linear in log(size) between its points, its rate flat beyond them
    curve = ((1e3, 4e9), (1e5, 2e9))
    assert interpolate(curve, 10) == 4e9 and interpolate(curve, 1e7) == 2e9
    assert interpolate(curve, 1e4) == pytest.approx(1 / (0.5 / 4e9 + 0.5 / 2e9))
    cpu = dataclasses.replace(
        SLOW,
        elementwise={"float32": ((1e3, 1e9), (1e6, 1e8)), "float32 in place": ((1e3, 2e9), (1e6, 4e8))},
        fresh_bandwidth=1e8,
        op_elements={"gelu float32": 1e6},
        op_flops={"attn float32": ((10.0, 1e8), (1000.0, 1e9))},
        op_overhead=1e-6,
        serial_overhead=True,
    )
    # beyond the caches (the second point) an op writing a new tensor and one writing in place
    new, in_place = (
        ("op", "device", "float32", 0, 10**6, "add", (4000,), 10),
        ("op", "device", "float32", 0, 10**6, "add_", (), 10),
    )
    assert op_seconds(new, cpu) == pytest.approx(1e-6 + 1e6 / 1e8)
    assert op_seconds(in_place, cpu) == pytest.approx(1e-6 + 1e6 / 4e8)
    # its output on fresh pages (at least the threshold) costs their first touch besides
    assert op_seconds(new, cpu, fresh_above=4000) == pytest.approx(1e-6 + 1e6 / 1e8 + 4000 / 1e8)
    assert op_seconds(in_place, cpu, fresh_above=1) == op_seconds(in_place, cpu)
    # an op measured on its own costs at least its elements at that rate (1e5 elements: 0.1 s)
    gelu = ("op", "device", "float32", 0, 1000, "gelu", (), 10**5)
    assert op_seconds(gelu, cpu) == pytest.approx(1e-6 + 0.1)
    # an op with its own FLOP rate curve, by FLOPs per output element (100: halfway in log)
    attention = ("op", "device", "float32", 10**9, 0, "attn", (), 10**7)
    assert op_seconds(attention, cpu) == pytest.approx(1e-6 + 1e9 / interpolate(((10.0, 1e8), (1000.0, 1e9)), 100))
    # on an accelerator the per-op cost hides under the work (launches run ahead)
    assert op_seconds(gelu, dataclasses.replace(cpu, serial_overhead=False)) == pytest.approx(0.1)
    # which new tensors land on fresh pages: the C library's threshold on a CPU rank, none on a GPU
    assert fresh_threshold("cuda", 1 << 20) == float("inf")
    assert fresh_threshold("cpu", 1 << 20) == 1 << 20 and fresh_threshold("cpu", None) == 32 << 20
    with pytest.raises(ValueError, match="increasing size"):
        dataclasses.replace(cpu, elementwise={"float32": ((1e6, 1e9), (1e3, 1e9))})


def test_the_recorder_names_ops_and_their_new_storages():
    from lightning_zero.plan.opclass import op_flops
    from lightning_zero.plan.timing import OpRecorder

    events: list = []
    x = torch.empty(8, 16, device="meta")
    with OpRecorder(events, host=None):
        torch.nn.functional.gelu(x, approximate="tanh")
        x.add_(1.0)
        x.t()
        x.sum()
    ops = {e[5]: e for e in events}
    assert ops["gelu[tanh]"][6] == (8 * 16 * 4,) and ops["gelu[tanh]"][7] == 128  # a new output
    assert ops["add_"][6] == ()  # in place
    assert ops["t"][4] == 0  # a view moves nothing
    assert ops["sum"][7] == 128  # a reduction's elements are its input's
    # the CPU attention kernel: 4 FLOPs per query x key x head element, half of them causal, the
    # backward 2.5 times the forward
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.empty(2, 3, 16, 8, device="meta")
    assert op_flops(flash, (q, q, q, 0.0, False), {}, None) == 4 * 2 * 3 * 16 * 16 * 8
    assert op_flops(flash, (q, q, q, 0.0, True), {}, None) == 2 * 2 * 3 * 16 * 16 * 8
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert op_flops(backward, (q, q, q, q, q, q, 0.0, True), {}, None) == 5 * 2 * 3 * 16 * 16 * 8


def test_a_cpu_plan_runs_the_kernels_a_cpu_rank_runs():
    """Attention through the CPU flash kernel (not the math path meta tensors would take) and, where
    the engine's compiled kernels are built, the optimizer step as the CPU kernel (one pass)."""
    from lightning_zero.ops import compiled
    from lightning_zero.plan.peak import cpu_attention
    from lightning_zero.plan.timing import OpRecorder

    def attention(host: set[int] | None, **kwargs: object) -> set[str]:
        events: list = []
        q = torch.empty(2, 3, 16, 8, device="meta", requires_grad=True)
        with cpu_attention(host is None), OpRecorder(events, host=host):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, **kwargs).sum().backward()  # type: ignore[arg-type]
        return {e[5] for e in events if e[0] == "op"}

    cpu = attention(None, is_causal=True)
    assert {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    } <= cpu
    assert "bmm" not in cpu
    assert "bmm" in attention(set(), is_causal=True)  # an accelerator's plan: not the CPU kernel
    # grouped-query heads: the kernel torch itself picks for CPU tensors of these shapes
    q = torch.zeros(1, 4, 2, 8)
    flash = (
        torch._fused_sdp_choice(q, q[:, :2], q[:, :2], None, 0.0, False, enable_gqa=True)
        == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value
    )
    assert ("bmm" not in attention(None, enable_gqa=True)) == bool(flash)
    if compiled():
        names = {e[5] for e in _plan(stage=2, device="cpu").trace if e[0] == "op"}
        assert "cpu_adam_step" in names and "_foreach_addcdiv_" not in names
    names = {e[5] for e in _plan(stage=2, device="cuda").trace if e[0] == "op"}
    assert "cpu_adam_step" not in names


def test_op_rates_measure_each_op_class():
    """Structure only: the calibration's per-op rates cover the activations, normalization,
    softmax and attention of common models, forward and backward, with positive rates."""
    from lightning_zero.plan.opclass import op_rates

    elements, flops = op_rates((torch.float32,), repeats=1)
    for name in ("gelu", "gelu[tanh]", "gelu_backward", "silu", "native_layer_norm", "native_layer_norm_backward"):
        assert elements[f"{name} float32"] > 0, name
    assert "add float32" not in elements  # plain element-wise ops: the bandwidth curves
    curve = flops["_scaled_dot_product_flash_attention_for_cpu_backward float32"]
    assert len(curve) == 3 and [size for size, _ in curve] == sorted(size for size, _ in curve)
    assert all(rate > 0 for _, rate in curve)


def test_a_dtype_without_a_curve_uses_float32s():
    cpu = dataclasses.replace(SLOW, elementwise={"float32": ((1e3, 1e9),), "float32 in place": ((1e3, 2e9),)})
    assert cpu.bandwidth("bool", 10**6) == 1e9 and cpu.bandwidth("int64", 10, in_place=True) == 2e9
    # the table's machines: one bandwidth, or a dtype's own where it differs
    table = dataclasses.replace(SLOW, dtype_bandwidth={"bfloat16": 5e8})
    assert table.bandwidth("bfloat16", 10**9) == 5e8 and table.bandwidth("float32", 10**9) == SLOW.memory_bandwidth
