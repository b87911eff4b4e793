"""The recipes under 3D layouts from the command line alone (LightningCLI arguments, no code change).

GPT-2 (tiny sizes of tests/recipes) under tp2 x pp2 with sequence parallelism on 4 ranks and BERT under pp2 x dp2 on 4 ranks,
3 steps and one validation each, through the recipes' own ``main(args)``. Checked: the runs finish,
every rank of a data-parallel replica logs the same ``train_loss`` (the true loss, sent from the last
stage), the first loss is
that of an untrained model (~ln(vocabulary), within 5%: initial logits are small but not zero), and
``val_loss`` is logged. Exact parity with one process is tests/distributed/test_pipeline.py's job.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from lightning_zero.testing import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY_GPT = [
    "--model.config.n_layer=2",
    "--model.config.n_head=2",
    "--model.config.n_embd=64",
    "--model.config.block_size=32",
    "--data.seq_len=32",
]
TINY_BERT = [
    "--model.config.n_layer=2",
    "--model.config.n_head=2",
    "--model.config.hidden=64",
    "--model.config.intermediate=128",
    "--model.config.max_position=32",
    "--data.seq_len=32",
]


def _recipe_worker(rank: int, recipe: str, tmp: str, cache: str, extra: list[str]) -> dict:
    import csv

    sys.path.insert(0, str(ROOT))
    sys.argv = ["train.py"]  # LightningCLI warns when pytest's own argv is present
    if recipe == "gpt2":
        from recipes.gpt2 import train
    else:
        from recipes.bert import train
    args = [
        "fit",
        "--config",
        str(ROOT / "recipes" / recipe / "configs" / "cpu-tiny.yaml"),
        f"--data.cache_dir={cache}",
        "--data.sources=[shakespeare]",
        "--trainer.devices=4",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1",
        "--data.batch_size=4",
        f"--trainer.logger.init_args.save_dir={tmp}",
        "--trainer.callbacks=[]",
        "--trainer.enable_checkpointing=false",
        "--trainer.strategy=lightning_zero.ZeroStrategy",
        *extra,
    ]
    trainer = train.main(args).trainer
    rows = []
    if rank == 0:  # the CSVLogger writes on rank 0 only
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    return {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "step": trainer.global_step,
        "rows": rows,
    }


@pytest.mark.parametrize(
    "recipe, extra, vocab",
    [
        (
            "gpt2",
            [
                *TINY_GPT,
                "--trainer.strategy.stage=1",
                "--trainer.strategy.tensor_parallel_size=2",
                "--trainer.strategy.pipeline_parallel_size=2",
                "--trainer.strategy.sequence_parallel=true",
            ],
            50257,
        ),
        (
            "bert",
            [
                *TINY_BERT,
                "--trainer.strategy.stage=2",
                "--trainer.strategy.pipeline_parallel_size=2",
                "--trainer.strategy.pipeline_micro_batches=2",
            ],
            30522,
        ),
    ],
)
def test_recipe_runs_3d_from_the_command_line(recipe, extra, vocab, tmp_path_factory):
    cache = tmp_path_factory.mktemp("tokens")
    results = run_ranks(
        _recipe_worker, recipe, str(tmp_path_factory.mktemp("logs")), str(cache), extra, world_size=4, timeout=420
    )
    # The ranks of one data-parallel replica (its tensor- and pipeline-parallel ranks) log the same
    # true loss; replicas log their own shard's (as under DDP). Global rank = pp*D*T + dp*T + tp.
    tensor, data = (2, 1) if recipe == "gpt2" else (1, 2)
    by_replica: dict[int, set] = {}
    for rank, r in enumerate(results):
        by_replica.setdefault((rank // tensor) % data, set()).add(r["metrics"]["train_loss"])
    assert all(len(losses) == 1 for losses in by_replica.values()), by_replica
    for r in results:
        assert r["step"] == 3
        assert math.isfinite(r["metrics"]["train_loss"]) and math.isfinite(r["metrics"]["val_loss"])
    first = [float(row["train_loss"]) for row in results[0]["rows"] if row.get("train_loss")][0]
    assert first == pytest.approx(math.log(vocab), rel=0.05)
