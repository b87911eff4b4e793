"""3D parallelism on CPU/gloo: step time of tensor x pipeline x data layouts of the GPT-2 cpu-tiny
model on 4 ranks, and the measured pipeline bubble against (P - 1) / (v m + P - 1).

    python benchmarks/parallel3d.py --quick       # 2 rounds x 3 steps: 4.3 min measured on 2 busy cores
    python benchmarks/parallel3d.py               # 3 rounds x 6 steps (9.8 min idle); benchmarks/results/parallel3d.json
    python benchmarks/parallel3d.py --smoke       # tiny GPT, 1 round, no JSON: does everything run?

Workload: ``recipes.gpt2.module.GPT2LM`` with the model and optimizer of
``recipes/gpt2/configs/cpu-tiny.yaml`` (read from the file: 4 layers, width 256, 4 heads, vocab
50,304, 128 positions, 16.0M parameters of which 12.9M are the tied embedding; AdamW with warm-up
and cosine decay; gradient clipping 1.0), "bf16-mixed", ``ZeroStrategy(stage=1)``, random tokens of
sequence 128. The module's own ``tensor_parallel_plan()`` (the GPT's Megatron plan under "model.")
and ``configure_pipeline()`` (layers ``[embed, h0, h1, h2, h3, head]``, split by parameter count)
are used as they are; the schedule is 1F1B.

1. **Step time**, 4 ranks, the same global batch of 16 sequences (2,048 tokens) in every layout;
   pipelined layouts cut each replica's batch into micro-batches of 2 sequences, so pp2 x dp2 has
   m = 4 (8 sequences per replica) and tp2 x pp2 m = 8 (16 sequences, one replica):

   ====== ========= =========================== ==========================
   layout T x P x D sequences per replica         stages (by parameters)
   ====== ========= =========================== ==========================
   dp4     1 x 1 x 4  4                           -
   tp2_dp2 2 x 1 x 2  8                           -
   pp2_dp2 1 x 2 x 2  8 = 4 micro-batches of 2    [embed h0 h1] [h2 h3 head]
   tp2_pp2 2 x 2 x 1  16 = 8 micro-batches of 2   [embed h0 h1] [h2 h3 head]
   ====== ========= =========================== ==========================

   A step is the interval between consecutive ``on_train_batch_end`` on rank 0 (the collectives of
   the step keep the ranks in lockstep), warm-up steps dropped; layouts run interleaved, every
   round, in the same processes, so that a busy moment of the shared machine hits all of them;
   the median over all kept steps and its ratio to dp4. The step is also cut in three (rank 0,
   medians): forward + backward (to ``on_after_backward``; under pipelining the schedule's time),
   the gradient reduction (from there to ``on_before_optimizer_step``: stage 1's one
   reduce-scatter per step, and under pipelining the sum of the tied embedding over its stages),
   and clipping (a global-norm all-reduce) + AdamW on this rank's slice + the all-gather of the
   updated parameters (to the batch end).

2. **Pipeline bubble**: P = 2 on 2 ranks and P = 4 on 4 ranks (data-parallel size 1), a batch of 8
   sequences cut into m in {1, 2, 4, 8} micro-batches; and P = 2 interleaved over v = 2 chunks per
   stage (m in {2, 4, 8}), whose formula is (P - 1) / (v m + P - 1). The same P = 2 rows run for
   :class:`BalancedStack` too, a model whose stages are equal by construction (the case the formula
   describes; the GPT's are not, see below). Each stage's
   ``strategy._parallel.runner.times`` (:class:`lightning_zero.parallel.runner.StageTimes`) holds the
   wall time of the latest schedule and the part of it spent blocked in receives; its
   ``idle_fraction`` is averaged over the kept steps and then over the stages, and set against
   :func:`lightning_zero.parallel.schedules.bubble_fraction`.

Why the measured idle fraction differs from (P - 1) / (m + P - 1):

* **Unequal stages.** The formula assumes every stage takes the same time per micro-batch. Here
  the last stage holds the LM head, a 256 x 50,304 matmul plus an fp32 cross entropy over 50,304
  classes per token: 12.9M multiply-adds per token against ~0.85M for a block (~15x), so it is the
  slowest stage by far, and the first stage (an embedding lookup plus blocks) the fastest. The stages
  before the slow one wait for it in every micro-batch (their idle fraction rises above the
  formula and does not fall to 0 as m grows); the slowest stage waits little (below the formula).
  Balancing by parameter count puts the tied embedding's 12.9M on both ends, which equalizes
  bytes, not FLOPs.
* **Only the schedule is timed.** ``StageTimes`` covers ``PipelineRunner.run``; gradient clipping,
  the ZeRO reduction and the optimizer step come after it and are not in the fraction. A stage
  that finishes its optimizer step early (a middle stage with 1.6M parameters against 12.9M on
  the end stages) starts the next schedule early and waits in its first receive for the others:
  that imbalance does enter the next step's idle time.
* **Oversubscribed CPU.** 4 ranks share 2 cores (and other engineers' processes share them too):
  a stage's blocked receive also covers time during which the sending rank was not running at
  all, descheduled in favour of another rank, so waiting is not only the schedule's bubble; and a
  stage's busy time stretches whenever it is descheduled. The P = 2 rows (2 ranks on 2 cores) are
  the cleaner ones. ``uptime`` is printed before and after the run; the benchmark's own ranks count
  in that load.
* **m = 1 is a check of the measurement.** With one micro-batch each stage idles exactly while the
  others compute, so the mean over stages is (P - 1) / P whatever the stage times; the measured
  value falls short of it by the busy time spent outside computation (payload copies, sends).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402 - also puts the repository root (``recipes``) on sys.path
import lightning.pytorch as pl
import torch
import yaml
from torch.utils.data import DataLoader, Dataset, TensorDataset

from recipes.common.optim import OptimizerConfig
from recipes.gpt2.model import GPTConfig

CPU_TINY = common.ROOT / "recipes" / "gpt2" / "configs" / "cpu-tiny.yaml"
GLOBAL_BATCH = 16  # sequences per step over all data-parallel replicas (step-time table)
MICRO_SEQS = 2  # sequences per pipeline micro-batch (step-time table)
BUBBLE_BATCH = 8  # sequences per step of the bubble rows, cut into m micro-batches
BUBBLE_MICRO = (1, 2, 4, 8)
ZERO_STAGE = 1
STACK_BLOCKS, STACK_WIDTH, STACK_ROWS = 8, 512, 256  # BalancedStack: 8 blocks, 256 rows per step
SMOKE_MODEL = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=2, n_embd=32)


@dataclass(frozen=True)
class Layout:
    """One configuration: T x P x D ranks, ``micro_batches`` per replica batch (pipelined only) and
    ``batch`` sequences per step over all replicas."""

    name: str
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    micro_batches: int = 1
    batch: int = GLOBAL_BATCH
    chunks: int = 1  # pipeline_chunks: above 1 the interleaved 1F1B schedule
    model: str = "gpt"  # "gpt": GPT-2 cpu-tiny; "stack": BalancedStack (equal stages)

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def per_replica(self) -> int:
        return self.batch // self.data


STEP_LAYOUTS = (
    Layout("dp4", data=4),
    Layout("tp2_dp2", tensor=2, data=2),
    Layout("pp2_dp2", pipeline=2, data=2, micro_batches=GLOBAL_BATCH // 2 // MICRO_SEQS),
    Layout("tp2_pp2", tensor=2, pipeline=2, micro_batches=GLOBAL_BATCH // MICRO_SEQS),
)


def bubble_layouts(stages: int, chunks: int = 1) -> list[Layout]:
    """P = ``stages`` on ``stages`` ranks, one replica, ``BUBBLE_BATCH`` sequences in m micro-batches;
    with ``chunks`` > 1 interleaved (m a multiple of P only)."""
    tag = f"_v{chunks}" if chunks > 1 else ""
    return [
        Layout(f"pp{stages}{tag}_m{m}", pipeline=stages, micro_batches=m, batch=BUBBLE_BATCH, chunks=chunks)
        for m in BUBBLE_MICRO
        if chunks == 1 or m % stages == 0
    ]


def stack_layouts() -> list[Layout]:
    """BalancedStack on P = 2 (2 ranks), m in BUBBLE_MICRO, plain (v = 1) and interleaved (v = 2)."""
    return [
        Layout(
            f"stack_pp2{'_v2' if v > 1 else ''}_m{m}",
            pipeline=2,
            micro_batches=m,
            batch=STACK_ROWS,
            chunks=v,
            model="stack",
        )
        for v in (1, 2)
        for m in BUBBLE_MICRO
        if v == 1 or m % 2 == 0
    ]


class BalancedStack(pl.LightningModule):
    """``STACK_BLOCKS`` identical residual MLP blocks (width ``STACK_WIDTH``, hidden 4x) and the mean
    square of the output as the loss: every stage of a pipeline does the same work per micro-batch
    and the loss is negligible, which is what the bubble formula assumes."""

    def __init__(self, smoke: bool) -> None:
        super().__init__()
        width = 32 if smoke else STACK_WIDTH
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(STACK_BLOCKS)
        )
        self.width = width

    def _loss(self, out: torch.Tensor, batch) -> torch.Tensor:
        return out.float().pow(2).mean()

    def configure_pipeline(self):
        from lightning_zero import PipelineSpec

        return PipelineSpec(layers=list(self.blocks), loss=self._loss, inputs=lambda batch: batch[0])

    def training_step(self, batch, batch_idx):  # the pipeline's schedule runs instead
        x = batch[0]
        for block in self.blocks:
            x = x + block(x)
        return self._loss(x, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def recipe(smoke: bool) -> tuple[GPTConfig, OptimizerConfig, float]:
    """Model, optimizer and clipping of cpu-tiny.yaml (the model replaced by a tiny one for ``smoke``)."""
    config = yaml.safe_load(CPU_TINY.read_text())
    optimizer = dict(config["model"]["optimizer"], betas=tuple(config["model"]["optimizer"]["betas"]))
    model = SMOKE_MODEL if smoke else GPTConfig(**config["model"]["config"])
    return model, OptimizerConfig(**optimizer), float(config["trainer"]["gradient_clip_val"])


class RandomTokens(Dataset):
    """``n`` random sequences as GPT2LM's batches: ``{"input_ids", "labels"}``, int64 (seq,), the
    labels shifted by one. Every rank builds the same rows; the sampler shards them over replicas."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 1234) -> None:
        self.tokens = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class Probe(pl.Callback):
    """At every training batch end: the time, the step cut in three (forward + backward, gradient
    reduction, clip + optimizer step + all-gather) and, on a pipeline stage, the schedule's times."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.parts: list[tuple[float, float, float]] = []  # seconds: (fwd + bwd, reduce, clip + step + gather)
        self._start = self._after_backward = self._before_step = 0.0
        self.stage_times: list[tuple[float, float]] = []  # (total_s, waiting_s) per step
        self.stage: int | None = None
        self.layers: list[str] = []  # this stage's pipeline layers

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_after_backward(self, trainer, pl_module) -> None:  # not called under pipelining
        self._after_backward = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._before_step = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())
        runner = trainer.strategy._parallel.runner
        # Stage 1 reduces once, between the end of backward (the end of the schedule) and this hook.
        compute = runner.times.total_s if runner is not None else self._after_backward - self._start
        before_step = self._before_step - self._start
        self.parts.append((compute, before_step - compute, self.stamps[-1] - self._before_step))
        if runner is not None:
            self.stage, self.layers = runner.stage, trainer.strategy._parallel.stage_plan.layer_names
            self.stage_times.append((runner.times.total_s, runner.times.waiting_s))


def _fit(layout: Layout, model: GPTConfig, optimizer: OptimizerConfig, clip: float, partition: str, steps: int) -> dict:
    from lightning_zero import ZeroStrategy
    from recipes.gpt2.module import GPT2LM

    pl.seed_everything(0, verbose=False)
    strategy = ZeroStrategy(
        stage=ZERO_STAGE,
        tensor_parallel_size=layout.tensor,
        pipeline_parallel_size=layout.pipeline,
        pipeline_micro_batches=layout.micro_batches,
        pipeline_schedule="1f1b",
        pipeline_partition=partition,
        pipeline_chunks=layout.chunks,
    )
    probe = Probe()
    # The process group survives Trainers (torchelastic variables from common.run_ranks).
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=layout.world,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        gradient_clip_val=clip,
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    # Lightning's DistributedSampler, with the strategy's data-parallel rank: the ranks of a
    # tensor-parallel group and the stages of a pipeline read the same rows.
    if layout.model == "stack":
        module = BalancedStack(smoke=model == SMOKE_MODEL)
        rows = TensorDataset(
            torch.randn(layout.batch * steps, module.width, generator=torch.Generator().manual_seed(0))
        )
    else:
        module = GPT2LM(model, optimizer)
        rows = RandomTokens(layout.batch * steps, model.block_size, model.vocab_size)
    trainer.fit(module, train_dataloaders=DataLoader(rows, batch_size=layout.per_replica))
    return {
        "stamps": probe.stamps,
        "parts": probe.parts,
        "stage": probe.stage,
        "layers": probe.layers,
        "stage_times": probe.stage_times,
    }


def _worker(rank: int, layouts: list[Layout], rounds: int, total: int, setup: tuple) -> dict:
    import lightning_zero  # noqa: F401 - registers the strategy names

    out: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for layout in layouts:
            out.setdefault(layout.name, []).append(_fit(layout, *setup, total))
    return out


def _summarize(layout: Layout, per_rank: list[dict], warmup: int) -> dict:
    """Rank 0's kept step times; per stage, the mean idle fraction over kept steps and ranks."""
    runs = [rank_out[layout.name] for rank_out in per_rank]
    steps: list[float] = []
    parts: list[tuple[float, float, float]] = []
    for run in runs[0]:  # the first stamp only opens the first interval
        steps += [b - a for a, b in zip(run["stamps"], run["stamps"][1:], strict=False)][max(warmup - 1, 0) :]
        parts += run["parts"][warmup:]
    record = {
        "layout": layout.name,
        "tensor": layout.tensor,
        "pipeline": layout.pipeline,
        "data": layout.data,
        "chunks": layout.chunks,
        "model": layout.model,
        "micro_batches": layout.micro_batches if layout.pipeline > 1 else None,
        "sequences_per_replica": layout.per_replica,
        "steps_s": steps,
        "median_s": statistics.median(steps),
        "compute_median_s": statistics.median(p[0] for p in parts),
        "reduce_median_s": statistics.median(p[1] for p in parts),
        "step_median_s": statistics.median(p[2] for p in parts),
    }
    if layout.pipeline > 1:
        idle: dict[int, list[float]] = {}
        schedule: list[float] = []
        for rank_runs in runs:
            for run in rank_runs:
                kept = run["stage_times"][warmup:]
                idle.setdefault(run["stage"], []).extend(w / t for t, w in kept if t > 0)
                if run["stage"] == 0:
                    schedule.extend(t for t, _ in kept)
        from lightning_zero.parallel.schedules import bubble_fraction

        layers = {run["stage"]: run["layers"] for rank_runs in runs for run in rank_runs}
        record["stages"] = [[name.removeprefix("model.") for name in layers[s]] for s in sorted(layers)]
        record["idle_per_stage"] = [statistics.mean(idle[s]) for s in sorted(idle)]
        record["idle_measured"] = statistics.mean(record["idle_per_stage"])
        record["idle_formula"] = bubble_fraction(layout.pipeline, layout.micro_batches, layout.chunks)
        record["schedule_median_s"] = statistics.median(schedule)
    return record


def _step_table(records: list[dict]) -> str:
    base = next(r for r in records if r["layout"] == "dp4")
    rows = []
    for r in records:
        micro = (
            f"{r['micro_batches']} x {r['sequences_per_replica'] // r['micro_batches']}" if r["micro_batches"] else "-"
        )
        idle = f"{r['idle_measured']:.2f} / {r['idle_formula']:.2f}" if "idle_measured" in r else "-"
        rows.append(
            [
                r["layout"],
                f"{r['tensor']}x{r['pipeline']}x{r['data']}",
                r["sequences_per_replica"],
                micro,
                f"{r['median_s'] * 1e3:.0f}",
                f"{min(r['steps_s']) * 1e3:.0f}-{max(r['steps_s']) * 1e3:.0f}",
                len(r["steps_s"]),
                f"{r['median_s'] / base['median_s']:.2f}",
                f"{min(r['steps_s']) / min(base['steps_s']):.2f}",
                f"{r['compute_median_s'] * 1e3:.0f}",
                f"{r['reduce_median_s'] * 1e3:.0f}",
                f"{r['step_median_s'] * 1e3:.0f}",
                idle,
            ]
        )
    headers = [
        "layout",
        "T x P x D",
        "seqs/replica",
        "micro-batches",
        "median ms",
        "min-max ms",
        "steps",
        "x dp4",
        "x dp4 (minima)",
        "fwd+bwd ms",
        "reduce ms",
        "clip+step+gather ms",
        "idle measured / formula",
    ]
    return common.format_table(headers, rows)


def _bubble_table(records: list[dict]) -> str:
    rows = [
        [
            f"{r['pipeline']}",
            r.get("chunks", 1),
            r["micro_batches"],
            r["sequences_per_replica"] // r["micro_batches"],
            f"{r['idle_formula']:.3f}",
            f"{r['idle_measured']:.3f}",
            " / ".join(f"{x:.2f}" for x in r["idle_per_stage"]),
            f"{r['idle_measured'] - r['idle_formula']:+.3f}",
            f"{r['median_s'] * 1e3:.0f}",
            f"{r['schedule_median_s'] * 1e3:.0f}",
        ]
        for r in records
    ]
    headers = [
        "P (ranks)",
        "v",
        "m",
        "rows per micro-batch",
        "formula (P-1)/(vm+P-1)",
        "measured idle",
        "per stage 0..P-1",
        "measured - formula",
        "step ms (median)",
        "schedule ms (stage 0)",
    ]
    return common.format_table(headers, rows)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _wait_for_load(limit: float, max_wait_s: float) -> None:
    """Sleep (up to ``max_wait_s``) until the 1-minute load average is at most ``limit``."""
    deadline = time.time() + max_wait_s
    while os.getloadavg()[0] > limit and time.time() < deadline:
        print(f"load {os.getloadavg()[0]:.2f} > {limit}: waiting", file=sys.stderr, flush=True)
        time.sleep(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 timed steps (a few minutes)")
    parser.add_argument("--smoke", action="store_true", help="tiny GPT, 1 round of 1 step: checks that it runs")
    parser.add_argument("--rounds", type=int, help="interleaved repetitions (default 3; --quick 2)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 6; --quick 3)")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run excluded from timing")
    parser.add_argument(
        "--partition", default="parameters", help="pipeline_partition (default: the strategy's, parameters)"
    )
    parser.add_argument("--wait-load", type=float, metavar="L", help="first wait (up to 5 min) for a 1-min load <= L")
    parser.add_argument("--json", help="output (default benchmarks/results/parallel3d[_quick].json; none with --smoke)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 3)
    steps = args.steps or (1 if args.smoke else 3 if args.quick else 6)
    setup = (*recipe(args.smoke), args.partition)

    if args.wait_load is not None:
        _wait_for_load(args.wait_load, 300)
    uptime_before, load_before = _uptime(), os.getloadavg()
    start = time.perf_counter()
    total = args.warmup + steps
    # 2 ranks first (P = 2 alone on the 2 cores), then every 4-rank configuration interleaved.
    two = [*bubble_layouts(2), *bubble_layouts(2, chunks=2), *stack_layouts()]
    four = [*STEP_LAYOUTS, *bubble_layouts(4)]
    per_rank_2 = common.run_ranks(_worker, two, rounds, total, setup, world_size=2)
    per_rank_4 = common.run_ranks(_worker, four, rounds, total, setup, world_size=4)
    wall_s = time.perf_counter() - start
    uptime_after, load_after = _uptime(), os.getloadavg()

    step_records = [_summarize(layout, per_rank_4, args.warmup) for layout in STEP_LAYOUTS]
    bubble_records = [_summarize(layout, per_rank_2, args.warmup) for layout in two if layout.model == "gpt"]
    bubble_records += [_summarize(layout, per_rank_4, args.warmup) for layout in bubble_layouts(4)]
    balanced_records = [_summarize(layout, per_rank_2, args.warmup) for layout in stack_layouts()]
    tables = {
        "step_time": _step_table(step_records),
        "bubble": _bubble_table(bubble_records),
        "bubble_balanced": _bubble_table(balanced_records),
    }

    model = setup[0]
    print(
        f"\nGPT-2 cpu-tiny ({model.n_layer} layers, width {model.n_embd}, vocab {model.vocab_size}, seq "
        f"{model.block_size}), bf16-mixed, ZeRO stage {ZERO_STAGE}, AdamW; CPU/gloo ranks, 1 thread each; median "
        f"of {steps} steps x {rounds} rounds after {args.warmup} warm-up steps per run.\n"
    )
    print(
        f"Step time on 4 ranks, global batch {GLOBAL_BATCH} sequences, pipeline micro-batches of {MICRO_SEQS} "
        f"sequences, 1F1B; idle = mean over stages of the time blocked in receives / schedule time:\n"
    )
    print(tables["step_time"])
    print(
        f"\nPipeline bubble, 1F1B (v > 1: interleaved over v chunks per stage), one replica, batch {BUBBLE_BATCH} "
        "sequences (P=2 on 2 ranks, P=4 on 4 ranks):\n"
    )
    print(tables["bubble"])
    print(
        f"\nPipeline bubble with equal stages: BalancedStack ({STACK_BLOCKS} residual MLP blocks of width "
        f"{STACK_WIDTH}, {STACK_ROWS} rows per step, mean-square loss), P=2 on 2 ranks:\n"
    )
    print(tables["bubble_balanced"])
    splits = {
        f"P={r['pipeline']},v={r.get('chunks', 1)}": " ".join("[" + " ".join(s) + "]" for s in r["stages"])
        for r in bubble_records
    }
    print(f"\nStages (pipeline_partition={args.partition!r}): " + "; ".join(f"{k}: {v}" for k, v in splits.items()))
    machine = {**common.machine(), "ranks": "4 gloo ranks (2 for the P=2 bubble rows), 1 thread each"}
    print("\n" + "; ".join(f"{k}: {v}" for k, v in machine.items()) + f"; wall time {wall_s / 60:.1f} min")
    print(f"uptime before: {uptime_before}\nuptime after:  {uptime_after}")
    if args.smoke and not args.json:
        return
    path = args.json or str(common.ROOT / "benchmarks" / "results" / f"parallel3d{'_quick' if args.quick else ''}.json")
    common.write_json(
        path,
        {
            "machine": machine,
            "quick": args.quick,
            "rounds": rounds,
            "steps": steps,
            "warmup": args.warmup,
            "global_batch": GLOBAL_BATCH,
            "micro_batch_sequences": MICRO_SEQS,
            "bubble_batch": BUBBLE_BATCH,
            "zero_stage": ZERO_STAGE,
            "partition": args.partition,
            "uptime_before": uptime_before,
            "uptime_after": uptime_after,
            "load_before": list(load_before),
            "load_after": list(load_after),
            "wall_s": wall_s,
            "step_time": step_records,
            "bubble": bubble_records,
            "bubble_balanced": balanced_records,
            "tables": tables,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
