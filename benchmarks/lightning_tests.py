"""Lightning's own ``tests_pytorch`` on 2 CPU ranks under DDP and under each ZeRO system.

Run (one system per call on a shared machine; the table merges every system found in ``--out``)::

    git -C <lightning git dir> archive 2.6.5 tests pyproject.toml | tar -x -C /tmp/lightning
    python benchmarks/lightning_tests.py --lightning /tmp/lightning --systems ddp
    python benchmarks/lightning_tests.py --lightning /tmp/lightning --systems zero2
    python benchmarks/lightning_tests.py --table          # pass counts, and what passes under DDP only

Each system runs the chosen files (``--files``, default :data:`FILES`) in two pytest processes,
``LOCAL_RANK`` 0 and 1, that the plugin :mod:`lightning_tests_plugin` keeps on the same test and whose
Trainers it moves to the system's strategy on 2 CPU devices. A test passes when it passes on both
ranks, is skipped when rank 0 skips it, and fails otherwise. Results: ``<out>/<system>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
# the files whose outcome a strategy can change: optimization, checkpointing, callbacks, loops, hooks
FILES = (
    "trainer/optimization/test_manual_optimization.py",
    "trainer/optimization/test_optimizers.py",
    "trainer/optimization/test_multiple_optimizers.py",
    "trainer/optimization/test_backward_calls.py",
    "core/test_lightning_optimizer.py",
    "checkpointing/test_model_checkpoint.py",
    "checkpointing/test_checkpoint_callback_frequency.py",
    "checkpointing/test_trainer_checkpoint.py",
    "checkpointing/test_torch_saving.py",
    "trainer/connectors/test_checkpoint_connector.py",
    "callbacks/test_stochastic_weight_avg.py",
    "callbacks/test_weight_averaging.py",
    "callbacks/test_early_stopping.py",
    "callbacks/test_lr_monitor.py",
    "callbacks/test_finetuning_callback.py",
    "callbacks/test_gradient_accumulation_scheduler.py",
    "callbacks/test_model_checkpoint_manual_opt.py",
    "callbacks/test_model_checkpoint_edge_cases.py",
    "callbacks/test_model_checkpoint_additional_cases.py",
    "loops/test_training_loop.py",
    "loops/test_evaluation_loop.py",
    "loops/test_loops.py",
    "loops/test_training_epoch_loop.py",
    "models/test_hooks.py",
    "models/test_restore.py",
    "trainer/flags/test_val_check_interval.py",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_system(args: argparse.Namespace, system: str) -> dict:
    """Both rank processes of one system; returns {nodeid: outcome} and the wall time."""
    checkout = Path(args.lightning).resolve()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = [f"tests/tests_pytorch/{f}" for f in (args.files.split(",") if args.files else FILES)]
    # a rerun starts from empty folders: Lightning's tests list what their checkpoint folder holds
    shutil.rmtree(out / "tmp" / system, ignore_errors=True)
    sync_port = free_port()
    procs = []
    start = time.time()
    for rank in (0, 1):
        env = {
            **os.environ,
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "LZ_LT_SYSTEM": system,
            "LZ_LT_SYNC_PORT": str(sync_port),
            "LZ_LT_TMP": str(out / "tmp"),
            "LZ_LT_PG_TIMEOUT": str(args.pg_timeout),
            "LZ_LT_ZERO_OPTIONS": args.zero_options,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *files,
            "-p",
            "lightning_tests_plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            "--color=no",
            f"--timeout={args.timeout}",
            f"--junitxml={out / f'{system}.rank{rank}.xml'}",
        ]
        if args.k:
            cmd += ["-k", args.k]
        log = open(out / f"{system}.rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        proc.wait()
        log.close()
    for rank in (0, 1):
        tail = (out / f"{system}.rank{rank}.log").read_text().splitlines()[-3:]
        if any("during collection" in line for line in tail):
            raise RuntimeError(f"{system}: rank {rank} could not collect the tests, see {out}/{system}.rank{rank}.log")
    outcomes = [read_junit(out / f"{system}.rank{rank}.xml") for rank in (0, 1)]
    merged = {}
    for nodeid, first in outcomes[0].items():
        second = outcomes[1].get(nodeid, "missing")
        merged[nodeid] = "skipped" if first == "skipped" else ("passed" if first == second == "passed" else "failed")
    result = {"system": system, "wall_s": time.time() - start, "files": files, "tests": merged}
    (out / f"{system}.json").write_text(json.dumps(result, indent=1))
    return result


def read_junit(path: Path) -> dict[str, str]:
    """{nodeid-like 'classname::name': passed/failed/skipped} from pytest's junit XML."""
    if not path.exists():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        if outcomes.get(key) != "failed":  # an error in teardown after a pass is a failure
            outcomes[key] = outcome
    return outcomes


def table(out: Path) -> str:
    """Pass counts per system and the tests that pass under DDP but not under each ZeRO system."""
    results = {s: json.loads((out / f"{s}.json").read_text()) for s in SYSTEMS if (out / f"{s}.json").exists()}
    lines = ["| system | tests | passed | failed | skipped | wall s |", "|---|---|---|---|---|---|"]
    for system, result in results.items():
        values = list(result["tests"].values())
        counts = [values.count(k) for k in ("passed", "failed", "skipped")]
        lines.append(f"| {system} | {len(values)} | {' | '.join(map(str, counts))} | {result['wall_s']:.0f} |")
    ddp = results.get("ddp", {}).get("tests", {})
    for system, result in results.items():
        if system == "ddp":
            continue
        lost = sorted(t for t, o in ddp.items() if o == "passed" and result["tests"].get(t) != "passed")
        lines.append(f"\n{system}: {len(lost)} pass under DDP but not here")
        lines.extend(f"  {t}" for t in lost)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lightning", help="a Lightning checkout (with tests/tests_pytorch and pyproject.toml)")
    parser.add_argument("--systems", default="ddp", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--files", help="comma-separated paths under tests_pytorch (default: FILES)")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--out", default=str(HERE / "out" / "lightning_tests"), help="results folder")
    parser.add_argument("--timeout", type=int, default=240, help="pytest-timeout per test, seconds")
    parser.add_argument("--pg-timeout", type=int, default=90, help="collective timeout, seconds")
    parser.add_argument(
        "--zero-options",
        default="state_dict_type=full",
        help="ZeroStrategy string options, name=value,... (Lightning's tests torch.load their checkpoint files)",
    )
    parser.add_argument("--table", action="store_true", help="only print the table of the results in --out")
    args = parser.parse_args()
    if not args.table:
        if not args.lightning:
            parser.error("--lightning is required to run tests")
        for system in args.systems.split(","):
            if system not in SYSTEMS:
                parser.error(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
            result = run_system(args, system)
            print(f"{system}: {len(result['tests'])} tests in {result['wall_s']:.0f} s", flush=True)
    print(table(Path(args.out)))


if __name__ == "__main__":
    main()
