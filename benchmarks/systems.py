"""One runner per training system, all on the same model, optimizer, data and measurement.

``run(rank, system, precision, workload, total)`` trains ``total`` steps on this rank and returns
``{"stamps": [...], "bytes": live tensor bytes at the end, "split": {"device", "host"} or None,
"peak_rss": peak RSS growth in bytes (measure.PeakRss) up to the end of the last step}``.

* Lightning (``ddp``, ``zero1`` ... ``zero3_offload``): a Trainer with the strategy; DDP runs with
  ``gradient_as_bucket_view=True`` (its gradients are its all-reduce buckets; Lightning's default
  keeps a hidden second copy). Ours report their own device/host split (``memory_breakdown``).
* ``fsdp2`` / ``fsdp2_no_reshard``: ``torch.distributed.fsdp.fully_shard`` on every block and the
  root, ``reshard_after_forward`` True / False; "bf16-mixed" = ``MixedPrecisionPolicy(param_dtype=bf16)``
  (bf16 compute and reduce-scatter, fp32 shards), the counterpart of our stage 3.
* ``zero_redundancy``: torch's ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer(AdamW)``
  (fp32 parameters, autocast for "bf16-mixed"): torch's own stage 1.
* ``ds0`` ... ``ds3``, ``ds2_offload``, ``ds3_offload``: ``deepspeed.initialize`` with the client
  AdamW (offload: DeepSpeed's own ``AdamW`` = ``DeepSpeedCPUAdam``, which its offload requires);
  bucket sizes set to ours so both move the same bytes per collective; "bf16-mixed" = its ``bf16``
  section (bf16 parameters and gradients, fp32 master + states).

The plain loops zero the gradients *before* each step, so that at the end gradients are held as
in Lightning (measured "after the optimizer step, gradients still held").
"""

from __future__ import annotations

import ast
import os
from typing import Any

import common
import lightning.pytorch as pl
import torch
from measure import Baseline, Clock, PeakRss

from lightning_zero.memory import MemoryMonitor

LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
LIGHTNING = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
TORCH = ("fsdp2", "fsdp2_no_reshard", "zero_redundancy")
DEEPSPEED = ("ds0", "ds1", "ds2", "ds3", "ds2_offload", "ds3_offload")


class _Measure(pl.Callback):
    """Ticks the clock at every batch end; at the last one counts the live bytes (and ours' split)."""

    def __init__(self, clock: Clock, baseline: Baseline, last: int, rss: PeakRss) -> None:
        self.clock, self.baseline, self.last, self.rss = clock, baseline, last, rss
        self.result: dict[str, Any] = {}
        # what the OS sees besides model states (activations, allocator slack, library pages), as the
        # package's own callback counts it
        self.monitor = MemoryMonitor(reset_peak=False)  # the peak column is PeakRss's, from before the model

    def setup(self, trainer, pl_module, stage) -> None:
        self.monitor.setup(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module) -> None:
        self.monitor.on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.monitor.on_before_backward(trainer, pl_module, loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.tick()
        if batch_idx != self.last:
            return
        peak_rss = self.rss.grown()  # before the count below allocates anything
        split = None
        if hasattr(trainer.strategy, "memory_breakdown"):
            split = trainer.strategy.memory_breakdown()
        self.monitor.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.result = {
            "bytes": self.baseline.grown(),
            "split": split,
            "peak_rss": peak_rss,
            "activations": self.monitor.meter.peak,
            "monitor": self.monitor.last,
        }
        self.clock.tick()  # the count is not part of any step: restart the interval after it


def variant(system: str) -> tuple[str, dict[str, Any]]:
    """``"zero2@host_mmap_threshold=131072@reduce_bucket_size=1000000"`` -> ``("zero2", {...})``: one
    of our systems with strategy options, to compare settings side by side in one run."""
    base, *pairs = system.split("@")
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        options[key] = ast.literal_eval(value)
    return base, options


def _lightning(rank: int, system: str, precision: str, workload: str, total: int) -> dict:
    system, options = variant(system)
    if system == "ddp":
        options = {"gradient_as_bucket_view": True, **options}
    rss = PeakRss()
    baseline, clock = Baseline(), Clock()
    module = common.WORKLOADS[workload]()
    measure = _Measure(clock, baseline, total - 1, rss)
    trainer = common.make_trainer(common.build_strategy(system, **options), precision, total, [measure])
    trainer.fit(module, train_dataloaders=common.make_loader(total, rank, workload=workload))
    # the last interval is the count itself, not a step: drop it
    return {"stamps": clock.stamps[:-1], **measure.result}


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = model.model
    return list(inner.h if hasattr(inner, "h") else inner.layer)


def _plain_loop(
    step_model: Any,
    optimizer: Any,
    loader,
    baseline: Baseline,
    rss: PeakRss,
    bf16_autocast: bool,
    backward=None,
    step=None,
) -> dict:
    """Train over ``loader``; ``backward``/``step`` default to ``loss.backward()``/``optimizer.step()``."""
    clock = Clock()
    batches = list(loader)
    result = {}
    for i, (input_ids, labels) in enumerate(batches):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            loss = step_model(input_ids, labels)
        (backward or torch.Tensor.backward)(loss)
        (step or optimizer.step)()
        clock.tick()
        if i == len(batches) - 1:
            peak_rss = rss.grown()
            result = {"bytes": baseline.grown(), "split": None, "peak_rss": peak_rss}
    return {"stamps": clock.stamps, **result}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _torch(rank: int, system: str, precision: str, workload: str, total: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    bf16 = precision == "bf16-mixed"
    pl.seed_everything(0, verbose=False)
    rss = PeakRss()
    baseline = Baseline()
    model = common.LossModel(common.WORKLOADS[workload]())
    loader = common.make_loader(total, rank, workload=workload)
    if system == "zero_redundancy":
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY
        )
        return _plain_loop(ddp, optimizer, loader, baseline, rss, bf16_autocast=bf16)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    reshard = system == "fsdp2"
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return _plain_loop(model, _adamw(model.parameters()), loader, baseline, rss, bf16_autocast=False)


def deepspeed_config(system: str, precision: str) -> dict:
    """DeepSpeed's config for ``ds<stage>[_offload]``: its defaults except bucket sizes (= ours)."""
    stage = int(system[2])
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 50_000_000}
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=50_000_000,
            stage3_param_persistence_threshold=100_000,
            stage3_max_live_parameters=1_000_000_000,
        )
    config = {
        "train_micro_batch_size_per_gpu": common.MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16-mixed"},
        # torch.optim.AdamW is elementwise; DeepSpeed asks for this flag for any client optimizer.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if system.endswith("_offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
        # ZeRO-Offload refuses a client optimizer other than its own CPU Adam.
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY},
        }
    return config


def _deepspeed(rank: int, system: str, precision: str, workload: str, total: int) -> dict:
    import deepspeed

    pl.seed_everything(0, verbose=False)
    rss = PeakRss()
    baseline = Baseline()
    model = common.LossModel(common.WORKLOADS[workload]())
    config = deepspeed_config(system, precision)
    client = None if "optimizer" in config else _adamw(model.parameters())
    # The process group is ours (gloo); DeepSpeed reuses an initialized one.
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, model_parameters=model.parameters(), config=config)
    loader = common.make_loader(total, rank, workload=workload)
    return _plain_loop(
        engine, None, loader, baseline, rss, bf16_autocast=False, backward=engine.backward, step=engine.step
    )


def run(rank: int, system: str, precision: str, workload: str, total: int) -> dict:
    """Train ``total`` steps of ``workload`` under ``system``; stamps and bytes of this rank."""
    common.ensure_process_group()
    if variant(system)[0] in LIGHTNING:
        pl.seed_everything(0, verbose=False)
        return _lightning(rank, system, precision, workload, total)
    if system in TORCH:
        return _torch(rank, system, precision, workload, total)
    if system in DEEPSPEED:
        return _deepspeed(rank, system, precision, workload, total)
    raise ValueError(f"unknown system {system!r}; one of {LIGHTNING + TORCH + DEEPSPEED}")
