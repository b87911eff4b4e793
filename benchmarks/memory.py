"""Model-state bytes per rank, measured from live tensors, against the ZeRO formulas (docs/stages.md).

Run: ``python benchmarks/memory.py [--steps 3] [--json memory.json]``

Trains the benchmark GPT (benchmarks/common.py) with AdamW on 2 CPU/gloo ranks under Lightning's
DDP and ZeRO stage 1 and 2, each in "32-true" and "bf16-mixed", and at the end of the last training
batch (after the optimizer step, gradients still held) counts this rank's bytes by storage:

* ZeRO: ``trainer.strategy.memory_breakdown()`` (device + host).
* DDP: ``lightning_zero.memory.memory_breakdown(module, None, device)`` for parameters and gradients
  plus the optimizer's state tensors. DDP runs with ``gradient_as_bucket_view=True`` so that its
  gradients *are* its all-reduce buckets; with Lightning's default (False) the reducer keeps another
  hidden 4Ψ of buckets that no live-tensor count can see.

"Model states" = parameters + gradients + master weights + optimizer states. Not counted:
``communication_buckets`` (stage 2's full-size gradient buckets exist only during backward, until
their reduction completes; the column "peak buckets" is the most seen during the last backward, and
an extra zero2 row with 2M-element buckets shows how much of it is alive at once) and module
buffers (the GPT has none). Ψ = distinct trainable parameters, N = 2 ranks. Formulas (bytes per rank):

==========  ======================  ======================
            bf16-mixed Adam         32-true Adam
==========  ======================  ======================
ddp         16Ψ (fp32 everything)   16Ψ
zero1       4Ψ + 12Ψ/N              8Ψ + 8Ψ/N
zero2       2Ψ + 14Ψ/N              4Ψ + 12Ψ/N
==========  ======================  ======================
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import lightning.pytorch as pl
import torch

#: (strategy, precision, options). The extra zero2 row with small buckets shows how much of the
#: transient bucket memory is alive at once when the model spans several buckets.
SMALL_BUCKETS = {"reduce_bucket_size": 2_000_000}
CONFIGS = [(s, p, {}) for p in ("bf16-mixed", "32-true") for s in ("ddp", "zero1", "zero2")]
CONFIGS.insert(3, ("zero2", "bf16-mixed", SMALL_BUCKETS))
MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_states")
TARGET = 1.05


def formula_bytes(strategy: str, precision: str, psi: int, n: int) -> float:
    """The ZeRO paper's per-rank model-state bytes (arXiv 1910.02054 §5) for Adam."""
    if strategy == "ddp":
        return 16 * psi
    mixed = precision != "32-true"
    if strategy == "zero1":
        return (4 * psi + 12 * psi / n) if mixed else (8 * psi + 8 * psi / n)
    return (2 * psi + 14 * psi / n) if mixed else (4 * psi + 12 * psi / n)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


class MeasureAtEnd(pl.Callback):
    """This rank's bytes by category (device + host) at the last training batch end, and the peak of
    the transient communication buckets during that batch's backward."""

    def __init__(self, last_batch: int) -> None:
        self.last_batch = last_batch
        self.bytes: dict[str, int] = {}
        self.peak_buckets = 0
        self._handles: list = []

    @staticmethod
    def _measure(trainer, pl_module) -> dict[str, int]:
        strategy = trainer.strategy
        if hasattr(strategy, "memory_breakdown"):
            split = strategy.memory_breakdown()
        else:
            from lightning_zero.memory import memory_breakdown

            split = memory_breakdown(pl_module, None, strategy.root_device)
            states = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()]
            split["device"]["optimizer_states"] += _storage_bytes(states)
        return {k: split["device"][k] + split["host"][k] for k in split["device"]}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != self.last_batch:
            return

        # Registered after ZeRO's own gradient hooks, so each runs once the gradient is in its bucket.
        def probe(_param) -> None:
            buckets = self._measure(trainer, pl_module)["communication_buckets"]
            self.peak_buckets = max(self.peak_buckets, buckets)

        self._handles = [p.register_post_accumulate_grad_hook(probe) for p in pl_module.parameters() if p.requires_grad]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.last_batch:
            return
        for handle in self._handles:
            handle.remove()
        self.bytes = self._measure(trainer, pl_module)


def _worker(rank: int, steps: int) -> list[dict]:
    import lightning_zero  # noqa: F401 - registers the strategy names

    out = []
    for strategy, precision, options in CONFIGS:
        pl.seed_everything(0, verbose=False)
        module = common.GPTModule()
        psi = common.num_params(module)
        probe = MeasureAtEnd(last_batch=steps - 1)
        if strategy == "ddp":
            options = {"gradient_as_bucket_view": True}
        trainer = common.make_trainer(common.build_strategy(strategy, **options), precision, steps, [probe])
        trainer.fit(module, train_dataloaders=common.make_loader(steps, rank))
        out.append(
            {
                "strategy": strategy,
                "precision": precision,
                "psi": psi,
                "bytes": probe.bytes,
                "peak_buckets": probe.peak_buckets,
            }
        )
    return out


def _label(strategy: str, precision: str, options: dict) -> str:
    extra = f" bucket {options['reduce_bucket_size'] / 1e6:g}M" if options else ""
    return f"{strategy} {precision}{extra}"


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (>= 2)")
    parser.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    args = parser.parse_args()

    per_rank = common.run_ranks(_worker, args.steps)
    n = common.WORLD_SIZE
    rows, records = [], []
    for i, (strategy, precision, options) in enumerate(CONFIGS):
        # Ranks differ by at most the padding of a flat buffer; report the larger.
        measured = max((r[i] for r in per_rank), key=lambda r: sum(r["bytes"][k] for k in MODEL_STATES))
        psi, got = measured["psi"], measured["bytes"]
        total = sum(got[k] for k in MODEL_STATES)
        formula = formula_bytes(strategy, precision, psi, n)
        ratio = total / formula
        rows.append(
            [
                _label(strategy, precision, options),
                *(_mb(got[k]) for k in MODEL_STATES),
                _mb(total),
                _mb(measured["peak_buckets"]),
                _mb(formula),
                f"{total / psi:.2f}",
                f"{ratio:.3f}",
                "ok" if ratio <= TARGET else "OVER",
            ]
        )
        records.append(
            {
                "strategy": strategy,
                "precision": precision,
                "options": options,
                "psi": psi,
                "bytes": got,
                "peak_buckets": measured["peak_buckets"],
                "model_states": total,
                "formula": formula,
                "ratio": ratio,
            }
        )

    headers = [
        "config",
        "params MiB",
        "grads MiB",
        "master MiB",
        "states MiB",
        "total MiB",
        "peak buckets MiB",
        "formula MiB",
        "bytes/Ψ",
        "measured/formula",
        f"<= {TARGET}",
    ]
    print(f"\nModel-state bytes per rank (N={n} gloo ranks, AdamW, Ψ={psi:,} parameters), after the last step.")
    print("total = params + grads + master + states (the model states). Not in total: 'peak buckets', the most")
    print("bytes of transient communication buckets seen during the last backward (stage 2's full-size gradient")
    print("buckets; freed after the reduction; for DDP its gradients are its buckets), and module buffers.\n")
    print(common.format_table(headers, rows))
    print("\n" + "; ".join(f"{k}: {v}" for k, v in common.machine().items()))
    common.write_json(args.json, {"world_size": n, "steps": args.steps, "results": records})


if __name__ == "__main__":
    main()
