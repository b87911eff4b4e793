"""Which optimizers and parameter groups are stepped by parameter, and how owners are balanced."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.zero.step import check_optimizer
from lightning_zero.zero.whole import assign_owners, whole_groups


def _params(*shapes):
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]


class Declared(torch.optim.SGD):
    whole_tensor = True


def test_known_declared_and_per_group():
    check_optimizer(torch.optim.Muon(_params((3, 5)), lr=0.1), allow_untested=False)
    check_optimizer(torch.optim.Adafactor(_params((3, 5))), allow_untested=False)
    assert whole_groups(torch.optim.Muon(_params((3, 5)))) == {0}
    assert whole_groups(torch.optim.Adafactor(_params((3, 5), (2,)))) == {0}
    assert whole_groups(Declared(_params((4,)), lr=0.1)) == {0}
    assert whole_groups(torch.optim.AdamW(_params((4,)))) == set()
    mixed = torch.optim.AdamW([{"params": _params((3, 5)), "whole_tensor": True}, {"params": _params((5,))}])
    assert whole_groups(mixed) == {0}
    check_optimizer(mixed, allow_untested=False)
    off = torch.optim.Adafactor([{"params": _params((3, 5)), "whole_tensor": False}, {"params": _params((5,))}])
    assert whole_groups(off) == {1}


def test_bad_declarations_rejected():
    bad = torch.optim.AdamW([{"params": _params((3,)), "whole_tensor": "yes"}])
    with pytest.raises(ValueError, match="whole_tensor='yes'"):
        whole_groups(bad)
    opt = torch.optim.SGD(_params((3,)), lr=0.1)
    opt.whole_tensor = 1
    with pytest.raises(ValueError, match="must be True or False"):
        check_optimizer(opt, allow_untested=False)


def test_whole_model_declarations_and_refusals(tmp_path):
    from lightning_zero.options import strategy_config
    from lightning_zero.zero.replicated import check_whole_model, declared_whole_model
    from lightning_zero.zero.surface import ModelParallelContext

    lbfgs = torch.optim.LBFGS(_params((3, 5)))
    check_optimizer(lbfgs, allow_untested=False)  # stepped replicated, not refused
    assert declared_whole_model(lbfgs) and not declared_whole_model(torch.optim.SGD(_params((3,)), lr=0.1))
    declared = torch.optim.SGD(_params((3,)), lr=0.1)
    declared.whole_model = True
    assert declared_whole_model(declared)
    declared.whole_model = "yes"
    with pytest.raises(ValueError, match="whole_model='yes' must be True or False"):
        declared_whole_model(declared)

    def check(optimizer, precision="32-true", shared=None, model_parallel=False, **options):
        config = strategy_config(**options)
        parallel = ModelParallelContext(tensor=object()) if model_parallel else ModelParallelContext()
        check_whole_model([optimizer], config, precision, shared or {}, parallel)

    check(lbfgs, stage=1)
    check(lbfgs, stage=2, offload_optimizer=True, precision="bf16-mixed")
    with pytest.raises(ValueError, match="ZeRO stage 3 keeps 1/N of the parameters.*Use stage 1 or 2"):
        check(lbfgs, stage=3)
    with pytest.raises(ValueError, match="16-mixed's loss scaling"):
        check(lbfgs, stage=2, precision="16-mixed")
    with pytest.raises(ValueError, match="NVMe tiers"):
        check(lbfgs, stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="tensor and pipeline parallelism"):
        check(lbfgs, stage=1, model_parallel=True)
    param = lbfgs.param_groups[0]["params"][0]
    with pytest.raises(ValueError, match="also given to another optimizer"):
        check(lbfgs, stage=1, shared={id(param): ((0, 0), (1, 0))})
    both = torch.optim.LBFGS(_params((3,)))
    both.whole_tensor = True
    with pytest.raises(ValueError, match="declares both whole_model"):
        check(both, stage=1)


def test_owners_balanced_largest_first():
    # largest first onto the least loaded rank: 10 -> rank 0, 9 -> rank 1, 4 -> rank 1 (9 < 10),
    # 3 -> rank 0 (10 < 13); every rank computes the same
    assert assign_owners([3, 10, 4, 9], 2) == [0, 0, 1, 1]
    assert assign_owners([5, 5, 5], 3) == [0, 1, 2]
    loads = [0, 0, 0]
    numels = [7 * 15, 15 * 7, 11 * 15, 15, 7, 7, 3 * 5]
    for numel, owner in zip(numels, assign_owners(numels, 3), strict=True):
        loads[owner] += numel
    assert max(loads) - min(loads) <= max(numels)  # greedy largest-first: within one tensor
