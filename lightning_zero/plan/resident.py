"""Resident memory of a CPU rank that is no tensor: the constant terms of the plan's peak.

What the OS counts in a CPU rank's resident set beyond its live tensors, measured with
``/proc/self/smaps`` and glibc's ``mallinfo2`` sampled at every op of a training step (the benchmark
GPT, 1, 2 and 4 gloo ranks, with and without activation checkpointing; bf16-mixed):

* **kernel code** (:attr:`HostRuntime.code_bytes`): the first training step executes torch's kernels
  (forward, backward, the optimizer, the collectives) and the OS pages their machine code in from
  ``libtorch_cpu.so`` and ``libtorch_python.so``: ~31-36 MiB of file-backed resident memory per
  process on torch 2.x x86-64, alike on 1, 2 and 4 ranks. It is shared by the ranks of a host (one
  copy in the page cache) and the OS may drop it under pressure, but each rank's resident set counts it.
* **oneDNN's primitive cache** (:attr:`HostRuntime.matmul_problem_bytes` per distinct 16-bit matrix
  product): a CPU runs bf16/fp16 matrix products through oneDNN, which keeps each distinct problem's
  primitive (its JIT-compiled kernels) for the rest of the process, ~0.5-0.8 MiB each. A step's
  forward and backward of one ``nn.Linear`` shape are three problems. The plan counts the distinct
  problems of its step on the meta tensors (:attr:`.peak.LiveBytes.matmul_problems`).

What is not in it: glibc's retained free memory is small once the mmap threshold is fixed (the
strategy's ``host_mmap_threshold``; measured < 2 MiB of free heap and < 3 MiB of heap growth), the
process group's buffers (gloo's, included in what was resident before the model was built) and the
interpreter's objects.

The values come from :data:`DEFAULT` (measured here: x86-64 with AVX-512 bf16, torch 2.x CPU) or
from :func:`measure_host_runtime`, which measures this machine in a fresh process in a few seconds.
On an accelerator the plan's peak is the device's, and none of these terms apply to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lightning_zero.plan.peak import LiveBytes

MIB = 1 << 20


@dataclass(frozen=True)
class HostRuntime:
    """A CPU rank's non-tensor resident memory terms (see the module's text)."""

    code_bytes: int
    """Machine code of torch's kernels paged in by the first training step (file-backed)."""
    matmul_problem_bytes: int
    """Bytes oneDNN keeps per distinct 16-bit matrix-product problem (0 where it is not used)."""
    source: str = "table"

    def resident(self, matmul_problems: int) -> int:
        """Bytes of a step with ``matmul_problems`` distinct 16-bit matrix products."""
        if matmul_problems < 0:
            raise ValueError(f"matmul_problems={matmul_problems} must be >= 0.")
        return self.code_bytes + matmul_problems * self.matmul_problem_bytes


#: Measured by :func:`measure_host_runtime` on an x86-64 CPU with AVX-512 bf16, torch 2.x (CPU build)
DEFAULT = HostRuntime(
    code_bytes=31 * MIB, matmul_problem_bytes=544 << 10, source="table (x86-64 AVX-512 bf16, torch 2.x)"
)


@functools.cache
def measure_host_runtime() -> HostRuntime:
    """Measure :class:`HostRuntime` on this machine: in a fresh process (one gloo rank), the
    file-backed resident growth over two training steps of a small transformer under the engine
    (bf16-mixed, stage 2, AdamW), then the in-use heap growth of distinct bf16 matrix products,
    counted as the plan counts them. A few seconds; cached for the process."""
    from lightning_zero.testing import run_ranks

    code, per_problem = run_ranks(_measure, world_size=1, timeout=120.0, run_id="lightning_zero_resident")[0]
    return HostRuntime(code_bytes=code, matmul_problem_bytes=per_problem, source="measured")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _heap_in_use() -> int:
    """Bytes glibc's malloc has handed out (heap and mmapped chunks), else the anonymous resident set."""
    from lightning_zero.memory import _glibc

    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return _status("RssAnon")
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _Probe(torch.nn.Module):
    """A small causal transformer: embedding, LayerNorm, attention, GELU MLP, a vocabulary head."""

    def __init__(self, vocab: int = 512, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(self.norm(x)).split(c, dim=2))
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(
            b, t, c
        )
        return self.head(x + self.mlp(self.norm(x)))


def _measure(rank: int) -> tuple[int, int]:
    import torch.distributed as dist

    from lightning_zero.config import StrategyConfig, ZeroConfig
    from lightning_zero.zero import ZeroEngine

    dist.init_process_group("gloo")
    try:
        ids = torch.randint(0, 512, (2, 32))
        start = _status("RssFile")
        model = _Probe()
        optimizer = torch.optim.AdamW(model.parameters())
        engine = ZeroEngine(
            model,
            [optimizer],
            config=StrategyConfig(zero=ZeroConfig(stage=2)),
            precision="bf16-mixed",
            device=torch.device("cpu"),
        )
        for _ in range(2):
            out = model(ids)
            torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), ids.flatten()).backward()
            engine.backward_done()
            engine.step(optimizer)
        code = _status("RssFile") - start
        engine.close()
        return code, _per_matmul_problem()
    finally:
        dist.destroy_process_group()


def _per_matmul_problem(shapes: int = 8) -> int:
    """Heap bytes kept per distinct bf16 matrix product (one linear's forward and backward: three)."""

    def product(rows: int, cols: int) -> None:
        a = torch.randn(rows, 72, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(cols, 72, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.linear(a, w).sum().backward()

    product(24, 56)  # oneDNN's one-time state (and this problem's primitives) before the count
    live = LiveBytes()
    before = _heap_in_use()
    for i in range(shapes):
        with live:
            product(40 + 8 * i, 104 + 16 * i)
    grown = _heap_in_use() - before
    return max(0, grown // max(1, len(live.matmul_problems)))
