"""GPT-2 350M (bf16) on one GPU: tokens/s, TFLOP/s, MFU and peak memory of one configuration.

    python benchmarks/gpu_bench.py train CONFIG --out DIR [--steps 8] [--warmup 3] [--cpu-smoke]
    python benchmarks/gpu_bench.py optim --out DIR [--cpu-smoke]   # FusedAdam vs torch fused AdamW
    python benchmarks/gpu_bench.py table --out DIR                 # gather DIR/*.json into one table

CONFIG: ``ddp`` (Lightning's single-device baseline), ``zero1``, ``zero2``, ``zero3``,
``zero2_offload`` (optimizer offload, pipelined), ``zero2_offload_serial`` (the same with
``offload_pipeline=False``), ``zero3_offload``, and ``zero2_fusedadam`` (zero2 with
``lightning_zero.ops.FusedAdam`` instead of ``torch.optim.AdamW(fused=True)``). World size 1: nothing
is sharded, but every step still goes through the ZeRO data path (flat buffers, reduce, sharded
step, publish; the host copies and the CPU step with offload).

Each invocation measures one configuration and writes ``DIR/<config>.json``, so ``gpu.sh`` can run
them as separate processes with their own timeouts. FLOPs are counted by
``recipes/common/flops.py`` (matmuls, attention in full, backward = 2 x forward); MFU is against
the dense bf16 peak of the GPU (``GPU_PEAK_TFLOPS`` overrides the table below).
``--cpu-smoke`` runs the same code on the CPU with a tiny GPT, to check the script, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from recipes.common.flops import transformer_training_flops
from recipes.gpt2.model import GPT, GPTConfig

#: GPT-2 medium
GPT_350M = GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
TINY = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)
#: dense bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name()
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "V100": 125.0}
CONFIGS = (
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "zero2_offload",
    "zero2_offload_serial",
    "zero3_offload",
    "zero2_fusedadam",
)


class Module(pl.LightningModule):
    """The recipe GPT with AdamW (torch fused on a GPU, or lightning_zero's FusedAdam)."""

    def __init__(self, config: GPTConfig, fused_adam: bool) -> None:
        super().__init__()
        self.model = GPT(config)
        self.fused_adam = fused_adam

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        return GPT.loss_fn(self.model(input_ids), labels)

    def configure_optimizers(self):
        kwargs = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        if self.fused_adam:
            from lightning_zero.ops import FusedAdam

            return FusedAdam(self.parameters(), **kwargs)
        return torch.optim.AdamW(self.parameters(), fused=torch.cuda.is_available(), **kwargs)


class Clock(pl.Callback):
    """Step-end stamps; on a GPU synchronized, so a stamp is when the step's kernels finished."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


def _peak_tflops() -> float | None:
    if "GPU_PEAK_TFLOPS" in os.environ:
        return float(os.environ["GPU_PEAK_TFLOPS"])
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def train(config_name: str, steps: int, warmup: int, batch: int, smoke: bool) -> dict:
    """Train one configuration; its throughput and peak memory."""
    import lightning_zero

    model_config, seq = (TINY, 64) if smoke else (GPT_350M, 1024)
    batch = 2 if smoke else batch
    pl.seed_everything(0, verbose=False)
    total = warmup + steps
    tokens = torch.randint(0, model_config.vocab_size, (total * batch, seq + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    if config_name == "ddp":
        strategy = "auto"  # one device: Lightning's SingleDeviceStrategy, the baseline without ZeRO
    else:
        name = config_name.replace("_fusedadam", "").replace("_serial", "")
        offload = (
            {"offload_optimizer": True, "offload_parameters": name == "zero3_offload"} if "offload" in name else {}
        )
        if config_name.endswith("_serial"):  # every bucket stepped on the host first, then copied back
            offload["offload_pipeline"] = False
        strategy = lightning_zero.ZeroStrategy(stage=int(name[4]), **offload)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu" if smoke else "gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=total,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = Module(model_config, fused_adam=config_name.endswith("_fusedadam"))
    trainer.fit(module, train_dataloaders=loader)
    times = sorted(b - a for a, b in zip(clock.stamps[warmup - 1 :], clock.stamps[warmup:], strict=False))
    median = times[len(times) // 2]
    flops = transformer_training_flops(
        batch=batch,
        seq=seq,
        n_layer=model_config.n_layer,
        d_model=model_config.n_embd,
        d_ff=4 * model_config.n_embd,
        vocab=model_config.vocab_size,
        head_positions=batch * seq,
    )
    peak = _peak_tflops()
    tflops = flops / median / 1e12
    return {
        "config": config_name,
        "params": sum(p.numel() for p in module.parameters()),
        "batch": batch,
        "seq": seq,
        "median_step_s": median,
        "steps_s": times,
        "tokens_per_s": batch * seq / median,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_tflops": peak,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }


def optim(smoke: bool, repeats: int = 20) -> dict:
    """One optimizer step over 350M fp32 parameters (24 x 14.7M tensors): FusedAdam vs torch fused AdamW."""
    from lightning_zero.ops import FusedAdam

    device = "cpu" if smoke else "cuda"
    shapes = [(1000,)] * 4 if smoke else [(14_680_064,)] * 24
    out = {}
    for name, cls, kwargs in (
        ("torch AdamW fused=True", torch.optim.AdamW, {"fused": not smoke}),
        ("lightning_zero FusedAdam", FusedAdam, {}),
    ):
        params = [torch.zeros(s, device=device, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = cls(params, lr=1e-4, weight_decay=0.01, **kwargs)
        opt.step()
        if not smoke:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            opt.step()
        if not smoke:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / repeats
        n = sum(p.numel() for p in params)
        # 28 bytes per parameter: read param, grad, m, v; write param, m, v (fp32)
        out[name] = {"ms": seconds * 1e3, "gbs": 28 * n / seconds / 1e9, "params": n}
        del params, opt
    return out


def table(out: Path) -> str:
    """Markdown table of every ``<config>.json`` in ``out`` (and the optimizer comparison)."""
    rows = ["| config | step ms | tokens/s | TFLOP/s | MFU | max memory GiB |", "|---|---|---|---|---|---|"]
    for name in CONFIGS:
        path = out / f"{name}.json"
        if not path.exists():
            rows.append(f"| {name} | not run or failed (see train_{name}.log) | | | | |")
            continue
        r = json.loads(path.read_text())
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['max_memory_allocated_gib']:.2f}" if r["max_memory_allocated_gib"] is not None else "-"
        rows.append(
            f"| {name} | {r['median_step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | {mem} |"
        )
    optim_path = out / "optim.json"
    if optim_path.exists():
        rows += ["", "| optimizer step, 350M fp32 | ms | GB/s |", "|---|---|---|"]
        for name, r in json.loads(optim_path.read_text()).items():
            rows.append(f"| {name} | {r['ms']:.2f} | {r['gbs']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("train", "optim", "table"))
    parser.add_argument("config", nargs="?", choices=CONFIGS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="sequences of 1024 tokens per step")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny GPT on the CPU: checks the script only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "table":
        text = table(out)
        (out / "table.md").write_text(text + "\n")
        print(text)
        return
    if args.what == "optim":
        result = optim(args.cpu_smoke)
        (out / "optim.json").write_text(json.dumps(result, indent=2) + "\n")
    else:
        if args.config is None:
            parser.error(f"train needs a CONFIG: one of {', '.join(CONFIGS)}")
        result = train(args.config, args.steps, args.warmup, args.batch, args.cpu_smoke)
        (out / f"{args.config}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
