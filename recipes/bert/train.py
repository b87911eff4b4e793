"""Train BERT with LightningCLI: ``python recipes/bert/train.py fit --config recipes/bert/configs/cpu-tiny.yaml``.

Any config value can be overridden on the command line, e.g. ``--trainer.max_steps 50``; resume with
``--ckpt_path last``. ``python recipes/bert/train.py fit --help`` lists every option.
"""

import sys
from pathlib import Path

# run as a script from anywhere: the repository root holds the ``recipes`` package
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recipes.bert.data import BertDataModule
from recipes.bert.module import BertMLM
from recipes.common.cli import RecipeCLI


def main(args: list[str] | None = None) -> RecipeCLI:
    """Run the CLI on ``args`` (default: ``sys.argv``)."""
    return RecipeCLI(BertMLM, BertDataModule, args=args)


if __name__ == "__main__":
    main()
