"""Pipeline parallelism on CPU/gloo: the recipes' GPT-2 cut into stages, against one process.

Tiny GPT-2 (3 blocks, d=32, 2 heads, vocab 64, 16 positions) as the layers
``[embed, h0, h1, h2, head]``; the token embedding and the LM head share one Parameter, so with 2
stages the tie spans stage 0 (embed) and stage 1 (head): each keeps a copy and their gradients are
summed. References are plain single-process PyTorch on the whole model with the same global batches,
AdamW and norm clipping (below every norm, so the global norm is used every step).

Tolerances: fp32 throughout. Pipelining alone changes only how a batch's gradient is summed (per
micro-batch, then across micro-batches, and the tied gradient across stages) - ~1e-7 relative; tensor
parallelism adds its split sums (see test_tensor_parallel.py). Four AdamW steps amplify that by ~10,
so losses, gradient norms and final weights are compared at 1e-5 relative. Weights get an absolute
floor of 1e-5 and AdamW an eps of 1e-6 (not 1e-8): AdamW divides by sqrt(v), so with eps=1e-8 an
element whose gradient is at rounding level still moves by up to lr (1e-2) in a direction set by
rounding (measured: 1.3e-5 on one weight element of 4096); with eps=1e-6 that noise is bounded by
lr * (rounding of the gradient, up to ~1e-9 with sequence parallelism's extra reductions) / 1e-6 =
1e-5 (measured: 4.4e-6 on one element of 2048 under tp2 x pp2 with sequence parallelism). A dropped
micro-batch, an unsummed tie or a norm counting the tie twice moves weights by ~lr and losses and
norms by 1e-2 relative or more.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.gpt_reference import BATCH, LR, reference_run, tiny_gpt, tokens
from tests.helpers.model_parallel import EPS, fit_pipelined
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed


def _gpt():
    return tiny_gpt(n_layer=3)


_tokens = tokens


def _reference(data_parallel: int) -> dict:
    """One process, whole model (3 blocks): per-step losses of each data-parallel shard, norms, final
    weights under every name (the tied LM head's too), and the loss on the validation rows."""
    ref = reference_run(
        3,
        lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=EPS),
        data_parallel,
        val_rows=_tokens(BATCH),
        alias_names=True,
    )
    ref["weights"] = {f"model.{n}": p for n, p in ref.pop("params").items()}
    return ref


def _close(got, want, what, atol=1e-7):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _shard_of(full: torch.Tensor, got: torch.Tensor, rank: int) -> torch.Tensor:
    for dim, (a, b) in enumerate(zip(full.shape, got.shape, strict=True)):
        if a != b:
            return full.narrow(dim, rank * b, b)
    return full


def _check(results: list[dict], reference: dict, tensor: int, pipeline: int) -> None:
    data = len(results) // (tensor * pipeline)
    seen = set()
    for rank, res in enumerate(results):
        tp, dp, pp = rank % tensor, (rank // tensor) % data, rank // (tensor * data)
        assert res["sampler"] == {"num_replicas": data, "rank": dp}, res["sampler"]
        _close(torch.tensor(res["losses"]), torch.tensor(reference["losses"][dp]), f"rank {rank} losses")
        _close(torch.tensor(res["norms"]), torch.tensor(reference["norms"]), f"rank {rank} grad norms")
        _close(torch.tensor(res["val_loss"]), torch.tensor(reference["val_loss"]), f"rank {rank} val")
        for name, got in res["weights"].items():
            want = reference["weights"][name]
            want = _shard_of(want, got, tp) if name in res["marked"] else want
            _close(got, want, f"rank {rank} (pp {pp}) weight {name}", atol=1e-5)
            seen.add(name)
        # Stage 0 keeps the embedding (and the tied weight), the last stage the head and its copy.
        assert ("model.embed.wte.weight" in res["weights"]) == (pp == 0), sorted(res["weights"])
        assert ("model.head.lm_head.weight" in res["weights"]) == (pp == pipeline - 1)
        assert res["remote"], "every stage replaces the other stages' layers"
    assert seen == set(reference["weights"]), set(reference["weights"]) - seen  # every weight lives somewhere


def _pp2_worker(rank: int) -> dict:
    return fit_pipelined(world=2, tensor=1, pipeline=2, stage=2, micro_batches=4, schedule="1f1b")


def test_pp2_stage2_1f1b_matches_one_process_with_tied_embedding():
    results = run_ranks(_pp2_worker, world_size=2)
    _check(results, _reference(data_parallel=1), tensor=1, pipeline=2)
    assert all("predict under pipeline_parallel_size > 1 is not available" in r["predict_error"] for r in results)
    # 1F1B with 4 micro-batches: stage 0 warms up with one forward, stage 1 alternates at once.
    assert results[0]["schedule"][:4] == ["F0", "F1", "B0", "F2"], results[0]["schedule"]
    assert results[1]["schedule"][:4] == ["F0", "B0", "F1", "B1"], results[1]["schedule"]


def _pp2_accumulate_worker(rank: int) -> dict:
    return fit_pipelined(world=2, tensor=1, pipeline=2, stage=1, micro_batches=2, schedule="1f1b", accumulate=2)


def test_pp2_with_gradient_accumulation_matches_one_process():
    # Two batches of 2 rows per step (each cut into 2 micro-batches) = the reference's 4 rows per step:
    # the loss of a step is the mean of its two batches' losses. (Lightning hands on_train_batch_end
    # the loss divided by accumulate_grad_batches, so the sum of a pair is that mean.)
    results = run_ranks(_pp2_accumulate_worker, world_size=2)
    reference = _reference(data_parallel=1)
    for res in results:
        res["losses"] = [sum(pair) for pair in zip(res["losses"][::2], res["losses"][1::2], strict=True)]
    _check(results, reference, tensor=1, pipeline=2)


def _pp2_interleaved_worker(rank: int) -> dict:
    return fit_pipelined(world=2, tensor=1, pipeline=2, stage=1, micro_batches=4, schedule="1f1b", chunks=2)


def test_pp2_interleaved_two_chunks_matches_one_process():
    # 5 layers in 4 virtual stages: stage 0 runs the embedding and h1, stage 1 h0 and h2 + head;
    # every micro-batch crosses the stages three times (0 -> 1 -> 0 -> 1).
    results = run_ranks(_pp2_interleaved_worker, world_size=2)
    _check(results, _reference(data_parallel=1), tensor=1, pipeline=2)
    assert results[0]["schedule"][:6] == ["F0", "F1", "F0.1", "F1.1", "F2", "B0.1"], results[0]["schedule"]


def _pp2_dp2_worker(rank: int) -> dict:
    return fit_pipelined(world=4, tensor=1, pipeline=2, stage=1, micro_batches=2, schedule="gpipe")


def test_pp2_dp2_stage1_matches_dp2_reference():
    _check(run_ranks(_pp2_dp2_worker, world_size=4, timeout=300), _reference(data_parallel=2), tensor=1, pipeline=2)


def _tp2_pp2_worker(rank: int, sequence_parallel: bool) -> dict:
    return fit_pipelined(
        world=4, tensor=2, pipeline=2, stage=1, micro_batches=2, schedule="1f1b", sequence_parallel=sequence_parallel
    )


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_pp2_matches_one_process(sequence_parallel):
    # With sequence parallelism every tensor-parallel rank sends its half of the sequence to the
    # same tensor-parallel rank of the next stage; the LM head's all-gather makes it whole again.
    results = run_ranks(_tp2_pp2_worker, sequence_parallel, world_size=4, timeout=300)
    _check(results, _reference(data_parallel=1), tensor=2, pipeline=2)


def _failing_worker(rank: int) -> dict:
    """The last stage's loss raises at the third micro-batch: the other stage waits in a receive."""
    import time

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import PipelineSpec, ZeroStrategy

    calls = []

    class Failing(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt()

        def _loss(self, logits, batch):
            calls.append(1)
            if len(calls) == 3:
                raise ValueError("bad batch in the loss")
            return self.model.loss(logits, batch[0][:, 1:])

        def configure_pipeline(self) -> PipelineSpec:
            return PipelineSpec(layers=self.model.to_layers(), loss=self._loss, inputs=lambda batch: batch[0][:, :-1])

        def training_step(self, batch, batch_idx):  # pragma: no cover - the pipeline runs instead
            raise AssertionError

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=1, pipeline_parallel_size=2, pipeline_micro_batches=2),
        max_steps=4,
    )
    start = time.perf_counter()
    try:
        trainer.fit(Failing(), DataLoader(TensorDataset(_tokens(16)), batch_size=4))
    except BaseException as error:  # noqa: BLE001 - returned for the parent to check
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def test_a_failing_stage_stops_every_stage_without_a_hang():
    # Stage 1 raises in its loss during the second step; stage 0, blocked in a receive from it,
    # must fail as soon as stage 1's process is gone (gloo closes the connection), not after the
    # 10-minute collective timeout. 120 s bounds two processes importing Lightning on busy cores.
    results = run_ranks(_failing_worker, world_size=2, timeout=180)
    assert "ValueError: bad batch in the loss" in results[1]["error"], results[1]
    assert "rank 1 of 2 is gone" in results[0]["error"] and results[0]["seconds"] < 120, results[0]  # measured 1.7 s
