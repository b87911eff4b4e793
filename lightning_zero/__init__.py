"""lightning_zero: ZeRO stages 1-3, CPU offload and 3D parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``
and ``zero3_offload`` with Lightning's ``StrategyRegistry`` (the Trainer's :class:`ZeroStrategy`) and with
Fabric's ``STRATEGY_REGISTRY`` (:class:`lightning_zero.fabric.FabricZeroStrategy`,
also importable as ``lightning_zero.fabric.ZeroStrategy``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import fabric
from lightning_zero.config import LossScaleConfig, PipelineConfig, ZeroConfig
from lightning_zero.memory import MemoryMonitor
from lightning_zero.parallel.pipeline import PipelineSpec
from lightning_zero.precision import OffloadPrecision
from lightning_zero.pretrained import LoadResult, load_pretrained
from lightning_zero.strategy import ZeroStrategy
from lightning_zero.sync_batchnorm import SyncBatchNorm

ZeroStrategy.register_strategies(StrategyRegistry)
fabric.FabricZeroStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "LoadResult",
    "LossScaleConfig",
    "MemoryMonitor",
    "OffloadPrecision",
    "PipelineConfig",
    "PipelineSpec",
    "SyncBatchNorm",
    "ZeroConfig",
    "ZeroStrategy",
    "fabric",
    "load_pretrained",
]
__version__ = "0.1.0"
