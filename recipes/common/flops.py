"""Training FLOPs of a transformer micro-batch, counted matmul by matmul (what MFU is measured against).

Forward FLOPs: every matmul of an (m x k) by (k x n) costs 2mkn. Backward costs twice the forward
(gradients with respect to inputs and to weights), so training = 3 x forward. Attention scores and
the weighted sum are counted in full even for causal attention, the convention of PaLM
(arXiv 2204.02311, appendix B) and nanoGPT, so MFU numbers compare with theirs. LayerNorm, softmax,
GELU and the optimizer step are left out (a few percent at most).
"""

from __future__ import annotations


def transformer_training_flops(
    *,
    batch: int,
    seq: int,
    n_layer: int,
    d_model: int,
    d_ff: int,
    vocab: int,
    head_positions: float,
    head_dense: bool = False,
) -> int:
    """FLOPs of forward + backward of one micro-batch of ``batch`` sequences of ``seq`` tokens.

    ``head_positions`` is how many positions per micro-batch go through the output projection
    (all tokens for GPT-2; the masked ones for BERT, 15% on average); ``head_dense`` adds BERT's
    d_model x d_model transform before it.
    """
    tokens = batch * seq
    projections = 2 * tokens * (4 * d_model * d_model + 2 * d_model * d_ff)  # qkv + out, ffn in + out
    attention = 2 * 2 * batch * seq * seq * d_model  # Q K^T and P V
    head = 2 * head_positions * d_model * (vocab + (d_model if head_dense else 0))
    return int(3 * (n_layer * (projections + attention) + head))
