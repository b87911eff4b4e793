"""lightning_zero: ZeRO stages 1-3, CPU offload and 3D parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy names with Lightning's ``StrategyRegistry``.
"""
