"""Adam moments kept in bf16 against fp32 under ZeRO-Offload: the loss curve and the bytes.

Run: ``python benchmarks/bf16_moments.py [--steps 120] [--batches 8] [--every 10]``

The benchmark GPT (benchmarks/common.py, ~14M parameters, seq 128, micro-batch 4 per rank) trains
with ``zero2_offload`` on 2 CPU/gloo ranks, fp32 compute, for ``--steps`` steps over ``--batches``
fixed batches per rank (repeated, so the loss falls well below its random-token start), once with
``lightning_zero.ops.CPUAdam(state_dtype=torch.float32)`` and once with ``torch.bfloat16`` (same
seed, same data, same hyperparameters: lr 1e-3, betas (0.9, 0.95), weight decay 0.1). The engine's
CPU kernel steps both; with bf16 it widens the moments to fp32 for the update and rounds them back
(nearest even). Prints rank 0's loss every ``--every`` steps for both, the largest relative
difference of the two curves, and the bytes of the moments per rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class _Module(common.GPTModule):
    def __init__(self, state_dtype: torch.dtype) -> None:
        super().__init__(lr=1e-3)
        self.state_dtype = state_dtype
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        from lightning_zero.ops import CPUAdam

        return CPUAdam(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=self.state_dtype)


def _worker(rank: int, steps: int, batches: int) -> dict:
    import lightning_zero  # noqa: F401 - registers the strategy names

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        pl.seed_everything(0, verbose=False)
        module = _Module(dtype)
        fixed = list(common.make_loader(batches, rank))
        repeated = [fixed[i % batches] for i in range(steps)]
        data = TensorDataset(torch.cat([x for x, _ in repeated]), torch.cat([y for _, y in repeated]))
        loader = DataLoader(data, batch_size=common.MICRO_BATCH, shuffle=False)
        trainer = common.make_trainer(common.build_strategy("zero2_offload"), "32-true", steps, [])
        trainer.fit(module, train_dataloaders=loader)
        states = trainer.strategy._engine._optimizers[0].state.values() if trainer.strategy._engine else []
        moment_bytes = sum(
            s[k].numel() * s[k].element_size() for s in states for k in ("exp_avg", "exp_avg_sq") if k in s
        )
        out[name] = {"losses": module.losses, "moment_bytes": moment_bytes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    res = common.run_ranks(_worker, args.steps, args.batches)[0]
    a, b = res["fp32"]["losses"], res["bf16"]["losses"]
    print("| step | loss, fp32 moments | loss, bf16 moments | bf16 / fp32 |")
    print("|---|---|---|---|")
    for i in list(range(0, len(a), args.every)) + ([len(a) - 1] if (len(a) - 1) % args.every else []):
        print(f"| {i + 1} | {a[i]:.4f} | {b[i]:.4f} | {b[i] / a[i]:.4f} |")
    worst = max(abs(y - x) / abs(x) for x, y in zip(a, b, strict=True))
    print(f"\nlargest relative difference of the curves: {worst:.4f}")
    print(
        f"moments per rank: fp32 {res['fp32']['moment_bytes'] / 2**20:.1f} MiB, "
        f"bf16 {res['bf16']['moment_bytes'] / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
