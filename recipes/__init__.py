"""Training recipes for lightning_zero: GPT-2 (causal LM) and BERT (masked LM) as LightningCLI programs.

``recipes`` is a plain package at the repository root, not part of the installed wheel: the recipe
scripts put the repository root on ``sys.path`` themselves, so ``python recipes/gpt2/train.py ...``
works from a checkout without installing anything beyond ``pip install -e ".[recipes]"``.
"""
