"""Inception Score as the ADM evaluator computes it: how far each sample's class distribution p(y|x) lies from
the marginal p(y) of its split, exp(E_x KL(p(y|x) || p(y))), averaged over the splits.

Named for what it computes, not `inception_score`: the `fid` package hands its function `inception_score` on
lazily, and a submodule of that name would take its place there once imported."""

import numpy as np
import torch

IS_SPLIT_SIZE = 5000  # ADM: consecutive splits of 5000 samples in file order (the last may be shorter)


def inception_score(logits: torch.Tensor | np.ndarray, split_size: int = IS_SPLIT_SIZE) -> float:
    """Mean over splits of exp(E_x KL(p(y|x) || p(y))), from 1008-class logits (N, C) in file order."""
    logits = torch.as_tensor(logits, dtype=torch.float64)  # (N, C)
    if len(logits) < split_size:
        raise ValueError(f"the Inception Score uses splits of {split_size} samples; got only {len(logits)} samples")
    log_p = torch.log_softmax(logits, dim=1)  # (N, C); log-space keeps p log p finite where p underflows
    scores = []
    for part in log_p.split(split_size):
        log_marginal = torch.logsumexp(part, dim=0) - np.log(len(part))  # (C,) log of the split's mean p(y)
        kl = (part.exp() * (part - log_marginal)).sum(dim=1).mean()
        scores.append(kl.exp().item())
    return float(np.mean(scores))
