"""Threads of the compiled CPU optimizers: results independent of the thread count,
torch's OpenMP runtime the only one in the process, and the per-rank thread choice.

Bitwise equality is the bar for 1 vs 2 threads, not a tolerance: every element is updated by
exactly one thread with the same instructions, and the LAMB norms are summed tile by tile in a fixed
order, so nothing may depend on how the tiles are split between threads. The size (3 * 16384 + 11)
gives several tiles and an odd tail, so with 2 threads each thread gets a different share.
"""

import pytest
import torch

from lightning_zero.ops import CPUAdam, CPULamb
from lightning_zero.ops._load import ISA_ENV, compiled, supported_isas
from lightning_zero.threads import choose_threads

N = 3 * 16384 + 11
STEPS = 5


def run(opt_cls, threads, **kw):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p = torch.randn(N, generator=torch.Generator().manual_seed(0)).requires_grad_()
        opt = opt_cls([p], lr=1e-3, weight_decay=0.01, **kw)
        for step in range(STEPS):
            p.grad = torch.randn(N, generator=torch.Generator().manual_seed(100 + step))
            opt.step()
        return p.detach().clone(), [s.clone() for s in opt.state[p].values() if torch.is_tensor(s)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not compiled(), reason="lightning_zero._C not built: nothing compiled to thread")
@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("opt_cls", [CPUAdam, CPULamb])
def test_bitwise_equal_at_1_and_2_threads(isa, opt_cls, monkeypatch):
    monkeypatch.setenv(ISA_ENV, isa)
    p1, s1 = run(opt_cls, 1)
    p2, s2 = run(opt_cls, 2)
    assert torch.equal(p1, p2)
    for a, b in zip(s1, s2, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not compiled(), reason="lightning_zero._C not built")
def test_one_openmp_runtime_in_the_process():
    """The extension must use torch's libgomp, not load a second OpenMP runtime (two pools would
    oversubscribe the cores and torch.set_num_threads would not govern ours)."""
    import lightning_zero._C as ext

    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if any(k in line for k in ("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) == 1, runtimes
    with open(ext.__file__, "rb") as f:
        blob = f.read()
    assert b"GOMP_parallel" in blob, "built without -fopenmp: at::parallel_for would run on one thread"


def fake_cores(monkeypatch):
    monkeypatch.setattr("lightning_zero.threads.physical_cores", lambda cpus: len(list(cpus)))


def test_two_local_ranks_share_the_cores(monkeypatch):
    fake_cores(monkeypatch)
    assert choose_threads(2, env={}, cpus=range(16))[0] == 8
    assert choose_threads(2, env={}, cpus=range(2))[0] == 1
    assert choose_threads(4, env={}, cpus=range(2))[0] == 1  # never 0
    assert choose_threads(1, env={}, cpus=range(12))[0] == 12


def test_user_choice_wins(monkeypatch):
    fake_cores(monkeypatch)
    assert choose_threads(2, threads=3, env={"OMP_NUM_THREADS": "5"}, cpus=range(16)) == (3, "threads option")
    assert choose_threads(2, env={"OMP_NUM_THREADS": "5"}, cpus=range(16)) == (5, "OMP_NUM_THREADS")
    assert choose_threads(2, env={"OMP_NUM_THREADS": "1"}, cpus=range(16))[0] == 1
    # torchrun's own OMP_NUM_THREADS=1 with several local workers is its default, not a choice
    assert choose_threads(2, env={"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, cpus=range(16))[0] == 8


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(local_world_size=0), "local_world_size=0"),
        (dict(local_world_size=2, threads=0), "threads=0"),
        (dict(local_world_size=2, env={"OMP_NUM_THREADS": "two"}), "'two'"),
        (dict(local_world_size=2, env={"OMP_NUM_THREADS": "0"}), "OMP_NUM_THREADS=0"),
    ],
)
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        choose_threads(**kw)
