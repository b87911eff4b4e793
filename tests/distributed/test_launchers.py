"""The launchers a user outgrows one machine with: torchrun across two "nodes" and SLURM.

Each test starts real processes on this machine (no mocks of Lightning's environment detection):

- two ``torchrun --nnodes 2 --nproc-per-node 1`` processes, one per node rank, meeting at a static
  rendezvous on 127.0.0.1, train zero3 exactly as ``torchrun --nproc-per-node 2`` on one node does;
- two processes with the variables ``srun`` sets in a 2-node job with one task per node: Lightning
  picks its ``SLURMEnvironment`` and the global, local and node ranks are SLURM's; node-local data
  (a cache in each node's own directory, prepared once per node) is prepared and read per node.

Losses are compared for equality (tolerance 0): both layouts have the same world size, rank order,
data shards and gloo collectives over 2 ranks, so every floating-point operation runs in the same
order; only which process group "node" a rank sits in differs, which no arithmetic depends on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.testing import free_port

WORKER = Path(__file__).resolve().parent / "launch_worker.py"
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds for a whole launch: far above the ~10-20 s it takes, short of a hang


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run_all(commands: list[tuple[list[str], dict[str, str]]]) -> None:
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for cmd, env in commands]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT)
            outputs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}"


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _torchrun(out: Path, nnodes: int, node_rank: int, nproc: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(WORKER),
        str(out),
        str(nproc),
        str(nnodes),
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The records of ``torchrun --nproc-per-node 2`` on one node, shared by both tests."""
    out = tmp_path_factory.mktemp("one_node")
    _run_all([(_torchrun(out, nnodes=1, node_rank=0, nproc=2, port=free_port()), _env())])
    return _records(out)


def test_torchrun_two_nodes_train_as_two_local_ranks(tmp_path, reference):
    out = tmp_path / "two_nodes"
    out.mkdir()
    port = free_port()
    for node in range(2):
        (tmp_path / f"node{node}-tmp").mkdir()
    _run_all(
        [
            (
                _torchrun(out, nnodes=2, node_rank=node, nproc=1, port=port),
                _env(NODE_TMP=str(tmp_path / f"node{node}-tmp")),
            )
            for node in range(2)
        ]
    )
    records = _records(out)
    for rank, (record, ref) in enumerate(zip(records, reference, strict=True)):
        assert record["environment"] == "TorchElasticEnvironment"
        assert (record["global_rank"], record["local_rank"], record["node_rank"]) == (rank, 0, rank)
        assert (ref["global_rank"], ref["local_rank"], ref["node_rank"]) == (rank, rank, 0)
        assert record["world_size"] == 2
        assert len(record["losses"]) == 12  # 6 steps x 2 accumulated micro-batches
        assert record["losses"] == ref["losses"]  # tolerance 0: see the module docstring
        # prepare_data ran once per node (each node's local rank 0), into that node's own directory,
        # and every rank read its own node's copy
        assert record["prepared_data"] is True
        assert record["cache"] == f"node {rank}"


def test_slurm_two_node_job(tmp_path, reference):
    out = tmp_path / "slurm"
    out.mkdir()
    port = str(free_port())
    commands = []
    for rank in range(2):
        env = _env(
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="train",
            SLURM_NTASKS="2",
            SLURM_NNODES="2",
            SLURM_NTASKS_PER_NODE="1",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID="0",
            SLURM_NODEID=str(rank),
            # a node list whose first host is this machine: the rendezvous resolves it as SLURM would
            SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2",
            SLURM_NODELIST="127.0.0.1,127.0.0.2",
            MASTER_PORT=port,
            NODE_TMP=str(tmp_path / f"node{rank}-tmp"),  # each node's own /tmp (or $SLURM_TMPDIR)
        )
        (tmp_path / f"node{rank}-tmp").mkdir()
        commands.append(([sys.executable, str(WORKER), str(out), "1", "2"], env))
    _run_all(commands)
    records = _records(out)
    for rank, (record, ref) in enumerate(zip(records, reference, strict=True)):
        assert record["environment"] == "SLURMEnvironment"
        assert (record["global_rank"], record["local_rank"], record["node_rank"]) == (rank, 0, rank)
        assert record["world_size"] == 2
        assert record["losses"] == ref["losses"]  # tolerance 0: see the module docstring
        # prepare_data ran once per node (each node's local rank 0), into that node's own directory,
        # and every rank read its own node's copy
        assert record["prepared_data"] is True
        assert record["cache"] == f"node {rank}"
