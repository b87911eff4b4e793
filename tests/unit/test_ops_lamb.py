"""CPULamb / FusedLamb against a LAMB written out from the paper, and LAMB on ZeRO-style shards.

Sizes are odd (see test_ops_adam.py) so vector and tile tails run.
"""

import pytest
import torch

from lightning_zero.ops import CPULamb, FusedLamb
from lightning_zero.ops import functional as F
from lightning_zero.ops._load import ISA_ENV, supported_isas

PATHS = supported_isas() + ["reference"]
SHAPES = [(278011,), (7, 15), (33,)]
STEPS = 20
LR, WD, EPS, BETAS = 1e-3, 0.01, 1e-6, (0.9, 0.999)
# The trust ratio comes from norms summed in a different order per path (per lane, per tile, in
# fp64), a relative difference of ~1e-7 that scales the whole update; on top of the ~1 ulp per
# step of Adam (see test_ops_adam.py). Parameters near zero: 1e-6 of what LAMB moved them.
RTOL, ATOL = 1e-6, 1e-6 * LR * STEPS


def make_params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads_for(step, params):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def paper_lamb(params):
    """LAMB (You et al. 2019, Algorithm 2) per parameter, with Adam's bias correction."""
    params = [p.clone() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for step in range(1, STEPS + 1):
        bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        for p, g, m, v in zip(params, grads_for(step, params), ms, vs, strict=True):
            m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            update = (m / bc1) / ((v / bc2).sqrt() + EPS) + WD * p
            w_norm, u_norm = p.norm(), update.norm()
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            p.sub_(LR * trust * update)
    return params


def run(opt_cls, params, steps=STEPS, **kw):
    params = [p.clone().requires_grad_() for p in params]
    opt = opt_cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    for step in range(1, steps + 1):
        for p, g in zip(params, grads_for(step, params), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv(ISA_ENV, request.param)
    return request.param


@pytest.mark.parametrize("opt_cls", [CPULamb, FusedLamb])
def test_lamb_matches_paper(path, opt_cls):
    for a, b in zip(run(opt_cls, make_params()), paper_lamb(make_params()), strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_lamb_on_shards_split_across_two_ranks_equals_whole(path):
    """Two 'ranks' own halves of one flat buffer whose cut falls inside the largest parameter."""
    params = make_params()
    whole = run(CPULamb, params)
    numels = [p.numel() for p in params]
    starts = torch.tensor([0] + numels).cumsum(0)  # parameter i is flat[starts[i]:starts[i+1]]
    flat = torch.cat([p.reshape(-1) for p in params])
    cut = 123457  # inside parameter 0 (278011 elements): both ranks hold a piece of it
    shards = [(0, cut), (cut, flat.numel())]
    states = [(torch.zeros(b - a), torch.zeros(b - a)) for a, b in shards]
    hp = dict(beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)

    def segments(a, b):
        """Offsets of the pieces of parameters inside [a, b), relative to a, and their owners."""
        bounds = sorted({a, b, *[int(s) for s in starts if a < s < b]})
        owners = [int(torch.searchsorted(starts, x, right=True)) - 1 for x in bounds[:-1]]
        return torch.tensor([x - a for x in bounds]), torch.tensor(owners)

    for step in range(1, STEPS + 1):
        flat_grad = torch.cat([g.reshape(-1) for g in grads_for(step, params)])
        per_param = torch.zeros(len(params), 2)
        pieces = []
        for (a, b), (m, v) in zip(shards, states, strict=True):
            offsets, owners = segments(a, b)
            sq = F.cpu_lamb_moments(flat[a:b], flat_grad[a:b], m, v, offsets, step=step, **hp)
            per_param.index_add_(0, owners, sq)  # stands in for all_reduce across the ranks
            pieces.append((offsets, owners))
        trust = F.lamb_trust_ratio(per_param)
        for (a, b), (m, v), (offsets, owners) in zip(shards, states, pieces, strict=True):
            F.cpu_lamb_apply(flat[a:b], m, v, offsets, trust[owners], lr=LR, step=step, **hp)
    for i, w in enumerate(whole):
        torch.testing.assert_close(flat[starts[i] : starts[i + 1]].view_as(w), w, rtol=RTOL, atol=ATOL)


def test_lamb_bf16_states_and_copy_out(path):
    params = [p.clone().requires_grad_() for p in make_params()]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    opt = CPULamb(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_dtype=torch.bfloat16)
    for step in range(1, 4):
        for p, g in zip(params, grads_for(step, params), strict=True):
            p.grad = g
        opt.step(param_copies=copies)
    for p, c in zip(params, copies, strict=True):
        assert torch.equal(c, p.detach().to(torch.bfloat16))
        assert opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    # bf16 states change the numbers by a bf16 rounding of the moments, not by more: 3 steps of lr
    for a, b in zip(params, run(CPULamb, make_params(), steps=3), strict=True):
        assert (a.detach() - b).abs().max() > 0
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=3 * LR)
