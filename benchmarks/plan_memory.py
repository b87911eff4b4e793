"""The plan's peak memory of a training step against the OS-measured peak RSS growth of real ranks.

Run: ``python benchmarks/plan_memory.py [--ranks 2] [--json benchmarks/results/plan-peak-memory.json]``
     ``--quick``: tiny models (checks the script, not the numbers)

Each case runs in freshly spawned gloo ranks (so no earlier case's freed memory is in the process):
a rank reads its resident set (``VmRSS``) after the process group starts, builds the model and the
engine (bf16-mixed, AdamW; the model's library is imported before), runs two training steps (the pools and the optimizer states are then
allocated), resets the kernel's high-water mark (``/proc/self/clear_refs``), runs a third step and
reads ``VmHWM``, with glibc's mmap threshold fixed (below) so that freed tensors leave the resident
set. The growth is ``VmHWM - VmRSS at the start``: the model states, the engine's pool
and the step's transient peak, plus whatever the allocator keeps of memory freed during construction.
The plan of the same case (``device="cpu"``) predicts it as :attr:`Plan.peak`, the model states and
pool (``memory_breakdown()``'s categories) plus the step's transient peak counted on meta tensors.
The plan's CPU terms that are no tensor (:mod:`lightning_zero.plan.resident`: the kernels' code paged
in, oneDNN's kept primitives) are measured once per run on this machine (``measure_host_runtime``).
Shapes: those of ``benchmarks/plan_check.py`` (the default), and two held out from any tuning of the
plan: ``gpt-wide`` (another GPT), ``hf-llama`` (a Hugging Face Llama with grouped-query
attention, its config built in code) and ``hf-gpt2`` (a small GPT2Config); the transformers also with every block checkpointed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# glibc raises its mmap threshold each time a large block is freed, and keeps later blocks below it
# on the heap after they are freed: the resident set then holds memory the program no longer uses
# (measured: the same peak with and without activation checkpointing). A fixed 128 KiB threshold
# (glibc's initial one) returns every tensor's memory when it is freed, so the high-water mark is
# the live peak. Read by glibc at process start: set before the ranks (and their fork server) start.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))

import tempfile

import common
import plan_check
import torch
import torch.distributed as dist

from recipes.gpt2.model import Block, GPTConfig

#: shapes held out from tuning the plan: (kind, config, (batch, seq)); "hf": a transformers config
HELD_OUT: dict[str, tuple[str, object, tuple[int, int]]] = {
    "gpt-wide": ("gpt", GPTConfig(vocab_size=6000, block_size=96, n_layer=4, n_head=8, n_embd=512), (6, 96)),
    "hf-llama": (
        "hf",
        {
            "model_type": "llama",
            "vocab_size": 5000,
            "hidden_size": 320,
            "intermediate_size": 864,
            "num_hidden_layers": 5,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        },
        (3, 160),
    ),
    "hf-gpt2": (
        "hf",
        {
            "model_type": "gpt2",
            "vocab_size": 3000,
            "n_embd": 256,
            "n_layer": 3,
            "n_head": 4,
            "n_positions": 128,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        (4, 128),
    ),
}


def _shape(shape: str) -> tuple[str, object, tuple[int, int]]:
    return HELD_OUT[shape] if shape in HELD_OUT else plan_check.SHAPES[shape]


def _hf_config(config: dict) -> object:
    import transformers

    values = dict(config)
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def _model(shape: str) -> torch.nn.Module:
    kind, config, _ = _shape(shape)
    if kind == "hf":
        import transformers

        return transformers.AutoModelForCausalLM.from_config(_hf_config(config))  # type: ignore[arg-type]
    if kind == "gpt":
        from recipes.gpt2.model import GPT

        return GPT(config)  # type: ignore[arg-type]
    if kind == "odd":
        return plan_check.OddMLP(**config)  # type: ignore[arg-type]
    return common.SquareStack()


def _inputs(shape: str, generator: torch.Generator) -> torch.Tensor:
    kind, config, dims = _shape(shape)
    if kind in ("square", "odd"):
        return torch.randn(*dims, generator=generator).to(torch.bfloat16)
    vocab = config["vocab_size"] if kind == "hf" else config.vocab_size  # type: ignore[index, union-attr]
    return torch.randint(0, vocab, dims, generator=generator)


def _loss(shape: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out = getattr(out, "logits", out)
    if _shape(shape)[0] not in ("square", "odd"):  # what the plan computes for token ids and (batch, seq, vocab) logits
        return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), x.flatten())
    return out.float().mean()


def _checkpointed(shape: str) -> object:
    """The block class every transformer block of ``shape`` is (what gets checkpointed)."""
    kind, config, _ = _shape(shape)
    if kind != "hf":
        return Block
    model = torch.nn.Module()
    with torch.device("meta"):
        model = _model(shape)
    blocks = set(getattr(model, "_no_split_modules", None) or ())  # transformers' name for its blocks
    return type(next(m for m in model.modules() if type(m).__name__ in blocks))


LAYOUTS = [("zero1", 1, False), ("zero2", 2, False), ("zero3", 3, False), ("zero3_offload", 3, True)]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _use_quick_shapes() -> None:
    """Tiny models (``--quick``), in the main process and in each rank."""
    common.use_tiny_models()
    plan_check.SHAPES["gpt"] = ("gpt", common.MODEL, (2, 16))
    plan_check.SHAPES["gpt-deep"] = (
        "gpt",
        GPTConfig(vocab_size=128, block_size=32, n_layer=3, n_head=2, n_embd=16),
        (2, 32),
    )
    plan_check.SHAPES["square"] = ("square", None, (4, common.SQUARE_WIDTH))
    plan_check.SHAPES["mlp-odd"] = ("odd", {"width": 10, "hidden": 29, "depth": 2}, (4, 10))
    HELD_OUT["gpt-wide"] = ("gpt", GPTConfig(vocab_size=96, block_size=24, n_layer=2, n_head=2, n_embd=24), (2, 24))
    HELD_OUT["hf-llama"] = (
        "hf",
        {
            **HELD_OUT["hf-llama"][1],
            "vocab_size": 96,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
        },  # type: ignore[dict-item]
        (2, 16),
    )


def measure(rank: int, shape: str, stage: int, offload: bool, checkpoint: bool, quick: bool = False) -> int:
    """Peak RSS growth (bytes) of this rank over a training step, from before the model existed."""
    from lightning_zero import comm
    from lightning_zero.activations import apply_activation_checkpointing
    from lightning_zero.config import ActivationCheckpointConfig, OffloadConfig, StrategyConfig, ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    if quick:
        _use_quick_shapes()
    dist.init_process_group("gloo")
    try:
        group = dist.group.WORLD
        generator = torch.Generator().manual_seed(rank)
        x = _inputs(shape, generator)
        # the model's library imported first (transformers: ~15 MiB of modules); a meta model imports it
        block = _checkpointed(shape)
        comm.barrier(group)
        start = _status("VmRSS")
        torch.manual_seed(0)
        model = _model(shape)
        optimizer = torch.optim.AdamW(model.parameters())
        activations = ActivationCheckpointConfig(policy=block if checkpoint else None)
        apply_activation_checkpointing(model, activations, None, stage == 3)
        config = StrategyConfig(
            zero=ZeroConfig(stage=stage), offload=OffloadConfig(offload_optimizer=offload), activations=activations
        )
        engine = ZeroEngine(model, [optimizer], config=config, precision="bf16-mixed", device=torch.device("cpu"))
        for step in range(3):
            if step == 2:
                comm.barrier(group)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # the high-water mark restarts at the current resident set
            _loss(shape, model, x).backward()
            engine.backward_done()
            engine.step(optimizer)
        growth = _status("VmHWM") - start
        engine.close()
        return growth
    finally:
        dist.destroy_process_group()


def planned(shape: str, stage: int, offload: bool, checkpoint: bool, world_size: int, runtime: object = None) -> object:
    """The plan of one case (device ``cpu``); ``runtime``: the CPU's non-tensor terms (a HostRuntime)."""
    from lightning_zero.plan import plan

    kind, config, dims = _shape(shape)
    if kind == "hf":  # the plan reads a Hugging Face config.json
        with tempfile.TemporaryDirectory() as directory:
            _hf_config(config).save_pretrained(directory)  # type: ignore[attr-defined]
            return _plan_of(plan, directory, None, kind, dims, shape, stage, offload, checkpoint, world_size, runtime)
    source = {"gpt": "recipes.gpt2.model:GPT", "odd": "plan_check:OddMLP"}.get(kind, "common:SquareStack")
    kwargs = {"config": config} if kind == "gpt" else config
    return _plan_of(plan, source, kwargs, kind, dims, shape, stage, offload, checkpoint, world_size, runtime)


def _plan_of(plan, source, kwargs, kind, dims, shape, stage, offload, checkpoint, world_size, runtime):  # type: ignore[no-untyped-def]
    from lightning_zero.config import ActivationCheckpointConfig, OffloadConfig, ZeroConfig

    return plan(
        source,
        world_size,
        zero=ZeroConfig(stage=stage),
        offload=OffloadConfig(offload_optimizer=offload),
        device="cpu",
        model_kwargs=kwargs,
        inputs=[(dims, torch.float32 if kind in ("square", "odd") else torch.int64)],
        activations=ActivationCheckpointConfig(policy=_checkpointed(shape) if checkpoint else None),
        host_runtime=runtime,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--shapes", default=",".join(plan_check.SHAPES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        _use_quick_shapes()
    from lightning_zero.plan.resident import measure_host_runtime

    runtime = measure_host_runtime()
    mib = 2**20
    print(
        f"this CPU's non-tensor terms: kernel code {runtime.code_bytes / mib:.1f} MiB, "
        f"{runtime.matmul_problem_bytes / 1024:.0f} KiB per 16-bit matrix product",
        flush=True,
    )
    rows = []
    for world_size in (int(n) for n in args.ranks.split(",")):
        for shape in args.shapes.split(","):
            checkpoints = (False, True) if _shape(shape)[0] not in ("square", "odd") else (False,)
            for label, stage, offload in LAYOUTS:
                for checkpoint in checkpoints:
                    growth = common.run_ranks(
                        measure, shape, stage, offload, checkpoint, args.quick, world_size=world_size
                    )[0]
                    p = planned(shape, stage, offload, checkpoint, world_size, runtime)
                    row = [
                        shape,
                        label + (" + checkpointing" if checkpoint else ""),
                        world_size,
                        f"{p.total('device') / mib:.1f}",  # type: ignore[attr-defined]
                        f"{p.transient_peak / mib:.1f}",  # type: ignore[attr-defined]
                        f"{p.resident / mib:.1f}",  # type: ignore[attr-defined]
                        f"{p.peak / mib:.1f}",  # type: ignore[attr-defined]
                        f"{growth / mib:.1f}",
                        f"{p.peak / growth:.2f}",  # type: ignore[attr-defined]
                    ]
                    rows.append(row)
                    print(" | ".join(str(c) for c in row), flush=True)
    headers = [
        "shape",
        "layout",
        "ranks",
        "planned states + pool MiB",
        "planned step transient MiB",
        "planned non-tensor MiB",
        "planned peak MiB",
        "measured peak RSS growth MiB",
        "planned / measured",
    ]
    print(common.format_table(headers, rows))
    ratios = [float(r[-1]) for r in rows]
    summary = f"{sum(0.85 <= r <= 1.15 for r in ratios)} of {len(ratios)} cases within 15% (ratios {min(ratios):.2f} to {max(ratios):.2f})"
    print(summary)
    common.write_json(
        args.json,
        {
            "machine": {**common.machine(), "ranks": f"{args.ranks} gloo ranks, 1 thread each"},
            "title": f"plan_memory.py: planned peak against the OS-measured peak RSS growth ({args.ranks} ranks"
            + (f"; {args.shapes})" if args.shapes != parser.get_default("shapes") else ")"),
            "topic": "memory",
            "command": ("python benchmarks/plan_memory.py " + " ".join(sys.argv[1:])).strip(),
            "headers": headers,
            "rows": rows,
            "notes": [
                summary,
                f"non-tensor terms measured on this machine: kernel code {runtime.code_bytes / mib:.1f} MiB, "
                f"{runtime.matmul_problem_bytes / 1024:.0f} KiB per distinct 16-bit matrix product",
            ],
        },
    )


if __name__ == "__main__":
    main()
