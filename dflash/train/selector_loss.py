"""DFlash2's candidate-selector objective (the drafter's own loss is :mod:`dflash.train.loss`).

z-lab publishes no DFlash2 training objective; the public trainers agree on its form and differ
in one choice. Teacher-forced, each supervised draft slot's candidates are its ``top_k`` tokens by
the drafter's LM-head logits; the selector scores them after the *true* previous token (slot 1:
the anchor) with the slot's final hidden state (:meth:`CandidateSelector.scores`), and a
cross-entropy over the K scores pulls the true token up, weighted like the slot's drafter loss
(SpecForge ``_selector_chunk_terms`` with ``dflash2_selector_loss_alpha``; speculators
``dflash2/metrics.py`` with ``selector_loss_alpha``; NeMo Automodel ``selector_loss_weight``).
The choice, ``missing_gold``: a slot whose true token is not a candidate is left out (SpecForge,
NeMo: serving can only select among the candidates) or gets it as the K-th candidate in place of
the weakest (speculators). The selector's gradient also reaches the drafter through the logits
and the hidden state, as in both trainers by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def selector_loss(
    selector,
    hidden: Tensor,
    lm_head_weight: Tensor,
    candidates: Tensor,
    labels: Tensor,
    predecessors: Tensor,
    slot_weights: Tensor,
    *,
    missing_gold: str = "exclude",
) -> Tensor:
    """Weighted sum over slots of the selector's cross-entropy (module docstring).

    Args:
        selector (CandidateSelector): the drafter's.
        hidden (Tensor): ``[C, Bs, H]`` final drafter hidden states of C blocks.
        lm_head_weight (Tensor): ``[V, H]`` the target's frozen LM head.
        candidates (Tensor): int64 ``[C, Bs, K]``, each slot's top-K tokens by its logits.
        labels (Tensor): int64 ``[C, Bs]``, the true token of each slot.
        predecessors (Tensor): int64 ``[C, Bs]``, the true token before each slot.
        slot_weights (Tensor): float32 ``[C, Bs]``, the slots' weights in the drafter's loss (0
            where unsupervised).
        missing_gold (str): ``"exclude"`` or ``"insert"``.

    Returns:
        Tensor: float32 scalar, differentiable in the selector, ``hidden`` and through it the drafter.

    Raises:
        ValueError: an unknown ``missing_gold``.
    """
    if missing_gold not in ("exclude", "insert"):
        raise ValueError(f"missing_gold must be 'exclude' or 'insert', got {missing_gold!r}")
    found = (candidates == labels[..., None]).any(-1)
    if missing_gold == "insert":
        inserted = candidates.clone()
        inserted[..., -1] = labels
        candidates = inserted.where(~found[..., None], candidates)
        found = torch.ones_like(found)
    unary = _CandidateLogits.apply(hidden, lm_head_weight, candidates)
    scores = selector.scores(hidden, unary, candidates, predecessors).float()
    gold = (candidates == labels[..., None]).float().argmax(-1)
    cross_entropy = F.cross_entropy(scores.flatten(0, 1), gold.flatten(), reduction="none").view_as(labels)
    return (slot_weights * found * cross_entropy).sum()


class _CandidateLogits(torch.autograd.Function):
    """float32 ``[C, Bs, K]`` logits of each slot's K candidates from ``hidden`` ``[C, Bs, H]`` and the
    frozen head ``weight`` ``[V, H]``, differentiable in ``hidden``. The candidates' head rows
    (``[C, Bs, K, H]``, K times the hidden states) are gathered in forward and again in backward,
    never kept: the chunked loss keeps nothing larger than the hidden states between its passes."""

    @staticmethod
    def forward(ctx, hidden, weight, candidates):
        ctx.save_for_backward(candidates)
        ctx.weight, ctx.hidden_dtype = weight, hidden.dtype
        rows = weight[candidates]  # [C, Bs, K, H]
        logits = torch.einsum("cbh,cbkh->cbk", hidden.to(rows.dtype), rows)
        # A no-op .float() returns an alias of the intermediate, whose gradient torch 2.11's
        # dynamo sends to the wrong output (pytorch/pytorch#180642).
        return logits if logits.dtype == torch.float32 else logits.float()

    @staticmethod
    def backward(ctx, grad_logits):
        (candidates,) = ctx.saved_tensors
        rows = ctx.weight[candidates]
        grad_hidden = torch.einsum("cbk,cbkh->cbh", grad_logits.to(rows.dtype), rows)
        return grad_hidden.to(ctx.hidden_dtype), None, None
