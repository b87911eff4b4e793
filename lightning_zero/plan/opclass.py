"""What the step-time model knows of one op: its name as the rates are keyed (:func:`op_name`), its
elements (:func:`op_elements`), its FLOPs (torch's formulas, and the CPU attention kernel's), and the
micro-benchmark that measures the rates of individual ops on this machine (:func:`op_rates`).

A CPU rank runs ``scaled_dot_product_attention`` through its flash kernel where the inputs allow it
(meta tensors would run the math path, a different cost and different saved tensors):
:func:`~.peak.cpu_attention` sends the plan of a CPU rank through the same kernel, and
:func:`op_flops` prices it.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

_ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"


def op_name(func: Any, kwargs: dict[str, Any]) -> str:
    """The aten op's name, with its ``approximate`` variant where it has one (``gelu[tanh]``: tanh
    costs several times erf on a CPU)."""
    approximate = kwargs.get("approximate")
    if isinstance(approximate, str) and approximate != "none":
        return f"{func._opname}[{approximate}]"
    return str(func._opname)


def op_elements(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Elements of the op's largest tensor, input or output (a reduction's input)."""
    return max((t.numel() for t in [*inputs, *outputs]), default=0)


def op_flops(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one op: torch's formulas (``torch.utils.flop_counter``), and for the CPU flash
    attention kernel the two products of the forward (four FLOPs per query, key and head element),
    half of them when causal (the kernel skips the masked blocks), 2.5 times that for the backward."""
    if func._overloadpacket in flop_registry:
        return int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
    name = func._opname
    if name in (_ATTENTION, f"{_ATTENTION}_backward"):
        backward = name.endswith("_backward")
        query, key = args[1:3] if backward else args[:2]
        causal = args[7] if backward else (args[4] if len(args) > 4 else kwargs.get("is_causal", False))
        *batch, queries, dim = query.shape
        flops = 4 * queries * key.shape[-2] * dim * int(torch.Size(batch).numel())
        return int(flops * (0.5 if causal else 1.0) * (2.5 if backward else 1.0))
    return 0


class _Timer(TorchDispatchMode):
    """Seconds, elements and FLOPs of every op dispatched in the block, by ``"<op name> <dtype>"``."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: dict[str, list[tuple[float, int, int]]] = defaultdict(list)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors and not func.is_view:
            dtype = str(tensors[0].dtype).removeprefix("torch.")
            flops = op_flops(func, args, kwargs, out)
            self.samples[f"{op_name(func, kwargs)} {dtype}"].append((seconds, op_elements(tensors, outputs), flops))
        return out


#: the helpers of the workloads (the backward's seed, gradient accumulation): the bandwidth model's ops
_PLAIN = {"ones_like", "fill_", "empty_like", "empty", "zeros_like", "add", "add_", "mul", "sum", "copy_", "clone"}
_PLAIN |= {"detach", "_to_copy", "expand", "t", "view", "alias"}


def _workloads(dtype: torch.dtype) -> list[Callable[[], object]]:
    """Forward and backward of the activations, normalizations and attention of common models, on
    tensors of a layer's size at a few hundred tokens (``512 x 1536``), a comparison and its ``any``,
    and the engine's CPU Adam kernel."""
    x = torch.randn(512, 1536, dtype=dtype, requires_grad=True)
    weight, bias = torch.ones(1536, dtype=dtype, requires_grad=True), torch.zeros(1536, dtype=dtype, requires_grad=True)
    # causal attention at three lengths (its rate grows with the length: blocks on the diagonal)
    attention = [
        [torch.randn(1, heads, length, 64, dtype=dtype, requires_grad=True) for _ in range(3)]
        for heads, length in ((16, 64), (4, 256), (1, 1024))
    ]
    other, flags = torch.randn(512, 1536, dtype=dtype), torch.empty(512, 1536, dtype=torch.bool)
    functions: list[Callable[[], torch.Tensor]] = [
        lambda: F.gelu(x),
        lambda: F.gelu(x, approximate="tanh"),
        lambda: F.silu(x),
        lambda: torch.tanh(x),
        lambda: torch.sigmoid(x),
        lambda: torch.exp(x),
        lambda: torch.softmax(x, -1),
        lambda: torch.log_softmax(x, -1),
        lambda: F.layer_norm(x, (1536,), weight, bias),
        *(lambda qkv=qkv: getattr(torch.ops.aten, _ATTENTION)(*qkv, 0.0, True)[0] for qkv in attention),
    ]

    def run(function: Callable[[], torch.Tensor]) -> None:
        y = function()
        y.backward(torch.ones_like(y))

    workloads: list[Callable[[], object]] = [lambda f=f: run(f) for f in functions]  # type: ignore[misc]
    workloads.append(lambda: torch.ne(x.detach(), other, out=flags))
    workloads.append(lambda: flags.any())  # the engine's check of a chunk for edited parameters
    from lightning_zero.ops import compiled, functional

    if dtype == torch.float32 and compiled():
        # the engine's optimizer step on fp32 masters in host memory (bf16 gradients and parameters)
        master, moments = torch.randn(1 << 20), [torch.zeros(1 << 20) for _ in range(2)]
        grad, param = torch.randn(1 << 20, dtype=torch.bfloat16), torch.empty(1 << 20, dtype=torch.bfloat16)
        workloads.append(
            lambda: functional.cpu_adam_step(
                master,
                grad,
                *moments,
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                step=1,
                param_copy=param,
            )
        )
    return workloads


def op_rates(
    dtypes: tuple[torch.dtype, ...], repeats: int = 5
) -> tuple[dict[str, float], dict[str, tuple[tuple[float, float], ...]]]:
    """This machine's rates of individual ops that are neither a matrix product nor a plain
    element-wise pass (:func:`_workloads`, each op timed on its own, the median of ``repeats``):
    elements/s by ``"<op name> <dtype>"``, and for those with FLOPs (attention) FLOP/s by their
    FLOPs per output element, ``((FLOPs per element, FLOP/s), ...)`` in increasing order."""
    timer = _Timer()
    for dtype in dtypes:
        workloads = _workloads(dtype)
        for workload in workloads:
            workload()  # a first run allocates; not timed
        with timer:
            for _ in range(repeats):
                for workload in workloads:
                    workload()
    elements: dict[str, float] = {}
    flops: dict[str, tuple[tuple[float, float], ...]] = {}
    for key, samples in timer.samples.items():
        if key.split(" ")[0] in _PLAIN:
            continue
        # by the op's FLOPs per output element (attention: its length) or its size
        sizes: dict[tuple[int, int], list[float]] = defaultdict(list)
        for seconds, count, work in samples:
            sizes[(count, work)].append(seconds)
        rates = sorted(
            (work / max(count, 1), (work or count) / statistics.median(times))
            for (count, work), times in sizes.items()
            if len(times) >= repeats and statistics.median(times) > 0 and count
        )
        if not rates:
            continue  # an op of a first call only
        if any(work for _, work in sizes):
            flops[key] = tuple(rates)
        else:
            elements[key] = statistics.mean(rate for _, rate in rates)
    return elements, flops


__all__ = ["op_elements", "op_flops", "op_name", "op_rates"]
