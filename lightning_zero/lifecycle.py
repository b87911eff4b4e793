"""The life of one ZeRO run around its engine, written once for the Trainer and the Fabric strategy.

:class:`lightning_zero.ZeroStrategy` (Lightning's Trainer API) and
:class:`lightning_zero.fabric.FabricZeroStrategy` (Fabric's) are adapters: they turn their API's calls
into the steps of one :class:`Lifecycle`, which holds what a run changes in the process and puts back:

1. **Processes** (:meth:`Lifecycle.before_process_group`, :meth:`Lifecycle.after_process_group`):
   NCCL's watchdog defaults, every rank's host and pid in the rendezvous store (to name a lost rank),
   the collective checker of ``debug_collectives``.
2. **Setup** (:meth:`Lifecycle.check_meta`, then :meth:`Lifecycle.build`: :meth:`Lifecycle.check_space`,
   :meth:`Lifecycle.prepare`, :meth:`Lifecycle.build_engine`, :meth:`Lifecycle.finish`): the meta-device
   check, the disk tier's free space, activation checkpointing, glibc's mmap threshold and torch's
   threads for host work, the :class:`~lightning_zero.zero.engine.ZeroEngine` (replaying stage 3's
   recorded build), the model's last move and cast, and the precision plugin attached to the engine.
3. **Failure** (:meth:`Lifecycle.explain`): a failed collective names the lost rank; an
   out-of-memory error gets this rank's memory and the settings to try.
4. **Teardown** (:meth:`Lifecycle.teardown`): the precision detached, activation checkpointing
   removed, and the environment, thread count and mmap threshold as they were before setup.

What stays in the adapters is what differs between the APIs: when the engine is built (the
Trainer's ``setup`` for its LightningModule and ``configure_optimizers``; Fabric's
``setup``/``setup_module``/``setup_optimizers``), how the model is moved and cast, and when the engine
is closed (the Trainer keeps it past fit for ``trainer.save_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from lightning_zero import comm, debug, failures, memory, threads
from lightning_zero.activations import apply_activation_checkpointing, remove_activation_checkpointing
from lightning_zero.config import PRECISIONS, StrategyConfig
from lightning_zero.precision import OffloadPrecision
from lightning_zero.zero import ModelParallelContext, Recorder, Recording, ZeroEngine, check_nvme_space

_EXPLAINED = "_lightning_zero_explained"  # set on an error once its message has been rewritten


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


class Lifecycle:
    """What one strategy changes in its process for a run, and the steps that change and restore it.

    One per strategy object, made with its validated options and the name of its API; the strategy
    calls the steps from the hooks of its API (see the module docstring)."""

    def __init__(self, config: StrategyConfig, api: Literal["trainer", "fabric"]) -> None:
        self.config = config
        #: The API whose strategy drives this lifecycle: its messages name what a user of that API does.
        self.api = api
        #: Host and pid of every rank (from :func:`lightning_zero.failures.register_rank`), to name a lost one.
        self.rank_processes: failures.Processes = {}
        #: The data-parallel group wrapped by the collective checker (``debug_collectives``), once made.
        self.checked_group: comm.CheckedGroup | None = None
        #: Stage 3 models built on the meta device and recorded, until the engine replays them.
        self.recordings: list[Recording] = []
        self._environment_before: dict[str, str | None] = {}  # what before_process_group changed
        self._threads_before: int | None = None  # torch's thread count before prepare changed it
        self._mmap_fixed = False  # glibc's mmap threshold set by prepare

    # -- processes ----------------------------------------------------------------------------------

    def before_process_group(self, backend: str) -> None:
        """NCCL's watchdog defaults (NCCL only), put back by :meth:`teardown`: the environment is left as found."""
        for name, value in failures.set_nccl_defaults(backend).items():
            self._environment_before.setdefault(name, value)  # the first value seen is the user's

    def after_process_group(self, rank: int, world_size: int, data_parallel_group: comm.ProcessGroup) -> None:
        """Every rank's host and pid into the store; the collective checker when ``debug_collectives``
        is on. Call on all ranks, once the default process group exists."""
        failure = self.config.failure
        self.rank_processes = failures.register_rank(rank, world_size, failure.collective_timeout)
        if failure.debug_collectives and self.checked_group is None:
            self.checked_group = debug.checked_group(data_parallel_group, failure.collective_timeout)

    # -- setup ----------------------------------------------------------------------------------------

    @contextmanager
    def recording(self, device: torch.device, skip_init: bool = False) -> Generator[Recording, None, None]:
        """Stage 3: a model built inside is made on the meta device and recorded; :meth:`build_engine`
        replays it into each rank's shards (:mod:`lightning_zero.zero.deferred`). ``skip_init``: the
        recorded ``torch.nn.init`` calls are not replayed (Fabric's ``init_module(empty_init=True)``)."""
        with Recorder(device, skip_init) as recording:
            yield recording
        self.recordings.append(recording)

    def check_meta(self, module: nn.Module) -> bool:
        """Whether ``module`` has tensors on the meta device; ``ValueError`` when the stage cannot materialize them."""
        meta = on_meta(module)
        if meta and self.config.zero.stage != 3:
            raise ValueError(
                f"the model has tensors on the meta device, which only stage 3 materializes (shard by shard); "
                f"this strategy runs stage {self.config.zero.stage}. Use stage=3 or build the model on a real device."
            )
        return meta

    def engine_config(self, precision: OffloadPrecision) -> StrategyConfig:
        """The options the engine runs with. The precision plugin may carry its own offload options
        (an :class:`~lightning_zero.OffloadPrecision` given by the user), checked against the stage like
        the strategy's; ``offload_pipeline`` stays the strategy's (how the engine steps, not where tensors live)."""
        offload = dataclasses.replace(precision.offload, pipeline=self.config.offload.pipeline)
        return dataclasses.replace(self.config, offload=offload)

    def prepare(self, module: nn.Module, precision: OffloadPrecision, device: torch.device, processes: int) -> None:
        """Before the engine: activation checkpointing (the forward wrapping touches no parameter),
        glibc's mmap threshold for host memory, torch's threads for the host step. ``processes``: the
        ranks on this machine, which share its cores."""
        host = torch.device("cpu") if device.type != "cpu" else None
        apply_activation_checkpointing(module, self.config.activations, host, self.config.zero.stage == 3)
        mmap = self.config.zero.host_mmap_threshold
        on_host = device.type == "cpu" or precision.offload.offload_optimizer
        if mmap is not None and on_host and not self._mmap_fixed:
            self._mmap_fixed = memory.fix_mmap_threshold(mmap)
        if precision.offload.offload_optimizer and self._threads_before is None:
            # The host step's kernels run on torch's OpenMP pool: ranks on one machine share its cores.
            self._threads_before = torch.get_num_threads()  # put back at teardown
            threads.apply_threads(processes)

    def check_space(
        self,
        config: StrategyConfig,
        module: nn.Module,
        precision: OffloadPrecision,
        group: comm.ProcessGroup,
        processes: int,
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        """Before anything is allocated: the disk tier's files must fit (:func:`~lightning_zero.zero.swap.check_space`);
        the optimizers say how many bytes their moments take."""
        itemsize = PRECISIONS[precision.engine_precision][0].itemsize
        check_nvme_space(config.offload, module, comm.world_size(group), processes, itemsize, optimizers)

    def build_engine(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        config: StrategyConfig,
        precision: OffloadPrecision,
        device: torch.device,
        parallel: ModelParallelContext,
    ) -> ZeroEngine:
        """The engine for ``module`` and ``optimizers``, replaying the recorded stage 3 build. Call on all ranks."""
        engine = ZeroEngine(
            module,
            optimizers,
            config=config,
            precision=precision.engine_precision,
            device=device,
            parallel=parallel,
            recordings=self.recordings,
        )
        self.close_recordings()
        return engine

    def build(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        precision: OffloadPrecision,
        device: torch.device,
        parallel: ModelParallelContext,
        *,
        processes: int,
        training: bool,
        move: Callable[[], object],
        cast: Callable[[], object],
        pipelined: bool = False,
    ) -> ZeroEngine:
        """Setup from a model (moved, or on the meta device) to a running engine, the steps in this
        order for both strategies: the disk tier's space (``training``: the optimizers' states will
        exist), checked before this process changes anything (:meth:`check_space`); then
        :meth:`prepare`, :meth:`build_engine` and :meth:`finish`, whose precision steps through the
        engine when ``training`` (evaluation steps nothing). ``processes``: the ranks on this machine;
        ``move``, ``cast``: as for :meth:`finish`. Call on all ranks."""
        meta = on_meta(module)  # before the engine materializes it
        config = self.engine_config(precision)
        if training:
            self.check_space(config, module, precision, parallel.data, processes, optimizers)
        self.prepare(module, precision, device, processes)
        engine = self.build_engine(module, optimizers, config, precision, device, parallel)
        self.finish(
            precision, engine if training else None, device, meta=meta, move=move, cast=cast, pipelined=pipelined
        )
        return engine

    def close_recordings(self) -> None:
        """Drop the recorded builds (replayed, or not needed), then give their memory back to the OS."""
        for recording in self.recordings:
            recording.close()
        self.recordings.clear()
        if self._mmap_fixed:
            memory.trim_heap()  # the parameters' memory before flattening (see trim_heap)

    def finish(
        self,
        precision: OffloadPrecision,
        engine: ZeroEngine | None,
        device: torch.device,
        *,
        meta: bool,
        move: Callable[[], object],
        cast: Callable[[], object],
        pipelined: bool = False,
    ) -> None:
        """After the engine: a model built on the meta device moves what stage 3 left whole (buffers,
        small frozen parameters) to the device (``move``), the precision casts the model (``cast``) and
        steps through ``engine`` (``None``: no optimizer to step)."""
        if meta:
            move()
        cast()
        precision.attach(engine, device, pipelined=pipelined)

    # -- failure ---------------------------------------------------------------------------------------

    def explain(
        self,
        error: BaseException,
        *,
        rank: int,
        world_size: int,
        engine: ZeroEngine | None,
        breakdown: Callable[[], dict[str, dict[str, int]]],
        registered: list[str],
        launcher: Any,
    ) -> None:
        """Name the lost rank of a failed collective, or add this rank's memory (``breakdown``) and the
        settings to try (``registered``: the strategy names the API knows) to an out-of-memory error, in
        place; make sure no rank outlives the run (``launcher``: the one that started the other ranks).
        An error is explained once, by the innermost call."""
        if getattr(error, _EXPLAINED, False):
            return
        try:
            setattr(error, _EXPLAINED, True)
            if failures.is_out_of_memory(error):
                try:
                    held = breakdown()
                except Exception:  # noqa: BLE001 - no model or engine yet: the advice alone still helps
                    held = None
                config = engine.config.zero if engine is not None else self.config.zero
                text: str | None = failures.oom_message(error, held, config, registered, api=self.api)
            else:
                last = engine.last_gathered() if engine is not None else None
                text = failures.lost_rank_message(error, rank, world_size, self.rank_processes, last)
            if text is not None:
                failures.replace_message(error, text)
        except Exception:  # noqa: BLE001 - explaining must never hide the error being explained
            pass
        failures.reap_children_at_exit(launcher)

    # -- teardown --------------------------------------------------------------------------------------

    def teardown(self, precision: OffloadPrecision, module: nn.Module | None, device: torch.device) -> None:
        """The precision detached from the engine, the model's own forwards back, and the process as
        setup found it (environment, thread count, mmap threshold). The engine is the adapter's to close."""
        precision.attach(None, device)
        if module is not None:
            remove_activation_checkpointing(module)
        failures.restore_environment(self._environment_before)
        self._environment_before.clear()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self._mmap_fixed:
            memory.restore_mmap_threshold()
            self._mmap_fixed = False
