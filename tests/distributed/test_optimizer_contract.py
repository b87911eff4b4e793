"""The Lightning optimizer contract under ZeRO, against DDP (fp32, 2 CPU/gloo ranks, one spawn):

* ``LightningOptimizer.step(closure)`` reaches the user's optimizer object: a subclass's code before
  and after ``closure()``, step pre/post hooks, in DDP's order, with the closure inside the step and
  the post-hook seeing the updated weights (also where the compiled kernels do the arithmetic);
* a subclass whose ``step`` drops the closure raises Lightning's MisconfigurationException;
* a ``Mock`` wrapped around manual optimization with accumulation is reached as often as under DDP;
* ``param.grad`` in ``configure_gradient_clipping`` (a user's own ``clip_grad_norm_``; Lightning's
  clipping by value) and during a validation run inside an accumulation window;
* ``configure_optimizers`` returning None trains without an optimizer, as under DDP;
* ``torch.save(trainer)`` after fit;
* an edit of ``param.grad`` after ``manual_backward`` that ZeRO cannot apply warns.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_zero.testing import run_ranks
from tests.helpers.models import VOCAB, ParityModel, make_loader
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

SPECS = {
    "ddp": "ddp",
    "zero1": {"stage": 1, "reduce_bucket_size": 40},
    "zero2": {"stage": 2, "reduce_bucket_size": 40},
    "zero3": {"stage": 3, "param_persistence_threshold": 10, "reduce_bucket_size": 40},
    "zero2_offload": {"stage": 2, "reduce_bucket_size": 40, "offload_optimizer": True},
}

EVENTS: list[str] = []


class RecordingAdamW(torch.optim.AdamW):
    """A subclass with code before and after ``closure()`` (as a user's or a library's may have)."""

    def step(self, closure=None):  # type: ignore[override]
        EVENTS.append("before_closure")
        closure()
        EVENTS.append("after_closure")
        return super().step()


class BrokenSGD(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[override]
        return super().step()  # forgot to pass the closure


class HookModel(ParityModel):
    """Records Lightning's and the optimizer's calls in order; the post-hook records the weights."""

    def __init__(self, optimizer_cls: type = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_cls = optimizer_cls
        self.after_step: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        EVENTS.append("training_step")
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        EVENTS.append("backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        EVENTS.append("on_before_optimizer_step")

    def _weight_sum(self) -> float:
        strategy = self.trainer.strategy  # stage 3: a sharded weight is read inside gathered_parameters
        gathered = getattr(strategy, "gathered_parameters", None)
        with gathered(self.up) if gathered else contextlib.nullcontext():
            return float(self.up.weight.double().sum())

    def configure_optimizers(self):
        opt = self.optimizer_cls([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        opt.register_step_pre_hook(lambda *_: EVENTS.append("pre_hook"))
        opt.register_step_post_hook(lambda *_: self.after_step.append(self._weight_sum()))
        opt.register_step_post_hook(lambda *_: EVENTS.append("post_hook"))
        return opt


class ClipModel(ParityModel):
    """A user's own ``clip_grad_norm_`` in ``configure_gradient_clipping`` (issue: a silent no-op)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norms: list[float] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        params = [p for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05)))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)  # picklable


class ValueClipModel(ParityModel):
    """Lightning's test_gradient_clipping_by_value: ``param.grad`` is clipped in the hook."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.grad_max: list[float] = []

    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        super().configure_gradient_clipping(*args, **kwargs)
        grads = [p.grad.detach().abs().max() for p in self.parameters() if p.grad is not None]
        self.grad_max.append(float(torch.stack(grads).max()))


class ValidationWindowModel(ParityModel):
    """Lightning's test_validation_during_gradient_accumulation_window."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[int, bool, float]] = []

    def on_validation_start(self) -> None:
        batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.completed
        grads = [p.grad for p in self.parameters() if p.requires_grad]
        flat = [x for g in grads if g is not None for x in g.double().reshape(-1).tolist()]
        self.seen.append((batches, sum(g is not None for g in grads), flat))

    def val_dataloader(self):
        return make_loader(n=6)


class NoOptimizerModel(ParityModel):
    def configure_optimizers(self):
        return None


class ManualMockModel(ParityModel):
    """Manual optimization, a step every second batch (accumulation), the step wrapped by a Mock."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.calls = -1

    def on_train_start(self) -> None:
        opt = self.optimizers()
        self.patch = mock.patch.object(opt, "step", wraps=opt.step)
        self.step_mock = self.patch.start()

    def on_train_end(self) -> None:
        self.patch.stop()
        self.calls = self.step_mock.call_count

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        opt = self.optimizers()
        logits = self(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()


class ManualEditModel(ManualMockModel):
    """A user's ``clip_grad_norm_`` after ``manual_backward``: ZeRO's exposed ``.grad`` are read-only."""

    def on_train_start(self) -> None:
        pass

    def on_train_end(self) -> None:
        pass

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        opt = self.optimizers()
        logits = self(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        self.manual_backward(loss)
        torch.nn.utils.clip_grad_norm_([p for p in self.parameters() if p.grad is not None], 1e-3)
        opt.step()
        opt.zero_grad()


def _events(model_kwargs: dict, spec: Any) -> dict:
    EVENTS.clear()
    _, model = fit(spec, max_steps=2, accumulate=1, clip=None, model_cls=HookModel, model_kwargs=model_kwargs)
    return {"events": list(EVENTS), "after_step": model.after_step, "losses": model.losses}


def _worker(rank: int) -> dict:
    # torch wraps a class's step (hooks) when its first instance is made: with AdamW's wrapped from
    # the start, RecordingAdamW's super().step() runs the hooks again, in every run alike
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    out: dict[str, dict] = {}
    for name, spec in SPECS.items():
        res: dict[str, Any] = {}
        res["subclass"] = _events({"optimizer_cls": RecordingAdamW}, spec)
        res["plain"] = _events({}, spec)  # exactly AdamW: the compiled kernel steps under ZeRO on CPU
        try:
            fit(spec, max_steps=1, accumulate=1, clip=None, model_kwargs={"optimizer": "sgd"}, model_cls=_broken())
            res["broken"] = "no error"
        except MisconfigurationException as exc:
            res["broken"] = str(exc)
        trainer, model = fit(spec, max_steps=4, accumulate=2, clip=None, model_cls=ClipModel)
        torch.save(trainer, io.BytesIO())  # nothing the package installs is a local closure
        res["clip"] = {"norms": model.norms, "losses": model.losses}
        _, model = fit(
            spec,
            max_steps=2,
            accumulate=1,
            clip=1e-10,
            model_cls=ValueClipModel,
            trainer_kwargs={"gradient_clip_algorithm": "value"},
        )
        res["value_clip"] = model.grad_max
        if spec != "ddp":  # (Lightning's "16-mixed" needs a GPU under DDP; ZeRO's runs on the CPU)
            _, model = fit(
                spec,
                precision="16-mixed",
                max_steps=2,
                accumulate=1,
                clip=1e-10,
                model_cls=ValueClipModel,
                trainer_kwargs={"gradient_clip_algorithm": "value"},
            )
            res["value_clip16"] = model.grad_max
        _, model = fit(
            spec,
            max_steps=2,
            accumulate=3,
            clip=None,
            model_cls=ValidationWindowModel,
            trainer_kwargs={"val_check_interval": 2, "limit_val_batches": 1, "limit_train_batches": 6},
        )
        res["validation"] = model.seen
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, model = fit(spec, max_steps=2, accumulate=1, clip=None, model_cls=NoOptimizerModel)
        res["no_optimizer"] = {"losses": model.losses, "warned": any("optimizer" in str(w.message) for w in caught)}
        trainer, model = fit(spec, max_steps=4, accumulate=1, clip=None, model_cls=ManualMockModel)
        res["manual_mock"] = {"calls": model.calls, "losses": model.losses}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(spec, max_steps=2, accumulate=1, clip=None, model_cls=ManualEditModel)
        res["edit_warned"] = any("does NOT reach" in str(w.message) for w in caught)
        out[name] = res
    return out


def _broken() -> type:
    class BrokenModel(ParityModel):
        def configure_optimizers(self):
            return BrokenSGD(self.parameters(), lr=0.1)

    return BrokenModel


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _vector_close(a: list[float], b: list[float], rtol: float) -> bool:
    """Relative to the vector's norm (elements near zero carry the reduction's rounding)."""
    scale = max(sum(x * x for x in b) ** 0.5, 1e-12)
    return len(a) == len(b) and sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5 <= rtol * scale


def test_optimizer_contract_matches_ddp():
    # fp32: only the reduction's summation order differs from DDP (~1e-7 relative per step): 1e-5
    results = run_ranks(_worker, timeout=900)
    for res in results:
        ref = res["ddp"]
        for name in SPECS:
            got = res[name]
            for case in ("subclass", "plain"):
                assert got[case]["events"] == ref[case]["events"], (
                    name,
                    case,
                    " ".join(got[case]["events"]),
                    " ".join(ref[case]["events"]),
                )
                assert _close(got[case]["after_step"], ref[case]["after_step"], 1e-5), (name, case)
                assert _close(got[case]["losses"], ref[case]["losses"], 1e-5), (name, case)
            assert "closure hasn't been executed" in got["broken"], name
            assert _close(got["clip"]["norms"], ref["clip"]["norms"], 1e-5), name
            assert min(got["clip"]["norms"]) > 0.05, name  # the gradients were there and got clipped
            assert _close(got["clip"]["losses"], ref["clip"]["losses"], 1e-5), name
            assert _close(got["value_clip"], [1e-10, 1e-10], 1e-5), name
            if name != "ddp":  # 16-bit gradients: the clip value as fp16 holds it (spacing 2**-10 relative)
                assert _close(got["value_clip16"], [1e-10, 1e-10], 1e-3), name
            assert [s[:2] for s in got["validation"]] == [s[:2] for s in ref["validation"]], name
            # DDP's .grad inside the window are this rank's own sums (Lightning's no_sync); ZeRO's are
            # the averages over ranks so far (stages 2/3 reduce at every backward): DDP's averaged
            for (_, _, ours), *theirs in zip(
                got["validation"], *(r["ddp"]["validation"] for r in results), strict=True
            ):
                if name in ("ddp", "zero3"):  # stage 3: a sharded parameter's .grad is this rank's piece
                    continue
                mean = [sum(v) / len(theirs) for v in zip(*(t[2] for t in theirs), strict=True)]
                assert _close(ours, mean, 1e-5) or _vector_close(ours, mean, 1e-5), name
            assert got["no_optimizer"] == ref["no_optimizer"], name
            assert got["manual_mock"]["calls"] == ref["manual_mock"]["calls"] == 4, name
            assert _close(got["manual_mock"]["losses"], ref["manual_mock"]["losses"], 1e-5), name
            if name != "ddp":
                assert got["edit_warned"], name
        # DDP's order: the closure inside the step, the post-hooks after it (twice: the subclass's
        # step and AdamW's, both wrapped by torch)
        first_step = ref["subclass"]["events"][: len(ref["subclass"]["events"]) // 2]
        assert first_step[:6] == [
            "pre_hook",
            "before_closure",
            "training_step",
            "backward",
            "on_before_optimizer_step",
            "after_closure",
        ]
        assert first_step[6:] == ["pre_hook", "post_hook", "post_hook"], first_step
        # mid-window (batches 2 and 4 of a window of 3) DDP has gradients; after the step none
        assert [s[0] for s in ref["validation"]] == [2, 4, 6]
        assert ref["validation"][0][1] > 0 and ref["validation"][-1][1] == 0
