"""The ZeRO data path, one file per step of a parameter's life, read top to bottom:

``partition.py`` (pure layout arithmetic) -> ``build.py`` (model and optimizers into flat buffers;
``flat.py`` and ``flat_grads.py`` hold their tensors and states) -> ``gather.py`` (stage 3 module
hooks; ``gather_prefetch.py`` their prefetch window, ``guarded.py`` the modules' attribute guard)
-> ``reduce.py`` (gradient buckets) -> ``step.py`` (the optimizer on this rank's slices;
``step_kernels.py``, ``step_lamb.py`` and ``step_mapping.py`` the compiled kernels it may use) ->
``publish.py`` (updated slices back into whole parameters). ``engine.py`` owns them all; its surface
comes in mixins (``engine_step.py``, ``engine_gather.py``, ``engine_grads.py``, ``engine_groups.py``,
``engine_checkpoint.py``).

This package's namespace is the engine's surface: the names below are everything the other layers
(strategies, checkpoint, activation checkpointing, pretrained loading, memory report, plan) use.
Its modules are private to it: ``tests/unit/test_import_contract.py`` fails when a module outside
``zero/`` imports one of them, or when any import cycle appears in the package.

* :class:`ZeroEngine` and the records it takes and returns (:mod:`~lightning_zero.zero.surface`).
* Sharded construction: :class:`Recorder` records ``configure_model`` on the meta device into
  :class:`Recording` s that the engine replays into the shards; :func:`active_recording`;
  :class:`Continuation` records what a program does to the meta model after it was built, until setup.
* Before the engine exists: :func:`check_nvme_space` (the disk tier's files fit);
  :func:`fp32_norm_params` (the parameters mixed precision keeps in fp32, for the precision plugin).
* Checkpoint support: :func:`placeholders_allowed` / :func:`placeholders_ok` (``state_dict()`` of a
  sharded model), :func:`exact_storage` (a tensor saved with exactly its bytes).
* Activation checkpointing: :func:`recompute_contexts` (the ``context_fn`` that gathers for recompute).
* Weight averaging at stage 3: :func:`shard_averaged_copies`, :func:`keep_edits_in_masters`.
"""

from lightning_zero.zero.averaging import keep_edits_in_masters, shard_averaged_copies
from lightning_zero.zero.build import fp32_norm_params
from lightning_zero.zero.deferred import Continuation, Recorder, Recording, active_recording
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.engine_checkpoint import exact_storage
from lightning_zero.zero.guarded import placeholders_allowed, placeholders_ok, recompute_contexts
from lightning_zero.zero.surface import (
    HeldParam,
    LocalPiece,
    ModelParallelContext,
    OptimizerPiece,
    OptimizerPieceReader,
    ParamGroup,
    PieceReader,
    TiedAcrossStages,
)
from lightning_zero.zero.swap import check_space as check_nvme_space

__all__ = [
    "Continuation",
    "HeldParam",
    "LocalPiece",
    "ModelParallelContext",
    "OptimizerPiece",
    "OptimizerPieceReader",
    "ParamGroup",
    "PieceReader",
    "Recorder",
    "Recording",
    "TiedAcrossStages",
    "ZeroEngine",
    "active_recording",
    "check_nvme_space",
    "exact_storage",
    "fp32_norm_params",
    "keep_edits_in_masters",
    "placeholders_allowed",
    "placeholders_ok",
    "recompute_contexts",
    "shard_averaged_copies",
]
