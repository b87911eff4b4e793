"""``lightning-zero plan``: its options and what it prints (the plan, its step time, or a search)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from lightning_zero.plan.machine import DEVICES, INTERCONNECTS


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``plan`` subcommand's options."""
    pl = commands.add_parser("plan", help="per-rank memory, collectives and step time from the engine on meta tensors")
    pl.add_argument("model", help="package.module:Class, or a Hugging Face config.json (or its directory)")
    pl.add_argument("--kwargs", default="{}", help="the class's constructor arguments as JSON (default {})")
    pl.add_argument("--world-size", type=int, required=True, help="every rank: data x tensor x pipeline sizes")
    pl.add_argument("--stage", type=int, default=2, help="1, 2 or 3 (default 2)")
    pl.add_argument("--precision", default="bf16-mixed", help="32-true, bf16-mixed or bf16-true")
    pl.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the ranks' accelerator")
    for tier in ("optimizer", "parameters"):
        pl.add_argument(
            f"--offload-{tier}",
            nargs="?",
            const=True,
            default=False,
            choices=["cpu", "nvme"],
            help="to host memory (no value, or cpu) or to NVMe swap files (nvme)",
        )
    pl.add_argument(
        "--nvme", type=float, help="GiB of NVMe per rank: checks the swap files; --search tries the NVMe tiers"
    )
    pl.add_argument(
        "--nvme-path", help="the swap directory: with --machine calibrate, its disk is measured (about a second)"
    )
    pl.add_argument("--no-pin-memory", action="store_true")
    for name in ("reduce-bucket-size", "param-persistence-threshold", "prefetch-bucket-size"):
        pl.add_argument(f"--{name}", help="elements (default: the strategy's)")
    pl.add_argument("--input", action="append", help="a forward input SHAPE[:DTYPE], e.g. 8,128:int64 (repeat)")
    pl.add_argument("--micro-batch", type=int, default=1, help="HF models: sequences per rank (default 1)")
    pl.add_argument("--seq-len", type=int, default=128, help="HF models: tokens per sequence (default 128)")
    pl.add_argument(
        "--activation-checkpointing", help="class names of the modules to checkpoint, comma-separated (e.g. GPT2Block)"
    )
    pl.add_argument(
        "--machine",
        help=f"time the step on {sorted(DEVICES)} (default H100 with --device cuda) or 'calibrate' "
        "(measure this machine as --world-size gloo ranks, a few seconds)",
    )
    pl.add_argument("--interconnect", help=f"the data-parallel link: {sorted(INTERCONNECTS)} (default the NVLink)")
    _model_parallel_options(pl)
    pl.add_argument("--search", action="store_true", help="every layout that fits, fastest first")
    pl.add_argument("--memory", type=float, help="GiB of device memory per rank (default: the machine's)")
    pl.add_argument("--host-memory", type=float, help="GiB of host memory per rank (default: no limit)")
    pl.add_argument("--micro-batches", default="1,2,4,8", help="--search: micro-batch sizes to try")
    pl.add_argument("--tensor-sizes", default="1", help="--search: tensor-parallel sizes to try, e.g. 1,2,4")
    pl.add_argument("--pipeline-sizes", default="1", help="--search: pipeline-parallel sizes to try, e.g. 1,2")


def _model_parallel_options(pl: argparse.ArgumentParser) -> None:
    """The strategy's tensor- and pipeline-parallel options, under their option names."""
    pl.add_argument("--tensor-parallel-size", type=int, default=1, help="T (default 1)")
    pl.add_argument(
        "--tensor-parallel-plan",
        help="the plan as JSON {pattern: style} (default: the model's tensor_parallel_plan())",
    )
    pl.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (with T > 1)")
    pl.add_argument("--pipeline-parallel-size", type=int, default=1, help="P (default 1)")
    pl.add_argument("--pipeline-micro-batches", type=int, help="m, micro-batches per batch (default P)")
    pl.add_argument("--pipeline-schedule", default="1f1b", help="1f1b (default) or gpipe")
    pl.add_argument("--pipeline-chunks", type=int, default=1, help="v, interleaved chunks per stage (default 1)")
    pl.add_argument("--pipeline-partition", default="parameters", help="parameters, uniform or type:<regex>")
    pl.add_argument(
        "--batch-keys",
        help="a pipeline's batch as a dict: the names of the --input tensors, comma-separated (default: a tuple)",
    )


def _parallel(args: argparse.Namespace) -> dict[str, Any]:
    """``tensor``, ``pipeline`` and ``batch_keys`` for :func:`~lightning_zero.plan.core.plan` (the
    configs validate the values as the strategy does)."""
    from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig

    plan = json.loads(args.tensor_parallel_plan) if args.tensor_parallel_plan else None
    if plan is not None and not isinstance(plan, dict):
        raise ValueError(f"--tensor-parallel-plan {args.tensor_parallel_plan!r} must be a JSON object")
    return {
        "tensor": TensorParallelConfig(
            size=args.tensor_parallel_size, plan=plan, sequence_parallel=args.sequence_parallel
        ),
        "pipeline": PipelineConfig(
            stages=args.pipeline_parallel_size,
            micro_batches=args.pipeline_micro_batches,
            schedule=args.pipeline_schedule,
            chunks=args.pipeline_chunks,
            partition=args.pipeline_partition,
        ),
        "batch_keys": tuple(k.strip() for k in args.batch_keys.split(",")) if args.batch_keys else None,
    }


def _machine(args: argparse.Namespace) -> Any:
    from lightning_zero.plan.machine import calibrate, known

    name = args.machine or ("H100" if args.device == "cuda" else None)
    if name is None:
        return None
    if name == "calibrate":
        if args.interconnect:
            raise ValueError("--interconnect applies to a machine of the table, not to 'calibrate'.")
        if args.device != "cpu":
            raise ValueError("--machine calibrate measures this machine's CPU ranks: plan them with --device cpu.")
        disk = "nvme" in (args.offload_optimizer, args.offload_parameters) or (args.search and args.nvme)
        if disk and not args.nvme_path:
            raise ValueError("the NVMe tiers' step time needs this machine's disk: give --nvme-path DIR to measure it.")
        return calibrate(args.world_size, nvme_path=args.nvme_path)
    return known(name, args.interconnect)


def _policy(names: str | None) -> Any:
    if not names:
        return None
    wanted = frozenset(n.strip() for n in names.split(",") if n.strip())

    def policy(module: Any) -> bool:
        return type(module).__name__ in wanted

    policy.__name__ = "classes named " + ",".join(sorted(wanted))
    return policy


def _nvme(args: argparse.Namespace) -> Any:
    from lightning_zero.config import NvmeConfig

    if args.nvme is not None and args.nvme <= 0:
        raise ValueError(f"--nvme {args.nvme} must be positive GiB per rank.")
    return NvmeConfig(path=args.nvme_path or "nvme")


def run(args: argparse.Namespace) -> int:
    """Run the ``plan`` subcommand; the exit status."""
    from lightning_zero.config import ActivationCheckpointConfig, OffloadConfig, ZeroConfig
    from lightning_zero.plan import format_plan, plan
    from lightning_zero.plan.model import parse_input

    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError(f"--kwargs {args.kwargs!r} must be a JSON object")
        sizes: dict[str, Any] = {
            key: (v if v == "auto" else int(v))
            for key in ("reduce_bucket_size", "param_persistence_threshold", "prefetch_bucket_size")
            if (v := getattr(args, key)) is not None
        }
        common: dict[str, Any] = {
            "precision": args.precision,
            "device": args.device,
            "model_kwargs": kwargs,
            "seq_len": args.seq_len,
            **_parallel(args),
        }
        inputs = [parse_input(text) for text in args.input] if args.input else None
        policy = _policy(args.activation_checkpointing)
        machine = _machine(args)
        if args.search:
            return _search(args, machine, policy, sizes, inputs, common)
        result = plan(
            args.model,
            args.world_size,
            zero=ZeroConfig(stage=args.stage, **sizes),
            offload=OffloadConfig(
                offload_optimizer=args.offload_optimizer,
                offload_parameters=args.offload_parameters,
                pin_memory=not args.no_pin_memory,
                nvme=_nvme(args) if "nvme" in (args.offload_optimizer, args.offload_parameters) else None,
            ),
            inputs=inputs,
            micro_batch=args.micro_batch,
            activations=ActivationCheckpointConfig(policy=policy),
            **common,
        )
    except ValueError as error:  # json.JSONDecodeError is one
        print(f"lightning-zero plan: error: {error}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.nvme is not None and result.nvme_bytes > args.nvme * 2**30:
        print(
            f"lightning-zero plan: the swap files need {result.nvme_bytes / 2**30:.2f} GiB per rank, more than "
            f"--nvme {args.nvme} GiB: more ranks, or fewer tiers on disk.",
            file=sys.stderr,
        )
        return 1
    if machine is not None:
        t = result.step_time(machine)
        print(
            f"step time on {t.machine}: {t.seconds * 1e3:.2f} ms (forward {t.forward * 1e3:.2f}, backward "
            f"{t.backward * 1e3:.2f}, optimizer {t.optimizer * 1e3:.2f}, of which on the host {t.host * 1e3:.2f}; "
            f"communication {t.communication * 1e3:.2f}, exposed {t.exposed_communication * 1e3:.2f}"
            + (f"; NVMe {t.disk * 1e3:.2f}, exposed {t.exposed_disk * 1e3:.2f}" if result.nvme is not None else "")
            + ")"
        )
        bubble = getattr(t, "bubble", 0.0)  # a pipeline's step (pipeline_time.PipelineStepTime)
        if bubble:
            print(
                f"  of it the pipeline's bubble {bubble * 1e3:.2f} ms (the idle time of stage {getattr(t, 'stage', 0)}, the busiest)"
            )
    return 0


def _search(args: argparse.Namespace, machine: Any, policy: Any, sizes: dict, inputs: Any, common: dict) -> int:
    from lightning_zero.config import ZeroConfig
    from lightning_zero.plan.search import format_search, search

    if machine is None:
        raise ValueError("--search ranks layouts by predicted speed: give --machine (a table device or 'calibrate').")
    table = DEVICES.get(args.machine or "H100", {})
    device_memory = int(args.memory * 2**30) if args.memory else int(table.get("memory_bytes", 0))  # type: ignore[call-overload]
    if not device_memory:
        raise ValueError(f"--search needs the device memory per rank: give --memory GiB (machine {args.machine!r}).")
    batches = [int(n) for n in args.micro_batches.split(",")]
    tensor_sizes = [int(n) for n in args.tensor_sizes.split(",")]
    pipeline_sizes = [int(n) for n in args.pipeline_sizes.split(",")]
    refused: list[str] = []
    make_inputs = None
    if inputs:  # the first dimension of every input is the micro-batch
        make_inputs = lambda mb: [((mb, *shape[1:]), dtype) for shape, dtype in inputs]  # noqa: E731
    found = search(
        args.model,
        args.world_size,
        machine,
        device_memory=device_memory,
        host_memory=int(args.host_memory * 2**30) if args.host_memory else sys.maxsize,
        micro_batches=batches,
        checkpoint_policy=policy,
        make_inputs=make_inputs,
        nvme_memory=int(args.nvme * 2**30) if args.nvme else 0,
        nvme=_nvme(args),
        tensor_sizes=tensor_sizes,
        pipeline_sizes=pipeline_sizes,
        refused=refused,
        zero=ZeroConfig(**sizes),
        **common,
    )
    print(
        f"search: {args.model} on {args.world_size} ranks of {machine.name}, {math.ceil(device_memory / 2**20)} MiB each"
    )
    print(format_search(found))
    for reason in refused:
        print(f"not planned: {reason}")
    return 0
