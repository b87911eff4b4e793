"""The model to plan, built on the meta device (shapes and dtypes, no storage), and its example batch."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

InputSpec = tuple[tuple[int, ...], torch.dtype]
"""One positional input of the model's forward: its shape and dtype."""


def meta_model(source: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """``source``: ``"pkg.module:Class"`` (an ``nn.Module`` or LightningModule, called with
    ``kwargs``; a LightningModule's ``configure_model`` runs too) or the path of a Hugging Face
    ``config.json`` (or its directory), built with ``AutoModelForCausalLM.from_config``. Everything
    is created on the meta device."""
    kwargs = kwargs or {}
    if ":" in source and not os.path.exists(source):
        module_name, _, attr = source.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cannot import {source!r} ({error}); give 'package.module:Class'.") from error
        with torch.device("meta"):
            model = cls(**kwargs)
            configure = getattr(model, "configure_model", None)
            if callable(configure):
                configure()
        if not isinstance(model, nn.Module):
            raise ValueError(f"{source!r} built a {type(model).__name__}, not a torch.nn.Module.")
        return model
    if not os.path.exists(source):
        raise ValueError(f"{source!r} is neither 'package.module:Class' nor an existing config.json or its directory.")
    if kwargs:
        raise ValueError(
            f"constructor arguments {sorted(kwargs)} apply to 'package.module:Class' only, not to {source!r}."
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isdir(source):
        config = AutoConfig.from_pretrained(source)
    else:
        with open(source) as f:
            values = json.load(f)
        if "model_type" not in values:
            raise ValueError(f"{source} has no 'model_type'; give the config.json of a Hugging Face model.")
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def default_inputs(model: nn.Module, micro_batch: int, seq_len: int) -> list[InputSpec]:
    """A Hugging Face causal LM: token ids ``(micro_batch, seq_len)``; a LightningModule with an
    ``example_input_array`` tensor: that one's shape and dtype; else a ValueError (give them)."""
    if hasattr(model, "config") and hasattr(model.config, "vocab_size"):
        return [((micro_batch, seq_len), torch.int64)]
    example = getattr(model, "example_input_array", None)
    if torch.is_tensor(example):
        return [(tuple(example.shape), example.dtype)]
    raise ValueError(
        f"{type(model).__name__} has no example_input_array: give the forward's inputs "
        "(--input 8,128:int64, one per positional argument)."
    )


def parse_input(text: str) -> InputSpec:
    """``"8,128:int64"`` -> ``((8, 128), torch.int64)``; the dtype defaults to float32."""
    shape_text, _, dtype_text = text.partition(":")
    dtype = getattr(torch, dtype_text or "float32", None)
    try:
        shape = tuple(int(n) for n in shape_text.split(","))
    except ValueError:
        shape = ()
    if not isinstance(dtype, torch.dtype) or not shape or min(shape) < 1:
        raise ValueError(f"input {text!r}: give a shape and an optional dtype, e.g. '8,128:int64' or '4,7'.")
    return shape, dtype


def loss_fn(model: nn.Module, inputs: Sequence[InputSpec], compute_dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """A scalar from one forward on meta inputs (floating inputs in the compute dtype, as autocast
    would give the first layer) of the output, its ``logits`` or its first element: a language
    model's cross entropy in fp32 when the first input is token ids ``(batch, seq)`` and the output
    logits ``(batch, seq, vocabulary)`` (what its training step computes, with its cost), else the
    mean in fp32."""

    def forward() -> torch.Tensor:
        args = [
            torch.zeros(shape, dtype=compute_dtype if dtype.is_floating_point else dtype, device="meta")
            for shape, dtype in inputs
        ]
        out = model(*args)
        out = getattr(out, "logits", out)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not torch.is_tensor(out):
            raise ValueError(
                f"{type(model).__name__}'s forward returned {type(out).__name__}; the plan needs a tensor."
            )
        ids = args[0] if args else None
        if ids is not None and not ids.is_floating_point() and out.dim() == 3 and out.shape[:2] == ids.shape:
            return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), ids.flatten())
        return out.float().mean()

    return forward
