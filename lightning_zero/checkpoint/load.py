"""Loading a checkpoint into a ZeRO run, resharding on the way: any world size, bucket size or stage.

Each rank reads, for each piece in its own slices, the overlapping pieces that the writing ranks
saved (see :mod:`~lightning_zero.checkpoint.format`). The tensors ZeRO does not partition (frozen
parameters at stages 1/2, buffers) are equal over the data-parallel group and were saved once, by its
rank 0: at resume only data-parallel rank 0 of each tensor/pipeline position reads them and
broadcasts them over its data-parallel group (:func:`_load_shared`), so a rank opens no other rank's
file for them (on a store: no download of rank 0's whole file per rank). Besides that broadcast,
only the final publish exchanges anything (stages 1/2 all-gather the loaded master slices into the
full parameters, as after a step). A plain Lightning checkpoint (DDP, single device, or our earlier
consolidated format) loads through the same code with the whole tensors as the source.

Lightning calls, after the strategy's setup (``restore_checkpoint_after_setup`` is True, so the
engine exists): ``load_checkpoint`` (Lightning's own state; this rank's random states and its own
data loader state), ``load_model_state_dict``, then, when fitting, ``load_optimizer_state_dict``
(and :func:`load_window`: the gradients of an accumulation window the checkpoint interrupted). A
mid-epoch resume restores the random states once more at ``on_train_start``, after Lightning has
created the train loader's iterator (see the strategy and docs/checkpoints.md, "Exact resume").

Speed (``benchmarks/checkpoint_store.py``): each rank file is CRC-checked once (compiled,
:mod:`lightning_zero.ops.checksum`) and memory-mapped; each piece is copied once, from the mapped file
into the master or into the optimizer's existing state tensor
(:meth:`~lightning_zero.zero.engine_checkpoint.CheckpointSurface.load_optimizer_pieces`). What remains
of a resume beyond reading the bytes is the publish's all-gather of the parameters (stages 1/2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint import rng
from lightning_zero.checkpoint.io import Location
from lightning_zero.checkpoint.lightning_dict import SHARDED_OPTIMIZER_MARKER
from lightning_zero.checkpoint.merge import Placement, Split
from lightning_zero.checkpoint.pieces import PartitionedParam, non_partitioned_state_dict, partitioned_params
from lightning_zero.checkpoint.reader import FullReader, ShardedReader
from lightning_zero.layout import ParallelLayout
from lightning_zero.parallel.tensor import is_tensor_parallel
from lightning_zero.zero import HeldParam, OptimizerPiece, placeholders_allowed

if TYPE_CHECKING:
    from lightning_zero.zero import ZeroEngine

SHARDED_KEY = "lightning_zero_sharded_checkpoint"
"""Key of the checkpoint dict that :func:`load_checkpoint` returns for a sharded checkpoint: its directory."""
SAVED_WORLD_SIZE_KEY = "lightning_zero_saved_world_size"
RESUME_KEY = "lightning_zero_resume"
"""This rank's random states and accumulation-window gradients, for an exact resume (see :func:`load_window`)."""


class SavedStateDict(MutableMapping[str, Any]):
    """``checkpoint["state_dict"]`` of a sharded checkpoint at load: every key the model saved, as
    under DDP. Lightning's saved tensors are held; each partitioned parameter is read whole from the
    rank files when it is asked for (not kept), so callbacks that read the saved weights (an EMA
    callback's ``on_load_checkpoint``) see them and nothing is read when none does."""

    def __init__(
        self, directory: Location, saved: dict[str, Any], keys: list[str], reader: ShardedReader | None = None
    ) -> None:
        self._directory = directory
        self._saved = saved
        self._keys = list(dict.fromkeys([*keys, *saved]))
        self._reader = reader

    @property
    def reader(self) -> ShardedReader:
        """The checkpoint's reader, shared by the model and optimizer loads of one resume: each rank
        file is opened (and its CRC-32 checked) once."""
        if self._reader is None:
            self._reader = ShardedReader(self._directory, self._saved)
        return self._reader

    def __getitem__(self, key: str) -> Any:
        if key in self._saved:
            return self._saved[key]
        if key not in self._keys:
            raise KeyError(key)
        return self.reader.full(key).clone()

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self._keys:
            self._keys.append(key)
        self._saved[key] = value

    def __delitem__(self, key: str) -> None:
        self._keys.remove(key)
        self._saved.pop(key, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


def reader_for(checkpoint: Mapping[str, Any]) -> ShardedReader | FullReader:
    if SHARDED_KEY in checkpoint:
        saved = checkpoint["state_dict"]
        if isinstance(saved, SavedStateDict):
            return saved.reader
        # the tensors Lightning's file holds (the partitioned ones come from the rank files)
        held = saved
        return ShardedReader(ckpt_io.location(checkpoint[SHARDED_KEY]), held)
    return FullReader(checkpoint["state_dict"])


def load_checkpoint(
    path: fmt.PathLike, weights_only: bool | None, rank: int, load_plain: Callable[[fmt.PathLike], dict[str, Any]]
) -> dict[str, Any]:
    """Lightning's part of the checkpoint at ``path`` (a sharded directory, or a plain file through
    ``load_plain``), and this rank's random states restored when the checkpoint has them.

    With a process group, call on all ranks: they agree on the outcome (one small all-gather), so a
    rank that cannot read its part (a node-local checkpoint whose file for this rank is not on its
    node) raises and the others raise too, naming it, instead of waiting for it in the load."""
    world_size = comm.world_size(None) if comm.initialized() else 1
    if world_size == 1:
        return _load_checkpoint(path, weights_only, rank, load_plain, world_size)
    try:
        checkpoint, failure = _load_checkpoint(path, weights_only, rank, load_plain, world_size), None
    except Exception as exc:
        checkpoint, failure = None, exc
    reports = comm.all_gather_object(None if failure is None else f"{type(failure).__name__}: {failure}", None)
    if failure is not None:
        raise failure
    failed = [f"rank {r}: {report}" for r, report in enumerate(reports) if report is not None]
    if failed:
        raise ValueError(f"loading the checkpoint {path} failed on other ranks: " + " | ".join(failed))
    assert checkpoint is not None
    return checkpoint


def _load_checkpoint(
    path: fmt.PathLike,
    weights_only: bool | None,
    rank: int,
    load_plain: Callable[[fmt.PathLike], dict[str, Any]],
    world_size: int,
) -> dict[str, Any]:
    directory = fmt.resolve(path)
    if directory is None:
        return load_plain(path)
    meta = fmt.read_metadata(directory)
    if meta.get("rank_nodes") is not None and rank < meta["world_size"]:
        fmt.check_own_file(directory, meta, rank)  # node-local: this node's directory has this node's ranks
    else:
        fmt.check_rank_files(directory, meta)
    # weights_only=None means torch's default (True): Lightning's state is plain containers; pass
    # weights_only=False to Trainer.fit only for a trusted checkpoint with arbitrary hyperparameters.
    checkpoint = fmt.load_file(
        directory / fmt.lightning_file(meta),
        meta.get("lightning_file_crc32"),
        "Lightning's state, written by rank 0",
        weights_only=True if weights_only is None else weights_only,
        mmap=False,
    )
    checkpoint[SHARDED_KEY] = str(directory)
    checkpoint[SAVED_WORLD_SIZE_KEY] = meta["world_size"]
    keys = meta.get("state_dict_keys") or list(meta.get("params", {}))
    held = checkpoint.get("state_dict", {})
    reader = ShardedReader(directory, held, meta=meta)
    checkpoint["state_dict"] = SavedStateDict(directory, held, keys, reader)
    resumed: dict[str, Any] = {"mid_window": bool(meta.get("mid_window", False)), "window": None, "rng": None}
    if rank < meta["world_size"]:
        own = reader.rank_data(rank)  # read and checked once: the model and optimizer loads reuse it
        resumed["rng"] = own["rng"]
        rng.restore(own["rng"])
        if meta["world_size"] == world_size:
            resumed["window"] = own.get("window")
            loops = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
            if own.get("loader") is not None and "combined_loader" in loops:
                loops["combined_loader"] = own["loader"]  # this rank's own position (Lightning saves rank 0's)
    checkpoint[RESUME_KEY] = resumed
    return checkpoint


def load_window(checkpoint: Mapping[str, Any], engine: ZeroEngine | None) -> None:
    """Put back this rank's gradients of the accumulation window the checkpoint was saved in (if it was
    saved in the middle of one): only into the same world size, stage and buckets, ``ValueError``
    otherwise. Local."""
    resumed = checkpoint.get(RESUME_KEY)
    if resumed is None or not resumed["mid_window"]:
        return
    if resumed["window"] is None or engine is None:
        raise ValueError(
            f"the checkpoint {checkpoint.get(SHARDED_KEY)} was saved in the middle of a gradient-accumulation window "
            f"and its partial gradients fit only its own world size ({checkpoint.get(SAVED_WORLD_SIZE_KEY)} ranks, "
            f"here {comm.world_size(None)}). Resume with that world size, or from a checkpoint saved at a window "
            "boundary (ModelCheckpoint(every_n_train_steps=...) saves there)."
        )
    engine.load_window_state(resumed["window"])


def _check_keys(reader: Any, local: dict[str, tuple | None], strict: bool, where: str) -> set[str]:
    """The keys to load here; ``ValueError`` listing what does not match (only shapes when not ``strict``).

    ``local`` maps this rank's keys to their whole (unsplit) shapes. The check is made against the
    keys of all ranks (each pipeline stage holds only some), so every rank raises the same error.
    Call on all ranks of the default group.
    """
    expected: dict[str, tuple | None] = {}
    for keys in comm.all_gather_object(local, None):
        for key, shape in keys.items():
            expected.setdefault(key, shape)
    found = {k: (tuple(s) if s is not None else None) for k in reader.keys() for s in [reader.shape(k)]}  # noqa: SIM118 (a reader, not a dict)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {found[k]} vs model {expected[k]}"
        for k in set(found) & set(expected)
        if found[k] is not None and expected[k] is not None and found[k] != expected[k]
    )
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {missing[:10]}")
    if strict and unexpected:
        problems.append(f"not in the model ({len(unexpected)}): {unexpected[:10]}")
    if shapes:
        problems.append(f"shapes differ ({len(shapes)}; whole shapes, before any tensor-parallel split): {shapes[:10]}")
    if problems:
        raise ValueError(
            f"the checkpoint {where} does not fit this model: " + "; ".join(problems) + ". Load it into the "
            "LightningModule that wrote it"
            + (" (or set model.strict_loading = False to skip missing and unexpected keys)." if not shapes else ".")
        )
    return set(found) & set(local)


def _match(p: PartitionedParam, keys: set[str]) -> str | None:
    """The checkpoint's key for ``p``: its name, or an alias (a tied weight saved under another name)."""
    return next((k for k in (p.name, *p.aliases) if k in keys), None)


def _splits(module: nn.Module, params: dict[str, PartitionedParam], placement: Placement) -> dict[str, Split | None]:
    """This rank's tensor-parallel part of each state-dict key (``None``: held whole)."""
    out: dict[str, Split | None] = {}
    for p in params.values():
        out.update({key: placement.split(p.partition_dim) for key in (p.name, *p.aliases)})
    for key, value in module.state_dict(keep_vars=True).items():
        if key not in out and torch.is_tensor(value) and is_tensor_parallel(value):
            out[key] = placement.split(getattr(value, "partition_dim", None))
    return out


def _module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{key: the module's own parameter or buffer}`` of the state-dict keys that are one (not extra
    state, nor a tensor a state-dict hook made)."""
    owned = {id(t) for t in (*module.parameters(), *module.buffers())}
    with placeholders_allowed():  # stage 3: the partitioned parameters have no storage here; not used
        entries = module.state_dict(keep_vars=True).items()
        return {k: v for k, v in entries if torch.is_tensor(v) and id(v) in owned}


def _load_shared(
    module: nn.Module,
    reader: ShardedReader,
    wanted: list[str],
    splits: dict[str, Split | None],
    group: comm.ProcessGroup,
) -> None:
    """Load the non-partitioned entries ``wanted`` (frozen parameters, buffers, extra state) on every
    rank of the data-parallel ``group`` while only its rank 0 reads those held in the rank files.

    They are equal over the data-parallel group (saved once, by its rank 0: see
    :func:`~lightning_zero.checkpoint.pieces.rank_report`). Group rank 0 loads them as before
    (``module.load_state_dict``, hooks included) and broadcasts the module's resulting tensors in
    place, a bounded batch at a time; the other ranks read no rank file but their own (on a store, a
    rank 0 file is a download of its whole optimizer shard). Entries in Lightning's file, which every
    rank has read, and those that are not the module's own tensors load on every rank, as before.
    Call on all ranks of ``group``.
    """
    own = _module_tensors(module)
    shared = [k for k in wanted if reader.in_files(k) and k in own]
    reads = wanted if comm.rank(group) == 0 else [k for k in wanted if k not in shared]
    try:
        module.load_state_dict({k: reader.full(k, split=splits.get(k)) for k in reads}, strict=False)
        failure = None
    except Exception as exc:  # reported to the group below: the others would wait in the broadcast
        failure = exc
    reports = comm.all_gather_object(None if failure is None else f"{type(failure).__name__}: {failure}", group)
    if failure is not None:
        raise failure
    failed = [f"data-parallel rank {r}: {report}" for r, report in enumerate(reports) if report is not None]
    if failed:
        raise RuntimeError("loading the frozen parameters and buffers failed on other ranks: " + " | ".join(failed))
    comm.broadcast_each(list({id(own[k]): own[k] for k in shared}.values()), 0, group)


def load_model(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    layout: ParallelLayout | None = None,
) -> None:
    """Load the parameters and buffers of ``checkpoint`` into ``module`` and the engine's slices.

    Partitioned parameters: each rank writes its own pieces into the fp32 ``master`` (exact when the
    checkpoint holds fp32 masters) and publishes. Everything else: ``module.load_state_dict``; from a
    sharded checkpoint, the tensors held in the rank files only on data-parallel rank 0, which
    broadcasts them over the engine's data-parallel group (:func:`_load_shared`). Under
    tensor parallelism (``layout``) each rank takes its part of each split parameter, whatever the
    tensor-parallel size that saved it. Call on all ranks of the default group.
    """
    reader = reader_for(checkpoint)
    where = checkpoint.get(SHARDED_KEY, "file")
    placement = Placement.of(comm.rank(None), comm.world_size(None), layout)
    params = partitioned_params(module, engine)
    splits = _splits(module, params, placement)
    rest = non_partitioned_state_dict(module, params)
    local: dict[str, tuple | None] = {}
    for key, value in rest.items():
        split = splits.get(key)
        dim = split.dim if split is not None else None
        local[key] = tuple(placement.full_shape(value.shape, dim)) if torch.is_tensor(value) else None
    for p in params.values():
        local.update({key: tuple(placement.full_shape(p.shape, p.partition_dim)) for key in (p.name, *p.aliases)})
    keys = _check_keys(reader, local, strict, where)
    wanted = [k for k in rest if k in keys]
    if isinstance(reader, FullReader) and all(split is None for split in splits.values()):
        # DDP's call: a plain checkpoint (whole tensors, in every rank's memory) goes through the
        # module's own load_state_dict (a user's override or hooks) with Lightning's strictness; at
        # stage 3 the model's full-state-dict hooks take each rank's pieces. The engine's fp32
        # masters are then loaded from the same dict below, exactly
        module.load_state_dict(reader.state_dict, strict=strict)
    elif engine is None or not isinstance(reader, ShardedReader):
        # a plain checkpoint is in every rank's memory already (and without an engine, no group to share)
        module.load_state_dict({k: reader.full(k, split=splits.get(k)) for k in wanted}, strict=False)
    else:
        _load_shared(module, reader, wanted, splits, engine.group)
    if engine is None:
        return
    by_param = {id(p.held.param): p for p in params.values()}

    def read(held: HeldParam, param_offset: int, numel: int) -> torch.Tensor | None:
        p = by_param[id(held.param)]
        key = _match(p, keys)
        return None if key is None else reader.read(key, param_offset, numel, split=splits[p.name])

    engine.load_pieces(read)
    engine.publish()


def _load_sharded_optimizer(
    reader: ShardedReader,
    index: int,
    optimizer: torch.optim.Optimizer,
    engine: ZeroEngine,
    saved: dict[str, Any],
    params: dict[str, PartitionedParam],
    placement: Placement,
) -> None:
    keys = set(reader.keys())
    by_param = {id(p.held.param): p for p in params.values()}
    groups = engine.param_groups(optimizer)
    here = [[by_param[id(param)] for param in group.params if id(param) in by_param] for group in groups]
    there = [{reader.primary(n) for n in group["param_names"]} for group in saved["param_groups"]]
    if len(here) != len(there):
        raise ValueError(
            f"the checkpoint's {saved['class']} has {len(there)} parameter groups but {type(optimizer).__name__} "
            f"here has {len(here)}; load it into the same model and configure_optimizers that wrote it."
        )
    for g_index, (mine, saved_names) in enumerate(zip(here, there, strict=True)):
        outside = [
            p.name for p in mine if (key := _match(p, keys)) is not None and reader.primary(key) not in saved_names
        ]
        if outside:
            raise ValueError(
                f"parameter group {g_index} of {type(optimizer).__name__} holds {outside[:5]}, which the checkpoint's "
                f"{saved['class']} had in another group; load it into the same configure_optimizers that wrote it."
            )

    def read(held: HeldParam, param_offset: int, numel: int) -> OptimizerPiece | None:
        p = by_param[id(held.param)]
        key = _match(p, keys)
        entry = None if key is None else reader.optimizer_entry(key, index)
        if key is None or entry is None:
            return None
        split = placement.split(p.partition_dim)
        slices = {
            k: reader.read(key, param_offset, numel, k, split=split, optimizer=index).to(dtype)
            for k, dtype in entry["slices"].items()
        }
        return OptimizerPiece(slices=slices, scalars=entry["scalars"])

    engine.load_optimizer_pieces(optimizer, saved["param_groups"], read)


def load_optimizers(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    layout: ParallelLayout | None = None,
) -> None:
    """Load every optimizer's state: sharded (read per piece, each rank its tensor-parallel part)
    or consolidated (the earlier single-file format, or a plain optimizer's). Call on all ranks."""
    states = checkpoint["optimizer_states"]
    if len(states) != len(optimizers):
        raise ValueError(
            f"the checkpoint has {len(states)} optimizer states but configure_optimizers returned "
            f"{len(optimizers)} optimizers."
        )
    if engine is not None:
        # Groups a callback added back before the states load (BaseFinetuning re-adds the groups of
        # the run it resumes in on_fit_start) are partitioned first, so that the states find them.
        engine.add_param_groups()
    params = partitioned_params(module, engine)
    reader = reader_for(checkpoint)
    placement = Placement.of(comm.rank(None), comm.world_size(None), layout)
    consolidated = False
    for index, (optimizer, saved) in enumerate(zip(optimizers, states, strict=True)):
        if engine is None or not engine.manages(optimizer):
            optimizer.load_state_dict(saved)
        elif saved.get("format") == SHARDED_OPTIMIZER_MARKER:
            assert isinstance(reader, ShardedReader)
            _load_sharded_optimizer(reader, index, optimizer, engine, saved, params, placement)
        elif placement.layout.tensor > 1:
            raise ValueError(
                f"a consolidated (single-file) optimizer state cannot be split for tensor_parallel_size="
                f"{placement.layout.tensor}; resume from a sharded checkpoint, or load the weights only "
                "(e.g. model.load_state_dict before fit, without ckpt_path)."
            )
        else:
            engine.load_consolidated(optimizer, saved)
            consolidated = True
    if engine is not None and consolidated:
        # A consolidated state may carry fp32 masters. (A sharded one does not: load_model published
        # the masters already, and publishing again is a whole all-gather of the parameters.)
        engine.publish()


def replay_callback_restores(module: Any) -> None:
    """What callbacks do in ``on_fit_start`` with their restored state. Under DDP their state is
    restored before ``on_fit_start``; under ZeRO (``restore_checkpoint_after_setup``) after it, so
    the strategy runs this part of their ``on_fit_start`` again before the optimizer and LR scheduler
    states load, as DDP runs it before them:

    * ``BaseFinetuning`` (``BackboneFinetuning``) puts back the parameter groups of the run it
      resumes (else the optimizer states of the resumed run would meet fewer groups);
    * ``StochasticWeightAveraging`` that had started averaging drops the user's LR scheduler (its
      own ``SWALR`` comes back from its state at the next epoch start): else the checkpoint's
      ``SWALR`` state would load into the user's scheduler (a ``LambdaLR``: ``KeyError: 'lr_lambdas'``)."""
    from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
    from lightning.pytorch.trainer.states import TrainerFn

    trainer = getattr(module, "_trainer", None)
    if module is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and callback._restarting:
            BaseFinetuning.on_fit_start(callback, trainer, module)
        if isinstance(callback, StochasticWeightAveraging) and callback._scheduler_state is not None:
            StochasticWeightAveraging._clear_schedulers(trainer)


def current_model_source(checkpoint: Mapping[str, Any], callbacks: list[Any]) -> dict[str, Any] | None:
    """Lightning's ``WeightAveraging`` checkpoint (``state_dict``: the averaged weights,
    ``current_model_state``: the model's own) resumed at stage 3: the checkpoint to load the model
    from, its ``current_model_state`` as a plain (whole-tensor) state dict; ``None`` for any other."""
    from lightning.pytorch.callbacks import WeightAveraging

    if not any(isinstance(c, WeightAveraging) for c in callbacks):
        return None
    current = checkpoint.get("current_model_state")
    if not isinstance(current, Mapping) or "averaging_state" not in checkpoint:
        return None
    source = {k: v for k, v in checkpoint.items() if k != SHARDED_KEY}
    source["state_dict"] = dict(current)
    return source
