"""DeepSpeed's ZeRO-Infinity beside ours in ``capacity.py --deepspeed``: the same GPT and
batch, stage 3 with optimizer states and parameters on NVMe, one CPU rank, fp32.

DeepSpeed (0.19.8, ``DS_ACCELERATOR=cpu``, gloo) runs its disk tier through its ``async_io`` op,
which it JIT-builds against libaio: without the libaio headers (Debian: ``apt-get install
libaio-dev``) ``deepspeed.initialize`` fails with "Unable to JIT load the async_io op due to it
not being compatible due to hardware/software issue", and the row reports that error instead. The
first run also JIT-builds its CPU Adam (minutes, not counted: the steps are timed after
``initialize``). Its ``aio`` settings follow our ``NvmeConfig`` defaults (block size, queue depth,
threads; overlapped events); it runs its own CPU AdamW (``DeepSpeedCPUAdam``, what ZeRO-Offload requires) with the
hyperparameters of the benchmark's ``torch.optim.AdamW``. It counts no bytes moved, so the I/O
columns are empty; "clean" says whether its swap files were gone after the run (DeepSpeed leaves
them; we remove ours).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path
from typing import Any


def ds_config(nvme_path: str) -> dict[str, Any]:
    """Stage 3, optimizer states and parameters under ``nvme_path``, aio as our NvmeConfig's defaults."""
    from lightning_zero.config import NvmeConfig

    ours = NvmeConfig(path=nvme_path)
    nvme = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_optimizer": dict(nvme), "offload_param": dict(nvme)},
        "aio": {
            "block_size": ours.block_size,
            "queue_depth": ours.queue_depth,
            "thread_count": ours.threads,
            "single_submit": False,
            "overlap_events": True,
        },
    }


def ds_child(args: argparse.Namespace) -> dict[str, Any]:
    """One DeepSpeed run (its own process): the row's numbers, or ``{"error": ...}``."""
    import lightning.pytorch as pl
    import torch

    from benchmarks.common import GPTModule, LossModel
    from recipes.gpt2.model import GPTConfig

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    config = GPTConfig(vocab_size=8192, block_size=128, n_layer=args.layers, n_head=6, n_embd=args.width)
    pl.seed_everything(0, verbose=False)
    model = LossModel(GPTModule(config))
    psi = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
    swap = os.path.join(args.nvme_path, "deepspeed")
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(swap))
    except Exception as error:  # noqa: BLE001 - reported as the row: DeepSpeed could not run here
        return {"error": f"{type(error).__name__}: {error}"}
    steps, optimizer, losses = [], [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        before_step = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        steps.append(end - start)
        optimizer.append(end - before_step)
        losses.append(float(loss))
    rest = slice(1, None) if args.steps > 1 else slice(None)
    return {
        "params": psi,
        "step_s": sum(steps[rest]) / len(steps[rest]),
        "optimizer_s": sum(optimizer[rest]) / len(optimizer[rest]),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "clean": not any(p.is_file() for p in Path(swap).rglob("*")),
    }
