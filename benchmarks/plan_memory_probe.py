"""Where a CPU rank's resident memory goes during training steps: one case of ``plan_memory.py``,
rank 0 sampled at every op.

Run: ``python benchmarks/plan_memory_probe.py gpt 2 --checkpoint --ranks 2``

Prints, from before the model is built to after each of three steps: the resident set's growth by
mapping (``/proc/self/smaps``: ``[anon]``, ``[heap]``, each shared library's file-backed pages),
glibc's bytes in use (``mallinfo2``: heap and mmapped chunks) and free, and at the step's resident
peak: the op and phase (forward, backward, optimizer), the live tensor bytes the plan's counter
(:class:`lightning_zero.plan.peak.LiveBytes`, on the real tensors) sees then, and the distinct 16-bit
matrix products of the step; finally ``memory_breakdown()``'s total and the plan's terms.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # as plan_memory.py

import common
import plan_memory
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

MIB = 2**20


def _in_use() -> tuple[int, int]:
    from lightning_zero.memory import _glibc

    info = _glibc().mallinfo2()  # type: ignore[union-attr]
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mappings() -> dict[str, int]:
    """Resident bytes by mapping: a library's name, ``[heap]``, ``[anon]`` (unnamed), or ``file``."""
    out: dict[str, int] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:  # a mapping's header line
                path = parts[5] if len(parts) > 5 else "[anon]"
                name = os.path.basename(path) if ".so" in path else "file" if path.startswith("/") else path
            elif parts[0] == "Rss:":
                out[name] = out.get(name, 0) + int(parts[1]) * 1024
    return out


class _Sampler(TorchDispatchMode):
    def __init__(self, live: object) -> None:
        super().__init__()
        self.live, self.phase, self.peak, self.at = live, "", 0, ("", "", 0, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        rss = _rss()
        if rss > self.peak:
            self.peak, self.at = rss, (self.phase, str(func), self.live.current, _in_use()[0])  # type: ignore[attr-defined]
        return out


def probe(rank: int, shape: str, stage: int, checkpoint: bool) -> list[str]:
    from lightning_zero.activations import apply_activation_checkpointing
    from lightning_zero.config import ActivationCheckpointConfig, StrategyConfig, ZeroConfig
    from lightning_zero.memory import memory_breakdown
    from lightning_zero.plan.peak import LiveBytes
    from lightning_zero.zero import ZeroEngine

    dist.init_process_group("gloo")
    lines = []
    try:
        x = plan_memory._inputs(shape, torch.Generator().manual_seed(rank))
        block = plan_memory._checkpointed(shape)
        dist.barrier()
        rss0, use0, maps0 = _rss(), _in_use()[0], _mappings()
        model = plan_memory._model(shape)
        optimizer = torch.optim.AdamW(model.parameters())
        activations = ActivationCheckpointConfig(policy=block if checkpoint else None)
        apply_activation_checkpointing(model, activations, None, stage == 3)
        config = StrategyConfig(zero=ZeroConfig(stage=stage), activations=activations)
        engine = ZeroEngine(model, [optimizer], config=config, precision="bf16-mixed", device=torch.device("cpu"))
        for step in range(3):
            live = LiveBytes()
            sampler = _Sampler(live)
            with live, sampler:
                sampler.phase = "forward"
                loss = plan_memory._loss(shape, model, x)
                sampler.phase = "backward"
                loss.backward()
                engine.backward_done()
                sampler.phase = "optimizer"
                engine.step(optimizer)
            use, free = _in_use()
            grown = {k: v - maps0.get(k, 0) for k, v in _mappings().items()}
            phase, op, tensors, use_at = sampler.at
            lines += [
                f"step {step}: resident +{(_rss() - rss0) / MIB:.1f} MiB; malloc in use +{(use - use0) / MIB:.1f}, "
                f"free {free / MIB:.1f}; by mapping (MiB): "
                + ", ".join(
                    f"{k} {v / MIB:+.1f}"
                    for k, v in sorted(grown.items(), key=lambda kv: -abs(kv[1]))
                    if abs(v) > MIB / 4
                ),
                f"  peak +{(sampler.peak - rss0) / MIB:.1f} MiB in {phase} at {op}: live tensors of the step "
                f"{tensors / MIB:.1f} MiB, malloc in use +{(use_at - use0) / MIB:.1f}; "
                f"{len(live.matmul_problems)} distinct 16-bit matrix products",
            ]
        total = sum(memory_breakdown(model, engine, torch.device("cpu"))["device"].values())
        lines.append(f"memory_breakdown() total {total / MIB:.1f} MiB")
        engine.close()
    finally:
        dist.destroy_process_group()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=[*plan_memory.plan_check.SHAPES, *plan_memory.HELD_OUT])
    parser.add_argument("stage", type=int, choices=[1, 2, 3])
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    for line in common.run_ranks(probe, args.shape, args.stage, args.checkpoint, world_size=args.ranks)[0]:
        print(line)
    p = plan_memory.planned(args.shape, args.stage, False, args.checkpoint, args.ranks)
    print(
        f"plan: total {p.total('device') / MIB:.1f} MiB, transient {p.transient_peak / MIB:.1f}, "  # type: ignore[attr-defined]
        f"resident {p.resident / MIB:.1f} ({p.matmul_problems} products), peak {p.peak / MIB:.1f}"  # type: ignore[attr-defined]
    )


if __name__ == "__main__":
    main()
