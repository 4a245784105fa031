"""Test oracles: dense attention over already-gathered live tokens.

Computed explicitly in float64, independent of SDPA, of any cache layout and of
the overlay's own helpers.
"""

import torch


def token_attention_reference(
    q: torch.Tensor, k_live: torch.Tensor, v_live: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of `q` `[Lq, Hq, D]` over live K/V `[Lk, H, D]`.

    Keys are in logical order with the queries last, so the causal mask is
    bottom-right aligned; GQA query head h reads KV head h // (Hq // H).
    Returns `[Lq, Hq, D]` in `q`'s dtype.
    """
    group = q.shape[1] // k_live.shape[1]
    qh = q.transpose(0, 1).double()
    kh = k_live.transpose(0, 1).double().repeat_interleave(group, dim=0)
    vh = v_live.transpose(0, 1).double().repeat_interleave(group, dim=0)
    logits = qh @ kh.transpose(1, 2) * scale
    lq, lk = q.shape[0], k_live.shape[0]
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    logits.masked_fill_(~causal, float("-inf"))
    return (logits.softmax(dim=-1) @ vh).transpose(0, 1).to(q.dtype)
