"""Muon + AdamW under ZeRO stages 1/2/3 and offload against DDP (and DeepSpeed's Muon where it runs).

Run: ``python benchmarks/muon.py [--steps 4] [--warmup 2] [--json benchmarks/results/muon.json]``

The benchmark GPT (benchmarks/common.py: ~14M parameters, seq 128, micro-batch 4 per rank) trains on
2 CPU/gloo ranks with the Muon recipe: ``torch.optim.Muon`` for the 2-D hidden weights of the blocks
(attention and MLP matrices, 10.6M parameters), ``torch.optim.AdamW`` for the embeddings (the tied
head), norms and biases, two optimizers under manual optimization. ZeRO steps each Muon matrix whole
on one owner rank (:mod:`lightning_zero.zero.whole`) and the AdamW parameters by flat slices.

Per configuration: the median step time (``on_train_batch_end`` to the next, warm-up dropped) and its
ratio to DDP, and the optimizer-state bytes each rank holds after training (every tensor in both
optimizers' ``state``: Muon's momentum, AdamW's moments and steps; not the fp32 masters).

DeepSpeed's Muon (``ds1_muon``, ``ds2_muon``: DeepSpeed 0.19.8, ``"optimizer": {"type": "Muon"}``, ZeRO
stage 1/2, no offload, which its Muon refuses) runs in the same ranks when ``deepspeed`` imports, with
``DS_ACCELERATOR=cpu`` and gloo. Its parameters are tagged ``use_muon`` by the same split as ours
(:func:`is_hidden_matrix`; DeepSpeed's own rule would also put the ``wte`` embedding under Muon), its
Muon learning rate 0.02 and its auxiliary Adam's 3e-4 with the same betas and weight decay. Its
optimizer-state bytes are every tensor in its inner optimizer's ``state`` (Muon momentum and Adam
moments of this rank's flat partitions). DeepSpeed JIT-builds its shared-memory communication op at
``init_distributed`` (2.5 minutes on the 2-core machine): build it once before a timed run, see
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import lightning.pytorch as pl
import torch

CONFIGS = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
DEEPSPEED = ("ds1_muon", "ds2_muon")
# read when deepspeed imports; its JIT-built ops go to the gitignored cache that README.md prebuilds
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "torch_extensions")
)
MUON_LR, ADAM_LR = 0.02, 3e-4


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """The Muon recipe's split: 2-D weights inside the blocks; embeddings, head, norms, biases to AdamW."""
    return param.dim() == 2 and ".h." in name


class MuonGPT(common.GPTModule):
    """The benchmark GPT with Muon (hidden matrices) + AdamW (the rest), manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        input_ids, labels = batch
        muon, adamw = self.optimizers()
        muon.zero_grad()
        adamw.zero_grad()
        self.manual_backward(common.GPT.loss_fn(self.model(input_ids), labels))
        muon.step()
        adamw.step()

    def configure_optimizers(self):  # type: ignore[override]
        named = list(self.named_parameters())
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        rest = [p for n, p in named if not is_hidden_matrix(n, p)]
        return [
            torch.optim.Muon(hidden, lr=MUON_LR, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=ADAM_LR, betas=(0.9, 0.95), weight_decay=0.1),
        ]


def state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor in the optimizers' ``state`` (each storage once)."""
    seen: dict[int, int] = {}
    for optimizer in optimizers:
        for entry in optimizer.state.values():
            for value in entry.values():
                if torch.is_tensor(value):
                    storage = value.untyped_storage()
                    seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


class Probe(pl.Callback):
    """Step stamps, and the optimizer-state bytes at the end of training (before teardown)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.bytes = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.bytes = state_bytes([getattr(o, "_optimizer", o) for o in trainer.optimizers])


def _lightning(rank: int, name: str, total: int) -> tuple[list[float], int]:
    pl.seed_everything(0, verbose=False)
    # manual optimization: ZeRO would otherwise all-gather param.grad after every backward for user
    # code that reads it (DDP's semantics); this loop does not, so the benchmark measures ZeRO's path
    options = {} if name == "ddp" else {"expose_param_grads": False}
    probe = Probe()
    trainer = common.make_trainer(common.build_strategy(name, **options), "32-true", total, [probe])
    # one epoch of ``total`` batches (global_step counts both optimizers' steps under manual optimization)
    trainer.fit_loop.epoch_loop.max_steps = -1
    trainer.fit_loop.max_epochs = 1
    trainer.fit(MuonGPT(), train_dataloaders=common.make_loader(total, rank))
    return probe.stamps, probe.bytes


def _worker(rank: int, steps: int, warmup: int, tiny: bool) -> dict:
    import lightning_zero  # noqa: F401 - registers the strategy names

    if tiny:
        common.use_tiny_models()
    out: dict[str, Any] = {}
    for name in CONFIGS + (DEEPSPEED if deepspeed_available() else ()):
        run = _deepspeed if name in DEEPSPEED else _lightning
        stamps, nbytes = run(rank, name, warmup + steps)
        kept = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][max(warmup - 1, 0) :]
        out[name] = {"steps_s": kept, "state_bytes": nbytes}
    return out


def deepspeed_available() -> bool:
    """Whether ``deepspeed`` imports here (its rows are left out otherwise)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def deepspeed_config(name: str) -> dict:
    """DeepSpeed's Muon at ZeRO stage 1 or 2 with the benchmark's hyper-parameters and our bucket sizes."""
    return {
        "train_micro_batch_size_per_gpu": common.MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": int(name[2]),
            "reduce_bucket_size": 5_000_000,
            "allgather_bucket_size": 50_000_000,
        },
        "optimizer": {
            "type": "Muon",
            "params": {
                "muon_lr": MUON_LR,
                "adam_lr": ADAM_LR,
                "momentum": 0.95,  # torch.optim.Muon's default
                "betas": [0.9, 0.95],
                "weight_decay": 0.1,
            },
        },
        "steps_per_print": 10**9,
    }


def _deepspeed(rank: int, name: str, total: int) -> tuple[list[float], int]:
    import deepspeed

    def tag_like_ours(config: Any, model: torch.nn.Module) -> None:
        for param_name, param in model.named_parameters():
            param.use_muon = is_hidden_matrix(param_name, param)

    pl.seed_everything(0, verbose=False)
    model = common.LossModel(MuonGPT())
    common.ensure_process_group()
    deepspeed.init_distributed(dist_backend="gloo")  # reuses our gloo group
    deepspeed.set_optimizer_flags = tag_like_ours  # what deepspeed.initialize calls to tag use_muon
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=deepspeed_config(name))
    stamps = []
    for input_ids, labels in common.make_loader(total, rank):
        engine.backward(engine(input_ids, labels))
        engine.step()
        stamps.append(time.perf_counter())
    nbytes = state_bytes([engine.optimizer.optimizer])
    engine.destroy()
    return stamps, nbytes


NOTES = [
    "The benchmark GPT with torch.optim.Muon on the blocks' 2-D matrices and AdamW on embeddings, norms and "
    "biases; 2 CPU gloo ranks, fp32, manual optimization; medians of the timed steps of one run.",
    "Optimizer-state bytes are exact: under DDP every rank holds Muon's momentum and AdamW's two moments; under "
    "ZeRO each rank holds the momentum of the matrices it owns and its slice of AdamW's moments.",
    "ds1_muon / ds2_muon: DeepSpeed 0.19.8's own Muon (MuonWithAuxAdam) at ZeRO stage 1 / 2, the same parameter "
    "split and hyper-parameters, a plain loop (engine.backward, engine.step); it refuses Muon with CPU offload; its "
    "stage-3 Muon was not measured here.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run excluded from timing")
    parser.add_argument("--tiny", action="store_true", help="a few-thousand-parameter GPT (checks the script)")
    parser.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    args = parser.parse_args()
    if args.tiny:
        common.use_tiny_models()
    results = common.run_ranks(_worker, args.steps, args.warmup, args.tiny)
    ddp_time = statistics.median(results[0]["ddp"]["steps_s"])
    ddp_bytes = max(r["ddp"]["state_bytes"] for r in results)
    rows, records = [], []
    for name in results[0]:
        median = statistics.median(results[0][name]["steps_s"])  # collectives keep the ranks in lockstep
        per_rank = [r[name]["state_bytes"] for r in results]
        rows.append(
            [
                name,
                f"{median * 1e3:.0f}",
                f"{median / ddp_time:.3f}",
                " / ".join(f"{b / 2**20:.1f}" for b in per_rank),
                f"{max(per_rank) / ddp_bytes:.3f}",
            ]
        )
        records.append(
            {
                "config": name,
                "median_step_s": median,
                "steps_s": results[0][name]["steps_s"],
                "ratio_to_ddp": median / ddp_time,
                "state_bytes_per_rank": per_rank,
                "state_ratio_to_ddp": max(per_rank) / ddp_bytes,
            }
        )
    headers = ["config (32-true)", "step ms", "time / DDP", "opt. states MiB (rank 0 / 1)", "max states / DDP"]
    print(common.format_table(headers, rows))
    common.write_json(
        args.json,
        {
            # what the docs' benchmark page renders (scripts/docs_hooks.py)
            "title": "muon.py: Muon + AdamW against DDP, step time and optimizer-state bytes per rank",
            "topic": "step-time",
            "command": "python benchmarks/muon.py"
            + (f" --steps {args.steps}" if args.steps != 4 else "")
            + (f" --warmup {args.warmup}" if args.warmup != 2 else "")
            + (" --tiny" if args.tiny else "")
            + f" --json {args.json}",
            "headers": headers,
            "rows": rows,
            "notes": NOTES,
            "model_params": common.num_params(MuonGPT()),
            "muon_params": sum(p.numel() for n, p in MuonGPT().named_parameters() if is_hidden_matrix(n, p)),
            "steps": args.steps,
            "warmup": args.warmup,
            "deepspeed": "ds1_muon, ds2_muon" if "ds1_muon" in results[0] else "not run: deepspeed does not import",
            "results": records,
        },
    )


if __name__ == "__main__":
    main()
