"""The plan as text (``lightning-zero plan``)."""

from __future__ import annotations

from lightning_zero.memory import CATEGORIES
from lightning_zero.plan.core import CollectiveTotal, Plan


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:12.2f}"


def _collectives(title: str, totals: tuple[CollectiveTotal, ...]) -> list[str]:
    lines = [f"{title}:"]
    if not totals:
        return [*lines, "  none (one rank)"]
    lines.append(f"  {'group':8} {'op':16} {'calls':>7} {'MiB':>12}")
    lines += [f"  {t.group:8} {t.op:16} {t.count:7d} {_mib(t.nbytes)}" for t in totals]
    return lines


def format_plan(p: Plan) -> str:
    """A table of :class:`~lightning_zero.plan.core.Plan`: memory by category (MiB per rank),
    buckets, the stage-3 gather window, collectives per step, and what is not modeled."""
    z = p.zero
    lines = [
        f"plan: {p.numel:,} parameters, {p.world_size} {'ranks' if p.parallel else 'data-parallel ranks'}, "
        f"stage {z.stage}, {p.precision}, "
        f"device {p.device}, offload optimizer={p.offload.offload_optimizer} parameters={p.offload.offload_parameters}",
        f"per rank, MiB   {'device':>12} {'host':>12}",
    ]
    for category in CATEGORIES:
        lines.append(f"  {category:22} {_mib(p.memory['device'][category])} {_mib(p.memory['host'][category])}")
    lines.append(f"  {'total':22} {_mib(p.total('device'))} {_mib(p.total('host'))}")
    lines.append(f"activations saved by one forward: {p.activations / 2**20:.2f} MiB")
    lines.append(
        f"peak of a step on the device: {p.peak / 2**20:.2f} MiB (the total above, {p.transient_peak / 2**20:.2f} MiB "
        f"transient during the step, {p.untracked / 2**20:.2f} MiB kept between steps outside the categories"
        + (
            f", {p.resident / 2**20:.2f} MiB resident that is no tensor: kernel code, oneDNN's primitives of "
            f"{p.matmul_problems} distinct 16-bit matrix products)"
            if p.device == "cpu"
            else ")"
        )
    )
    if p.activation_checkpointing:
        lines.append(f"activation checkpointing: {len(p.activation_checkpointing)} modules")
    lines.append(f"pinned host memory: {p.pinned_host_bytes / 2**20:.2f} MiB")
    if p.nvme is not None:
        d = p.nvme
        lines.append(
            f"NVMe: {d.nvme_bytes / 2**20:.2f} MiB in {len(d.files)} swap files ({d.engine} engine); host memory the "
            f"tier holds during a step {d.staging_bytes / 2**20:.2f} MiB; per step read {d.read_per_step / 2**20:.2f} "
            f"MiB, written {d.written_per_step / 2**20:.2f} MiB"
        )
    lines.append(
        f"buckets: reduce_bucket_size {z.reduce_bucket_size:,} elements, allgather_bucket_size "
        f"{z.allgather_bucket_size:,}; {p.flat_buffers} flat buffers"
    )
    if z.stage == 3:
        lines.append(
            f"stage-3 gather window: prefetch_bucket_size {z.prefetch_bucket_size:,} elements, max_live_parameters "
            f"{z.max_live_parameters:,}, param_persistence_threshold {z.param_persistence_threshold:,}; "
            f"largest all-gather {p.largest_gather_bytes / 2**20:.2f} MiB"
        )
    if p.parallel is not None:
        from lightning_zero.plan.model_parallel import format_model_parallel

        lines += format_model_parallel(p)
    lines += _collectives("collectives per training step", p.step)
    lines += _collectives("collectives at setup (once)", p.setup)
    lines.append("not modeled: " + "; ".join(p.not_modeled))
    return "\n".join(lines)
