"""The one-process reference of the model-parallel tests: the recipes' tiny GPT-2 trained whole.

Both tests/distributed/test_tensor_parallel.py and test_pipeline.py compare a split model against
this run: the same global batches (data-parallel rank r reads what Lightning's
``DistributedSampler(shuffle=True, seed=SEED)`` gives it), the same optimizer, norm clipping at
``CLIP`` (below every norm, so the global norm is used every step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

VOCAB, SEQ, BATCH, STEPS, LR, CLIP, SEED = 64, 16, 4, 4, 1e-2, 0.05, 3


def tiny_gpt(n_layer: int):
    """GPT-2 with d=32, 2 heads, vocabulary 64, 16 positions, built from seed 0."""
    from recipes.gpt2.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=2, n_embd=32))


def tokens(n: int) -> torch.Tensor:
    """``n`` rows of SEQ + 1 token ids (inputs and shifted labels), the same in every process."""
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(5))


def reference_run(
    n_layer: int,
    make_optimizer: Callable,
    data_parallel: int,
    val_rows: torch.Tensor | None = None,
    alias_names: bool = False,
) -> dict:
    """Per-step losses of each data-parallel shard, gradient norms, final parameters (with the tied
    LM head's name too when ``alias_names``), and the loss on ``val_rows`` after training."""
    from torch.utils.data import DistributedSampler

    from recipes.gpt2.model import GPT

    model = tiny_gpt(n_layer)
    opt = make_optimizer(model.parameters())
    rows = tokens(BATCH * STEPS * data_parallel)
    shards = [
        rows[list(DistributedSampler(range(len(rows)), num_replicas=data_parallel, rank=r, shuffle=True, seed=SEED))]
        for r in range(data_parallel)
    ]
    losses, norms = [[] for _ in range(data_parallel)], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for r in range(data_parallel):
            batch = shards[r][step * BATCH : (step + 1) * BATCH]
            loss = GPT.loss_fn(model(batch[:, :-1]), batch[:, 1:])
            losses[r].append(loss.item())
            total = total + loss / data_parallel  # equal shards: the mean over the global batch
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=not alias_names)}
    out = {"losses": losses, "norms": norms, "params": params}
    if val_rows is not None:
        with torch.no_grad():
            out["val_loss"] = GPT.loss_fn(model(val_rows[:, :-1]), val_rows[:, 1:]).item()
    return out
