"""The plan of a tensor- and pipeline-parallel layout (:mod:`lightning_zero.plan.model_parallel`, the
strategy's split and schedule on meta tensors in a fake world) against the same layout on 4 real gloo
ranks: for every planned stage, its rank's ``memory_breakdown()`` categories and one training step's
collectives per group (data, tensor, pipeline, tied), counted by a wrapper around
:mod:`lightning_zero.comm` here (not the plan's own recorder), in calls and bytes per operation.

The real ranks run what the strategy runs (``ParallelSetup.build_groups`` / ``apply`` on the whole
model, the engine built with the setup's context, the runner's schedule with the engine's reductions
after each backward, then the step) on real tensors."""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lightning_zero.testing import run_ranks

pytestmark = pytest.mark.distributed

MODEL = "tests.helpers.plan_models:PlannedGPT"
# (tensor, pipeline, stage, schedule, chunks, sequence parallel): D x T x P = 4 ranks. overlap_comm=False: which gradient
# buckets the pool keeps does not depend on gloo's speed (the plan states that dependence).
CASES = [
    (2, 1, 2, "1f1b", 1, False),  # D=2 x T=2
    (1, 2, 1, "1f1b", 1, False),  # D=2 x P=2, the tied embedding/head across the two stages
    (2, 2, 2, "gpipe", 1, False),  # T=2 x P=2
    (1, 4, 2, "1f1b", 1, False),  # P=4: the two middle stages are equal, planned once
    (1, 2, 1, "1f1b", 2, False),  # D=2 x P=2 interleaved: 2 chunks per stage, messages both ways on each
    (2, 2, 1, "1f1b", 1, True),  # T=2 x P=2 with sequence parallelism: each message holds half the sequence
]
MICRO_BATCHES = 4
ROWS = 8  # the batch of one data-parallel replica: (8, 17) token ids, inputs and shifted labels
PRECISION = "bf16-mixed"
ZERO = {"reduce_bucket_size": 3000, "overlap_comm": False}


def _configs(tensor: int, pipeline: int, schedule: str, chunks: int, sequence: bool):  # noqa: ANN202
    from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig

    return TensorParallelConfig(size=tensor, sequence_parallel=sequence), PipelineConfig(
        stages=pipeline, micro_batches=MICRO_BATCHES, schedule=schedule, chunks=chunks
    )


@contextlib.contextmanager
def _counting(calls: list[tuple[str, str, int]], names: dict[int, str]):
    """Count every collective of lightning_zero.comm on a group of more than one rank: (group name,
    op, bytes of the whole buffer: a reduce-scatter's input, an all-gather's output, else the tensor)."""
    from lightning_zero import comm

    buffer = {"reduce_scatter": "full_in", "all_gather": "full_out"}
    with contextlib.ExitStack() as stack:
        for op in ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "send", "recv"):
            original = getattr(comm, op)
            signature = inspect.signature(original)

            def counted(*args, _op=op, _orig=original, _sig=signature, **kwargs):
                bound = _sig.bind(*args, **kwargs).arguments
                group = bound.get("group")
                if comm.world_size(group) > 1:
                    t = bound[buffer.get(_op, "tensor")]
                    calls.append((names.get(id(group), "other"), _op, t.numel() * t.element_size()))
                return _orig(*args, **kwargs)

            stack.enter_context(mock.patch.object(comm, op, counted))
        yield


def _worker(rank: int) -> list[tuple[dict, Counter, int]]:
    from lightning_zero.config import StrategyConfig, ZeroConfig
    from lightning_zero.memory import memory_breakdown
    from lightning_zero.parallel.setup import ParallelSetup
    from lightning_zero.parallel.vocab import vocab_parallel_cross_entropy
    from lightning_zero.plan.peak import LiveBytes
    from lightning_zero.zero import ZeroEngine
    from tests.helpers.plan_models import PlannedGPT

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    out = []
    try:
        for tensor, pipeline, stage, schedule, chunks, sequence in CASES:
            torch.manual_seed(0)
            tp, pp = _configs(tensor, pipeline, schedule, chunks, sequence)
            model = PlannedGPT()
            setup = ParallelSetup(tensor=tp, pipeline=pp)
            setup.build_groups(dist.get_world_size(), "cpu")
            setup.apply(model, cpu)
            assert setup.groups is not None
            names = {id(setup.groups.dp): "data", id(setup.groups.tp): "tensor", id(setup.groups.pp): "pipeline"}
            names.update({id(t.group): "tied" for t in setup.tied})
            params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
            optimizer = torch.optim.AdamW(params)
            config = StrategyConfig(zero=ZeroConfig(stage=stage, **ZERO), tensor=tp, pipeline=pp)
            parallel = setup.context(setup.dp_group)
            engine = ZeroEngine(model, [optimizer], config=config, precision=PRECISION, device=cpu, parallel=parallel)
            rows = torch.randint(0, 96, (ROWS, 17), generator=torch.Generator().manual_seed(1 + setup.groups.coords.dp))
            calls: list[tuple[str, str, int]] = []
            for step in range(2):  # the second step is compared, as the plan reports it
                live = LiveBytes()  # the plan's storage counter, here on the real tensors
                with _counting(calls if step else [], names), live:
                    if setup.runner is not None:
                        setup.runner.run((rows,), train=True, after_backward=engine.backward_done)
                    else:
                        logits = model(rows[:, :-1])
                        loss = vocab_parallel_cross_entropy(
                            logits.flatten(0, 1), rows[:, :-1].flatten(), setup.tp_group
                        )
                        loss.backward()
                        engine.backward_done()
                    engine.step(optimizer)
            out.append((memory_breakdown(model, engine, cpu), Counter(calls), live.peak))
            engine.close()
    finally:
        dist.destroy_process_group()
    return out


def test_model_parallel_plan_equals_four_real_ranks():
    from lightning_zero.config import ZeroConfig
    from lightning_zero.plan import plan

    measured = run_ranks(_worker, world_size=4, timeout=600)
    for index, (tensor, pipeline, stage, schedule, chunks, sequence) in enumerate(CASES):
        tp, pp = _configs(tensor, pipeline, schedule, chunks, sequence)
        # the pipeline's batch is the rows (inputs and labels); without one the forward's token ids
        inputs = [((ROWS, 17), torch.int64)] if pipeline > 1 else [((ROWS, 16), torch.int64)]
        planned = plan(
            MODEL,
            4,
            zero=ZeroConfig(stage=stage, **ZERO),
            device="cpu",
            tensor=tp,
            pipeline=pp,
            inputs=inputs,
            precision=PRECISION,
        )
        info = planned.parallel
        assert (info.data, info.tensor, info.pipeline) == (4 // (tensor * pipeline), tensor, pipeline)
        planned_stages = {q.parallel.stage: q for q in info.stages}
        covered = sorted(s for q in info.stages for s in q.parallel.represents)
        assert covered == list(range(pipeline)), covered  # every stage stands somewhere
        if pipeline == 4:
            assert sorted(planned_stages) == [0, 1, 3], "stages 1 and 2 hold equal layers: planned once"
        assert planned.peak == max(q.peak for q in info.stages)  # the most loaded stage is returned
        for q in info.stages:
            for represented in q.parallel.represents:
                rank = represented * info.data * info.tensor  # data- and tensor-parallel rank 0 of it
                breakdown, calls, peak = measured[rank][index]
                case = f"tp {tensor} pp {pipeline} stage {stage}: pipeline stage {represented} (rank {rank})"
                for where in ("device", "host"):
                    for category, nbytes in breakdown[where].items():
                        # within 2% (the feature's promise); on these sizes the counts agree exactly
                        assert q.memory[where][category] == pytest.approx(nbytes, rel=0.02, abs=0), (case, category)
                # (group, op) -> calls and bytes; every group, the pipeline's sends and receives included
                want_calls, want_bytes = Counter(), Counter()
                for (group, op, nbytes), n in calls.items():
                    want_calls[(group, op)] += n
                    want_bytes[(group, op)] += nbytes * n
                got_calls = {(t.group, t.op): t.count for t in q.step}
                got_bytes = {(t.group, t.op): t.nbytes for t in q.step}
                assert got_calls == dict(want_calls), (case, got_calls, dict(want_calls))
                assert got_bytes == dict(want_bytes), (case, got_bytes, dict(want_bytes))
                if represented == q.parallel.stage:
                    # The step's transient peak (the plan's storage counter, on meta tensors and here on the
                    # real ones), with a CPU rank's kernels (flash attention, the single-pass Adam) in the
                    # plan: measured planned/measured 0.98-1.02 on these tiny stages, 1.21 on a 26 KB first
                    # stage of four (5.5 KB over). 5% or 8 KiB, whichever is larger, holds both.
                    # Equal stages planned once are bounded by the first's (1F1B keeps the most
                    # micro-batches in flight there).
                    assert abs(q.transient_peak - peak) <= max(0.05 * peak, 8192), (case, q.transient_peak, peak)
                else:
                    assert q.transient_peak >= peak and q.parallel.in_flight > 1, (case, q.transient_peak, peak)
        groups = {t.group for q in info.stages for t in q.step}
        assert ("tensor" in groups) == (tensor > 1) and ("pipeline" in groups) == (pipeline > 1), groups
