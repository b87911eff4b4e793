"""The peak of a training step's transient memory, counted on meta tensors.

:class:`LiveBytes` watches every op of the step: a tensor whose storage is new (not a view or an
in-place result of an input) adds its storage's bytes, and the storage's end (a weak-reference
finalizer, run when autograd, the engine or the model drops the last reference) takes them away. So
saved activations live until the backward frees them, gradients until the engine has copied them into
its buckets, checkpointed modules' recomputed activations only within their backward; the largest sum
reached is the step's transient peak, over what was alive when it began (the model states and the
engine's pool, counted by ``memory_breakdown()``).

Where a CPU rank runs a different kernel than torch runs on meta tensors, the plan runs (or counts)
the CPU's one, so that the lifetimes are the real run's:

* attention: on meta tensors ``scaled_dot_product_attention`` takes torch's math path (its scores
  and their softmax materialized and saved for backward); a CPU takes the flash kernel when torch's
  own choice (``torch._fused_sdp_choice``) picks it, which saves only the output and its logsumexp.
  :func:`cpu_attention` makes the plan call that kernel's meta implementation in those cases.
* the optimizer step: a CPU rank steps fp32 masters of Adam/AdamW with the compiled single-pass
  kernel (:mod:`lightning_zero.ops`), which allocates nothing; torch's AdamW on meta tensors makes
  several temporaries of each slice. :func:`kernel_step_uncounted` leaves those out.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: Matrix products that a CPU runs through oneDNN in 16-bit dtypes (its primitive cache: .resident)
_MATMULS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
    }
)
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created in the block and still alive: ``current`` and ``peak``.

    Also collects the distinct 16-bit matrix-product problems of the block (``matmul_problems``: op,
    shapes, strides and dtype of each operand), which :mod:`.resident` prices."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.paused = 0
        """While above zero, new storages are not counted (a kernel the real run replaces)."""
        self.matmul_problems: set[tuple[Any, ...]] = set()
        self._live: dict[int, int] = {}

    def alive(self) -> dict[int, int]:
        """The storages created in the block and alive now: ``{storage key: bytes}``."""
        return dict(self._live)

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _MATMULS and isinstance(args[-1], torch.Tensor) and args[-1].dtype in _SIXTEEN_BIT:
            operands = tuple((tuple(a.shape), a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor))
            self.matmul_problems.add((func, operands))
        if func.is_view or self.paused:
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue  # in place, or already counted
            self._live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out


def host_kernel_steps(engine: Any, device: str) -> bool:
    """Whether a real CPU rank steps this engine's optimizer with the compiled single-pass Adam/AdamW
    kernel where the plan, on meta tensors, runs torch's own step: fp32 masters in host memory
    (``device="cpu"``, no offload: offloaded masters take the kernel in the plan too) and the compiled
    ops loaded, on a compiled (not the reference) CPU path."""
    from lightning_zero import ops

    if device != "cpu" or not ops.compiled() or ops.available()["cpu_adam"] == "reference":
        return False
    tensors = engine.memory_tensors()
    masters = tensors["master_weights"] or tensors["parameters"]
    return bool(masters) and all(t.dtype == torch.float32 for t in masters)


@contextlib.contextmanager
def kernel_step_uncounted(optimizer: torch.optim.Optimizer, lives: list[LiveBytes], on: bool) -> Iterator[None]:
    """While ``optimizer.step()`` runs, the :class:`LiveBytes` in ``lives`` count no new storage
    (``on``: :func:`host_kernel_steps`): torch's AdamW temporaries, which the compiled kernel a real
    CPU rank runs instead does not allocate. Its states are created by the first step all the same
    (``memory_breakdown()`` counts them)."""
    if not on:
        yield
        return

    def pause(*_: Any) -> None:
        for live in lives:
            live.paused += 1

    def resume(*_: Any) -> None:
        for live in lives:
            live.paused -= 1

    handles = [optimizer.register_step_pre_hook(pause), optimizer.register_step_post_hook(resume)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def cpu_attention(on: bool) -> Iterator[None]:
    """``torch.nn.functional.scaled_dot_product_attention`` on meta tensors runs the CPU's flash
    kernel (its meta implementation) wherever torch picks that kernel for CPU tensors of the same
    dtypes, dimensions and options (``on``: the plan is for CPU ranks), else torch's own path."""
    if not on:
        yield
        return
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        args = (query, key, value, attn_mask, dropout_p, is_causal)
        if query.device.type != "meta" or not _cpu_picks_flash(*args, scale, enable_gqa):
            return original(*args, scale=scale, enable_gqa=enable_gqa)
        # (with enable_gqa the CPU kernel takes the fewer key/value heads as they are, as here)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        try:
            return flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        except (NotImplementedError, RuntimeError):  # a torch without this kernel's meta function
            return original(*args, scale=scale, enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _cpu_picks_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> bool:
    """torch's kernel choice for CPU tensors like these (their dtypes, ranks, head sizes, the mask's
    dtype and broadcast dims, grouped-query heads), asked on tiny copies: the choice does not depend
    on the lengths."""

    def tiny(t: torch.Tensor) -> torch.Tensor:
        shape = [1 if size == 1 else 2 for size in t.shape[:-1]] + [t.shape[-1]]
        return torch.zeros(shape, dtype=t.dtype, requires_grad=t.requires_grad)

    small_mask = None
    if mask is not None:
        small_mask = torch.zeros([1 if s == 1 else 2 for s in mask.shape], dtype=mask.dtype)
    backend = torch._fused_sdp_choice(
        tiny(query), tiny(key), tiny(value), small_mask, dropout_p, is_causal, scale=scale
    )
    return bool(backend == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value)
