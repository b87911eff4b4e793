"""Activation bytes per rank with and without activation checkpointing.

Run: ``python benchmarks/activations.py [--tiny] [--json activations.json]``

Trains one step of the benchmark GPT (benchmarks/common.py; 4 x 128 tokens per rank, fp32) on 2
CPU/gloo ranks under zero2 and zero3, each without and with ``activation_checkpointing={Block}``,
and counts, at the end of the training forward (the moment activations peak), the bytes that wait
for backward: every tensor autograd saved (a ``saved_tensors_hooks`` around the forward) plus the
inputs of the checkpointed blocks (what ``torch.utils.checkpoint`` keeps to recompute them), each
storage once, parameters excluded. Tensors saved inside a checkpointed block are not kept (the
checkpoint's own hooks replace them by placeholders), so they are rightly not counted.
The ratio column is against the same strategy without checkpointing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch

from recipes.gpt2.model import Block


class _Counter:
    """Storages waiting for backward, by data pointer, parameters excluded."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.storages: dict[int, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters() if p.numel()}
        if storage.data_ptr() not in params and storage.nbytes():
            self.storages[storage.data_ptr()] = storage.nbytes()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor


class MeasuredGPT(common.GPTModule):
    """The benchmark GPT; ``activation_bytes`` after the training step's forward."""

    activation_bytes = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        counter = _Counter(self)

        def held(module: torch.nn.Module, args: tuple) -> None:  # a pre-hook returning a value replaces the args
            for a in args:
                if torch.is_tensor(a):
                    counter.add(a)

        hooks = [m.register_forward_pre_hook(held) for m in self.modules() if isinstance(m, Block)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                loss = super().training_step(batch, batch_idx)
        finally:
            for h in hooks:
                h.remove()
        MeasuredGPT.activation_bytes = sum(counter.storages.values())
        return loss


def _worker(rank: int, tiny: bool) -> list[list[Any]]:
    if tiny:
        common.use_tiny_models()
    rows = []
    for strategy in ("zero2", "zero3"):
        measured = {}
        for policy in (None, {Block}):
            torch.manual_seed(0)
            model = MeasuredGPT()
            trainer = common.make_trainer(
                common.build_strategy(strategy, activation_checkpointing=policy), "32-true", 1, []
            )
            trainer.fit(model, train_dataloaders=common.make_loader(1, rank))
            measured[policy is not None] = MeasuredGPT.activation_bytes
        base = measured[False]
        for on in (False, True):
            name = "{Block}" if on else "none"
            rows.append([strategy, name, f"{measured[on] / 2**20:.2f}", f"{measured[on] / base:.3f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer, 32-wide GPT: checks the script, not numbers")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = common.run_ranks(_worker, args.tiny)[0]
    headers = ["strategy", "activation_checkpointing", "activation MiB / rank", "ratio to none"]
    print(common.format_table(headers, rows))
    common.write_json(args.json, {"headers": headers, "rows": rows})


if __name__ == "__main__":
    main()
