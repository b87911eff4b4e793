"""The ``lightning-zero`` command.

    lightning-zero consolidate CKPT_DIR OUT.pt [--dtype fp32|bf16|fp16|saved] [--lightning]

``consolidate`` turns a sharded checkpoint directory into one file, on any machine (no GPU, no
process group), one parameter in memory at a time: by default the LightningModule's state dict,
which loads with ``model.load_state_dict(torch.load(OUT, weights_only=True), strict=True)``; with
``--lightning`` a whole Lightning checkpoint (optimizer states, loops, schedulers) that a DDP or
single-device Trainer resumes from (built in memory).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from lightning_zero.checkpoint.consolidate import DTYPES, consolidate, to_lightning_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="lightning_zero tools")
    commands = parser.add_subparsers(dest="command", required=True)
    cons = commands.add_parser("consolidate", help="sharded checkpoint directory -> one state dict file")
    cons.add_argument("checkpoint", help="the sharded checkpoint directory")
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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``lightning-zero`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    dtype = None if args.dtype == "saved" else DTYPES[args.dtype]
    try:
        if args.lightning:
            to_lightning_checkpoint(args.checkpoint, args.out, dtype)
        else:
            consolidate(args.checkpoint, args.out, dtype)
    except (ValueError, FileNotFoundError) as error:
        print(f"lightning-zero consolidate: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
