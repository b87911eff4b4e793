"""Activation checkpointing: chosen submodules keep only their inputs in forward and run their
forward again in backward (``torch.utils.checkpoint``, non-reentrant), trading one extra forward
of those modules for their activations.

``ZeroStrategy(activation_checkpointing={Block})`` (or a callable ``module -> bool``, validated by
:class:`~lightning_zero.config.ActivationCheckpointConfig`) picks the modules; a module inside an
already chosen one is not wrapped again. The module's ``forward`` is replaced on the instance, so
parameter names, ``state_dict`` keys and checkpoints stay those of the unwrapped model, and
``teardown`` restores the original.

How it meets the rest of the data path:

* Stages 1 and 2: parameters are whole; the recompute needs nothing from ZeRO. Gradients reach
  the reduction hooks as without checkpointing.
* Stage 3: the recompute calls the submodules of the checkpointed module again, so their gather
  hooks (:mod:`lightning_zero.zero.gather`) run inside backward. Under
  :func:`~lightning_zero.zero.guarded.recomputing` they all-gather what the recompute reads, leave
  the module-order trace (the prefetch plan) alone, and do not release after the recomputed
  forward: the recomputed activations feed the backward that follows at once, and the reduction's
  gradient hooks release each buffer when all of its gradients have arrived, as without
  checkpointing (``end_pass`` releases the rest). All ranks recompute the same modules in the same
  order, so the gathers match.
* Tensor parallelism: the recompute repeats the forward collectives of the split layers (e.g. the
  all-reduce of a row-parallel layer) in backward, on every rank of the tensor-parallel group alike.
* Pipeline parallelism: each stage checkpoints its own chosen layers; the schedule is unchanged.

``activation_checkpointing_offload=True`` also keeps the inputs of the checkpointed modules (the only
activations a checkpoint holds) in host memory until backward copies them back, for models whose
block inputs alone fill the accelerator (long sequences, many blocks). On a CPU-only run the model
is already on the host and the option changes nothing.

RNG state (dropout) is saved at forward and restored for the recompute (``preserve_rng_state``),
so the recomputed activations equal the original ones and the loss equals the run without it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.config import ActivationCheckpointConfig
from lightning_zero.zero import recompute_contexts

_ORIGINAL = "_lightning_zero_checkpointed_forward"  # the instance attribute holding the wrapped forward


def _checkpointed(forward: Any, host: torch.device | None, gathers: bool, *args: Any, **kwargs: Any) -> Any:
    # Stage 3 marks the recompute for its gather hooks. Stages 1/2 pass no context_fn: under
    # torch.compile the checkpoint is traced as one graph, and a context_fn there must produce
    # TorchDispatchModes, which the marker is not (it need not be: no gather hook runs at those stages).
    if gathers:
        kwargs = {**kwargs, "context_fn": recompute_contexts}
    if host is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    # The positional tensor inputs are all a checkpoint keeps: hand it host copies (the device ones are
    # freed once nothing else holds them) and copy them back inside the checkpointed function, so the
    # copy back is recomputed in backward too. Autograd carries the gradients across both copies.
    devices = [a.device if torch.is_tensor(a) else None for a in args]
    held = [a.to(host) if torch.is_tensor(a) else a for a in args]

    def run(*held_args: Any, **inner: Any) -> Any:
        restored = [a.to(d) if d is not None else a for a, d in zip(held_args, devices, strict=True)]
        return forward(*restored, **inner)

    return checkpoint(run, *held, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(
    root: nn.Module, config: ActivationCheckpointConfig, host: torch.device | None = None, stage3: bool = False
) -> list[str]:
    """Wrap the forward of every submodule of ``root`` that ``config`` selects (outermost only).

    ``host``: where the checkpointed modules' inputs wait for backward when ``config.offload`` is set
    (the strategy passes the CPU when the model is on an accelerator, ``None`` when it is already on
    the CPU). ``stage3``: the recompute runs under :func:`~lightning_zero.zero.guarded.recomputing`, for
    the gather hooks (stages 1/2 need nothing around it). Returns the qualified names of the wrapped modules. Wrapping twice is a no-op.
    """
    host = host if config.offload else None
    if config.policy is None:
        return []
    wrapped: list[str] = []
    for name, module in root.named_modules():
        if module is root or any(name.startswith(outer + ".") for outer in wrapped):
            continue
        if hasattr(module, _ORIGINAL):
            wrapped.append(name)
            continue
        if not config.selects(module):
            continue
        original = module.forward
        # (the forward to restore if the instance had its own, else None: the class's shows through)
        setattr(module, _ORIGINAL, module.__dict__.get("forward"))
        # An instance attribute shadows the class's forward; nn.Module.__call__ still runs the hooks.
        module.forward = functools.partial(_checkpointed, original, host, stage3)
        wrapped.append(name)
    return wrapped


def remove_activation_checkpointing(root: nn.Module) -> None:
    """Give every wrapped module of ``root`` its own forward back."""
    for module in root.modules():
        if hasattr(module, _ORIGINAL):
            own = getattr(module, _ORIGINAL)
            delattr(module, _ORIGINAL)
            del module.forward  # the class's forward shows through again
            if own is not None:
                module.forward = own
