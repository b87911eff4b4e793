"""lightning_zero: ZeRO stages 1-3, CPU offload and 3D parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``
and ``zero3_offload`` with Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.config import LossScaleConfig, PipelineConfig, ZeroConfig
from lightning_zero.parallel.pipeline import PipelineSpec
from lightning_zero.precision import OffloadPrecision
from lightning_zero.pretrained import LoadResult, load_pretrained
from lightning_zero.strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "LoadResult",
    "LossScaleConfig",
    "OffloadPrecision",
    "PipelineConfig",
    "PipelineSpec",
    "ZeroConfig",
    "ZeroStrategy",
    "load_pretrained",
]
__version__ = "0.1.0.dev0"
