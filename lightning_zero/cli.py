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
    from lightning_zero.plan.command import add_parser

    add_parser(commands)
    return parser


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
        from lightning_zero.plan.command import run

        return run(args)
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
