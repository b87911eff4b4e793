"""Train GPT-2 with LightningCLI: ``python recipes/gpt2/train.py fit --config recipes/gpt2/configs/cpu-tiny.yaml``.

Any config value can be overridden on the command line, e.g. ``--trainer.max_steps 50``; resume with
``--ckpt_path last``. ``python recipes/gpt2/train.py fit --help`` lists every option.
"""

import sys
from pathlib import Path

# run as a script from anywhere: the repository root holds the ``recipes`` package
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recipes.common.cli import RecipeCLI
from recipes.gpt2.data import GPT2DataModule
from recipes.gpt2.module import GPT2LM


def main(args: list[str] | None = None) -> RecipeCLI:
    """Run the CLI on ``args`` (default: ``sys.argv``)."""
    return RecipeCLI(GPT2LM, GPT2DataModule, args=args)


if __name__ == "__main__":
    main()
