"""The ``lightning-zero`` command.

    lightning-zero consolidate CKPT_DIR [CKPT_DIR ...] OUT.pt [--dtype fp32|bf16|fp16|saved] [--lightning] [--trust-pickles]
    lightning-zero report --params 1.5B --dp 8 --stage 3 [--precision bf16-mixed] [--offload-optimizer] [--offload-parameters]
    lightning-zero plan MODEL --world-size 1024 --stage 3 [--kwargs JSON] [--input 8,128:int64] [layout options]

``consolidate`` turns a sharded checkpoint directory into one file, on any machine (no GPU, no
process group), one parameter in memory at a time: by default the LightningModule's state dict,
which loads with ``model.load_state_dict(torch.load(OUT, weights_only=True), strict=True)``; with
``--lightning`` a whole Lightning checkpoint (optimizer states, loops, schedulers) that a DDP or
single-device Trainer resumes from (built in memory).

A node-local checkpoint (``node_local_storage=True``) is given as its nodes' directories, each
once (copied to one machine, or mounted there): ``lightning-zero consolidate node0/ck/last.ckpt
node1/ck/last.ckpt OUT.pt`` reads their union, and names the ranks whose files are missing.

``CKPT_DIR`` and ``OUT`` may be fsspec URLs (``s3://bucket/run/epoch=3.ckpt``) with the filesystem's
package installed (see :mod:`lightning_zero.checkpoint.io`).

``report`` prints the per-rank model-state memory of a parameter count and layout from the ZeRO
formulas (:mod:`lightning_zero.report`). ``plan`` runs the engine itself on meta tensors in a fake
process group of the given size and prints one rank's model-state memory and collectives per step
(:mod:`lightning_zero.plan`); MODEL is ``package.module:Class`` or a Hugging Face ``config.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from lightning_zero.checkpoint.consolidate import DTYPES, consolidate, to_lightning_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="lightning_zero tools")
    commands = parser.add_subparsers(dest="command", required=True)
    cons = commands.add_parser("consolidate", help="sharded checkpoint directory -> one state dict file")
    cons.add_argument(
        "checkpoint",
        nargs="+",
        help="the sharded checkpoint directory (node-local storage: every node's directory of it, each once)",
    )
    cons.add_argument("out", help="the file to write")
    cons.add_argument(
        "--dtype",
        choices=[*DTYPES, "saved"],
        default="fp32",
        help="dtype of floating tensors (default fp32; 'saved': as stored, the fp32 masters under mixed precision)",
    )
    cons.add_argument(
        "--lightning", action="store_true", help="write a whole Lightning checkpoint that DDP resumes from"
    )
    cons.add_argument(
        "--trust-pickles",
        action="store_true",
        help="unpickle Lightning's state fully (hyperparameters holding a pathlib.Path or your own classes); "
        "only for a checkpoint you trust (default: weights only)",
    )
    rep = commands.add_parser("report", help="per-rank model-state memory estimate (ZeRO formulas)")
    rep.add_argument("--params", required=True, help="parameter count, e.g. 124M, 1.5B")
    rep.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    rep.add_argument("--stage", type=int, default=2, help="0 (DDP), 1, 2 or 3 (default 2)")
    rep.add_argument("--precision", default="bf16-mixed", help="32-true, bf16-mixed, 16-mixed or bf16-true")
    rep.add_argument("--offload-optimizer", action="store_true")
    rep.add_argument("--offload-parameters", action="store_true")
    _plan_parser(commands)
    return parser


def _plan_parser(commands: argparse._SubParsersAction) -> None:
    pl = commands.add_parser("plan", help="per-rank memory and collectives from the engine on meta tensors")
    pl.add_argument("model", help="package.module:Class, or a Hugging Face config.json (or its directory)")
    pl.add_argument("--kwargs", default="{}", help="the class's constructor arguments as JSON (default {})")
    pl.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    pl.add_argument("--stage", type=int, default=2, help="1, 2 or 3 (default 2)")
    pl.add_argument("--precision", default="bf16-mixed", help="32-true, bf16-mixed or bf16-true")
    pl.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the ranks' accelerator")
    pl.add_argument("--offload-optimizer", action="store_true")
    pl.add_argument("--offload-parameters", action="store_true")
    pl.add_argument("--no-pin-memory", action="store_true")
    for name in ("reduce-bucket-size", "param-persistence-threshold", "prefetch-bucket-size"):
        pl.add_argument(f"--{name}", help="elements (default: the strategy's)")
    pl.add_argument("--input", action="append", help="a forward input SHAPE[:DTYPE], e.g. 8,128:int64 (repeat)")
    pl.add_argument("--micro-batch", type=int, default=1, help="HF models: sequences per rank (default 1)")
    pl.add_argument("--seq-len", type=int, default=128, help="HF models: tokens per sequence (default 128)")


def _plan(args: argparse.Namespace) -> int:
    import json

    from lightning_zero.config import OffloadConfig, ZeroConfig
    from lightning_zero.plan import format_plan, plan
    from lightning_zero.plan.model import parse_input

    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError(f"--kwargs {args.kwargs!r} must be a JSON object")
        sizes: dict[str, Any] = {
            key: (v if v == "auto" else int(v))
            for key in ("reduce_bucket_size", "param_persistence_threshold", "prefetch_bucket_size")
            if (v := getattr(args, key)) is not None
        }
        result = plan(
            args.model,
            args.world_size,
            zero=ZeroConfig(stage=args.stage, **sizes),
            offload=OffloadConfig(
                offload_optimizer=args.offload_optimizer,
                offload_parameters=args.offload_parameters,
                pin_memory=not args.no_pin_memory,
            ),
            precision=args.precision,
            device=args.device,
            model_kwargs=kwargs,
            inputs=[parse_input(text) for text in args.input] if args.input else None,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
        )
    except ValueError as error:  # json.JSONDecodeError is one
        print(f"lightning-zero plan: error: {error}", file=sys.stderr)
        return 2
    print(format_plan(result))
    return 0


def _report(args: argparse.Namespace) -> int:
    from lightning_zero.report import estimate, format_estimate, parse_count

    try:
        result = estimate(
            parse_count(args.params),
            args.dp,
            args.stage,
            args.precision,
            args.offload_optimizer,
            args.offload_parameters,
        )
    except ValueError as error:
        print(f"lightning-zero report: error: {error}", file=sys.stderr)
        return 2
    print(format_estimate(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-zero`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "report":
        return _report(args)
    if args.command == "plan":
        return _plan(args)
    dtype = None if args.dtype == "saved" else DTYPES[args.dtype]
    source = args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint
    try:
        if args.lightning:
            to_lightning_checkpoint(source, args.out, dtype, trust_pickles=args.trust_pickles)
        else:
            consolidate(source, args.out, dtype, trust_pickles=args.trust_pickles)
    except (ValueError, FileNotFoundError) as error:
        print(f"lightning-zero consolidate: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
