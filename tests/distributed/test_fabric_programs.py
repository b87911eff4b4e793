"""Fabric programs written for DDP or FSDP, run unchanged with ZeRO on 2 gloo ranks, against Fabric's DDP.

Each program builds a model, sets it up in one of the call orders Lightning documents for FSDP, loads
"pretrained" weights after setup (``model.load_state_dict`` of a full state dict, or
``fabric.load_raw``), trains, and saves as LitGPT does: the model with the optimizer and a counter,
then the model alone, then (here also) the optimizer alone. A second program of another seed resumes
from the model-only and the optimizer-only saves. Everything must equal Fabric's DDP doing the same.

Orders: ``fabric.setup(model, optimizer)``; ``setup_module`` then ``setup_optimizers`` with the
optimizer built before or after ``setup_module`` (from the set-up model's parameters); a model built
under ``fabric.init_module(empty_init=True)`` whose weights come only from the load.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.fabric import make_fabric, train, weights
from tests.helpers.models import ParityModel, make_loader

pytestmark = pytest.mark.distributed

ZERO3 = {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0}
# fp32 on CPU: ZeRO reduces the same gradients in another grouping (bucketed reduce-scatter vs DDP's
# all-reduce) and steps slices instead of whole tensors, so sums round differently: ~1e-7 relative per
# step, a few steps. 1e-5 relative on losses and 1e-4 on weights leave two orders of margin and still
# catch any wrong piece (a missed load moves a weight by ~1e-1, a lost step by ~1e-2).
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-4


def _pretrained() -> dict[str, torch.Tensor]:
    """The weights every program loads after setup: another seed's model."""
    with torch.random.fork_rng():
        torch.manual_seed(11)
        return {k: v.clone() for k, v in ParityModel().state_dict().items()}


def _optimizer(model: ParityModel) -> torch.optim.Optimizer:
    """ParityModel's groups, chosen by name: a stage-3 parameter outside a forward has the shape of its
    piece, so grouping by ``p.dim()`` (as ``configure_optimizers`` does) after setup would differ."""
    decay = [
        p for n, p in model.named_parameters() if n in ("embed.weight", "frozen.weight", "up.weight", "down.weight")
    ]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]
    return torch.optim.AdamW(groups, lr=1e-2)


def _program(spec: Any, how: str, load: str, tmp: str, name: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    fabric = make_fabric(spec)
    pl.seed_everything(7, verbose=False)
    with fabric.init_module(empty_init=True) if how == "init_empty" else contextlib.nullcontext():
        model = ParityModel()
    if how == "setup":
        fabric_model, optimizer = fabric.setup(model, _optimizer(model))
    elif how == "module_opt_before":
        built = _optimizer(model)
        fabric_model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(built)
    else:  # "module_opt_after", "init_empty": the optimizer over the set-up model's parameters (LitGPT)
        fabric_model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(_optimizer(fabric_model.module))
    if load == "load_state_dict":
        fabric_model.load_state_dict(_pretrained())
    elif load == "lazy_load":  # LitGPT's load_checkpoint: tensors read from the file as they are copied
        from lightning.fabric.utilities.load import _lazy_load

        fabric_model.load_state_dict(_lazy_load(f"{tmp}/pretrained.pt"))
    else:
        fabric.load_raw(f"{tmp}/pretrained.pt", fabric_model)
    loader = fabric.setup_dataloaders(make_loader())
    losses = train(fabric, fabric_model, optimizer, None, loader, "norm", 2)
    out: dict[str, Any] = {"losses": losses, "state": weights(fabric, model)}
    # A full state dict gathered on request, as FSDP's (stage 3 too), equal to the gathered weights
    out["state_dict"] = {k: v.detach().float().clone() for k, v in fabric_model.state_dict().items()}
    fabric.save(f"{tmp}/{name}/step", {"model": fabric_model, "optimizer": optimizer, "iter_num": 2})
    fabric.save(f"{tmp}/{name}/model", {"model": fabric_model})
    fabric.save(f"{tmp}/{name}/optimizer", {"optimizer": optimizer})
    fabric.strategy.teardown()
    # another seed's program resumes from the model-only and the optimizer-only saves
    fabric = make_fabric(spec)
    pl.seed_everything(8, verbose=False)
    model = ParityModel()
    fabric_model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(_optimizer(fabric_model.module))
    fabric.load(f"{tmp}/{name}/model", {"model": fabric_model})
    fabric.load(f"{tmp}/{name}/optimizer", {"optimizer": optimizer})
    state = {"iter_num": -1}
    fabric.load(f"{tmp}/{name}/step", state, strict=False)
    loader = fabric.setup_dataloaders(make_loader())
    out["resumed"] = train(fabric, fabric_model, optimizer, None, loader, "norm", 2)
    out["resumed_state"] = weights(fabric, model)
    out["iter_num"] = state["iter_num"]
    fabric.strategy.teardown()
    return out


CASES = [
    ("zero3_setup", ZERO3, "setup", "load_state_dict"),
    ("zero3_before", ZERO3, "module_opt_before", "load_raw"),
    ("zero3_after", ZERO3, "module_opt_after", "load_state_dict"),
    ("zero3_init_empty", ZERO3, "init_empty", "load_raw"),
    ("zero3_lazy", ZERO3, "init_empty", "lazy_load"),
    ("zero3_full", {**ZERO3, "state_dict_type": "full"}, "module_opt_after", "load_state_dict"),
    ("zero3_offload_full", {**ZERO3, "offload_optimizer": "cpu", "state_dict_type": "full"}, "init_empty", "load_raw"),
    ("zero2", {"stage": 2, "reduce_bucket_size": 40}, "module_opt_after", "load_state_dict"),
    ("zero1_full", {"stage": 1, "state_dict_type": "full"}, "setup", "load_raw"),
]


def _worker(rank: int, tmp: str) -> dict[str, Any]:
    import lightning_zero  # noqa: F401 - registers the names

    if rank == 0:
        torch.save(_pretrained(), f"{tmp}/pretrained.pt")
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    out = {"ddp": _program("ddp", "setup", "load_state_dict", tmp, "ddp")}
    for name, spec, how, load in CASES:
        out[name] = _program(spec, how, load, tmp, name)
    return out


def _close(name: str, ours: dict[str, torch.Tensor], ddp: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == ddp.keys(), name
    for key, value in ddp.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=WEIGHT_ATOL, msg=f"{name}: {key}")


@pytest.mark.timeout(900)
def test_fabric_programs_match_ddp(tmp_path) -> None:
    import lightning_zero.checkpoint as ckpt

    results = run_ranks(_worker, str(tmp_path), timeout=900)
    for rank_out in results:
        ddp = rank_out["ddp"]
        for name, _, _, _ in CASES:
            ours = rank_out[name]
            torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=LOSS_RTOL, atol=0, msg=name)
            torch.testing.assert_close(ours["resumed"], ddp["resumed"], rtol=LOSS_RTOL, atol=0, msg=name)
            _close(name, ours["state"], ddp["state"])
            _close(name + " state_dict()", ours["state_dict"], ddp["state"])
            _close(name + " resumed", ours["resumed_state"], ddp["resumed_state"])
            assert ours["iter_num"] == 2, name
    # The saved files: a "full" save is one file that torch.load reads, with Fabric DDP's keys; a sharded
    # one consolidates (without torch's deprecation warning) into the same weights.
    ddp_model = results[0]["ddp"]["state"]
    for name, spec, _, _ in CASES:
        path = tmp_path / name / "model"
        if spec.get("state_dict_type") == "full":
            assert path.is_file(), name
            saved = torch.load(path, weights_only=True)
            assert sorted(saved) == ["model"], name
            step = torch.load(tmp_path / name / "step", weights_only=True)
            ddp_step = torch.load(tmp_path / "ddp" / "step", weights_only=True)
            assert sorted(step) == sorted(ddp_step) == ["iter_num", "model", "optimizer"], name
            for key, value in ddp_step["optimizer"]["state"].items():
                for state_key, tensor in value.items():
                    mine = step["optimizer"]["state"][key][state_key]
                    torch.testing.assert_close(mine.float(), tensor.float(), rtol=0, atol=WEIGHT_ATOL)
        else:
            assert path.is_dir(), name
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ckpt.consolidate(path, tmp_path / f"{name}.pt")
            saved = {"model": torch.load(tmp_path / f"{name}.pt", weights_only=True)}
        _close(name + " saved", {k: v.float() for k, v in saved["model"].items()}, ddp_model)


class PretrainedModel(ParityModel):
    """Loads the pretrained weights with ``self.load_state_dict`` in ``setup`` (before the strategy sets
    the model up) or ``on_fit_start`` (after: under stage 3 the parameters are pieces then)."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when

    def setup(self, stage: str) -> None:
        if self.when == "setup":
            self.load_state_dict(_pretrained())

    def on_fit_start(self) -> None:
        if self.when == "on_fit_start":
            self.load_state_dict(_pretrained())


def _trainer_worker(rank: int) -> dict[str, Any]:
    from tests.helpers.models import state
    from tests.helpers.trainer import fit

    out = {}
    for name, spec in (("ddp", "ddp"), ("zero3", ZERO3), ("zero3_default", "zero3"), ("zero2", "zero2")):
        for when in ("setup", "on_fit_start"):
            trainer, model = fit(spec, max_steps=3, model_cls=PretrainedModel, model_kwargs={"when": when})
            out[(name, when)] = {"losses": model.losses, "state": state(model)}  # stage 3: whole again after fit
    return out


@pytest.mark.timeout(600)
def test_trainer_loads_pretrained_weights_after_setup() -> None:
    results = run_ranks(_trainer_worker, timeout=600)
    for rank_out in results:
        for (name, when), ours in rank_out.items():
            ddp = rank_out[("ddp", when)]
            torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=LOSS_RTOL, atol=0, msg=f"{name} {when}")
            _close(f"{name} {when}", ours["state"], ddp["state"])


def _solo_worker(rank: int, solo: int) -> str:
    """Rank ``solo`` runs a forward alone (as LitGPT's rank-0 sample generation) while the other
    waits at fabric.barrier()."""
    import lightning.pytorch as pl

    import lightning_zero  # noqa: F401

    fabric = make_fabric(ZERO3)
    pl.seed_everything(7, verbose=False)
    model = ParityModel()
    fabric_model, _ = fabric.setup(model, _optimizer(model))
    tokens = make_loader().dataset.tensors[0][:3]
    with torch.no_grad():
        fabric_model(tokens)  # every rank: fine
        # inside gathered_parameters (entered by every rank) one rank alone may run a forward
        with fabric.strategy.gathered_parameters():
            if rank == solo:
                fabric_model(tokens)
        fabric.barrier()
        try:
            if rank == solo:
                fabric_model(tokens)
            fabric.barrier()
        except RuntimeError as exc:
            return str(exc)
    return "no error"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("solo", [0, 1])
def test_forward_on_one_rank_is_an_error_not_a_hang(solo: int) -> None:
    messages = run_ranks(_solo_worker, solo, timeout=240)
    # The rank that detects it names the model and the barrier; the other one's wait ends with it
    # (its peer's exit), whatever the message of that.
    named = [m for m in messages if "ParityModel" in m and "fabric.barrier()" in m]
    assert named, messages
    assert all(m != "no error" for m in messages), messages


def _failed_save_worker(rank: int, tmp: str) -> dict[str, Any]:
    """A model-only save over an earlier checkpoint fails on rank 1 mid-write: every rank raises and
    the earlier checkpoint still loads, with its own weights."""
    import lightning.pytorch as pl

    import lightning_zero  # noqa: F401
    from lightning_zero.checkpoint import save as ckpt_save

    fabric = make_fabric(ZERO3)
    pl.seed_everything(7, verbose=False)
    model = ParityModel()
    fabric_model, optimizer = fabric.setup(model, _optimizer(model))
    loader = fabric.setup_dataloaders(make_loader())
    train(fabric, fabric_model, optimizer, None, loader, "norm", 1)
    saved = weights(fabric, model)
    fabric.save(f"{tmp}/ck", {"model": fabric_model, "optimizer": optimizer})
    train(fabric, fabric_model, optimizer, None, loader, "norm", 1)
    real = ckpt_save.rank_payload

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full (injected)")

    ckpt_save.rank_payload = broken if rank == 1 else real  # type: ignore[assignment]
    try:
        fabric.save(f"{tmp}/ck", {"model": fabric_model})
        error = "no error"
    except RuntimeError as exc:
        error = str(exc)
    finally:
        ckpt_save.rank_payload = real  # type: ignore[assignment]
    fabric.load(f"{tmp}/ck", {"model": fabric_model, "optimizer": optimizer})
    loaded = weights(fabric, model)
    fabric.strategy.teardown()
    return {"error": error, "saved": saved, "loaded": loaded}


@pytest.mark.timeout(300)
def test_failed_save_keeps_the_previous_checkpoint(tmp_path) -> None:
    for out in run_ranks(_failed_save_worker, str(tmp_path), timeout=240):
        assert "disk full (injected)" in out["error"], out["error"]
        for key, value in out["saved"].items():
            torch.testing.assert_close(out["loaded"][key], value, rtol=0, atol=0, msg=key)


# -- a LitGPT-like program: a small GPT, LitGPT's call order, load and save pattern --------------------


def _gpt_program(spec: Any, tmp: str, name: str, part: str) -> dict[str, Any]:
    """``part`` "first": init_module(empty_init=True), setup (model alone), an AdamW over the set-up
    model's parameters, setup_optimizers, the pretrained weights through fabric.load_raw, 2 steps of 2
    micro-batches (clipped), fabric.save of the state. "resume": a fresh program loads that state
    (LitGPT's resume), 2 more steps, then the final model-only save. "eval": a third program loads the
    final weights with model.load_state_dict(lazy_load(...)["model"]) (LitGPT's load_checkpoint, full
    format) or fabric.load (sharded) and evaluates."""
    from lightning.fabric.utilities.load import _lazy_load

    from tests.helpers.gpt_reference import VOCAB, tiny_gpt, tokens

    fabric = make_fabric(spec)
    fabric.seed_everything(1337)
    with fabric.init_module(empty_init=True):
        model = tiny_gpt(n_layer=2)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.02))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}
    full = spec == "ddp" or spec.get("state_dict_type") == "full"
    data = tokens(32)[fabric.global_rank :: 2]
    out: dict[str, Any] = {"losses": []}
    if part == "eval":
        final = f"{tmp}/{name}/final.pth"
        if full:
            model.load_state_dict(_lazy_load(final)["model"])
        else:
            fabric.load(final, {"model": model})
        with torch.no_grad():
            logits = model(data[:4, :-1])
        out["eval"] = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), data[:4, 1:].reshape(-1)).item()
        fabric.strategy.teardown()
        return out
    if part == "first":
        fabric.load_raw(f"{tmp}/gpt_pretrained.pt", model)
    else:
        fabric.load(f"{tmp}/{name}/step", state)
    start = state["iter_num"]
    for iter_num in range(start, start + 4):
        batch = data[2 * iter_num : 2 * iter_num + 2]
        accumulating = iter_num % 2 == 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            fabric.backward(loss / 2)
        out["losses"].append(loss.item())
        state["iter_num"] = iter_num + 1
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    if part == "first":
        fabric.save(f"{tmp}/{name}/step", state)
    else:
        fabric.save(f"{tmp}/{name}/final.pth", {"model": model})
    fabric.strategy.teardown()
    return out


GPT_CASES = [
    ("gpt_zero1", {"stage": 1}),
    ("gpt_zero2_full", {"stage": 2, "state_dict_type": "full"}),
    ("gpt_zero3_full", {**ZERO3, "state_dict_type": "full"}),
    ("gpt_zero3_offload", {**ZERO3, "offload_optimizer": "cpu"}),
]


def _gpt_worker(rank: int, tmp: str) -> dict[str, Any]:
    import lightning_zero  # noqa: F401
    from tests.helpers.gpt_reference import tiny_gpt

    if rank == 0:  # "pretrained": the init moved by noise, so that a missed load shows
        generator = torch.Generator().manual_seed(21)
        pretrained = tiny_gpt(2)
        with torch.no_grad():  # on the parameters: the tied embedding / head stays one value under its two keys
            for param in pretrained.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
        torch.save(pretrained.state_dict(), f"{tmp}/gpt_pretrained.pt")
    out = {}
    for name, spec in [("gpt_ddp", "ddp"), *GPT_CASES]:
        first = _gpt_program(spec, tmp, name, "first")
        resumed = _gpt_program(spec, tmp, name, "resume")
        out[name] = {"losses": first["losses"] + resumed["losses"], **_gpt_program(spec, tmp, name, "eval")}
    return out


@pytest.mark.timeout(600)
def test_litgpt_like_program_matches_ddp(tmp_path) -> None:
    for rank_out in run_ranks(_gpt_worker, str(tmp_path), timeout=600):
        ddp = rank_out["gpt_ddp"]
        for name, _ in GPT_CASES:
            # every micro-batch loss of the first program and of the resumed one
            torch.testing.assert_close(rank_out[name]["losses"], ddp["losses"], rtol=LOSS_RTOL, atol=0, msg=name)
            # the final weights, saved and loaded back (sharded or full format), evaluate as DDP's
            assert abs(rank_out[name]["eval"] - ddp["eval"]) <= LOSS_RTOL * abs(ddp["eval"]), name
    ddp_final = torch.load(tmp_path / "gpt_ddp" / "final.pth", weights_only=True)["model"]
    for name, spec in GPT_CASES:
        if spec.get("state_dict_type") == "full":  # one file, as Fabric's DDP writes it
            _close(name, torch.load(tmp_path / name / "final.pth", weights_only=True)["model"], ddp_final)


class _SoloCallback(pl.Callback):
    """At batch 0 every rank runs a forward outside the steps (fine); at batch 1 rank 0 alone does,
    while rank 1 goes on into its next batch or into ``strategy.barrier()``."""

    def __init__(self, then: str) -> None:
        self.then = then

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # a short wait for the case no counter shows (rank 1 in Lightning's per-batch broadcast)
        trainer.strategy._steplock.wait_s = 5.0
        if batch_idx == 0 or (batch_idx == 1 and trainer.is_global_zero):
            with torch.no_grad():
                pl_module(batch[0][:2])
        if batch_idx == 1 and self.then == "barrier":
            trainer.strategy.barrier()


def _trainer_solo_worker(rank: int, then: str) -> str:
    from tests.helpers.trainer import fit

    try:
        fit(ZERO3, max_steps=3, trainer_kwargs={"callbacks": [_SoloCallback(then)]})
    except Exception as exc:  # rank 1 ends with whatever its peer's exit raises (gloo's error type varies)
        return str(exc)
    return "no error"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("then", ["next_batch", "barrier"])
def test_trainer_forward_on_one_rank_is_an_error_not_a_hang(then: str) -> None:
    messages = run_ranks(_trainer_solo_worker, then, timeout=240)
    # rank 0 names the module and what rank 1 did instead; rank 1's wait ends with rank 0's exit
    assert "ParityModel" in messages[0] and "outside the Trainer's steps" in messages[0], messages
    if then == "barrier":
        assert "strategy.barrier()" in messages[0], messages
    assert messages[1] != "no error", messages


def _initialize(model: torch.nn.Module) -> None:
    """LitGPT's pretraining init on the model built under init_module(empty_init=True): its own
    reset_parameters for Linear and Embedding, then every module's reset_parameters()."""
    import functools

    def init(module: torch.nn.Module) -> None:
        torch.nn.init.normal_(module.weight, std=0.05)
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)

    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.reset_parameters = functools.partial(init, module)
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def _init_worker(rank: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    import lightning_zero  # noqa: F401

    out = {}
    for name, spec, how in (
        ("ddp", "ddp", "setup"),
        ("zero3", ZERO3, "setup"),
        ("zero3_module_first", ZERO3, "module_opt_after"),
        ("zero2", {"stage": 2}, "setup"),
    ):
        fabric = make_fabric(spec)
        pl.seed_everything(7, verbose=False)
        with fabric.init_module(empty_init=True):
            model = ParityModel()
        _initialize(model)  # on the meta model at stage 3: recorded until setup
        if how == "setup":
            fabric_model, optimizer = fabric.setup(model, _optimizer(model))
        else:
            fabric_model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(_optimizer(fabric_model.module))
        drawn = torch.rand(4)  # the random state after setup, as the unsharded build leaves it
        loader = fabric.setup_dataloaders(make_loader())
        losses = train(fabric, fabric_model, optimizer, None, loader, "norm", 2)
        out[name] = {"losses": losses, "state": weights(fabric, model), "drawn": drawn}
        fabric.strategy.teardown()
    return out


@pytest.mark.timeout(600)
def test_init_module_empty_then_initialized_before_setup_matches_ddp() -> None:
    for rank_out in run_ranks(_init_worker, timeout=600):
        ddp = rank_out["ddp"]
        for name in ("zero3", "zero3_module_first", "zero2"):
            ours = rank_out[name]
            torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=LOSS_RTOL, atol=0, msg=name)
            _close(name, ours["state"], ddp["state"])
            # stage 3 replays the same random draws: the generator ends where DDP's does
            torch.testing.assert_close(ours["drawn"], ddp["drawn"], rtol=0, atol=0, msg=name)
