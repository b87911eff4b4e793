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


def test_bad_declarations_and_lbfgs_rejected():
    bad = torch.optim.AdamW([{"params": _params((3,)), "whole_tensor": "yes"}])
    with pytest.raises(ValueError, match="whole_tensor='yes'"):
        whole_groups(bad)
    opt = torch.optim.SGD(_params((3,)), lr=0.1)
    opt.whole_tensor = 1
    with pytest.raises(ValueError, match="must be True or False"):
        check_optimizer(opt, allow_untested=False)
    with pytest.raises(ValueError, match="LBFGS computes one update from all parameters"):
        check_optimizer(torch.optim.LBFGS(_params((3,))), allow_untested=True)


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
