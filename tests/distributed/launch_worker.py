"""One rank of the launcher tests (``test_launchers.py``): trains zero3 on the parity model, however the
process was started (torchrun on one or two "nodes", or SLURM's variables), and writes what it saw.

    python tests/distributed/launch_worker.py OUT_DIR DEVICES NUM_NODES

writes ``OUT_DIR/rank{global_rank}.json``: the cluster environment Lightning detected, the global,
local and node ranks, the world size, the losses of every micro-batch, and (with ``NODE_TMP`` set: a
node-local directory, one per simulated node) whether this rank prepared the node's data cache and
what it read from it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

# run by path (by torchrun, or as SLURM's task): the repository root, for tests.helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.models import ParityModel  # noqa: E402 - after the path above
from tests.helpers.trainer import fit  # noqa: E402 - after the path above


class NodeLocalData(ParityModel):
    """Writes a "cache" into the node-local directory ``$NODE_TMP`` in ``prepare_data``, which
    Lightning runs once per node (on its local rank 0), and reads it back in ``setup`` on every rank,
    as the recipes' token cache does."""

    prepared = False

    def prepare_data(self) -> None:
        NodeLocalData.prepared = True
        Path(os.environ["NODE_TMP"], "cache.txt").write_text(f"node {self.trainer.node_rank}")

    def setup(self, stage: str) -> None:
        self.cache = Path(os.environ["NODE_TMP"], "cache.txt").read_text()


def main(out_dir: str, devices: int, num_nodes: int) -> None:
    torch.set_num_threads(1)  # two ranks share the cores
    trainer, model = fit(
        {"stage": 3, "reduce_bucket_size": 40, "param_persistence_threshold": 0},
        devices=devices,
        trainer_kwargs={"num_nodes": num_nodes},
        model_cls=NodeLocalData if "NODE_TMP" in os.environ else None,
    )
    strategy = trainer.strategy
    record = {
        "environment": type(strategy.cluster_environment).__name__,
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "losses": model.losses,
        "prepared_data": NodeLocalData.prepared,
        "cache": getattr(model, "cache", None),
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
