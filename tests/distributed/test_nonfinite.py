"""Non-finite gradients without loss scaling: an error naming the step before the weights are touched
(default), or a skipped step with a counter (``on_nonfinite="skip"``). Rank 0 alone multiplies its
loss by inf at optimizer step 1, so the reduced gradients of both ranks are non-finite."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.models import StateEveryStep
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed


def _worker(rank: int, precision: str) -> dict:
    out = {}
    for stage in (2, 3):
        spec = {"stage": stage, "param_persistence_threshold": 10}
        recorder = StateEveryStep()
        common = {"precision": precision, "accumulate": 1, "max_steps": 3, "model_kwargs": {"inject_inf_at": 1}}
        try:
            fit(spec, trainer_kwargs={"callbacks": [recorder]}, **common)
            error = None
        except FloatingPointError as exc:
            error = str(exc)
        skipper = StateEveryStep()
        trainer, _ = fit({**spec, "on_nonfinite": "skip"}, trainer_kwargs={"callbacks": [skipper]}, **common)
        out[stage] = {
            "error": error,
            "before_error": recorder.states,
            "skipped": skipper.states,
            "count": trainer.strategy.precision_plugin.nonfinite_steps,
        }
    return out


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nonfinite_gradients_error_or_skip(precision):
    for res in run_ranks(_worker, precision):
        for stage in (2, 3):
            got = res[stage]
            assert got["error"] is not None and "optimizer step 1" in got["error"], got["error"]
            assert "on_nonfinite='skip'" in got["error"]
            # the failing step never reached the callback; the run stopped with step 0's weights
            assert len(got["before_error"]) == 1
            before, skipped, after = got["skipped"]
            assert got["count"] == 1
            for key in before:
                # the skipped step leaves every weight bit-identical, and no weight is ever NaN
                assert torch.equal(before[key], skipped[key]), (stage, key)
                assert torch.isfinite(after[key]).all(), (stage, key)
            assert any(not torch.equal(skipped[k], after[k]) for k in skipped if k != "frozen.weight")
