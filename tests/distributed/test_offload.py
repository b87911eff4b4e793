"""ZeRO-Offload and shard-aware LAMB on 2 CPU/gloo ranks, against Lightning's DDP.

On a CPU-only machine the device is the host, so offloading changes where the step runs (the
compiled CPU kernels of lightning_zero.ops instead of torch.optim) but not the numbers: every run
must match DDP, with accumulation 2, clipping and two parameter groups.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_zero.testing import run_ranks
from tests.helpers.models import state
from tests.helpers.parity import max_rel
from tests.helpers.trainer import fit
from tests.helpers.workers import resume_worker

pytestmark = pytest.mark.distributed

SMALL = {"param_persistence_threshold": 10, "reduce_bucket_size": 40}
OFFLOAD_SPECS = [
    ("zero1_offload", {"stage": 1, "offload_optimizer": True, "reduce_bucket_size": 40}),
    ("zero2_offload", {"stage": 2, "offload_optimizer": True, "reduce_bucket_size": 40}),
    ("zero3_offload", {"stage": 3, "offload_optimizer": True, **SMALL}),
    ("zero3_offload_params", {"stage": 3, "offload_optimizer": True, "offload_parameters": True, **SMALL}),
]


class _ForceMultiTensorLamb(Callback):
    """Run LAMB through the multi-tensor kernels used for GPU masters (they also run on CPU
    tensors), so that path is checked here too."""

    def on_train_start(self, trainer, pl_module) -> None:
        for sharded in trainer.strategy._engine._sharded.values():  # reaches inside on purpose: a test of a path
            sharded.kernel.fused = True


def _worker(rank: int, optimizer: str, specs: list, precision: str) -> dict:
    out = {}
    for name, spec in [("ddp", "ddp"), *specs]:
        callbacks = []
        if isinstance(spec, dict) and spec.pop("multi_tensor", False):
            callbacks.append(_ForceMultiTensorLamb())
        _, model = fit(
            spec, precision=precision, model_kwargs={"optimizer": optimizer}, trainer_kwargs={"callbacks": callbacks}
        )
        out[name] = {"losses": model.losses, "state": state(model)}
    return out


def _check(results: list, names: list[str], rtol: float) -> None:
    for res in results:
        ref = res["ddp"]
        for name in names:
            got = res[name]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
            for key, value in ref["state"].items():
                diff = max_rel(got["state"][key], value)
                assert diff <= rtol, (name, key, diff)


def test_adamw_offload_matches_ddp():
    results = run_ranks(_worker, "adamw", OFFLOAD_SPECS, "32-true")
    # fp32: the CPU kernel computes AdamW with the same formula as torch (1 - beta in double, as
    # torch does), so the only differences are summation order in the reductions and fused vs
    # separate roundings in the kernel: ~1e-7 per step; 1e-5 relative is the bound.
    _check(results, [name for name, _ in OFFLOAD_SPECS], rtol=1e-5)


def test_lamb_on_shards_matches_ddp():
    specs = [
        ("zero2", {"stage": 2, "reduce_bucket_size": 40}),
        ("zero2_multi_tensor", {"stage": 2, "reduce_bucket_size": 40, "multi_tensor": True}),
        ("zero3_offload", OFFLOAD_SPECS[2][1]),
    ]
    results = run_ranks(_worker, "lamb", specs, "32-true")
    # LAMB's trust ratio uses whole-parameter norms: summed from pieces on both ranks (and from
    # several pieces of a parameter cut by buffer boundaries) in another order than DDP's single
    # sum: ~1e-7 relative on the ratio; same 1e-5 bound as AdamW.
    _check(results, ["zero2", "zero2_multi_tensor", "zero3_offload"], rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["adagrad", "lion"])
def test_adagrad_and_lion_offload_match_ddp(optimizer):
    """torch.optim.Adagrad and ops.Lion under zero2_offload step with the compiled one-state host
    kernels; DDP steps torch's Adagrad and Lion's own step() on whole parameters."""
    results = run_ranks(_worker, optimizer, [OFFLOAD_SPECS[1]], "32-true")
    # Adagrad: same formula, fused vs separate roundings and the reduction's summation order, ~1e-7
    # per step, as for AdamW. Lion: every update is +-lr (sign), so the only differences are the
    # decay term's rounding and the order of the gradient sum (which cannot flip a sign that is not
    # within ~1e-7 of 0): the same 1e-5 bound.
    _check(results, ["zero2_offload"], rtol=1e-5)


def _moment_dtypes(rank: int) -> dict:
    """The moments' dtype and bytes the engine keeps for ops.CPUAdam(state_dtype=torch.bfloat16)."""
    from lightning import Callback as LightningCallback

    seen: dict = {}

    class Probe(LightningCallback):
        def on_train_end(self, trainer, pl_module) -> None:
            optimizer = trainer.strategy._engine._optimizers[0]
            states = [s for s in optimizer.state.values() if "exp_avg_sq" in s]
            seen["dtypes"] = sorted({str(s[k].dtype) for s in states for k in ("exp_avg", "exp_avg_sq")})

    fit(OFFLOAD_SPECS[1][1].copy(), model_kwargs={"optimizer": "cpuadam_bf16"}, trainer_kwargs={"callbacks": [Probe()]})
    return seen


def test_bf16_moments_offload_match_ddp():
    """ops.CPUAdam(state_dtype=torch.bfloat16) under zero2_offload: the engine keeps the moments in
    bf16 (half the state bytes in memory, on disk and through the step) and steps them with the
    same kernel DDP's run calls through CPUAdam.step() on whole parameters."""
    results = run_ranks(_worker, "cpuadam_bf16", [OFFLOAD_SPECS[1]], "32-true")
    # The same kernel on both sides; the gradients differ by the reduction's summation order (~1e-7
    # relative), which could move a bf16 moment across a rounding boundary (2**-8 relative): measured
    # 0 on the losses and 1e-7 on the states here; the 1e-5 bound of the fp32 tests holds.
    _check(results, ["zero2_offload"], rtol=1e-5)
    for res in run_ranks(_moment_dtypes):
        assert res["dtypes"] == ["torch.bfloat16"], res


def test_bf16_moments_resume_bit_exact(tmp_path):
    """A checkpoint of a zero2_offload run with bf16 moments resumes as if never interrupted: the
    moments come back in bf16 (fp32 ones would step differently from there on)."""
    spec = OFFLOAD_SPECS[1][1]
    for res in run_ranks(resume_worker, str(tmp_path), spec, spec, "32-true", "cpuadam_bf16"):
        assert res["resumed"] == res["full"][4:]
        for key, value in res["full_state"].items():
            assert torch.equal(res["resumed_state"][key], value), key


@pytest.mark.parametrize(
    "first,second,precision",
    [
        (OFFLOAD_SPECS[1][1], OFFLOAD_SPECS[1][1], "bf16-mixed"),
        (OFFLOAD_SPECS[3][1], {"stage": 2, "reduce_bucket_size": 40}, "32-true"),
    ],
    ids=["zero2_offload-zero2_offload-bf16", "zero3_offload_params-zero2-fp32"],
)
def test_offloaded_run_resumes(tmp_path, first, second, precision):
    for res in run_ranks(resume_worker, str(tmp_path), first, second, precision):
        # Same arithmetic as the uninterrupted run once masters and moments are restored (the
        # offloaded kernels keep torch's Adam state keys, so the checkpoint also resumes without
        # offload); summation order differs only between stages: ~1e-7.
        torch.testing.assert_close(torch.tensor(res["resumed"]), torch.tensor(res["full"][4:]), rtol=1e-5, atol=0)
        for key, value in res["full_state"].items():
            torch.testing.assert_close(res["resumed_state"][key], value, rtol=1e-5, atol=1e-7)


def _any_optimizer_worker(rank: int) -> dict:
    out = {}
    specs = [("ddp", "ddp"), ("zero2_offload", OFFLOAD_SPECS[1][1]), ("zero3_offload_params", OFFLOAD_SPECS[3][1])]
    for optimizer in ("sgd", "counting_adamw"):
        for name, spec in specs:
            trainer, model = fit(spec, model_kwargs={"optimizer": optimizer})
            calls = getattr(trainer.optimizers[0], "calls", None)
            out[optimizer, name] = {"losses": model.losses, "state": state(model), "calls": calls}
    return out


def test_offload_runs_any_optimizer_with_its_own_step():
    for res in run_ranks(_any_optimizer_worker):
        for optimizer in ("sgd", "counting_adamw"):
            ref = res[optimizer, "ddp"]
            for name in ("zero2_offload", "zero3_offload_params"):
                got = res[optimizer, name]
                # torch's own step on the host fp32 masters: DDP's arithmetic up to the summation
                # order of the reduction (~1e-7 relative per step), 1e-5 over 6 steps as elsewhere.
                torch.testing.assert_close(
                    torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0, msg=(optimizer, name)
                )
                # The subclass's own step() ran once per optimizer step (6 steps), not a kernel instead.
                assert got["calls"] == ref["calls"], (optimizer, name, got["calls"], ref["calls"])
        assert res["counting_adamw", "ddp"]["calls"] == 6
