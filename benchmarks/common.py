"""Shared pieces of the benchmarks: spawning 2 CPU/gloo ranks, the GPT workload, strategies, tables.

Each script is run as ``python benchmarks/<name>.py``; it spawns its own ranks. Every rank gets the
torchelastic environment variables, so Lightning detects ``TorchElasticEnvironment`` and starts no
processes of its own; several Trainers can then run one after the other in the same ranks over one
process group (which is how the scripts interleave configurations).

The workload is the GPT-2 of ``recipes/gpt2/model.py`` (tied LM head) at a size where both compute
and communication are visible on 2 CPU cores, trained with AdamW on random tokens.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# ``recipes`` is a plain package at the repository root, not part of the installed wheel.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import testing
from recipes.bert.model import Bert, BertConfig
from recipes.gpt2.model import GPT, GPTConfig

WORLD_SIZE = 2
#: ~14M parameters: 6 blocks of 1.77M plus a 3.1M tied embedding. Big enough that the gradient
#: reduction (56 MB in fp32) and the Adam step are visible next to forward/backward, small enough
#: for a run of every configuration to fit in a few minutes on 2 cores.
MODEL = GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=6, n_embd=384)
SEQ = 128
MICRO_BATCH = 4
#: The BERT of recipes/bert/model.py at the GPT's width and depth (~13M parameters, no dropout so
#: every system computes the same thing); masked-LM loss on 15% of the positions.
BERT_MODEL = BertConfig(
    vocab_size=8192, max_position=SEQ, n_layer=6, n_head=6, hidden=384, intermediate=1536, dropout=0.0
)
MASK_FRACTION = 0.15
#: The "square" workload: ``SQUARE_LAYERS`` Linear(SQUARE_WIDTH, SQUARE_WIDTH) + GELU (33.6M parameters
#: in 8 big tensors): memory dominated by model states, the shape where ZeRO's formulas are tested.
SQUARE_WIDTH, SQUARE_LAYERS, SQUARE_ROWS = 2048, 8, 64


def use_tiny_models() -> None:
    """Shrink both workloads to a few thousand parameters: for checking the scripts, not for numbers."""
    global MODEL, BERT_MODEL, SQUARE_WIDTH, SQUARE_LAYERS
    MODEL = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=32)
    SQUARE_WIDTH, SQUARE_LAYERS = 32, 2
    BERT_MODEL = BertConfig(
        vocab_size=256, max_position=SEQ, n_layer=2, n_head=2, hidden=32, intermediate=64, dropout=0.0
    )


# -- ranks --------------------------------------------------------------------------------------


def _quiet() -> None:
    """Keep the tables readable: Lightning's per-Trainer banners and tips are repeated per run."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    # torch.distributed deprecations, repeated at every collective of DeepSpeed and FSDP2
    warnings.filterwarnings("ignore", category=FutureWarning)


#: Longest a benchmark's ranks may run before they are killed and the script fails: a rank killed
#: from outside (for memory) never reports, and its peers would otherwise wait for it forever.
DEADLINE_S = 3600.0


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = WORLD_SIZE) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned CPU ranks; their results in rank order
    (:func:`lightning_zero.testing.run_ranks`, the tests' harness, with :data:`DEADLINE_S`).

    ``fn`` must be importable by the children (a module-level function of the script).
    """
    return testing.run_ranks(
        fn, *args, world_size=world_size, timeout=DEADLINE_S, run_id="lightning_zero_benchmarks", prepare=_quiet
    )


# -- workload -----------------------------------------------------------------------------------


class GPTModule(pl.LightningModule):
    """The recipe GPT with AdamW, as a LightningModule; ``batch`` is (input_ids, labels)."""

    def __init__(self, config: GPTConfig | None = None, lr: float = 3e-4) -> None:
        super().__init__()
        self.model = GPT(config or MODEL)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        return GPT.loss_fn(self.model(input_ids), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


class BertModule(GPTModule):
    """The recipe BERT (masked LM) with the same AdamW; ``batch`` is (input_ids, labels), -100 = not masked."""

    def __init__(self, config: BertConfig | None = None, lr: float = 3e-4) -> None:
        pl.LightningModule.__init__(self)
        self.model = Bert(config or BERT_MODEL)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return bert_loss(self.model, *batch)


def bert_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy (fp32) over the masked positions of a (batch, seq) micro-batch."""
    logits, _ = model(input_ids, labels)
    return torch.nn.functional.cross_entropy(logits.float(), labels[labels != -100])


class SquareStack(torch.nn.Module):
    """``SQUARE_LAYERS`` blocks of Linear + GELU in ``self.h`` (the blocks FSDP2 wraps)."""

    def __init__(self) -> None:
        super().__init__()
        self.h = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(SQUARE_WIDTH, SQUARE_WIDTH), torch.nn.GELU())
            for _ in range(SQUARE_LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return x


def square_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 (FSDP2's bf16 policy casts the root's inputs, the targets too)."""
    return torch.nn.functional.mse_loss(model(inputs).float(), targets.float())


class SquareModule(GPTModule):
    """The square stack with the same AdamW; ``batch`` is (inputs, targets), both (rows, width)."""

    def __init__(self, lr: float = 3e-4) -> None:
        pl.LightningModule.__init__(self)
        self.model = SquareStack()
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return square_loss(self.model, *batch)


class LossModel(torch.nn.Module):
    """``model(input_ids, labels) -> loss`` for the systems driven by a plain loop (FSDP2, DeepSpeed)."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.model = module.model
        self.is_bert = isinstance(module, BertModule)
        self.is_square = isinstance(module, SquareModule)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.is_square:
            return square_loss(self.model, input_ids, labels)
        if self.is_bert:
            return bert_loss(self.model, input_ids, labels)
        return GPT.loss_fn(self.model(input_ids), labels)


#: workload name -> its LightningModule class
WORKLOADS = {"gpt": GPTModule, "bert": BertModule, "square": SquareModule}


def num_params(module: torch.nn.Module) -> int:
    """Ψ: distinct trainable parameters (the tied head counted once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def make_loader(steps: int, rank: int, seed: int = 1234, workload: str = "gpt") -> DataLoader:
    """``steps`` micro-batches of random tokens for this rank (each rank its own, same every run).

    gpt: (input_ids, next tokens); bert: (input_ids, labels) with ``MASK_FRACTION`` of the
    positions labelled (the rest -100), the labelled inputs replaced by token 0 ([MASK]); square:
    (inputs, targets) of ``SQUARE_ROWS`` random rows.
    """
    generator = torch.Generator().manual_seed(seed + rank)
    if workload == "square":
        data = torch.randn(2, steps * SQUARE_ROWS, SQUARE_WIDTH, generator=generator)
        return DataLoader(TensorDataset(data[0], data[1]), batch_size=SQUARE_ROWS, shuffle=False)
    tokens = torch.randint(0, MODEL.vocab_size, (steps * MICRO_BATCH, SEQ + 1), generator=generator)
    if workload == "bert":
        inputs = tokens[:, :-1].clone()
        masked = torch.rand(inputs.shape, generator=generator) < MASK_FRACTION
        labels = torch.where(masked, inputs, torch.full_like(inputs, -100))
        dataset = TensorDataset(inputs.masked_fill(masked, 0), labels)
    else:
        dataset = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=False)


def ensure_process_group() -> None:
    """Initialize the gloo group from the torchelastic variables unless a Trainer already did.

    The plain-loop systems (FSDP2, DeepSpeed, ZeroRedundancyOptimizer) need one; Lightning reuses it.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


#: ZeroStrategy arguments of the offload names, as lightning_zero registers them
OFFLOAD = {
    "zero2_offload": {"offload_optimizer": True},
    "zero3_offload": {"offload_optimizer": True, "offload_parameters": True},
}


def build_strategy(name: str, **options: Any) -> Any:
    """ "ddp" -> Lightning's ``DDPStrategy(**options)``; "zero1"/"zero2"/"zero3"/"zero2_offload"/
    "zero3_offload" -> ``ZeroStrategy(stage, **offload arguments, **options)``."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    if name == "ddp":
        return DDPStrategy(**options)
    if name in ("zero1", "zero2", "zero3", *OFFLOAD):
        return ZeroStrategy(stage=int(name[4]), **OFFLOAD.get(name, {}), **options)
    raise ValueError(f"unknown strategy {name!r}; use ddp, zero1, zero2, zero3, zero2_offload or zero3_offload")


def make_trainer(strategy: Any, precision: str, max_steps: int, callbacks: list) -> pl.Trainer:
    """A bare Trainer on the spawned CPU ranks: no logging, checkpoints, validation or progress bar."""
    # The process group survives Trainers; Lightning reuses the existing one.
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        precision=precision,
        max_steps=max_steps,
        callbacks=callbacks,
        # Each rank already reads its own loader: no DistributedSampler on top.
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


# -- reporting ----------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """What the numbers were measured on: CPU model, cores, torch/lightning versions, date, load."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown"
    try:
        git = ["git", "-C", str(ROOT)]
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "lightning_zero"], capture_output=True, text=True
        ).stdout.strip()
        revision = commit + (" + uncommitted changes to lightning_zero/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        revision = "unknown (not a git checkout)"
    return {
        "lightning_zero": revision,
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "ranks": f"{WORLD_SIZE} gloo ranks, 1 thread each",
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (it reads as plain text on a terminal and pastes into the README)."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` (with the machine description) to ``path`` if one was given."""
    if path:
        Path(path).write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
