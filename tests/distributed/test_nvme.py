"""ZeRO-Infinity's disk tier (offload_optimizer="nvme") on 2 CPU/gloo ranks, against CPU offload.

The disk tier only moves where masters and Adam moments rest between steps (files instead of host
memory); the step runs the same compiled kernel on the same values in the same order, so every
loss and every weight must be bit-identical to offload_optimizer=True.
"""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch
from lightning.pytorch import Callback

from lightning_zero.config import NvmeConfig
from lightning_zero.offload import nvme as nvme_io
from lightning_zero.testing import run_ranks
from tests.helpers.models import state
from tests.helpers.trainer import fit
from tests.helpers.workers import gan_worker, resume_worker

pytestmark = pytest.mark.distributed

SMALL = {"param_persistence_threshold": 10, "reduce_bucket_size": 40}


def _specs(nvme_path: str) -> list[tuple[str, dict]]:
    nvme = {"offload_optimizer": "nvme", "nvme_path": nvme_path, "nvme_config": {"block_size": 4096}}
    return [
        ("zero2_cpu", {"stage": 2, "offload_optimizer": True, "reduce_bucket_size": 40}),
        ("zero2_nvme", {"stage": 2, **nvme, "reduce_bucket_size": 40}),
        ("zero3_cpu", {"stage": 3, "offload_optimizer": True, **SMALL}),
        ("zero3_nvme", {"stage": 3, **nvme, **SMALL}),
        # the default engine ("auto") is io_uring where it works: the thread-pool engine as well
        (
            "zero3_nvme_threads",
            {"stage": 3, **nvme, "nvme_config": {"block_size": 4096, "aio_engine": "threads"}, **SMALL},
        ),
        ("zero3_nvme_params_on_host", {"stage": 3, **nvme, "offload_parameters": True, **SMALL}),
        ("zero3_nvme_params_on_disk", {**_params_on_disk(nvme_path), **SMALL}),
    ]


def _params_on_disk(nvme_path: str, buffers: int = 2, restore: bool | None = True) -> dict:
    # restore=True: the tests compare the model after fit (the default with parameters on disk,
    # None, leaves it sharded: test_default_end_of_fit_leaves_the_model_on_disk)
    knobs = {"block_size": 4096, "param_buffer_count": buffers, "restore_after_fit": restore}
    return {
        "stage": 3,
        "offload_optimizer": "nvme",
        "offload_parameters": "nvme",
        "nvme_path": nvme_path,
        **{"nvme_config": knobs},
    }


class _SwappedOut(Callback):
    """Records, at each batch after the first step, whether every master and moment rests on disk
    (zero bytes of memory) and how many bytes the tier moved: the test must not pass by keeping
    the states in memory."""

    def __init__(self) -> None:
        self.resting: list[bool] = []
        self.bytes_read = 0
        self.params_resting: list[bool] = []
        self.peak = 0
        self.grads_resting: list[bool] = []
        self.grad_peak = (0, 0, 0)
        self.grad_bytes = 0
        self.grad_direct = 0
        self.engine = ""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        grads = trainer.strategy._engine.grad_tier
        if grads is not None and batch_idx > 0:
            # between backwards (inside an accumulation window too) and between steps: no gradient
            # slice holds memory; the files hold them
            self.grads_resting.append(all(b.grad_shard.untyped_storage().nbytes() == 0 for b in grads.buffers))
            self.grad_peak = (grads.peak, grads.peak_buckets, len(grads.buffers))
            self.grad_direct = grads.direct
            names = [grads.item(b)[0] for b in grads.buffers]
            directory = grads.store.directory
            self.grad_bytes = sum(
                os.path.getsize(directory / f"{n}.swp") for n in names if (directory / f"{n}.swp").exists()
            )
        swap = trainer.strategy._engine.swap  # reaches inside on purpose: a test of where the states are
        if swap is None or trainer.global_step == 0:
            return  # CPU offload, or nothing stepped yet
        tensors = [t for kernel in swap.kernels for i in range(len(kernel.buffers)) for _, t in kernel.swapped(i)]
        self.resting.append(len(tensors) > 0 and all(t.untyped_storage().nbytes() == 0 for t in tensors))
        self.bytes_read = swap.store.bytes_read
        self.engine = swap.store.engine
        tier = trainer.strategy._engine.param_tier
        if tier is not None:  # the parameter shards too, between steps
            self.params_resting.append(all(b.param_shard.untyped_storage().nbytes() == 0 for b in tier.buffers))
            self.peak = tier.peak


def _worker(rank: int, nvme_path: str, precision: str, names: list[str], optimizer: str = "adamw") -> dict:
    out = {}
    for name, spec in _specs(nvme_path):
        if name not in names:
            continue
        probe = _SwappedOut()
        _, model = fit(
            spec, precision=precision, model_kwargs={"optimizer": optimizer}, trainer_kwargs={"callbacks": [probe]}
        )
        out[name] = {
            "losses": model.losses,
            "state": state(model),
            "resting": probe.resting,
            "bytes_read": probe.bytes_read,
            "params_resting": probe.params_resting,
            "peak": probe.peak,
            "grads_resting": probe.grads_resting,
            "grad_peak": probe.grad_peak,
            "grad_bytes": probe.grad_bytes,
            "grad_direct": probe.grad_direct,
            "engine": probe.engine,
            # this rank's directory only: the other rank may still be cleaning up its own
            "left": os.path.exists(os.path.join(nvme_path, f"lightning_zero-rank{rank}")),
        }
    return out


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nvme_offload_is_bit_identical_to_cpu_offload(tmp_path, precision):
    names = [n for n, _ in _specs("")]
    for res in run_ranks(_worker, str(tmp_path / "swap"), precision, names):
        for stage in ("zero2", "zero3"):
            ref = res[f"{stage}_cpu"]
            for name in [n for n in names if n.startswith(f"{stage}_nvme")]:
                got = res[name]
                # Exact: same kernel, same inputs, same order; only the resting place differs.
                assert got["losses"] == ref["losses"], name
                for key, value in ref["state"].items():
                    assert torch.equal(got["state"][key], value), (name, key)
                assert got["resting"] and all(got["resting"]), (name, got["resting"])
                assert got["bytes_read"] > 0, name
                # the gradient slices rest in their files between backwards and steps (accumulate=2,
                # clip=0.5: read-add-write and deferred clipping are exercised) ...
                assert got["grads_resting"] and all(got["grads_resting"]), (name, got["grads_resting"])
                assert got["grad_bytes"] > 0, name
                # bf16 slices (clipped once: one factor) went to the kernel as they are, no fp32
                # copy (GradTier.kernel_grad); fp32 slices need none
                assert (got["grad_direct"] > 0) == (precision == "bf16-mixed"), (name, got["grad_direct"])
                # ... and at most buffer_count written behind plus one per reduction bucket alive
                # (those being reduced into) are in memory at once: bounded by counts, not the model
                peak, buckets, total = got["grad_peak"]
                limit = NvmeConfig(path=str(tmp_path)).buffer_count
                assert 1 <= peak <= limit + buckets, (name, got["grad_peak"])
                assert peak < total or total <= limit + buckets, (name, got["grad_peak"])  # (stage 2: 5 buffers)
                if name.endswith("params_on_disk"):
                    assert got["params_resting"] and all(got["params_resting"]), got["params_resting"]
                    # param_buffer_count=2 read ahead, plus the one being gathered (not read ahead)
                    assert 1 <= got["peak"] <= 3, got["peak"]
                assert not got["left"], name  # the rank directory was removed after fit
        if nvme_io.compiled_engine():  # which engine ran on each rank (auto: io_uring where the probe succeeds)
            assert res["zero3_nvme_threads"]["engine"] == "threads"
            assert res["zero3_nvme"]["engine"] == ("io_uring" if nvme_io.io_uring_probe(8) is None else "threads")


def test_bf16_moments_on_disk_are_bit_identical_to_host_memory(tmp_path):
    """ops.CPUAdam(state_dtype=torch.bfloat16): the moments rest on disk in bf16 (half the bytes the
    tier reads and writes for them) and train exactly as in host memory."""
    fp32 = run_ranks(_worker, str(tmp_path / "a"), "32-true", ["zero2_nvme"])
    for res, ref in zip(
        run_ranks(_worker, str(tmp_path / "b"), "32-true", ["zero2_cpu", "zero2_nvme"], "cpuadam_bf16"),
        fp32,
        strict=True,
    ):
        got, cpu = res["zero2_nvme"], res["zero2_cpu"]
        # exact: the same kernel and inputs, only the resting place of the moments differs
        assert got["losses"] == cpu["losses"]
        for key, value in cpu["state"].items():
            assert torch.equal(got["state"][key], value), key
        assert got["resting"] and all(got["resting"])
        # masters (4 bytes) + two moments (2 bytes each) instead of 4 + 4 + 4 per element: the moments'
        # share of what the tier read halves (the gradient slices' reads are the same in both)
        assert got["bytes_read"] < ref["zero2_nvme"]["bytes_read"], (got["bytes_read"], ref["zero2_nvme"]["bytes_read"])


def _nvme_stage2(nvme_path: str) -> dict:
    return dict(_specs(nvme_path))["zero2_nvme"]


@pytest.mark.parametrize("direction", ["nvme-to-cpu", "cpu-to-nvme"])
def test_checkpoint_round_trip_between_tiers(tmp_path, direction):
    nvme, cpu = _nvme_stage2(str(tmp_path / "swap")), dict(_specs(""))["zero2_cpu"]
    first, second = (nvme, cpu) if direction == "nvme-to-cpu" else (cpu, nvme)
    for res in run_ranks(resume_worker, str(tmp_path / "ckpt"), first, second, "32-true"):
        # The checkpoint format does not depend on the tier (torch's Adam keys, fp32 masters), so
        # the resumed run repeats the uninterrupted one; the bound is the CPU-offload resume test's
        # (tests/distributed/test_offload.py), in practice both tiers run the same kernel.
        torch.testing.assert_close(torch.tensor(res["resumed"]), torch.tensor(res["full"][4:]), rtol=1e-5, atol=0)
        for key, value in res["full_state"].items():
            torch.testing.assert_close(res["resumed_state"][key], value, rtol=1e-5, atol=1e-7)
    assert not list((tmp_path / "swap").glob("lightning_zero-rank*"))  # both runs cleaned up


@pytest.mark.parametrize("direction", ["disk-to-cpu", "cpu-to-disk", "disk-to-disk"])
def test_checkpoint_round_trip_with_parameters_on_disk(tmp_path, direction):
    disk = {**_params_on_disk(str(tmp_path / "swap")), **SMALL}
    cpu = dict(_specs(""))["zero3_cpu"]
    first, second = {"disk-to-cpu": (disk, cpu), "cpu-to-disk": (cpu, disk), "disk-to-disk": (disk, disk)}[direction]
    for res in run_ranks(resume_worker, str(tmp_path / "ckpt"), first, second, "bf16-mixed"):
        # The checkpoint holds fp32 masters and torch's Adam keys whatever the tier, and the 16-bit
        # shards are rebuilt from the masters on load (cast, as after a step), so the resumed run
        # repeats the uninterrupted one exactly: same kernel, same inputs, same order.
        assert res["resumed"] == res["full"][4:]
        for key, value in res["full_state"].items():
            assert torch.equal(res["resumed_state"][key], value), key
    assert not list((tmp_path / "swap").glob("lightning_zero-rank*"))  # both runs cleaned up


class _SaveMidFit(Callback):
    """Saves a checkpoint between two steps and records what the disk tier read meanwhile: a
    streamed save maps the swap files and reads none of them into memory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fetched: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 2 or self.fetched or batch_idx % 2:
            return  # once (accumulate=2: two batches per step)
        engine = trainer.strategy._engine  # reaches inside on purpose: what was read
        store = engine.param_tier.store
        # Masters of persistent (whole, small) buffers are read to absorb in-place edits of their
        # parameters; sharded buffers' parameters cannot be edited in place (they are empty).
        self.persistent = {
            n for b in engine._buffers if b.persistent for n, _ in engine.swap.items_of(b, master_only=True)
        }
        real = store.fetch
        store.fetch = lambda items: (self.fetched.extend(n for n, _ in items), real(items))[1]
        try:
            trainer.save_checkpoint(self.path)
        finally:
            del store.fetch


class _ReadsUntilTraining(Callback):
    """Records every swap-file read of the disk tier from the start of fit (the checkpoint load)
    until the first training batch."""

    def __init__(self) -> None:
        self.fetched: list[str] = []

    def setup(self, trainer, pl_module, stage) -> None:
        from lightning_zero.offload.nvme import SwapStore

        real, probe = SwapStore.fetch, self

        def fetch(store, items):
            items = list(items)
            probe.fetched.extend(n for n, _ in items)
            return real(store, items)

        SwapStore.fetch = fetch  # type: ignore[method-assign]
        self.real = real

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_zero.offload.nvme import SwapStore

        SwapStore.fetch = self.real  # type: ignore[method-assign]


def _save_worker(rank: int, tmp: str) -> dict:
    probe = _SaveMidFit(f"{tmp}/mid.ckpt")
    fit({**_params_on_disk(f"{tmp}/swap"), **SMALL}, max_steps=3, trainer_kwargs={"callbacks": [probe]})
    loading = _ReadsUntilTraining()
    fit(
        {**_params_on_disk(f"{tmp}/swap"), **SMALL},
        max_steps=4,
        ckpt_path=f"{tmp}/mid.ckpt",
        trainer_kwargs={"callbacks": [loading]},
    )
    return {
        "fetched": probe.fetched,
        "persistent": probe.persistent,
        "saved": os.path.isdir(f"{tmp}/mid.ckpt"),
        "load_fetched": loading.fetched,
    }


def test_save_streams_from_the_swap_files(tmp_path):
    for res in run_ranks(_save_worker, str(tmp_path)):
        assert res["saved"]
        # moments and sharded masters and shards stayed on disk, read only through memory maps
        assert res["fetched"] and set(res["fetched"]) <= res["persistent"], (res["fetched"], res["persistent"])
        # Loading reads masters one buffer at a time, each once (its pieces are written and it is
        # cast into the parameter shard while in memory), and the shards of frozen buffers (their own
        # masters); moments are written straight to their files, never read.
        loaded = res["load_fetched"]
        moments = [n for n in loaded if not (n.endswith(".master") or n.startswith("param"))]
        assert loaded and not moments, moments
        masters = [n for n in loaded if n.endswith(".master")]
        assert masters and len(masters) == len(set(masters)), sorted(masters)


class _FailAtStep(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            directory = trainer.strategy._engine.swap.store.directory
            assert any(directory.glob("*.swp")), "the states should be on disk by now"
            raise RuntimeError("failing on purpose")


def _failing_worker(rank: int, nvme_path: str) -> list[str]:
    try:
        fit(_nvme_stage2(nvme_path), trainer_kwargs={"callbacks": [_FailAtStep()]})
    except RuntimeError as error:
        assert "failing on purpose" in str(error)
    else:
        raise AssertionError("the run should have failed")
    return os.path.exists(os.path.join(nvme_path, f"lightning_zero-rank{rank}"))


def test_swap_files_removed_after_a_failure(tmp_path):
    left = run_ranks(_failing_worker, str(tmp_path / "swap"))
    assert left == [False, False]  # the teardown on the failure path removed each rank's directory
    assert not list((tmp_path / "swap").iterdir())


class _KillMidStep(Callback):
    """SIGKILL this rank inside its second optimizer step (after backward, before the update): no
    teardown, no ``finally`` runs, as when the OOM killer or a scheduler ends a rank."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def _killed_worker(rank: int, nvme_path: str) -> None:
    fit({**_params_on_disk(nvme_path), **SMALL}, trainer_kwargs={"callbacks": [_KillMidStep()]})
    raise AssertionError("the rank should have been killed")


def _restart_worker(rank: int, nvme_path: str) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, model = fit({**_params_on_disk(nvme_path), **SMALL})
    return {
        "stale": [str(w.message) for w in caught if "stale swap directory" in str(w.message)],
        "losses": model.losses,
        "left": os.path.exists(os.path.join(nvme_path, f"lightning_zero-rank{rank}")),
    }


def test_directory_of_a_killed_rank_is_cleaned_at_the_next_start(tmp_path):
    swap = tmp_path / "swap"
    with pytest.raises(AssertionError, match="exit codes \\[-9, -9\\]"):
        run_ranks(_killed_worker, str(swap))
    left = sorted(p.name for p in swap.iterdir())
    assert left == ["lightning_zero-rank0", "lightning_zero-rank1"]  # no cleanup ran in the killed ranks
    assert all(any((swap / name).glob("param*.swp")) for name in left)
    reference = run_ranks(_restart_worker, str(tmp_path / "fresh"))  # same run on an empty nvme_path
    for rank, res in enumerate(run_ranks(_restart_worker, str(swap))):
        assert len(res["stale"]) == 1 and f"lightning_zero-rank{rank}" in res["stale"][0], res["stale"]
        assert res["losses"] == reference[rank]["losses"]  # the stale files did not leak into the run
        assert not res["left"]
    assert not list(swap.iterdir())


class _EditInsideGathered(Callback):
    """Halves ``up`` (sharded) and ``frozen`` (sharded, no optimizer) on rank 0 inside
    ``gathered_parameters(modifier_rank=0)`` before the third step: the edit must reach every rank's
    shards and masters, wherever they rest."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 2 or batch_idx % 2:
            return
        for module in (pl_module.up, pl_module.frozen):
            with trainer.strategy.gathered_parameters(module, modifier_rank=0), torch.no_grad():
                for p in module.parameters():
                    p.mul_(0.5)


def _edit_worker(rank: int, nvme_path: str) -> dict:
    out = {}
    specs = {"cpu": dict(_specs(""))["zero3_cpu"], "nvme": dict(_specs(nvme_path))["zero3_nvme"]}
    specs["params_on_disk"] = {**_params_on_disk(nvme_path), **SMALL}
    for name, spec in specs.items():
        _, model = fit(spec, precision="bf16-mixed", trainer_kwargs={"callbacks": [_EditInsideGathered()]})
        out[name] = {"losses": model.losses, "state": state(model)}
    return out


def test_edits_inside_gathered_parameters_reach_the_disk_tier(tmp_path):
    for res in run_ranks(_edit_worker, str(tmp_path / "swap")):
        ref = res["cpu"]
        for name in ("nvme", "params_on_disk"):
            # Exact, as the parity test: the edit is the same bf16 multiply, scattered the same way.
            assert res[name]["losses"] == ref["losses"], name
            for key, value in ref["state"].items():
                assert torch.equal(res[name]["state"][key], value), (name, key)


def _no_space_worker(rank: int, nvme_path: str, optimizer_name: str) -> str:
    import shutil

    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=1000)  # a nearly full disk
    try:
        fit(_nvme_stage2(nvme_path), devices=1, model_kwargs={"optimizer": optimizer_name})
    except ValueError as error:
        return str(error)
    finally:
        shutil.disk_usage = real
    raise AssertionError("the run should have been refused")


@pytest.mark.parametrize(("optimizer_name", "moment_bytes"), [("adamw", 4), ("cpuadam_bf16", 2)])
def test_free_space_is_checked_before_training(tmp_path, optimizer_name, moment_bytes):
    (message,) = run_ranks(_no_space_worker, str(tmp_path / "swap"), optimizer_name, world_size=1)
    from tests.helpers.models import ParityModel

    # ParityModel's trainable elements * (4 + 2 * moment bytes) (fp32 master + 2 moments, bf16 ones
    # under ops.CPUAdam(state_dtype=torch.bfloat16)) on the one rank, plus a 4096-byte block of
    # padding for each of 3 files per buffer, at most one buffer per tensor; and the gradient
    # slices' files (fp32 here: 4 bytes per element, one block of padding each)
    trainable = [p for p in ParityModel().parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    needed = (4 + 2 * moment_bytes) * numel + 3 * 4096 * len(trainable) + 4 * numel + 4096 * len(trainable)
    assert f"writes {needed} bytes" in message and "only 1000 bytes" in message, message
    assert not (tmp_path / "swap").exists()  # refused before anything was created


class _InitialWeights(Callback):
    """The full weights at the start of training (gathered from the shards), and what the build
    left in memory while it wrote each flat buffer to disk."""

    def on_train_start(self, trainer, pl_module) -> None:
        with torch.no_grad(), trainer.strategy.gathered_parameters(pl_module):
            self.initial = state(pl_module)
        sink = trainer.strategy._engine.build_to_disk  # reaches inside on purpose: what the build kept
        self.left_behind = None if sink is None else sink.peak_left_behind
        self.written = 0 if sink is None else sink.count
        tier = trainer.strategy._engine.param_tier
        self.sharded = 0 if tier is None else len(tier.buffers)


def _configure_model_worker(rank: int, nvme_path: str, devices: int) -> dict:
    from lightning_zero.offload.nvme import SwapStore
    from tests.helpers.models import BuiltInConfigureModel

    if rank == 1:
        # A slow disk on one rank: none of its reads has completed until waited for. Whatever the
        # disks do, the ranks must issue the same all-gathers in the same order.
        SwapStore.done = lambda self, name: False  # type: ignore[method-assign]

    out = {}
    for name, spec in (
        ("memory", {"stage": 3, "offload_optimizer": True, **SMALL}),
        ("disk", {**_params_on_disk(nvme_path), **SMALL}),
    ):
        probe = _InitialWeights()
        _, model = fit(
            spec,
            precision="bf16-mixed",
            max_steps=2,
            devices=devices,
            model_cls=BuiltInConfigureModel,
            trainer_kwargs={"callbacks": [probe]},
        )
        out[name] = {
            "initial": probe.initial,
            "final": state(model),
            "left_behind": probe.left_behind,
            "written": probe.written,
            "sharded": probe.sharded,
        }
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_configure_model_builds_straight_to_disk(tmp_path, world_size):
    # 2 ranks: the read-ahead must not make the ranks issue their prefetch all-gathers in different
    # orders (it did: a prefetch gated on this rank's read having completed hung in backward);
    # a hang fails within run_ranks' timeout.
    for res in run_ranks(
        _configure_model_worker, str(tmp_path / "swap"), world_size, world_size=world_size, timeout=180
    ):
        memory, disk = res["memory"], res["disk"]
        # Exact: the same recorded ops replayed into the same shards; only where they rest differs.
        for key, value in memory["initial"].items():
            assert torch.equal(disk["initial"][key], value), key
        for key, value in memory["final"].items():
            assert torch.equal(disk["final"][key], value), key
        # Every sharded buffer (5 here) went to disk as it was built, and when each was written no
        # earlier buffer's master, shard or gradient slice held a byte of memory: the build holds one
        # module at a time, never the model (the in-memory build keeps them all).
        assert disk["written"] == disk["sharded"] >= 4, disk
        assert disk["left_behind"] == 0, disk["left_behind"]
        assert memory["left_behind"] is None


class _SaveLast(Callback):
    """Saves a checkpoint after the last optimizer step, inside fit (as ModelCheckpoint does)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == trainer.max_steps and not os.path.isdir(self.path):
            trainer.save_checkpoint(self.path)


def _end_of_fit_worker(rank: int, tmp: str) -> dict:
    from lightning_zero.checkpoint.consolidate import consolidate

    _, reference = fit({"stage": 3, "offload_optimizer": True, **SMALL}, precision="bf16-mixed", max_steps=3)
    trainer, model = fit(
        {**_params_on_disk(f"{tmp}/swap", restore=None), **SMALL},
        precision="bf16-mixed",
        max_steps=3,
        trainer_kwargs={"callbacks": [_SaveLast(f"{tmp}/last.ckpt")]},
    )
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    with pytest.raises(ValueError) as refused:  # the files are gone: nothing to save after this fit
        trainer.save_checkpoint(f"{tmp}/after.ckpt")
    error = str(refused.value)
    dtypes = {k: v.dtype for k, v in reference.state_dict().items()}
    out = {
        "reference": state(reference),
        "dtypes": dtypes,
        "sizes": sizes,
        "error": error,
        "losses": (reference.losses, model.losses),
    }
    if rank == 0:
        consolidate(f"{tmp}/last.ckpt", f"{tmp}/last.pt")
        out["consolidated"] = torch.load(f"{tmp}/last.pt", weights_only=True)
    out["left"] = os.path.exists(os.path.join(tmp, "swap", f"lightning_zero-rank{rank}"))
    return out


def test_default_end_of_fit_leaves_the_model_on_disk(tmp_path):
    ranks = run_ranks(_end_of_fit_worker, str(tmp_path))
    for res in ranks:
        # As documented (NvmeConfig.restore_after_fit): with the parameters on disk a finished fit
        # does not gather the model back; every sharded parameter is released (ParityModel's
        # matrices are over param_persistence_threshold=10) and the files are removed ...
        sharded = {n: size for n, size in res["sizes"].items() if res["reference"][n].numel() > 10}
        assert sharded and all(size == 0 for size in sharded.values()), res["sizes"]
        assert not res["left"]
        # ... so saving after fit is refused with the way out, not written with empty weights.
        assert "restore_after_fit" in res["error"] and "consolidate" in res["error"], res["error"]
        assert res["losses"][0] == res["losses"][1]  # exact: same kernel, same order (see the parity test)
    # The checkpoint saved inside fit holds the trained weights: consolidated (fp32 masters) and cast
    # to the dtype the CPU-offload run's model holds after fit (its 16-bit copies of the same masters,
    # bf16-mixed), bit-identical to that model: the same cast of the same values.
    consolidated, reference, dtypes = ranks[0]["consolidated"], ranks[0]["reference"], ranks[0]["dtypes"]
    assert set(consolidated) == set(reference)
    assert any(dtype == torch.bfloat16 for dtype in dtypes.values())  # the cast is exercised
    for key, value in reference.items():
        assert torch.equal(consolidated[key].to(dtypes[key]).float(), value), key


def test_two_optimizers_on_disk_match_cpu_offload(tmp_path):
    # A GAN's two optimizers (Adam and AdamW) on one engine: their swap files are named per
    # optimizer (each has a buffer 0, whose files collided before), and the run is bit-identical to
    # CPU offload: same kernel, same inputs, same order.
    nvme = {"offload_optimizer": "nvme", "nvme_path": str(tmp_path / "swap"), "nvme_config": {"block_size": 4096}}
    specs = [
        ("cpu", {"stage": 2, "offload_optimizer": True, "reduce_bucket_size": 40}),
        ("nvme", {"stage": 2, **nvme, "reduce_bucket_size": 40}),
    ]
    for res in run_ranks(gan_worker, specs):
        assert res["nvme"]["losses"] == res["cpu"]["losses"]
        for key, value in res["cpu"]["state"].items():
            assert torch.equal(res["nvme"]["state"][key], value), key
    assert not list((tmp_path / "swap").glob("lightning_zero-rank*"))
