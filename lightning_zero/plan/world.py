"""The pretend world the planner runs the real engine in: a fake process group of any size, host
memory on the meta device, and a recorder of the collectives :mod:`lightning_zero.comm` issues.

torch ships the fake process group for its own tests (``torch.testing._internal.distributed.fake_pg``:
backend ``"fake"``): every collective completes at once without touching data, so one process can
be rank 0 of 1,024 ranks. Tensors are on the meta device (shapes and dtypes, no storage), so nothing
the engine builds is allocated.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from lightning_zero import comm

#: the functions of :mod:`lightning_zero.comm` that are collectives (the others call these)
COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "send", "recv", "barrier")


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Make this process ``rank`` of a fake process group of ``world_size`` ranks for the block."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"world_size={world_size} must be >= 1 and rank={rank} one of its ranks.")
    if dist.is_initialized():
        raise ValueError(
            "a process group already exists in this process; the planner makes its own fake one. "
            "Run the plan in a process that has not started distributed training."
        )
    try:  # private to torch's tests, present from torch 2.1 on
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as error:
        raise RuntimeError(f"this torch ({torch.__version__}) has no fake process group to plan in: {error}") from error

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()


@contextmanager
def host_on_meta(host: list[tuple[torch.Tensor, bool]]) -> Iterator[None]:
    """Host allocations of the engine (:mod:`lightning_zero.offload.host`) become meta tensors,
    moving a meta tensor to the host keeps it meta, and stage 3 does not materialize meta modules;
    appended to ``host`` with whether they would be pinned; ``copy_`` out of a meta tensor is
    refused by torch, so the copy is left out (values do not matter here)."""

    def host_empty(numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=dtype, device="meta")
        host.append((tensor, pin))
        return tensor

    def host_copy(tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
        return host_empty(tensor.numel(), tensor.dtype, pin).view(tensor.shape)

    original_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The offloaded step moves meta slices "to the host": they stay meta.
        if self.is_meta:
            target = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
            if target is not None and torch.device(target).type == "cpu":
                kwargs["device"] = "meta"
                args = tuple(a for a in args if not isinstance(a, (str, torch.device)))
        return original_to(self, *args, **kwargs)

    with (
        mock.patch.object(torch.Tensor, "to", to),
        # stage 3 gives meta parameters their values module by module; the plan's stay meta
        mock.patch("lightning_zero.zero.build.materialize", lambda *args, **kwargs: None),
        mock.patch("lightning_zero.zero.flat.host_empty", host_empty),
        mock.patch("lightning_zero.zero.flat.host_copy", host_copy),
        mock.patch("lightning_zero.zero.step_kernels.host_empty", host_empty),
    ):
        yield


def _meta_reports_cpu(stands_for_host: Callable[[torch.Tensor], bool]) -> Any:
    """While open, meta tensors for which ``stands_for_host`` holds report the CPU as their device
    (where the engine decides by a tensor's device, the plan's meta tensors stand for host ones)."""
    device = torch.Tensor.device

    def placed(tensor: torch.Tensor) -> torch.device:
        where = device.__get__(tensor)
        return torch.device("cpu") if where.type == "meta" and stands_for_host(tensor) else where

    return mock.patch.object(torch.Tensor, "device", property(placed))


@contextmanager
def accelerator_staging(host: list[tuple[torch.Tensor, bool]]) -> Iterator[None]:
    """The offloaded step of a GPU rank writes each updated 16-bit slice into a (pinned) host copy
    before it goes to the device (``KernelStep._param_copy``); the engine decides by the device of the
    master, which is meta here. While it decides, tensors of the host allocations (``host``) report
    the CPU, so the engine's own rule makes (or skips) the copy."""
    import importlib

    kernels = importlib.import_module("lightning_zero.zero.step_kernels")
    original = kernels.KernelStep._param_copy

    def param_copy(self: Any, b: Any) -> Any:
        stored = {t.untyped_storage()._cdata for t, _ in host}
        with _meta_reports_cpu(lambda tensor: tensor.untyped_storage()._cdata in stored):
            return original(self, b)

    with mock.patch.object(kernels.KernelStep, "_param_copy", param_copy):
        yield


@contextmanager
def cpu_step_kernels() -> Iterator[None]:
    """The optimizer step a CPU rank runs, where the engine decides by the device of its tensors
    (meta in the plan): without offload it steps Adam/AdamW on fp32 masters in host memory with its
    compiled kernel when one is built (one pass instead of torch's several), and before the step it
    checks each chunk of the parameter slice for edits made outside the step (``ne`` and ``any``),
    writing back only where one was. While the engine decides, meta tensors report the CPU (the
    device they stand for in a CPU plan); the check finds no edit (meta tensors have no values: the
    common case, parameters changed only by the step)."""
    import importlib

    mapping = importlib.import_module("lightning_zero.zero.step_mapping")
    flat = importlib.import_module("lightning_zero.zero.flat")
    decide, absorb = mapping._kind_for_host_masters, flat.FlatBuffer.absorb_edits
    empty = torch.empty

    def no_values(tensor: torch.Tensor) -> bool:
        return False  # the plan's tensors stand for values it does not have

    def meta_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            kwargs["device"] = "meta"  # what the engine allocates "on the CPU" stays meta
        return empty(*args, **kwargs)

    def on_cpu() -> Any:
        return _meta_reports_cpu(lambda tensor: True)

    def for_host_masters(*args: Any, **kwargs: Any) -> Any:
        with on_cpu():
            return decide(*args, **kwargs)

    def absorb_edits(self: Any, *args: Any, **kwargs: Any) -> Any:
        with (
            on_cpu(),
            mock.patch.object(torch.Tensor, "__bool__", no_values),
            mock.patch.object(torch, "empty", meta_empty),
        ):
            return absorb(self, *args, **kwargs)

    with (
        mock.patch.object(mapping, "_kind_for_host_masters", for_host_masters),
        mock.patch.object(flat.FlatBuffer, "absorb_edits", absorb_edits),
    ):
        yield


@dataclass(frozen=True)
class Call:
    """One collective as issued: its :mod:`~lightning_zero.comm` function, the group's name and
    the bytes of the whole buffer it moves (the full tensor of a reduce-scatter or all-gather)."""

    op: str
    group: str
    nbytes: int


def _nbytes(op: str, args: dict[str, Any]) -> int:
    tensor = {"reduce_scatter": "full_in", "all_gather": "full_out"}.get(op, "tensor")
    value = args.get(tensor)
    return value.numel() * value.element_size() if torch.is_tensor(value) else 0


@contextmanager
def record_collectives(
    calls: list[Call], groups: dict[int, str], events: list[tuple[Any, ...]] | None = None
) -> Iterator[None]:
    """Append every collective of :mod:`lightning_zero.comm` issued in the block to ``calls``
    (those on one-rank groups return early and move nothing: not recorded). ``groups`` names the
    groups by ``id``; the default group (``None``) is named as the world group.

    The fake group completes every collective at once; a real network is slower than the compute
    that overlaps it. The asynchronous handles recorded here report themselves complete only once
    waited for: the engine then keeps as many reductions (and their buckets) in flight as its own
    limits allow, as behind a slow network.

    ``events`` (the step-time trace, :mod:`.timing`): ``("issue", index in calls, synchronous)`` per
    recorded collective and ``("wait", index)`` when the engine waits for an asynchronous one."""
    originals = {name: getattr(comm, name) for name in COLLECTIVES}

    def wrap(name: str) -> Any:
        original = originals[name]
        signature = inspect.signature(original)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            index = None
            if comm.world_size(group) > 1:
                plain = group.group if isinstance(group, comm.CheckedGroup) else group
                if plain is None:
                    plain = dist.group.WORLD
                index = len(calls)
                calls.append(Call(name, groups.get(id(plain), "other"), _nbytes(name, bound)))
                if events is not None:
                    events.append(("issue", index, not bound.get("async_op", name == "send")))
            result = original(*args, **kwargs)
            if isinstance(result, comm.Handle) and result is not comm._DONE:
                handle = result
                handle.is_completed = lambda: not handle._works  # type: ignore[method-assign]
                if events is not None and index is not None:
                    handle.wait = _waited(handle.wait, events, index)  # type: ignore[method-assign]
            return result

        return recorded

    with contextlib_patches({name: wrap(name) for name in COLLECTIVES}):
        yield


def _waited(wait: Any, events: list[tuple[Any, ...]], index: int) -> Any:
    def recorded_wait() -> None:
        events.append(("wait", index))
        wait()

    return recorded_wait


@contextmanager
def contextlib_patches(replacements: dict[str, Any]) -> Iterator[None]:
    """Replace functions of :mod:`lightning_zero.comm` for the block (its own functions call one
    another through the module, so a wrapped ``broadcast`` also sees ``broadcast_tensors``'s)."""
    saved = {name: getattr(comm, name) for name in replacements}
    try:
        for name, function in replacements.items():
            setattr(comm, name, function)
        yield
    finally:
        for name, function in saved.items():
            setattr(comm, name, function)
