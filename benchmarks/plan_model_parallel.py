"""Per-rank memory, collectives and predicted step of GPT-2 medium under tensor and pipeline
parallelism at 512 ranks (the plan): every (T, P) of the table at ZeRO stage 1.

Run: ``PYTHONPATH=. python benchmarks/plan_model_parallel.py [--ranks 512] [--sizes 1x1,2x1,8x1,1x4,2x4,8x4]``

The model is the recipes' GPT (``recipes/gpt2/model.py``: its Megatron tensor-parallel plan and its
pipeline layers ``[embed, h0..h23, head]``) at GPT-2 medium's widths (24 blocks, 1024 wide, 16 heads,
vocabulary 50,304, tied embedding and LM head); one data-parallel replica's batch is 8 sequences of
1,024 tokens, cut into 8 micro-batches under a pipeline (1F1B); bf16-mixed AdamW. Each row is
:func:`lightning_zero.plan.plan` (the strategy's split and schedule on meta tensors in a fake world of
that size), timed on the table's H100 over InfiniBand NDR400 (every group on that one link: an
assumption; the tensor group usually sits on NVLink inside a node). "peak" is the most loaded planned
stage's device peak.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from lightning_zero import PipelineSpec
from lightning_zero.config import ZeroConfig
from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig
from lightning_zero.plan import plan
from lightning_zero.plan.machine import known

MEDIUM = {"n_layer": 24, "vocab_size": 50304, "n_embd": 1024, "n_head": 16, "block_size": 1025}


class GPTModel(nn.Module):
    """The recipes' GPT with its tensor-parallel plan and pipeline spec; the pipeline's batch is
    ``(rows,)`` of ``seq + 1`` token ids (inputs and the shifted labels)."""

    def __init__(self, **sizes: int) -> None:
        super().__init__()
        from recipes.gpt2.model import GPT, GPTConfig

        self.model = GPT(GPTConfig(**sizes))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def tensor_parallel_plan(self) -> dict[str, str]:
        from recipes.gpt2.model import TENSOR_PARALLEL_PLAN

        return {f"model.{k}": v for k, v in TENSOR_PARALLEL_PLAN.items()}

    def configure_pipeline(self) -> PipelineSpec:
        return PipelineSpec(
            layers=self.model.to_layers(),
            loss=lambda logits, batch: self.model.loss(logits, batch[0][:, 1:]),
            inputs=lambda batch: batch[0][:, :-1],
        )


def _calls(totals: dict, key: tuple[str, str]) -> str:
    c = totals.get(key)
    return f"{c.count} / {c.nbytes / 2**20:,.1f}" if c else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--sizes", default="1x1,2x1,8x1,1x4,2x4,8x4", help="TxP pairs")
    args = parser.parse_args()
    machine = known("H100", "ib-ndr400")
    print(
        "| T x P | D | stages planned | parameters per rank | model states MiB | peak MiB | tensor all-reduce calls / MiB "
        "| pipeline send calls / MiB | data reduce-scatter + all-gather MiB | step ms | bubble ms | plan CPU s |"
    )
    print("|" + "---|" * 12)
    for pair in args.sizes.split(","):
        t, p = (int(n) for n in pair.split("x"))
        start = time.process_time()
        result = plan(
            f"{__name__}:GPTModel",
            args.ranks,
            model_kwargs=MEDIUM,
            zero=ZeroConfig(stage=1),
            inputs=[((8, 1025) if p > 1 else (8, 1024), torch.int64)],
            tensor=TensorParallelConfig(size=t),
            pipeline=PipelineConfig(stages=p, micro_batches=8),
        )
        cpu = time.process_time() - start
        step = result.step_time(machine)
        info = result.parallel
        d = info.data if info is not None else args.ranks
        numel = info.local_numel if info is not None else result.numel
        stages = ", ".join(str(q.parallel.represents).replace(",)", ")") for q in info.stages) if info else "-"
        totals = {(c.group, c.op): c for c in result.step}
        states = result.total("device") - result.memory["device"]["communication_buckets"]

        data = sum(c.nbytes for (g, op), c in totals.items() if g == "data" and op != "all_reduce")
        print(
            f"| {t} x {p} | {d} | {stages} | {numel:,} | {states / 2**20:,.1f} | "
            f"{result.peak / 2**20:,.1f} | {_calls(totals, ('tensor', 'all_reduce'))} | {_calls(totals, ('pipeline', 'send'))} | "
            f"{data / 2**20:,.1f} | {step.seconds * 1e3:,.1f} | {getattr(step, 'bubble', 0.0) * 1e3:,.1f} | {cpu:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
